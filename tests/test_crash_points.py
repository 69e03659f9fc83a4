"""The crash-point test: the driver's whole session is SIGKILLed at each durable write point of a
search in turn, and ``--resume`` carries on from whatever the kill left.

One real search (embedded Ray, the tiny space, a random sampler so that asks pending at a kill
matter, one configuration per trial process, 2 replicates; the fused runner, and one trial per run) is
started, killed at a write point, resumed and killed at the next one, ... and finally resumed to its
end. Halfway the unfinished folder is copied under another name and the copy is resumed from then on
(the ledger belongs to the folder; Tune's saved state, which leads back to the original, is set
aside). The write points, each hit in the process that writes it (a trial process or the driver):

- before the first start entry of the ledger is written (nothing charged yet);
- after a start entry (charged, nothing trained): the first, and the second (a unit charged after Tune
  last saved its state, which a resume must run as it was charged, not replace by a new proposal);
- after an end entry (trained and charged, no row yet);
- after a ``trials`` part file (a run recorded, the rest of its unit not), and after a start entry once
  runs are recorded;
- during composition: before the driver writes the ``search`` row (every run recorded, the search
  not yet finished);
- during the release of a private search tuned on a subsample (its own test): after its start entry
  and before its first checkpoint (charged, nothing trained), then after its checkpoint of epoch 1.

After each kill: the command did not exit 0 and no ``search`` row exists. After the last resume:
exit 0, every planned (configuration, replicate) recorded exactly once, and the printed ε is at
least an independent PLD (dp_accounting) over every start entry of the folder's ledger, the
killed attempts included. The release: one start entry, ended, one row, trained its planned steps,
and no checkpoint left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import REPO_ROOT, run_search, search_command
from dptune.privacy.checks import bound_text
from dptune.records import TRUST_BOUNDARY, read_table
from dptune.records.ledger import charged_runs
from dptune.records.store import PER_TRIAL_TABLES
from dptune.runners.checkpoint import CHECKPOINTS, RunCheckpoint
from dptune.search.planning.subsample import RELEASE_SUFFIX
from test_faults import TINY, expected_search_epsilon, ledger_entries, recorded

# Installed as sitecustomize in every process of the search: the write functions are wrapped when
# dptune's records modules are imported (Ray's own processes never import them). The hit of a write
# point DPTUNE_CRASH_AT ("<point>:<before|after>:<nth>", nth counted over every process of one
# launch by exclusive mark files) writes the file "crash" and blocks; the test then kills the session.
_CRASH_HOOK = """
import importlib.abc, importlib.util, os, pathlib, sys, time

_AT = os.environ.get("DPTUNE_CRASH_AT")
_MARKS = pathlib.Path(os.environ.get("DPTUNE_CRASH_MARKS", "."))

