"""Tracking in MLflow (``tracking.mlflow``, :mod:`dptune.search.finish.tracking`): real searches logged to a
real ``mlflow server`` (SQLite store, artifacts served by it) on loopback, checked value by value
against their Parquet records; a private search's release alone, its server's whole store scanned
for traces of the hidden runs; a server that is down or refuses told before compute; one that dies
before the logging costs one warning line and nothing of the search."""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from conftest import ONE_CELL, REPO_ROOT, SHORT_PRIVATE, _free_ports, run_search
from dptune import __version__, predict, search
from dptune.data.sources import load_20newsgroups
from dptune.records import TRUST_BOUNDARY, read_table, release_label
from dptune.records.weights import CARD_JSON, CARD_MD, MODEL_FILE
from dptune.search.finish.publish import model_name
from dptune.search.finish.tracking import (
    CHECK_TIMEOUT_S,
    CLASSIC_EXPERIMENT,
    DPTUNE_RUN_TAG,
    EXPERIMENT_KIND_TAG,
    INSTANCE_TAG,
    check_server,
    kept_instance,
)
from dptune.search.preflight import PreflightError
from dptune.space import load_space
from dptune.space.tracking import TrackingSpec
from hidden_runs import (
    assert_none_in,
    assert_nothing_of_the_hidden_runs_outside,
    card_numbers,
    hidden_needles,
    private_data_digests,
)

#: One server serves the module: its tests run on one xdist worker.
pytestmark = pytest.mark.xdist_group("mlflow_server")

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"
PRIVATE = REPO_ROOT / "search_spaces/private.yaml"
SERVER_START_TIMEOUT_S = 300.0
#: A run's configuration and budget, as MLflow params.
CONFIGURATION = (
    "clip_bound",
    "batch_size",
    "base_learning_rate",
    "learning_rate",
    "epochs",
    "optimizer",
    "clipping",
    "epsilon",
    "delta",
    "noise_multiplier",
    "sample_rate",
    "steps",
    "replicate",
)


@dataclass(frozen=True)
class MlflowServer:
    """A real ``mlflow server`` started by the ``mlflow_server`` fixture: its URL and its folder (the
    SQLite store ``mlflow.db``, the artifacts under ``artifacts/``, its log ``server.log``)."""

    url: str
    folder: Path


