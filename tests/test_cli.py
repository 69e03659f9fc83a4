"""The command lines on day one: every entry point answers --version and --help; a second run of
the search's command exits 0 without computing; the report lands beside the results (or where
--report-dir says); the printed summary names the report's best trial."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import ray

from conftest import ONE_CELL, REPO_ROOT, SearchRun, run_search, search_command
from dptune import __version__, search
from dptune.analysis import CELL, load_results, select_best
from dptune.contract import EpochMetrics, TrialResult
from dptune.errors import SearchInterrupted, shown
from dptune.plan.mechanism import wrapped
from dptune.records import ResultsStore, read_table, trial_rows
from dptune.records.ids import configuration_id
from dptune.search import CellPlan, base_trial_config, format_summary, preflight, summary_table
from dptune.search.finished import STOPPED_COMPOSING
from dptune.search.runs.execution import TrialContext, run_spec
from dptune.space import Cell, load_space
from dptune.space.tracking import TrackingSpec

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"


@pytest.mark.parametrize(
    "module",
    ["dptune.__main__", "dptune.plan", "dptune.search", "dptune.report", "dptune.predict", "dptune.data.example"],
)
def test_version_and_help(module: str, capsys: pytest.CaptureFixture) -> None:
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"dptune {__version__}"
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "usage: python -m " in capsys.readouterr().out


def test_an_unwritable_report_location_fails_before_compute(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as info:
        search.main(["--storage", str(tmp_path / "results"), "--report-dir", str(blocker / "report")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --report-dir: {shown(str(blocker))} exists and is not a folder" in err, err
    assert not ray.is_initialized()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_report_location_is_beside_the_results_unless_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert search.report_location("/data/results/default", None) == "/data/results/default/report"
    assert search.report_location("s3://bucket/results/default", None) == "s3://bucket/results/default/report"
    assert search.report_location("/data/results/default", "mine") == str(tmp_path / "mine")  # absolute
    assert search.report_location("/data/results/default", "gs://b/r/") == "gs://b/r"


def _search_again(storage: Path, *args: str) -> subprocess.CompletedProcess:
    completed = subprocess.run(
        search_command("--space", str(TINY), "--storage", str(storage), "--resume", *args),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed


def test_a_second_run_of_the_same_command_computes_nothing_and_rebuilds_the_report(
    tiny_search: SearchRun, tmp_path: Path
) -> None:
    # The finished tiny search, copied, then its command again with --resume (what `make run` passes).
    results = tmp_path / "tiny"
    shutil.copytree(tiny_search.root, results)
    parts = {p: p.stat().st_mtime_ns for p in results.rglob("*.parquet")}
    completed = _search_again(tmp_path)
    search_id = read_table(str(results), "search")["search_id"].iloc[0]
    assert f"--resume: search {search_id} at {results} is finished; nothing to run" in completed.stdout
    assert "Ray" not in completed.stdout and "loading" not in completed.stdout, "nothing may start or load"
    assert {p: p.stat().st_mtime_ns for p in results.rglob("*.parquet")} == parts, "no row may be written"
    best = summary_table(str(results))
    assert format_summary(best) in completed.stdout
    report = results / "report" / "index.html"
    assert f"report: {report}\n" in completed.stdout and report.is_file()

    # --report-dir elsewhere, as a pyarrow URI: built in a temporary folder, then copied there
    elsewhere = tmp_path / "elsewhere"
    completed = _search_again(tmp_path, "--report-dir", f"file://{elsewhere}")
    assert f"report: file://{elsewhere}/index.html\n" in completed.stdout
    assert str(results) in (elsewhere / "index.html").read_text()
    assert {p.name for p in elsewhere.glob("*.png")} == {p.name for p in report.parent.glob("*.png")} != set()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "tiny"]


def test_a_finished_search_shows_its_summary_from_a_read_only_folder(tiny_search: SearchRun, tmp_path: Path) -> None:
    """A results volume mounted read-only (a results pod's, an archive): --resume shows the summary and
    says the report is not rebuilt, in one line, taking no lease."""
    results, storage = tmp_path / "copy" / "tiny", tmp_path / "ro"
    shutil.copytree(tiny_search.root, results)
    storage.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(results.parent), str(storage)], capture_output=True)
    if mounted.returncode != 0:  # not root: permissions make it read-only for this user
        storage.rmdir()
        storage = results.parent
        for path in (storage, *storage.rglob("*")):
            path.chmod(path.stat().st_mode & ~0o222)
    try:
        if mounted.returncode == 0:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(storage)], check=True)
        try:
            (storage / "tiny" / "probe").write_text("")
            pytest.skip("no read-only folder can be made here (root without mount)")
        except OSError:
            pass  # read-only indeed
        completed = _search_again(storage)
        assert "is finished; nothing to run" in completed.stdout and "Traceback" not in completed.stderr
        assert format_summary(summary_table(str(results))) in completed.stdout
        (warning,) = [line for line in completed.stderr.splitlines() if "report is not rebuilt" in line]
        assert (
            warning.startswith("warning: the report is not rebuilt: the report location") and "not writable" in warning
        )
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(storage)], check=False)
        else:
            for path in (storage, *storage.rglob("*")):
                path.chmod(path.stat().st_mode | 0o200)


# --------------------------------------------------------------------------- Ctrl+C once every run is recorded

#: A search command (``python -c``) whose step ``sys.argv[1]`` says that it has begun, then waits for a Ctrl+C:
#: ``compose`` the search rows (every run is recorded), ``report`` the report (the summary is printed).
_WAITS_IN = """
import sys, time
import dptune.search.finished as finished, dptune.search.finish.outcome as outcome
from dptune.search import main
def wait(*args, **kwargs):
    print("waiting for Ctrl+C", flush=True)
    time.sleep(600)
if sys.argv[1] == "compose":
    outcome.cell_search_rows = wait
else:
    finished.build_report_at = wait
main(sys.argv[2:])
"""


def _ctrl_c_in(step: str, env: dict[str, str], tmp_path: Path, *args: str) -> tuple[int, str, list[str], float]:
    """Run the search command with ``args``, Ctrl+C its process group (as a terminal does) once ``step`` has
    begun; its exit status, stdout, stderr lines and the seconds from the Ctrl+C to its exit."""
    errors = tmp_path / f"{step}.stderr"
    with errors.open("w") as stderr:
        driver = subprocess.Popen(
            [sys.executable, "-c", _WAITS_IN, step, *search_command(*args)[3:]],
            cwd=REPO_ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
        assert driver.stdout is not None
        printed = []
        for line in driver.stdout:
            printed.append(line)
            if line == "waiting for Ctrl+C\n":
                break
        else:
            raise AssertionError(f"{step} never began:\n{''.join(printed)[-3000:]}\n{errors.read_text()[-3000:]}")
        sent = time.monotonic()
        os.killpg(driver.pid, signal.SIGINT)
        out, _ = driver.communicate(timeout=120)
        took = time.monotonic() - sent
    return driver.returncode, "".join(printed) + out, errors.read_text().splitlines(), took


def test_ctrl_c_during_the_report_of_a_finished_search_says_it_finished_in_one_line(
    tiny_search: SearchRun, search_env: dict[str, str], tmp_path: Path
) -> None:
    results = tmp_path / "tiny"
    shutil.copytree(tiny_search.root, results)
    status, out, err, took = _ctrl_c_in(
        "report", search_env, tmp_path, "--space", str(TINY), "--storage", str(tmp_path), "--resume"
    )
    assert "is finished; nothing to run" in out and format_summary(summary_table(str(results))) in out
    assert status == 130 and err == [
        f"error: stopped by Ctrl+C (SIGINT) after the search finished: its results are at {results}, its summary is "
        f"above; not done: its report ({results / 'report'}). Run the same command with --resume to do what is not "
        "done; it trains nothing"
    ], err
    assert took < 10, f"{took:.1f} s from Ctrl+C to exit"


def test_ctrl_c_once_every_run_is_recorded_says_so_and_resume_trains_nothing(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    args = ("--space", str(TINY), "--storage", str(tmp_path), "--no-report", *ONE_CELL)
    status, out, err, took = _ctrl_c_in("compose", search_env, tmp_path, *args)
    root = tmp_path / "tiny"
    assert "search finished" in out and not (root / "search").exists()
    composing_line = STOPPED_COMPOSING.format(how="Ctrl+C (SIGINT)")
    assert status == 130 and err[-1] == f"error: {composing_line}" and "Traceback" not in "\n".join(err), err
    assert took < 10, f"{took:.1f} s from Ctrl+C to exit"
    ledger, recorded = sorted((root / "ledger").iterdir()), read_table(str(root), "trials")
    resumed = run_search(search_env, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted((root / "ledger").iterdir()) == ledger, "a resume after every run was recorded trains nothing"
    assert read_table(str(root), "trials").equals(recorded) and (root / "search").is_dir()


def test_a_ctrl_c_is_one_line_naming_the_phase(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """In process: a Ctrl+C before every run is recorded (the dry run apart), inside :func:`finished.composing`,
    and during each step of :func:`finished.conclude`."""
    from dptune.search import driver, finished

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "run_search", interrupted)
    for flags, line in (
        ([], "error: stopped by Ctrl+C (SIGINT) before the search finished. Run the same command with --resume to "),
        (["--dry-run"], "error: stopped by Ctrl+C (SIGINT) during the dry run; nothing was written"),
    ):
        with pytest.raises(SystemExit) as info:
            search.main(["--space", str(TINY), "--storage", str(tmp_path), *flags])
        (err,) = capsys.readouterr().err.splitlines()
        assert info.value.code == 130 and err.startswith(line), err
    composing_line = STOPPED_COMPOSING.format(how="Ctrl+C (SIGINT)")
    with pytest.raises(SearchInterrupted, match=f"^{re.escape(composing_line)}$") as stopped:
        with finished.composing():
            interrupted()
    assert stopped.value.exit_status == 130
    tracking = TrackingSpec(mlflow="http://127.0.0.1:5000")
    monkeypatch.setattr(finished, "summary_text", lambda *args, **kwargs: "the summary")
    for step, done, undone in (
        ("summary_text", "", "its summary, its report (R/report), its record in MLflow (http://127.0.0.1:5000)"),
        (
            "build_report_at",
            ", its summary is above",
            "its report (R/report), its record in MLflow (http://127.0.0.1:5000)",
        ),
        (
            "log_search",
            ", its summary is above, its report (R/report) is built",
            "its record in MLflow (http://127.0.0.1:5000)",
        ),
    ):
        with monkeypatch.context() as patch:
            patch.setattr(finished, "build_report_at", lambda *args: "R/report/index.html")
            patch.setattr(finished, "log_search", lambda *args, **kwargs: None)
            patch.setattr(finished, step, interrupted)
            with pytest.raises(SearchInterrupted) as stopped:
                finished.conclude("R", "R/report", "s", tracking, private=False)
        assert str(stopped.value) == (
            f"stopped by Ctrl+C (SIGINT) after the search finished: its results are at R{done}; not done: {undone}. "
            "Run the same command with --resume to do what is not done; it trains nothing"
        )
        assert stopped.value.exit_status == 130


def test_a_job_that_ray_job_stop_would_kill_mid_stop_is_warned_about() -> None:
    """Under ``ray job submit`` (the driver has Ray's RAY_JOB_CONFIG_JSON_ENV_VAR) with the stop wait below
    ``JOB_STOP_WAIT_S``: one warning naming the variable and where to set it; none outside a job."""
    job = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    assert preflight.job_stop_warnings({}) == []
    assert preflight.job_stop_warnings({**job, "RAY_JOB_STOP_WAIT_TIME_S": str(preflight.JOB_STOP_WAIT_S)}) == []
    fix = (
        f"set RAY_JOB_STOP_WAIT_TIME_S={preflight.JOB_STOP_WAIT_S} in the environment of the cluster's nodes or in the "
        "job's --runtime-env-json env_vars (cluster/README.md)"
    )
    assert preflight.job_stop_warnings(job) == [
        f"`ray job stop` kills this search 3 s after its SIGTERM (Ray's default), before it can stop cleanly; {fix}"
    ]
    assert preflight.job_stop_warnings({**job, "RAY_JOB_STOP_WAIT_TIME_S": "30"}) == [
        "`ray job stop` kills this search 30 s after its SIGTERM (RAY_JOB_STOP_WAIT_TIME_S), before it can stop "
        f"cleanly; {fix}"
    ]
    assert preflight.job_stop_warnings({**job, "RAY_JOB_STOP_WAIT_TIME_S": "2m"}) == [
        f"RAY_JOB_STOP_WAIT_TIME_S='2m' is not a whole number of seconds, as Ray reads it; {fix}"
    ]


def test_summary_and_report_rank_the_same_trial(tmp_path: Path) -> None:
    # A trial stopped early at a high intermediate validation accuracy must not beat a finished one.
    space = load_space(TINY).space
    plan = CellPlan(Cell(1.0, 4), "normalized", 1000, (32, 64), (), wrapped({32: 1.0, 64: 1.5}, 1.0, 1e-5, 1000, 4), 0)
    context = TrialContext(
        base=base_trial_config(space, plan, None, None),
        results_root=str(tmp_path),
        search_id="s",
        cell_id=plan.cell.cell_id,
        cell_key=plan.cell_key,
        coupling=space.coupling.rule,
        reference_batch_size=space.coupling.reference_batch_size,
    )
    store = ResultsStore(str(tmp_path))
    for status, val, batch_size in (("stopped_early", 0.90, 32), ("ok", 0.70, 64), ("ok", 0.65, 32)):
        params = {"clip_bound": 1.0, "batch_size": batch_size, "base_learning_rate": 0.01 if val > 0.66 else 0.001}
        config = run_spec(context, params).config
        epochs = [
            EpochMetrics(
                epoch=1, steps=10, train_loss=1.0, val_loss=1.0, val_accuracy=val, wall_time_s=1.0, examples_per_s=100.0
            )
        ]
        result = TrialResult(config=config, status=status, val_accuracy=val, test_accuracy=val - 0.1, epochs=epochs)
        trial_id = configuration_id(plan.cell_key, params)
        store.write_trial(
            trial_rows(
                result,
                search_id="s",
                trial_id=trial_id,
                cell_id=plan.cell.cell_id,
                reference_batch_size=256,
                versions={},
                finished_at=pd.Timestamp.now(tz="UTC"),
            ),
            trial_id,
        )
    summary = summary_table(str(tmp_path))
    reported = select_best(load_results([str(tmp_path)]).tuned, CELL)
    assert summary["trial_id"].tolist() == reported["trial_id"].tolist()
    assert summary["val_accuracy"].tolist() == [0.70] and summary["batch_size"].tolist() == [64]
    assert summary["stopped_early"].tolist() == [1]


@pytest.mark.parametrize(
    "args",
    [
        ["--space", "/no/such/space.yaml"],
        ["--space", "{malformed}"],
        ["--help"],
        ["--set", "sampler.name=cmaes"],
        ["--space", str(TINY), "--set", "task.dataset=cifar1000"],
        ["--space", str(TINY), "--set", "task.backbone=vit_huge"],
    ],
)
def test_the_command_line_answers_before_importing_anything_heavy(args: list[str], tmp_path: Path) -> None:
    """A mistake (or --help) is answered before torch, Ray, Optuna, pandas or pyarrow load."""
    if args[1:] == ["{malformed}"]:
        (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
        args = ["--space", str(tmp_path / "bad.yaml")]
    probe = (
        "import sys\nfrom dptune.search import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exit:\n"
        "    heavy = sorted(m for m in ('torch', 'ray', 'optuna', 'pandas', 'pyarrow', 'opacus')\n"
        "                   if m in sys.modules)\n"
        "    print('EXIT', exit.code, heavy)\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert completed.stdout.strip().splitlines()[-1] == f"EXIT {0 if args == ['--help'] else 2} []", completed.stderr


def test_sigterm_outside_the_tune_run_stops_the_search_in_one_line_as_ctrl_c_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """``ray job stop`` during loading, composing or the report (Ray's own handler would exit 15 without a
    line): SIGTERM raises ``StopSignal`` where the driver is, and each phase's line names SIGTERM, exit 143."""
    from dptune.errors import StopSignal
    from dptune.search import driver, finished
    from dptune.search.stopping import sigterm_raises, sigterm_stops_the_search

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_stops_the_search():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as ray.init replaces it
        sigterm_raises()  # the driver's call after each Ray start
        with pytest.raises(StopSignal) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode
        assert stop.value.signal_number == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before

    def stopped(*args: object, **kwargs: object) -> None:
        raise StopSignal(signal.SIGTERM)

    monkeypatch.setattr(driver, "run_search", stopped)
    with pytest.raises(SystemExit) as info:
        search.main(["--space", str(TINY), "--storage", str(tmp_path)])
    (err,) = capsys.readouterr().err.splitlines()
    assert info.value.code == 143 and err.startswith("error: stopped by SIGTERM before the search finished. "), err
    with pytest.raises(SearchInterrupted, match=re.escape(STOPPED_COMPOSING.format(how="SIGTERM"))) as composing:
        with finished.composing():
            stopped()
    assert composing.value.exit_status == 143
