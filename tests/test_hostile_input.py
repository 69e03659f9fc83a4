"""Hostile and careless input: every command refuses it early, clearly, and without hanging.

Each refusal is checked for the same things: exit status 2, one ``error: <where>: <what>`` line
that names the flag, key or file, no traceback, and no Ray started (not initialised in this
process, no ``raylet``/``gcs_server`` below it). Almost every case fails before the workload is
loaded, so these tests run in seconds; the few that must load data use the tiny test caps.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from conftest import REPO_ROOT, _free_ports, ray_processes_below, search_command
from dptune import plan, report, search
from dptune.errors import MAX_SHOWN_CHARS, DptuneError
from dptune.paths import probe_writable
from dptune.plan.mechanism import wrapped
from dptune.records import SCHEMAS, ResultsStore, lease, read_table
from dptune.search import driver, preflight
from dptune.space import MAX_TRIALS_PER_CELL, Cell, SpaceError, load_space, parse_space

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"
#: A "billion laughs": nine levels of ten aliases, about 10⁹ strings once expanded (under 1 kB of text).
ALIAS_BOMB = (
    "\n".join(
        ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
        + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
        + ["name: *a8"]
    )
    + "\n"
)


@pytest.fixture(autouse=True)
def no_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process, reaching the data loader means a check came too late: fail at once instead."""
    import dptune.data

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the search reached data loading: a check must come before it")

    monkeypatch.setattr(dptune.data, "load_workload", refuse)


def refused(capsys: pytest.CaptureFixture[str], main: object, *args: str) -> str:
    """Run a command's ``main`` in this process; assert a clean refusal before Ray; return stderr."""
    before = ray_processes_below()
    with pytest.raises(SystemExit) as info:
        main(list(args))  # type: ignore[operator]
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert not ray.is_initialized() and ray_processes_below() <= before
    return err


def closed_port() -> int:
    return _free_ports(1)[0]


# --------------------------------------------------------------------------- the search: flags and specs