def _hit(point, when):
    if not _AT:
        return
    name, at_when, nth = _AT.split(":")
    if (name, at_when) != (point, when):
        return
    count = 0
    while True:
        try:
            os.close(os.open(_MARKS / f"hit-{count}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            count += 1
    if count + 1 == int(nth):
        (_MARKS / "crash").write_text(f"{point}:{when} in pid {os.getpid()}")
        time.sleep(600)

def _patch(module):
    if module.__name__ == "dptune.records.ledger":
        real_write = module._write
        def _write(runs_root, kind, *args, **kwargs):
            _hit(kind, "before")
            real_write(runs_root, kind, *args, **kwargs)
            _hit(kind, "after")
        module._write = _write
    elif module.__name__ == "dptune.runners.checkpoint":
        checkpoint = module.RunCheckpoint
        real_save = checkpoint.save
        def save(self, state):
            _hit("checkpoint", "before")
            real_save(self, state)
            _hit("checkpoint", "after")
        checkpoint.save = save
    else:
        store = module.ResultsStore
        real_part = store.write_part
        def write_part(self, table, key, rows):
            _hit(table, "before")
            real_part(self, table, key, rows)
            _hit(table, "after")
        store.write_part = write_part

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in ("dptune.records.ledger", "dptune.records.store", "dptune.runners.checkpoint"):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        real_exec = spec.loader.exec_module
        def exec_module(module):
            real_exec(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec

if _AT:
    sys.meta_path.insert(0, _Finder())
"""

#: The stages: (write point, which hit of this launch), then the folder is resumed from there on.
POINTS = (
    ("start:before:1", "tiny"),
    ("start:after:1", "tiny"),
    ("start:after:2", "tiny"),  # the second unit charged, perhaps after Tune last saved its state
    ("end:after:1", "tiny"),
    ("trials:after:2", "copy"),  # the first trials part of a launch may be a pruned configuration's
    ("start:after:2", "copy"),  # just after a start, with runs recorded
    ("search:before:1", "copy"),
)


#: The searches of these tests: one cell, a random sampler (asks pending at a kill matter), 4 configurations
#: × 2 replicates, one configuration per trial process, units asked one at a time.
_RANDOM_SEARCH = (
    "--space",
    str(TINY),
    "--no-report",
    "--set",
    "privacy.epsilons=[2]",
    "--set",
    "training.compare_auto_s=false",
    "--set",
    "sampler.name=random",
    "--set",
    "sampler.trials_per_cell=4",
    "--set",
    "base_learning_rate={low: 0.001, high: 0.1}",
    "--set",
    "replicates=2",
    "--set",
    "resources.configurations_per_trial=1",
    "--set",
    "resources.max_concurrent_trials=1",
)


def _session_pids(session: int) -> list[int]:
    """Every process of the session ``session`` (the driver leads it; Ray's processes are in it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session:
                    pids.append(int(entry.name))
            except ProcessLookupError:
                continue
    return pids


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` (Tune's own folder included): its size and modification time (ns)."""
    return {
        str(path.relative_to(root)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in root.rglob("*")
        if path.is_file()
    }


def _killed_at(point: str, args: tuple[str, ...], env: dict[str, str], marks: Path) -> None:
    """Launch the search, wait until it reaches ``point``, SIGKILL its whole session."""
    marks.mkdir()
    driver = subprocess.Popen(
        search_command(*args),
        cwd=REPO_ROOT,
        env={**env, "DPTUNE_CRASH_AT": point, "DPTUNE_CRASH_MARKS": str(marks)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    try:
        while not (marks / "crash").exists():
            if driver.poll() is not None:
                pytest.fail(
                    f"{point}: the search ended ({driver.returncode}) before the point: {driver.stderr.read()[-3000:]}"
                )
            assert time.monotonic() < deadline, f"{point}: not reached in 10 minutes"
            time.sleep(0.2)
    finally:
        for pid in _session_pids(driver.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        driver.wait()
    assert driver.returncode == -signal.SIGKILL


@pytest.fixture
def crash_env(search_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The search's environment with the crash hook installed as sitecustomize."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_CRASH_HOOK)
    return {**search_env, "PYTHONPATH": os.pathsep.join(p for p in (str(hook), search_env.get("PYTHONPATH", "")) if p)}


@pytest.mark.parametrize("runner", ["fused", "trial"])
def test_a_kill_at_every_write_point_then_resume_records_every_run_once_and_charges_every_start(
    search_env: dict[str, str], crash_env: dict[str, str], tmp_path: Path, runner: str
) -> None:
    common = (*_RANDOM_SEARCH, "--set", f"training.runner={runner}", "--storage", str(tmp_path / "st"))
    st = tmp_path / "st"
    for stage, (point, name) in enumerate(POINTS):
        if name == "copy" and not (st / "copy").exists():  # the unfinished folder, copied as cp -a does
            shutil.copytree(st / "tiny", st / "copy", symlinks=True)
            original = _files(st / "tiny")
        args = (*common, "--name", name, *(("--resume",) if stage else ()))
        # Tune saves its state once, as it starts: every kill leaves that state behind the ledger and the rows
        lagging = {**crash_env, "TUNE_GLOBAL_CHECKPOINT_S": "3600"}
        _killed_at(point, args, lagging, tmp_path / f"marks-{stage}")
        root = st / name
        assert not (root / "search").exists(), f"{point}: a killed search was marked finished"
        ran = recorded(root) if (root / "trials").exists() else None
        assert ran is None or ran["trial_id"].is_unique, point
        assert ran is None or len(ledger_entries(root)[0]) >= len(ran), point  # no row without its start entry
    done = run_search(search_env, *common, "--name", "copy", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]  # in one go, whatever Tune's saved state missed
    # the copy's resumes wrote nothing into the folder it came from, Tune's trial folders included
    assert _files(st / "tiny") == original
    root = st / "copy"
    ran = recorded(root)
    configurations = ran[["clip_bound", "batch_size", "base_learning_rate"]].apply(tuple, axis=1)
    assert len(ran) == 8 and ran["trial_id"].is_unique and set(ran["status"]) == {"ok"}, ran[["trial_id", "status"]]
    assert configurations.nunique() == 4 and sorted(ran["replicate"]) == [0, 0, 0, 0, 1, 1, 1, 1]  # as planned
    assert len(ledger_entries(root)[0]) >= len(ran)
    row = read_table(str(root), "search").iloc[0]
    assert row["trials_planned"] == 8
    # every start entry of the folder's ledger, the killed attempts' and the copied ones included
    assert row["epsilon_search"] >= expected_search_epsilon(root, 1e-5) * (1 - 1e-9)
    assert f"whole search: ε = {bound_text(row['epsilon_search'])} at δ = 1e-05" in done.stdout


def test_a_kill_just_after_a_unit_was_charged_and_before_tune_saved_it_is_run_again_by_one_resume(
    search_env: dict[str, str], crash_env: dict[str, str], tmp_path: Path
) -> None:
    """Tune's saved state knows the first unit only; the second was charged, then the driver was killed. One
    ``--resume`` runs that unit's configuration as it was charged (not a new proposal in its place), asks no
    more configurations than planned, and finishes."""
    args = (*_RANDOM_SEARCH, "--set", "training.runner=trial", "--storage", str(tmp_path / "st"), "--name", "tiny")
    lagging = {**crash_env, "TUNE_GLOBAL_CHECKPOINT_S": "3600"}  # Tune saves its state once, as it starts
    _killed_at("start:after:2", args, lagging, tmp_path / "marks")
    root = tmp_path / "st" / "tiny"
    charged = {start["configuration_id"] for start in ledger_entries(root)[0]}
    assert len(charged) == 2
    done = run_search(search_env, *args, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 configuration(s) charged in the privacy ledger after Tune last saved its state run again" in done.stdout
    ran = recorded(root)
    assert len(ran) == 8 and ran["trial_id"].is_unique and set(ran["status"]) == {"ok"}  # 4 planned, each twice
    assert charged <= set(ran["configuration_id"]) and ran["configuration_id"].nunique() == 4
    starts, _ = ledger_entries(root)
    assert len(starts) == 8 + 2  # the killed attempt's two runs, then each planned run once
    row = read_table(str(root), "search").iloc[0]
    assert row["epsilon_search"] >= expected_search_epsilon(root, 1e-5) * (1 - 1e-9)


def test_a_moved_folder_resumes_on_the_first_try_and_writes_nothing_where_it_came_from(
    search_env: dict[str, str], crash_env: dict[str, str], tmp_path: Path
) -> None:
    """A search killed once runs had been recorded; its folder is copied and the original moved away (as a
    rename across disks does). The first ``--resume`` of the copy finishes; Tune's saved state, whose paths
    lead to the original, is set aside, so nothing is written at the original's path or into the moved one."""
    st = tmp_path / "st"
    args = (*_RANDOM_SEARCH, "--set", "training.runner=trial", "--storage", str(st))
    _killed_at("trials:after:3", (*args, "--name", "tiny"), crash_env, tmp_path / "marks")
    shutil.copytree(st / "tiny", st / "copy", symlinks=True)
    (st / "tiny").rename(tmp_path / "elsewhere")
    before = _files(tmp_path / "elsewhere")
    done = run_search(search_env, *args, "--name", "copy", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (st / "tiny").exists() and _files(tmp_path / "elsewhere") == before
    came_from = str(st / "tiny").encode()
    assert came_from + b"/_tune/search/" not in done.stderr.encode()  # no Tune trial of the resume is placed there
    live = [path for path in (st / "copy" / "_tune" / "search").rglob("*") if path.is_file()]
    assert live and not [path for path in live if came_from in path.read_bytes()]  # Tune's state: the copy's own
    assert "this results folder was copied or moved from" in done.stderr and "Tune starts afresh" in done.stderr
    ran = recorded(st / "copy")
    assert len(ran) == 8 and ran["trial_id"].is_unique and ran["configuration_id"].nunique() == 4
    row = read_table(str(st / "copy"), "search").iloc[0]
    assert row["epsilon_search"] >= expected_search_epsilon(st / "copy", 1e-5) * (1 - 1e-9)


def test_a_kill_during_the_subsample_release_is_continued_by_resume_under_its_one_charge(
    search_env: dict[str, str], crash_env: dict[str, str], tmp_path: Path
) -> None:
    args = (
        "--space",
        str(REPO_ROOT / "search_spaces" / "private_subsample.yaml"),
        "--no-report",
        "--storage",
        str(tmp_path / "st"),
        "--name",
        "sub",
        "--set",
        "sampler.trials_per_cell=2",
        "--set",
        "epochs=[3]",
        "--set",
        "privacy.private_selection.tuning_subsample.fraction=0.5",
    )
    root = tmp_path / "st" / "sub"
    inside = root / TRUST_BOUNDARY
    # charged, nothing trained; then, resumed, killed after its state of epoch 1 was kept
    for stage, point in enumerate(("checkpoint:before:1", "checkpoint:after:2")):
        _killed_at(point, (*args, *(("--resume",) if stage else ())), crash_env, tmp_path / f"marks-{stage}")
        assert not (root / "search").exists() and not (root / "release").exists(), point
    (kept,) = (inside / CHECKPOINTS).glob("*.pt")
    state = RunCheckpoint(str(kept.parent), kept.name).load()
    assert state is not None and state["epochs_done"] == 1
    done = run_search(search_env, *args, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    search_id = read_table(str(root), "search").iloc[0]["search_id"]
    charged = charged_runs(str(inside), search_id)
    released = charged[charged["cell_id"].str.endswith(RELEASE_SUFFIX)]
    assert len(released) == 1 and bool(released["ended"].iloc[0]), released  # one start entry: one run
    trials = read_table(str(inside), "trials")
    (trained,) = trials[trials["cell_id"].str.endswith(RELEASE_SUFFIX)].itertuples()
    run_id = released["trial_id"].iloc[0]
    assert (trained.status, trained.steps_taken, trained.trial_id) == ("ok", trained.steps, run_id)
    assert len(read_table(str(root), "release")) == 1 and not list((inside / CHECKPOINTS).iterdir())


# --------------------------------------------------------------------------- compaction


class _Killed(BaseException):
    """Raised at a step of compaction: what is on disk then is what a kill there leaves (no step cleans up
    after it: a file written is complete, a file deleted is gone)."""


def _compaction_steps(monkeypatch: pytest.MonkeyPatch, at: int) -> list[str]:
    """Count every durable step of compaction (a file written, each file deleted: rows and weights) and raise
    ``_Killed`` at step ``at``; step 0 of a write is a kill while it writes (its temporary left behind).
    Returns the steps taken, by name."""
    from dptune.records import store, weights

    steps: list[str] = []

    def step(name: str) -> None:
        steps.append(name)
        if len(steps) == at:
            raise _Killed(name)

    real_write, real_delete = store.ResultsStore.write_file, store.ResultsStore.delete_files

    def write_file(self: store.ResultsStore, table: str, name: str, data: Any, **options: Any) -> str:
        if not store.COMPACTED_NAME.fullmatch(name):  # a run's own part: not a step of compaction
            return real_write(self, table, name, data, **options)
        if len(steps) + 1 == at:  # killed while writing: a partial temporary beside the files
            Path(self.root, table, f".tmp-{uuid.uuid4().hex}-{name}").write_bytes(b"PAR1 half a file")
        step(f"write {table}")
        return real_write(self, table, name, data, **options)

    def delete_files(self: store.ResultsStore, paths: Any) -> None:
        for path in paths:
            real_delete(self, [path])
            step(f"delete {path}")

    real_bundle, real_remove = weights._write_bundle, weights._delete

    def write_bundle(*args: Any) -> None:
        real_bundle(*args)
        step("write bundle")

    def remove(fs: Any, paths: list[str]) -> None:
        for path in paths:
            real_remove(fs, [path])
            step(f"delete {path}")

    monkeypatch.setattr(store.ResultsStore, "write_file", write_file)
    monkeypatch.setattr(store.ResultsStore, "delete_files", delete_files)
    monkeypatch.setattr(weights, "_write_bundle", write_bundle)
    monkeypatch.setattr(weights, "_delete", remove)
    return steps


def _model(value: float) -> Any:
    """A small trained model whose bias counts up from ``value``."""
    import numpy as np

    from dptune.contract import TrainedModel

    bias = np.arange(3, dtype=np.float32) + value
    return TrainedModel({"weight": np.full((3, 4), value, np.float32), "bias": bias}, {"seed": str(value)})


#: The trials of the compaction tests: four units of two, and one killed before its trials part.
_UNITS = [[f"u{u}-t{n}" for n in range(2)] for u in range(4)]
_TRIALS = [*sum(_UNITS, []), "u3-killed"]


def _seen(root: Path) -> tuple[dict[str, pd.DataFrame], set[str], dict[str, list[float]]]:
    """Everything a reader sees: every per-trial table, the completed trial ids, each run's weights."""
    from dptune.records import ResultsStore
    from dptune.records.weights import read_weights

    ids = ResultsStore(str(root), cache=None).completed_trial_ids()
    saved = {trial: read_weights(str(root), trial) for trial in _TRIALS}
    return (
        {table: ResultsStore(str(root), cache=None).read(table) for table in PER_TRIAL_TABLES},
        ids,
        {trial: model.parameters["bias"].tolist() for trial, model in saved.items() if model is not None},
    )


def _assert_seen(root: Path, expected: tuple[dict[str, pd.DataFrame], set[str], dict[str, list[float]]]) -> None:
    tables, ids, weights = _seen(root)
    assert ids == expected[1] and weights == expected[2]
    assert tables["trials"]["trial_id"].is_unique
    assert all(frame.equals(expected[0][table]) for table, frame in tables.items())


def test_a_kill_at_every_step_of_compaction_loses_and_duplicates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three units compacted, a fourth unit's files (and a trial whose trials part was never written) left:
    the fourth unit's compaction (its files into one, then the four files of each table and of weights,
    one tier, merged) is killed at each of its steps in turn; every reader then sees every trial's rows and
    weights exactly once, and the finishing step's compaction then leaves one file per table."""
    from dptune.records import ResultsStore, compact_records, trial_rows
    from dptune.records.weights import write_weights
    from test_records import NOW, make_result

    template = tmp_path / "template"
    store = ResultsStore(str(template))
    units = _UNITS
    for n, trial in enumerate(_TRIALS):
        rows = trial_rows(
            make_result(n / 10, epochs=1 + n % 3),
            search_id="s",
            trial_id=trial,
            cell_id="c",
            reference_batch_size=1,
            versions={},
            finished_at=NOW,
        )
        write_weights(str(template), trial, _model(n))
        if trial == "u3-killed":
            store.write_part("epochs", trial, rows["epochs"])  # its trials part was never written
        else:
            store.write_trial(rows, trial)
    for unit in units[:3]:
        compact_records(str(template), unit)
    expected = _seen(template)
    assert len(expected[1]) == 8 and len(expected[2]) == 9
    at = 1
    while True:
        root = tmp_path / f"killed-at-{at}"
        shutil.copytree(template, root)
        with monkeypatch.context() as patched:
            steps = _compaction_steps(patched, at)
            try:
                compact_records(str(root), [*units[3], "u3-killed"])
            except _Killed:
                pass
        _assert_seen(root, expected)
        compact_records(str(root))  # the finishing step (or the next unit's end) completes the work
        _assert_seen(root, expected)
        assert [len(list((root / table).glob("part-*"))) for table in PER_TRIAL_TABLES] == [1] * 4, steps
        if len(steps) < at:  # compaction ran to its end: every step was killed once
            break
        at += 1
    names = {step.split(" ")[0] + (" bundle" if step.endswith("bundle") else "") for step in steps}
    assert names == {"write", "delete", "write bundle"} and at > 30


def test_a_unit_compacted_or_killed_while_compacting_runs_nothing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit's runs are recorded and its files compacted at its end; the same unit run again (a resume)
    trains nothing, also after a kill midway through that compaction."""
    from dptune.contract import TrialResult
    from dptune.records import ResultsStore, read_table
    from dptune.records.weights import read_weights
    from dptune.search.runs import execution
    from trial_configs import HEAD_TRIAL

    trained: list[str] = []

    def fake_run(config: Any, report: Any = None, checkpoint: Any = None) -> TrialResult:
        trained.append(str(config.batch_size))
        return TrialResult(config=config, status="ok", val_accuracy=0.5, trained=_model(config.batch_size))

    monkeypatch.setattr(execution, "run_trial", fake_run)
    configurations = [{"clip_bound": 1.0, "batch_size": b, "base_learning_rate": 0.05} for b in (16, 32, 64)]
    for kill_at in (None, 7):
        root = tmp_path / f"kill-{kill_at}"
        context = execution.TrialContext(
            base=HEAD_TRIAL,
            results_root=str(root),
            search_id="s",
            cell_id="eps=8|epochs=2",
            cell_key="eps8-E2",
            coupling="sqrt",
            reference_batch_size=64,
            replicates=2,
        )
        with monkeypatch.context() as patched:
            if kill_at is not None:
                _compaction_steps(patched, kill_at)
            try:
                first = execution.run_configurations(context, configurations)
                assert kill_at is None and first.ran == 6
                assert [p.name[:7] for p in (root / "trials").iterdir()] == ["part-c-"]
            except _Killed:
                assert kill_at is not None
        trained.clear()
        again = execution.run_configurations(context, configurations)
        assert again.ran == 0 and not trained and again.statuses == ["ok"] * 3
        trials = read_table(str(root), "trials")
        assert len(trials) == 6 and trials["trial_id"].is_unique
        assert ResultsStore(str(root)).completed_trial_ids() == set(trials["trial_id"])
        assert all(read_weights(str(root), trial) is not None for trial in trials["trial_id"])