def _health(url: str) -> int:
    """HTTP status of ``GET /health`` (0 while nothing answers)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group this test started (the server and its uvicorn worker), wait, then
    SIGKILL what is left of it."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[MlflowServer]:
    """``mlflow server`` on 127.0.0.1 (a free port) with a SQLite store and the artifacts it serves in
    ``folder``, in its own process group, stopped by that group's id at the end. Its job runner is off
    (nothing here submits jobs, and mlflow-skinny comes without the runner's package)."""
    (port,) = _free_ports(1)
    url = f"http://127.0.0.1:{port}"
    command = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination",
        str(folder / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while _health(url) != 200:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"mlflow server did not answer at {url} within {SERVER_START_TIMEOUT_S:.0f} s (exit code "
                    f"{process.poll()}); log:\n{log_path.read_text(errors='replace')[-4000:]}"
                )
            time.sleep(0.5)
        yield MlflowServer(url=url, folder=folder)
    finally:
        _stop_group(process)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One server for the module's non-private searches (:func:`serve`)."""
    with serve(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def _client(url: str):  # -> mlflow.tracking.MlflowClient (imported here: a few seconds)
    from mlflow.tracking import MlflowClient

    return MlflowClient(url)


def _free_url() -> str:
    """The URL of a loopback port nothing listens on."""
    (port,) = _free_ports(1)
    return f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------- the key and the check before compute


def test_the_keys_are_checked_and_leave_the_search_id_as_it_was(capsys: pytest.CaptureFixture) -> None:
    plain = load_space(TINY)
    keys = {
        "tracking.mlflow": "http://127.0.0.1:5000/",
        "tracking.registered_model": "tiny",
        "tracking.experiment": "a b",
    }
    tracked = load_space(TINY, keys)
    assert tracked.space.tracking == TrackingSpec(
        mlflow="http://127.0.0.1:5000", registered_model="tiny", experiment="a b"
    )
    assert tracked.spec_hash == plain.spec_hash and "tracking" not in tracked.text  # not part of the search
    for bad in ("ftp://127.0.0.1:5000", "127.0.0.1:5000", "http://user:secret@host:5000", "http://host:0"):
        with pytest.raises(SystemExit) as info:
            search.main(["--space", str(TINY), "--set", f"tracking.mlflow={bad}", "--dry-run"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "tracking.mlflow" in err and "expected the http:// or https:// URL of an MLflow tracking server" in err
    for key in ("registered_model", "experiment"):
        with pytest.raises(SystemExit):
            search.main(["--space", str(TINY), "--set", f"tracking.{key}=tiny", "--dry-run"])
        assert f"{key} needs mlflow" in capsys.readouterr().err
    for bad in ("   ", "a\tb", "x" * 501):
        with pytest.raises(ValueError, match="expected an MLflow experiment name: printable characters, not only"):
            TrackingSpec(mlflow="http://127.0.0.1:5000", experiment=bad)


class _Refusing(http.server.BaseHTTPRequestHandler):
    """An HTTP server that is not a tracking server this client may use: 401 to everything."""

    def do_GET(self) -> None:
        self.send_response(401)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_that_is_down_or_refuses_is_told_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow.tracking  # noqa: F401 (imported before the clock starts: seconds on a busy machine)

    down = _free_url()
    started = time.monotonic()
    with pytest.raises(PreflightError) as info:
        check_server(TrackingSpec(mlflow=down))
    assert time.monotonic() - started < 3 * CHECK_TIMEOUT_S
    assert f"tracking.mlflow '{down}': the MLflow tracking server does not answer or refuses" in str(info.value)
    assert "Connection refused" in str(info.value) and "nothing was loaded or trained" in str(info.value)
    refusing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=refusing.serve_forever, daemon=True).start()
    try:
        with pytest.raises(PreflightError, match="does not answer or refuses .*401"):
            check_server(TrackingSpec(mlflow=f"http://127.0.0.1:{refusing.server_address[1]}"))
    finally:
        refusing.shutdown()
    find_spec = importlib.util.find_spec  # as where mlflow-skinny is not installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "mlflow" else find_spec(name))
    with pytest.raises(PreflightError, match=r"MLflow's client is not installed .*dptune\[mlflow\]"):
        check_server(TrackingSpec(mlflow=down))
    check_server(TrackingSpec())  # no tracking: nothing to check


def test_an_unreachable_server_is_refused_before_compute(search_env: dict[str, str], tmp_path: Path) -> None:
    down = _free_url()
    started = time.monotonic()
    completed = run_search(
        search_env, "--space", str(TINY), "--storage", str(tmp_path), "--set", f"tracking.mlflow={down}", timeout=600
    )
    # the command's imports take most of it (the check alone: test above); MLflow's own retries take minutes
    assert time.monotonic() - started < 120
    assert completed.returncode == 2, completed.stderr[-3000:]
    (line,) = [line for line in completed.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: tracking.mlflow '{down}': the MLflow tracking server does not answer or refuses")
    assert "loading" not in completed.stdout and not list(tmp_path.iterdir())  # no data, no results folder


# --------------------------------------------------------------------------- a search logged

#: The experiment the non-private searches share, and the base name of their cells' registered models.
SHARED = "dptune tests"
REGISTERED = "tiny-models"
#: ``--set`` flags of the tiny search in both its cells (ε = 1 and 8), without AUTO-S or diagnostics.
TWO_CELLS = ("--set", "training.compare_auto_s=false", "--set", "training.diagnostics=false")
#: In the search process (``sitecustomize``): the live logging looks every 0.2 s, and as the end's logging
#: starts, the status of each run of this search that the server holds then goes to ``DPTUNE_TEST_SNAPSHOT``.
_SNAPSHOT_AT_THE_END = """import json, os
import dptune.search.finish.live_tracking as live
import dptune.search.finish.tracking as tracking
live.LIVE_POLL_S = 0.2
_log = tracking.SearchLogger.log
def log(self):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(self.uri)
    experiment = client.get_experiment_by_name(self.tracking.experiment)
    mine = "tags.`dptune.instance` = '%s'" % tracking.kept_instance(self.results_root)
    runs = client.search_runs([experiment.experiment_id], mine, max_results=1000)
    with open(os.environ["DPTUNE_TEST_SNAPSHOT"], "w") as file:
        json.dump({run.data.tags["dptune.run"]: run.info.status for run in runs}, file)
    return _log(self)
tracking.SearchLogger.log = log
"""


def _tracking(url: str) -> tuple[str, ...]:
    """``--set`` flags that log to ``url``, into the ``SHARED`` experiment and ``REGISTERED`` models."""
    keys = {"mlflow": url, "experiment": SHARED, "registered_model": REGISTERED}
    return tuple(flag for key, value in keys.items() for flag in ("--set", f"tracking.{key}={value}"))


def _mine(client, root: Path) -> dict[str, object]:
    """The active runs of the search at ``root`` (its ``INSTANCE_TAG``) in ``SHARED``, by their run tag."""
    experiment = client.get_experiment_by_name(SHARED)
    mine = f"tags.`{INSTANCE_TAG}` = '{kept_instance(str(root))}'"
    return {run.data.tags[DPTUNE_RUN_TAG]: run for run in client.search_runs([experiment.experiment_id], mine)}


def _versions(client, name: str, search_id: str) -> list[object]:
    """The versions of registered model ``name`` that the search ``search_id`` registered."""
    versions = client.search_model_versions(f"name = '{name}'")
    return [version for version in versions if version.tags["dptune.search_id"] == search_id]


@dataclass(frozen=True)
class LoggedSearch:
    """The tiny search in both cells, logged to the module's server (``_tracking``): its results ``root``,
    the first command (``first``) and a ``--resume`` of the finished search (``resumed``); ``snapshot``:
    the status of each of its runs on the server when the first command's end logging started."""

    root: Path
    first: subprocess.CompletedProcess
    resumed: subprocess.CompletedProcess
    snapshot: dict[str, str]


@pytest.fixture(scope="module")
def logged(
    mlflow_server: MlflowServer, search_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> LoggedSearch:
    folder = tmp_path_factory.mktemp("logged")
    hook, snapshot = folder / "hook", folder / "snapshot.json"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SNAPSHOT_AT_THE_END)
    env = {
        **search_env,
        "PYTHONPATH": f"{hook}{os.pathsep}{search_env.get('PYTHONPATH', '')}",
        "DPTUNE_TEST_SNAPSHOT": str(snapshot),
    }
    args = ("--space", str(TINY), "--storage", str(folder), *TWO_CELLS, *_tracking(mlflow_server.url))
    first = run_search(env, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_search(search_env, *args, "--resume", "--no-report")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return LoggedSearch(folder / "tiny", first, resumed, json.loads(snapshot.read_text()))


def test_runs_are_logged_as_they_finish(logged: LoggedSearch) -> None:
    trials = read_table(str(logged.root), "trials")
    trained = set(trials.loc[trials["status"] == "ok", "trial_id"])
    assert len(trained) == 8 and "warning: tracking" not in logged.first.stderr
    # when the search's end logging started, trained runs were on the server, finished, under a search
    # run that was not: they were logged as they finished
    assert logged.snapshot["search"] == "RUNNING"
    live = {key for key, status in logged.snapshot.items() if status == "FINISHED"}
    assert live & trained and live <= {*trials["trial_id"]}
    assert f"mlflow: {len(trials) + 1} run(s) logged to " in logged.first.stdout
    assert f"({len(trials) - len(live)} of them now)" in logged.first.stdout  # the search run was started live


def test_a_search_logs_each_run_its_models_and_report(
    mlflow_server: MlflowServer, logged: LoggedSearch, tmp_path: Path
) -> None:
    root = logged.root
    trials, epochs = read_table(str(root), "trials"), read_table(str(root), "epochs")
    (row, _) = read_table(str(root), "search").to_dict("records")  # one row per cell
    client = _client(mlflow_server.url)
    experiment = client.get_experiment_by_name(SHARED)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == CLASSIC_EXPERIMENT == "custom_model_development"
    runs = _mine(client, root)
    assert set(runs) == {*trials["trial_id"], "search"}
    assert {run.info.status for run in runs.values()} == {"FINISHED"}
    parent = runs["search"]
    assert parent.info.run_name == row["search_id"]
    for trial in trials.to_dict("records"):
        run = runs[trial["trial_id"]]
        params, metrics, tags = run.data.params, run.data.metrics, run.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id and tags["dptune.status"] == trial["status"]
        for name in CONFIGURATION:  # as recorded (a run the min-step rule pruned has no σ)
            value = trial[name]
            assert name not in params if pd.isna(value) else type(value)(params[name]) == value, name
        if trial["status"] == "ok":
            for name in ("val_accuracy", "test_accuracy", "epsilon_spent", "steps_taken"):
                assert metrics[name] == trial[name], name
            assert run.info.end_time == int(trial["finished_at"].timestamp() * 1000)
        else:  # pruned by the min-step rule: recorded, never run
            assert "val_accuracy" not in metrics
        curve = epochs[epochs["trial_id"] == trial["trial_id"]]
        history = client.get_metric_history(run.info.run_id, "epoch_val_accuracy")
        assert [(m.step, m.value) for m in history] == list(zip(curve["epoch"], curve["val_accuracy"], strict=True))
    assert parent.data.metrics["epsilon_search"] == row["epsilon_search"]
    summary = Path(client.download_artifacts(parent.info.run_id, "summary.txt", str(tmp_path))).read_text()
    assert "best configuration per cell" in summary and summary.strip() in logged.first.stdout
    assert client.list_artifacts(parent.info.run_id, "report")  # the report, built beside the results
    assert Path(client.download_artifacts(parent.info.run_id, "report/index.html", str(tmp_path))).stat().st_size
    # each published model is a pyfunc model in the run that trained it, its cell's registered model's version
    models = sorted((root / "models").iterdir())
    assert len(models) == 2
    for model in models:
        card = json.loads((model / CARD_JSON).read_text())
        trial_id = card["model"]["trial_id"]
        source = runs[trial_id].info.run_id
        metrics = client.get_run(source).data.metrics  # the card's intervals, the numbers it prints
        intervals = {
            key.removesuffix("_interval"): value for key, value in card["accuracy"].items() if key.endswith("_interval")
        }
        assert set(intervals) == {"val", "test", "configuration_val", "configuration_test"}
        for name, interval in intervals.items():
            assert [metrics[f"{name}_accuracy_low"], metrics[f"{name}_accuracy_high"]] == interval, name
        logged_model = Path(client.download_artifacts(source, "model", str(tmp_path / trial_id)))
        assert {path.name for path in logged_model.iterdir()} >= {"MLmodel", "python_model.pkl", "requirements.txt"}
        assert f"dptune=={__version__}" in (logged_model / "requirements.txt").read_text().split()
        for name in (MODEL_FILE, CARD_MD, CARD_JSON):
            assert (logged_model / "artifacts" / model.name / name).read_bytes() == (model / name).read_bytes()
        (version,) = _versions(client, f"{REGISTERED}-{model.name}", row["search_id"])
        assert version.source == f"runs:/{source}/model" and version.run_id == source


def test_a_registered_version_predicts_as_dptune_predict(
    mlflow_server: MlflowServer, logged: LoggedSearch, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import mlflow.pyfunc

    raw = load_20newsgroups()
    rows = pd.DataFrame({"text": raw.inputs[raw.num_official_train :][:40]}, index=range(100, 140))
    rows.to_parquet(tmp_path / "rows.parquet")
    model = logged.root / "models" / model_name("eps=8|epochs=3", "normalized")
    predict.main(
        ["--model", str(model), "--input", str(tmp_path / "rows.parquet"), "--output", str(tmp_path / "out.parquet")]
    )
    expected = pd.read_parquet(tmp_path / "out.parquet")
    search_id = read_table(str(logged.root), "search")["search_id"].iloc[0]
    (version,) = _versions(_client(mlflow_server.url), f"{REGISTERED}-{model.name}", search_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    pyfunc = mlflow.pyfunc.load_model(f"models:/{REGISTERED}-{model.name}/{version.version}")
    assert pyfunc.metadata.get_input_schema().input_names() == ["text"]
    predicted = pyfunc.predict(rows)
    assert list(predicted.columns) == ["prediction", "softmax_score"] and predicted.index.tolist() == list(
        range(100, 140)
    )
    assert predicted["prediction"].tolist() == expected["prediction"].tolist()
    assert predicted["softmax_score"].to_numpy().tolist() == expected["softmax_score"].to_numpy().tolist()
    assert expected["prediction"].nunique() > 1  # a model that tells the rows apart


def test_a_resume_of_a_logged_search_logs_nothing_twice(mlflow_server: MlflowServer, logged: LoggedSearch) -> None:
    assert "is finished; nothing to run" in logged.resumed.stdout
    trials = read_table(str(logged.root), "trials")
    assert f"mlflow: {len(trials) + 1} run(s) logged to {mlflow_server.url}/#/experiments/" in logged.resumed.stdout
    assert "(0 of them now)" in logged.resumed.stdout
    client = _client(mlflow_server.url)
    assert len(_mine(client, logged.root)) == len(trials) + 1
    search_id = read_table(str(logged.root), "search")["search_id"].iloc[0]
    for model in (logged.root / "models").iterdir():
        assert len(_versions(client, f"{REGISTERED}-{model.name}", search_id)) == 1


def test_a_deleted_experiment_is_refused_before_compute(mlflow_server: MlflowServer) -> None:
    client = _client(mlflow_server.url)
    client.delete_experiment(client.create_experiment("deleted"))
    with pytest.raises(PreflightError, match=r"tracking.experiment 'deleted': the experiment is deleted .* restore it"):
        check_server(TrackingSpec(mlflow=mlflow_server.url, experiment="deleted"))
    check_server(TrackingSpec(mlflow=mlflow_server.url, experiment="not there yet"))  # created when logging


#: Kills the process whose id ``DPTUNE_TEST_KILL_PID`` holds when a search starts its logging.
_KILL_BEFORE_LOGGING = """import os, signal, time
import dptune.search.finish.tracking as tracking
_log = tracking.SearchLogger.log
def log(self):
    os.kill(int(os.environ["DPTUNE_TEST_KILL_PID"]), signal.SIGKILL)
    time.sleep(1)
    return _log(self)
tracking.SearchLogger.log = log
"""
#: A TCP forwarder from a free loopback port (printed) to the port given: a stand-in for the server.
_FORWARDER = """import socket, sys, threading
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
def pipe(source, target):
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    finally:
        source.close()
        target.close()
while True:
    client, _ = listener.accept()
    server = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    threading.Thread(target=pipe, args=(client, server), daemon=True).start()
    threading.Thread(target=pipe, args=(server, client), daemon=True).start()
"""


def test_a_server_that_dies_before_logging_leaves_the_search_as_it_was(
    mlflow_server: MlflowServer, logged: LoggedSearch, search_env: dict[str, str], tmp_path: Path
) -> None:
    port = int(mlflow_server.url.rsplit(":", 1)[1])
    forwarder = subprocess.Popen([sys.executable, "-c", _FORWARDER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        dying = f"http://127.0.0.1:{forwarder.stdout.readline().strip()}"  # type: ignore[union-attr]
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_KILL_BEFORE_LOGGING)
        env = {
            **search_env,
            "PYTHONPATH": f"{hook}{os.pathsep}{search_env.get('PYTHONPATH', '')}",
            "DPTUNE_TEST_KILL_PID": str(forwarder.pid),
        }
        args = ("--space", str(TINY), "--storage", str(tmp_path), "--name", "dies", *ONE_CELL, "--no-report")
        completed = run_search(env, *args, *_tracking(dying))
    finally:
        forwarder.kill()
        forwarder.wait()
    assert completed.returncode == 0, completed.stderr[-3000:]  # as without tracking
    (warning,) = [line for line in completed.stderr.splitlines() if line.startswith("warning: tracking")]
    assert warning.startswith(f"warning: tracking.mlflow {dying}: opening the experiment {SHARED} failed")
    assert "Connection refused" in warning and "--resume to log what is missing" in warning
    root = tmp_path / "dies"
    trials = read_table(str(root), "trials")
    (row,) = read_table(str(root), "search").to_dict("records")  # the search finished and its records are whole
    assert len(trials) == 6 and len(list((root / "models").iterdir())) == 1
    assert "best configuration per cell" in completed.stdout
    # --resume with the server reachable logs what was missing, beside the other search in the experiment
    again = run_search(search_env, *args, "--resume", *_tracking(mlflow_server.url))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"mlflow: {len(trials) + 1} run(s) logged" in again.stdout
    client = _client(mlflow_server.url)
    mine, other = _mine(client, root), _mine(client, logged.root)
    assert set(mine) == {*trials["trial_id"], "search"} and {run.info.status for run in mine.values()} == {"FINISHED"}
    shared = set(trials["trial_id"]) & set(other)  # the same space: the same trial ids, told apart by instance
    assert shared and all(mine[key].info.run_id != other[key].info.run_id for key in shared)
    # its model is the next version of its cell's registered model, after the other search's
    (model,) = (root / "models").iterdir()
    versions = client.search_model_versions(f"name = '{REGISTERED}-{model.name}'")
    first_id = read_table(str(logged.root), "search")["search_id"].iloc[0]
    by_search = sorted((int(version.version), version.tags["dptune.search_id"]) for version in versions)
    assert by_search == [(1, first_id), (2, row["search_id"])]


# --------------------------------------------------------------------------- a private search: its release only


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[MlflowServer]:
    """A server for one test alone (:func:`serve`): every byte it keeps is that test's."""
    with serve(tmp_path / "mlflow") as server:
        yield server


def test_a_private_search_logs_its_release_and_nothing_of_its_hidden_runs(
    own_server: MlflowServer, search_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.pyfunc

    from dptune.model import load_model

    # a server of its own, whose whole folder is scanned: another search's scores (k/150 on a validation
    # split of the same size) would stand for a hidden run's score by chance
    mlflow_server = own_server
    temporary = Path(tempfile.mkdtemp(prefix="pmf-", dir="/tmp"))  # short: Ray's socket paths (hidden_runs)
    tracking = ("--set", f"tracking.mlflow={mlflow_server.url}", "--set", "tracking.registered_model=private-model")
    try:
        completed = run_search(
            {**search_env, "TMPDIR": str(temporary)},
            *("--space", str(PRIVATE), "--storage", str(tmp_path), "--name", "private", *SHORT_PRIVATE, *tracking),
        )
        assert completed.returncode == 0, completed.stderr[-3000:]
        root = tmp_path / "private"
        assert_nothing_of_the_hidden_runs_outside(root, completed.stdout, temporary, os.cpu_count() or 1)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    assert f"mlflow: the release is logged at {mlflow_server.url}/#/experiments/" in completed.stdout
    (release,) = read_table(str(root), "release").to_dict("records")
    hidden = read_table(str(root / TRUST_BOUNDARY), "trials")
    client = _client(mlflow_server.url)
    experiment = client.get_experiment_by_name(release["search_id"])
    with sqlite3.connect(mlflow_server.folder / "mlflow.db") as db:  # deleted runs too: exactly one run
        ((count,),) = db.execute("SELECT COUNT(*) FROM runs WHERE experiment_id = ?", (experiment.experiment_id,))
    assert count == 1
    (run,) = client.search_runs([experiment.experiment_id])
    card = json.loads(next((root / "models").glob(f"*/{CARD_JSON}")).read_text())
    # named by the release's own total (ε, δ), as its model folder and card are
    assert run.data.tags[DPTUNE_RUN_TAG] == run.info.run_name == "release eps=8|delta=1e-05|epochs=5"
    assert card["model"]["cell_id"] == release_label(release) == "eps=8|delta=1e-05|epochs=5"
    for name in ("clip_bound", "base_learning_rate", "learning_rate"):
        assert float(run.data.params[name]) == release[name], name
    for name in ("noise_multiplier", "sample_rate"):
        assert float(run.data.params[name]) == card["configuration"][name], name
    assert int(run.data.params["steps"]) == card["configuration"]["steps"]
    assert run.data.metrics["epsilon"] == release["epsilon_total"] == 8
    assert run.data.metrics["noisy_val_accuracy"] == release["noisy_val_accuracy"]
    assert experiment.tags[EXPERIMENT_KIND_TAG] == CLASSIC_EXPERIMENT
    assert {f.path for f in client.list_artifacts(run.info.run_id)} == {"model", "report", "summary.txt"}
    (folder,) = (root / "models").iterdir()
    assert {f.path for f in client.list_artifacts(run.info.run_id, f"model/artifacts/{folder.name}")} == {
        f"model/artifacts/{folder.name}/{name}" for name in (MODEL_FILE, CARD_MD, CARD_JSON)
    }
    (version,) = client.search_model_versions(f"name = 'private-model-{folder.name}'")
    assert version.source == f"runs:/{run.info.run_id}/model"
    # its registered version is loaded and predicts as the model folder does
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    pyfunc = mlflow.pyfunc.load_model(f"models:/private-model-{folder.name}/{version.version}")
    rows = pd.DataFrame({"text": ["the orbit of the shuttle", "a new graphics card", "the hockey season"]})
    pd.testing.assert_frame_equal(pyfunc.predict(rows), load_model(folder).predict_frame(rows))
    # nothing of the hidden runs anywhere the server keeps or logs: its store, its artifacts, its log
    needles = hidden_needles(hidden, read_table(str(root), "release"), card_numbers(root))
    digests = private_data_digests(root / TRUST_BOUNDARY)
    for needle, what in list(needles.items()):  # a float as SQLite keeps a REAL: 8 bytes, big-endian
        try:
            needles[struct.pack(">d", float(needle))] = f"{what} (binary)"
        except ValueError:  # an id
            continue
    stored = b"".join(path.read_bytes() for path in sorted(mlflow_server.folder.rglob("*")) if path.is_file())
    assert needles and release["search_id"].encode() in stored  # the scan reads what the server keeps...
    assert struct.pack(">d", release["noisy_val_accuracy"]) in stored  # ...and its doubles as 8 bytes
    assert_none_in(stored, needles | digests, f"the MLflow server's folder {mlflow_server.folder}")