BAD_SPECS = {
    "alias_bomb": (ALIAS_BOMB, "expands to more than"),
    "duplicate_key": (TINY.read_text() + "seed: 3\n", "key 'seed' is given twice"),
    "python_tag": (TINY.read_text().replace("seed: 0", "seed: !!python/object/apply:os.getpid []"), "YAML tag"),
    "custom_tag": (TINY.read_text().replace("seed: 0", "seed: !secret 0"), "YAML tag '!secret'"),
    "not_a_mapping": ("- just\n- a list\n", "must be a YAML mapping"),
    "name_dotdot": (TINY.read_text().replace("name: tiny", "name: '..'"), "name"),
    "seed_too_large": (TINY.read_text().replace("seed: 0", f"seed: {2**70}"), "seed"),
    "inf_range": (TINY.read_text().replace("values: [0.01]", "low: 0.001\n  high: .inf"), "base_learning_rate.high"),
    "huge_grid": (
        TINY.read_text().replace("values: [0.01]", f"values: [{', '.join(['0.01'] * 5000)}]"),
        f"more than the {MAX_TRIALS_PER_CELL} trials",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_spec_file_is_refused_naming_file_and_key(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, message = BAD_SPECS[case]
    spec = tmp_path / f"{case}.yaml"
    spec.write_text(text)
    err = refused(capsys, search.main, "--space", str(spec), "--storage", str(tmp_path / "results"), "--dry-run")
    assert str(spec) in err and message in err
    assert len(err) < 2000, "an error message never echoes unbounded input"
    assert not (tmp_path / "results").exists()


def test_binary_space_file_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "model.bin"
    spec.write_bytes(bytes(range(256)) * 4)
    err = refused(capsys, search.main, "--space", str(spec), "--storage", str(tmp_path))
    assert f"{spec}: not a text file (a NUL byte at offset 0" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # resources a trial can never get: refused, where Tune would wait forever
        (
            ["--set", "resources.gpu=64"],
            "resources: a trial asks for 1 CPU(s) and 64 GPU(s), more than this machine has",
        ),
        (["--set", "resources.cpus=4096"], "resources: a trial asks for 4096 CPU(s)"),
        (["--set", "resources.cpus=4096", "--dry-run"], "resources: a trial asks for 4096 CPU(s)"),
        # a Ray address: syntax at once, reachability within seconds, in the dry run too
        (["--address", "not-a-host"], "--address 'not-a-host': not a Ray address (expected HOST:PORT"),
        (["--address", "127.0.0.1:<closed>"], "--address '127.0.0.1:<closed>': no Ray cluster answers there"),
        (["--address", "127.0.0.1:<closed>", "--dry-run"], "no Ray cluster answers there"),
        # names that would leave their folder, or not fit a file name
        (["--name", ".."], "--name '..': names the folder itself or its parent"),
        (["--name", "."], "--name '.': names the folder itself or its parent"),
        (["--name", "n" * 300], "300 characters is too long"),
        (["--set", "name=.."], "name"),
        # storage that is empty, of an unknown kind, or not writable
        (["--storage", ""], "--storage: an empty location"),
        (
            ["--storage", "foo://bucket/results"],
            "--storage 'foo://bucket/results': unknown URI scheme 'foo' (allowed: ",
        ),
        (["--storage", "/proc/dptune-results"], "--storage '/proc/dptune-results/tiny': not writable"),
        (["--storage", "/sys/dptune-results"], "--storage '/sys/dptune-results/tiny': not writable"),
        # ranges and limits
        (["--set", f"seed={2**70}"], "seed: must be at most"),
        (
            ["--set", "sampler.name=random", "--set", "sampler.trials_per_cell=1000000000"],
            f"sampler.trials_per_cell: must be at most {MAX_TRIALS_PER_CELL}",
        ),
        (["--set", "sampler.name=tpe", "--trials-per-cell", "1000000000"], "sampler.trials_per_cell"),
        # --set values and keys that do not parse or do not fit
        (["--set", "privacy.epsilons=[1"], "--set 'privacy.epsilons': not valid YAML"),
        (["--set", "seed.x=1"], "--set 'seed.x': seed is a value (0), not a section"),
        (["--set", "seed=!!python/name:os.system"], "--set 'seed': line 1: YAML tag"),
        (["--set", "extends.file=x"], "--set 'extends.file': extends is a file name, not a section"),
        (["--set", "extends=nowhere.yaml"], "extends: 'nowhere.yaml' is no such file"),
        (["--set", "privacy.epsilons=*anchor"], "--set 'privacy.epsilons': not valid YAML"),
        (["--set", "privacy.epsilons=[1e9]"], "privacy.epsilons.0: must be at most 50"),
    ],
)
def test_bad_search_flag_is_refused_before_ray(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = str(closed_port())
    args = [arg.replace("<closed>", port) for arg in args]
    storage = tmp_path / "results"
    flags = ["--storage", str(storage)] if "--storage" not in args else []
    err = refused(capsys, search.main, "--space", str(TINY), *flags, *args)
    assert message.replace("<closed>", port) in err
    assert not storage.exists(), "a refused search writes nothing"


def test_bad_ray_address_in_the_environment_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:not-a-port")
    err = refused(capsys, search.main, "--space", str(TINY), "--storage", str(tmp_path), "--dry-run")
    assert "RAY_ADDRESS '127.0.0.1:not-a-port': not a Ray address" in err


@pytest.mark.parametrize(
    ("key", "name", "allowed"),
    [
        ("dataset", "cifar1000", "20newsgroups, mnist5k, cifar100, sun397, cassava, or a file of your own"),
        ("backbone", "vit_huge", "vit_base_patch16_224.augreg_in21k, vit_tiny_patch16_224.augreg_in21k,"),
    ],
    ids=["dataset", "backbone"],
)
def test_an_unknown_dataset_or_backbone_is_named_with_the_allowed_ones_before_any_data(
    key: str, name: str, allowed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(capsys, search.main, "--space", str(TINY), "--storage", str(tmp_path), "--set", f"task.{key}={name}")
    assert err.startswith(f"error: {TINY}: task.{key}: unknown {key} '{name}' (allowed: {allowed}"), err
    assert not list(tmp_path.iterdir())  # refused before the results folder and its lease


def test_dotdot_name_cannot_write_outside_storage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    (tmp_path / "index.html").write_text("the user's own page")
    before = sorted(p.name for p in tmp_path.iterdir())
    for name in ("..", "../x", "x/../.."):
        refused(capsys, search.main, "--space", str(TINY), "--storage", str(storage), "--name", name)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "index.html").read_text() == "the user's own page" and not list(storage.iterdir())


@pytest.mark.parametrize(
    ("override", "named"),
    [("training.runner=trial", "training.runner 'trial' cannot run tuning_subsample"), ("task.peft=film", "task.peft")],
)
def test_tuning_on_a_subsample_without_the_fused_runner_is_refused_before_any_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, named: str
) -> None:
    err = refused(
        capsys,
        search.main,
        "--space",
        str(REPO_ROOT / "search_spaces/private_subsample.yaml"),
        "--storage",
        str(tmp_path),
        "--set",
        override,
    )
    assert "privacy.private_selection" in err and named in err and "public numbers" in err
    assert not list(tmp_path.iterdir())  # refused before the lease: no results folder


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(options: search.SearchOptions) -> str:
        raise KeyError("a bug, not a user error")

    monkeypatch.setattr(driver, "run_search", broken)
    with pytest.raises(KeyError, match="a bug"):
        search.main(["--space", str(TINY), "--storage", str(tmp_path)])


@pytest.mark.parametrize(
    ("spec", "args"),
    [
        ("alias_bomb", []),
        (None, ["--address", "127.0.0.1:<closed>"]),
    ],
)
def test_no_hostile_input_hangs(spec: str | None, args: list[str], tmp_path: Path, search_env: dict[str, str]) -> None:
    """As a user runs it (a fresh process), each input ends quickly with one error line."""
    path = TINY
    if spec is not None:
        path = tmp_path / "spec.yaml"
        path.write_text(BAD_SPECS[spec][0])
    args = [arg.replace("<closed>", str(closed_port())) for arg in args]
    done = subprocess.run(
        search_command("--space", str(path), "--storage", str(tmp_path / "r"), *args),
        cwd=REPO_ROOT,
        env=search_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Started a local Ray" not in done.stdout + done.stderr


# --------------------------------------------------------------------------- the search: results folders


def _results(tmp_path: Path) -> Path:
    """A results folder of the tiny space, as a search leaves it (its manifest)."""
    root = tmp_path / "tiny"
    loaded = load_space(TINY)
    preflight.write_manifest(str(root), loaded, "tiny", f"tiny-{loaded.spec_hash}")
    return root


def test_resume_of_a_changed_space_is_refused_with_the_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _results(tmp_path)
    err = refused(
        capsys,
        search.main,
        "--space",
        str(TINY),
        "--storage",
        str(tmp_path),
        "--resume",
        "--set",
        "privacy.epsilons=[1]",
        "--set",
        "seed=3",
    )
    assert "--resume: the search space differs from the one" in err
    assert "privacy.epsilons: [1, 8] → [1]" in err and "seed: 0 → 3" in err
    assert not (tmp_path / "tiny" / "search").exists(), "no search row for a cell that did not run"


def test_resume_compares_with_the_search_table_when_there_is_no_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = load_space(TINY)
    root = tmp_path / "tiny"
    ResultsStore(str(root)).write_part(
        "search", "old", [{"search_id": "old", "spec_yaml": loaded.text, "spec_hash": loaded.spec_hash}]
    )
    preflight.check_same_space(str(root), loaded)  # the same space resumes
    err = refused(
        capsys,
        search.main,
        "--space",
        str(TINY),
        "--storage",
        str(tmp_path),
        "--resume",
        "--set",
        "privacy.epsilons=[1]",
    )
    assert "privacy.epsilons: [1, 8] → [1]" in err


@pytest.mark.parametrize("resume", [True, False])
def test_a_junk_part_is_named_before_any_compute(
    resume: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = _results(tmp_path) / "trials" / "part-junk.parquet"
    junk.parent.mkdir()
    junk.write_bytes(b"PAR1 this is not a parquet file")
    err = refused(
        capsys, search.main, "--space", str(TINY), "--storage", str(tmp_path), *(["--resume"] if resume else [])
    )
    assert f"{junk}: not a readable Parquet file" in err and "--quarantine-corrupt" in err


@pytest.mark.parametrize("what", ["a table that is a file", "a lease that is a folder"])
def test_a_file_or_folder_where_dptune_keeps_its_own_is_refused_in_one_line(
    what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _results(tmp_path)
    root.mkdir(parents=True, exist_ok=True)
    if what == "a table that is a file":
        (root / "trials").write_text("not a folder of parts")
        named = f"{root}/trials is a file where dptune keeps table 'trials' (a folder of part files); move it away"
    else:
        (root / ".lease").mkdir()
        named = f"{root / '.lease'} is a folder or a link, not the lock file dptune keeps there; move it away"
    err = refused(capsys, search.main, "--space", str(TINY), "--storage", str(tmp_path), "--resume")
    assert named in err and "Traceback" not in err


def test_a_damaged_ledger_entry_is_named_before_anything_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cut = _results(tmp_path) / "ledger" / "start-cut.json"
    cut.parent.mkdir()
    cut.write_text('{"version": 1, "entries": [{"run": "r1", "trial_id": "t1", "noise_multip')
    err = refused(capsys, search.main, "--space", str(TINY), "--storage", str(tmp_path), "--resume")
    assert f"{cut}: unreadable privacy ledger entry" in err and "nothing more is trained" in err
    assert "restore the file from a backup, or pass --charge-unreadable-ledger" in err.lower()


def _charge(root: Path, search_id: str) -> None:
    """One start entry of ``search_id`` in the ledger at ``root``, as a trial process writes it."""
    from dptune.records.ledger import RunStart, record_starts

    start = RunStart(
        "t-r0", "t", 0, search_id, "eps=2|epochs=3", "normalized", {"batch_size": 32}, 1.5, 0.1, 28, 1e-5, 2.0
    )
    record_starts(str(root), [start])


def test_a_renamed_folder_resumes_its_own_search_and_a_foreign_ledger_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = load_space(TINY)
    root = _results(tmp_path)
    _charge(root, f"tiny-{loaded.spec_hash}")
    moved = root.rename(tmp_path / "renamed")
    # resumed under its new name, the folder's runs stay charged to the search that started it
    assert preflight.folder_search_id(str(moved), loaded, "renamed", resume=True) == f"tiny-{loaded.spec_hash}"
    err = refused(capsys, search.main, "--space", str(TINY), "--storage", str(tmp_path), "--name", "renamed")
    assert f"{moved}/ledger: the privacy ledger of this results folder already charges 1 run(s)" in err
    assert "pass --resume" in err
    _charge(moved, "other-0123456789abcdef")  # an entry file copied in from another search's folder
    err = refused(
        capsys, search.main, "--space", str(TINY), "--storage", str(tmp_path), "--name", "renamed", "--resume"
    )
    assert "holds start entries of search(es) other-0123456789abcdef, not of this folder's search tiny-" in err


def test_quarantine_moves_unreadable_parts_aside(tmp_path: Path) -> None:
    root = _results(tmp_path)
    store = ResultsStore(str(root))
    store.write_part("trials", "good", [{"search_id": "s", "trial_id": "good", "cell_id": "eps=1|epochs=3"}])
    (root / "trials" / "part-junk.parquet").write_bytes(b"junk")
    wrong = pa.table({"search_id": ["s"], "trial_id": ["typed"], "epsilon": ["one"]})  # epsilon must be a float
    pq.write_table(wrong, root / "trials" / "part-typed.parquet")
    preview = preflight.check_results_folder(str(root), quarantine=True, move=False)
    assert len(preview) == 2 and all("would be moved" in note for note in preview)
    assert (root / "trials" / "part-junk.parquet").exists()
    notes = preflight.check_results_folder(str(root), quarantine=True)
    assert any("epsilon is string, expected double" in note for note in notes)
    assert sorted(p.name for p in (root / "quarantine" / "trials").iterdir()) == [
        "part-junk.parquet",
        "part-typed.parquet",
    ]
    assert list(read_table(str(root), "trials")["trial_id"]) == ["good"]


def test_read_table_names_an_unreadable_part(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path))
    store.write_part("trials", "good", [{"search_id": "s", "trial_id": "good"}])
    (tmp_path / "trials" / "part-bad.parquet").write_bytes(b"\0" * 64)
    with pytest.raises(DptuneError, match="part-bad.parquet: not a readable Parquet file"):
        read_table(str(tmp_path), "trials")


def test_a_corrupt_tune_state_is_refused_on_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tuner = _results(tmp_path) / "_tune" / "search" / "tuner.pkl"
    tuner.parent.mkdir(parents=True)
    tuner.write_bytes(pickle.dumps({"state": 1})[:-3])
    err = refused(capsys, search.main, "--space", str(TINY), "--storage", str(tmp_path), "--resume")
    assert f"{tuner}: Tune's state cannot be loaded" in err


def test_only_cells_that_ran_get_a_search_row(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path))
    store.write_part(
        "trials", "t1", [{"search_id": "mine", "trial_id": "t1", "cell_id": "eps=8|epochs=3", "clipping": "normalized"}]
    )
    store.write_part(
        "trials",
        "t2",
        [{"search_id": "other", "trial_id": "t2", "cell_id": "eps=1|epochs=3", "clipping": "normalized"}],
    )
    plans = [
        search.CellPlan(Cell(epsilon, 3), clipping, 300, (32,), (), wrapped({32: 1.0}, epsilon, 1e-5, 300, 3), 1)
        for epsilon in (1.0, 8.0)
        for clipping in ("normalized", "auto_s")
    ]
    ran = search.plans_that_ran(str(tmp_path), "mine", plans)
    assert [(p.cell.epsilon, p.clipping) for p in ran] == [(8.0, "normalized")]


def test_search_rows_from_before_the_warnings_column_still_read(tmp_path: Path) -> None:
    old_schema = SCHEMAS["search"].remove(SCHEMAS["search"].get_field_index("warnings"))
    (tmp_path / "search").mkdir()
    pq.write_table(
        pa.Table.from_pylist([{"search_id": "old", "name": "x"}], schema=old_schema),
        tmp_path / "search" / "part-old.parquet",
    )
    ResultsStore(str(tmp_path)).write_part("search", "new", [{"search_id": "new", "warnings": json.dumps(["δ"])}])
    table = read_table(str(tmp_path), "search").set_index("search_id")
    assert pd.isna(table.loc["old", "warnings"]) and json.loads(table.loc["new", "warnings"]) == ["δ"]


def test_dry_run_prints_warnings_and_dropped_batch_sizes(search_env: dict[str, str], tmp_path: Path) -> None:
    """δ > 1/N, a flag that does not apply and B > N reach the search's own output (loads the tiny workload)."""
    done = subprocess.run(
        search_command(
            "--space",
            str(TINY),
            "--storage",
            str(tmp_path),
            "--dry-run",
            "--trials-per-cell",
            "5",
            "--set",
            "privacy.delta=0.01",
            "--set",
            "batch_size.values=[32,64,512]",
        ),
        cwd=REPO_ROOT,
        env=search_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "warning: --trials-per-cell (or --set sampler.trials_per_cell) does not apply to sampler 'grid'" in done.stderr
    )
    assert "warning: privacy.delta: delta=0.01 is larger than 1/num_examples = 1/300" in done.stderr
    assert "warning: batch_size: B = [512] exceed the training set (N = 300) and are dropped" in done.stderr
    assert "  dropped, larger than N = 300: B = [512]" in done.stdout
    assert not list(tmp_path.iterdir())


def test_a_trial_worker_that_cannot_see_its_results_folder_names_storage_every_node_shares(tmp_path: Path) -> None:
    """A worker on a node where --storage is another folder (a local path the nodes do not share) is told
    so, not that its search ended; one whose folder was removed after it saw it is told that."""
    root = tmp_path / "head" / "tiny"
    elsewhere = tmp_path / "worker" / "tiny"  # the same --storage path, as another node's own disk has it
    with lease.hold_lease(str(root)) as token:
        with pytest.raises(lease.SearchGone) as unshared:
            lease.check_holder(str(elsewhere), token)
        assert str(unshared.value).startswith(f"{elsewhere}: this results folder is not visible on this node (")
        assert "--storage must be a path every node of the cluster shares" in str(unshared.value)
        assert "s3://" in str(unshared.value) and "ended" not in str(unshared.value)
        lease.check_holder(str(root), token)  # its search holds it
        shutil.rmtree(root)
        with pytest.raises(lease.SearchGone, match="the results folder was removed while its search ran"):
            lease.check_holder(str(root), token)
    root.mkdir(parents=True)
    (root / lease.LEASE_FILE).write_bytes(b"")  # released, as a search that ended leaves it
    with pytest.raises(lease.SearchGone, match="no longer holds its results folder .it ended, or was stopped"):
        lease.check_holder(str(root), token)


# --------------------------------------------------------------------------- spec loading


def test_alias_error_quotes_a_bounded_excerpt() -> None:
    with pytest.raises(SpaceError) as info:
        parse_space(
            TINY.read_text().replace("name: tiny", "name: &n [" + ", ".join(["x" * 50] * 50) + "]\nx: *n"),
            "aliased.yaml",
        )
    assert all(len(line) < 3 * MAX_SHOWN_CHARS for line in str(info.value).splitlines())


def test_extends_through_set_works(tmp_path: Path) -> None:
    child = tmp_path / "child.yaml"
    child.write_text("name: child\nseed: 7\n")
    loaded = parse_space(child.read_text(), child, {"extends": str(TINY)})
    assert (loaded.space.name, loaded.space.seed, loaded.space.privacy.epsilons) == ("child", 7, [1.0, 8.0])


def test_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    probe_writable(str(tmp_path / "a" / "b"), "--report-dir")
    probe_writable(f"file://{tmp_path}/c", "--report-dir")
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- report and plan


def test_report_names_a_corrupt_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiny_results import copy_results, results_paths

    (copy,) = copy_results(results_paths()[:1], tmp_path)
    junk = Path(copy) / "epochs" / "part-junk.parquet"
    junk.write_bytes(b"junk")
    err = refused(capsys, report.main, copy, "--out", str(tmp_path / "out"))
    assert f"{junk}: not a readable Parquet file" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out", ["/proc/dptune-report", "/sys/dptune-report"])
def test_report_refuses_an_unwritable_out(out: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiny_results import results_paths

    err = refused(capsys, report.main, results_paths()[0], "--out", out)
    assert f"--out '{out}': not writable" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "/proc/plan.csv"], "--out '/proc': not writable"),
        (["--out", "/tmp"], "--out must end in .csv or .parquet"),
        (["--delta", "nan"], "delta (--delta) must be in (0, 1)"),
        (["--eps", "1e9"], "epsilons (--eps) must be one or more values in"),
        (["--n", "1000000000000"], "B = 16 gives T = E·N/B = 312500000000 steps (N = 1000000000000, E = 5), more than"),
        (["--epochs", "1000000000"], "use fewer epochs"),
    ],
)
def test_plan_refuses_bad_flags(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--n": "1000", "--eps": "1", "--epochs": "5"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    assert message in refused(capsys, plan.main, *[part for pair in base.items() for part in pair])
