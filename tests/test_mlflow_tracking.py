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
from dptune import search
from dptune.records import TRUST_BOUNDARY, read_table, release_label
from dptune.records.weights import CARD_JSON, CARD_MD, MODEL_FILE
from dptune.search.finish.tracking import CHECK_TIMEOUT_S, DPTUNE_RUN_TAG, check_server
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


def _runs(client, experiment_id: str) -> dict[str, object]:
    """The experiment's active runs by their ``dptune.run`` tag."""
    return {run.data.tags[DPTUNE_RUN_TAG]: run for run in client.search_runs([experiment_id], max_results=1000)}


def _free_url() -> str:
    """The URL of a loopback port nothing listens on."""
    (port,) = _free_ports(1)
    return f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------- the key and the check before compute


def test_the_key_is_an_http_url_and_leaves_the_search_id_as_it_was(capsys: pytest.CaptureFixture) -> None:
    plain = load_space(TINY)
    tracked = load_space(TINY, {"tracking.mlflow": "http://127.0.0.1:5000/", "tracking.registered_model": "tiny"})
    assert tracked.space.tracking == TrackingSpec(mlflow="http://127.0.0.1:5000", registered_model="tiny")
    assert tracked.spec_hash == plain.spec_hash and "tracking" not in tracked.text  # not part of the search
    for bad in ("ftp://127.0.0.1:5000", "127.0.0.1:5000", "http://user:secret@host:5000", "http://host:0"):
        with pytest.raises(SystemExit) as info:
            search.main(["--space", str(TINY), "--set", f"tracking.mlflow={bad}", "--dry-run"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "tracking.mlflow: Value error, expected the http:// or https:// URL of an MLflow tracking server" in err
    with pytest.raises(SystemExit):
        search.main(["--space", str(TINY), "--set", "tracking.registered_model=tiny", "--dry-run"])
    assert "registered_model needs mlflow" in capsys.readouterr().err


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


def test_a_search_logs_each_run_its_models_and_report_and_a_resume_adds_nothing(
    mlflow_server: MlflowServer, search_env: dict[str, str], tmp_path: Path
) -> None:
    tracking = ("--set", f"tracking.mlflow={mlflow_server.url}", "--set", "tracking.registered_model=tiny-models")
    args = ("--space", str(TINY), "--storage", str(tmp_path), *ONE_CELL, *tracking)
    completed = run_search(search_env, *args)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "warning: tracking" not in completed.stderr
    root = tmp_path / "tiny"
    trials, epochs = read_table(str(root), "trials"), read_table(str(root), "epochs")
    (row,) = read_table(str(root), "search").to_dict("records")
    assert f"mlflow: {len(trials) + 1} run(s) logged to {mlflow_server.url}/#/experiments/" in completed.stdout
    client = _client(mlflow_server.url)
    experiment = client.get_experiment_by_name(row["search_id"])
    runs = _runs(client, experiment.experiment_id)
    assert set(runs) == {*trials["trial_id"], "search"}
    assert {run.info.status for run in runs.values()} == {"FINISHED"}
    parent = runs["search"]
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
    assert "best configuration per cell" in summary and summary.strip() in completed.stdout
    assert client.list_artifacts(parent.info.run_id, "report")  # the report, built beside the results
    assert Path(client.download_artifacts(parent.info.run_id, "report/index.html", str(tmp_path))).stat().st_size
    # each published model is in the run that trained it, with its card, and registered from there
    (model,) = (root / "models").iterdir()
    trial_id = json.loads((model / CARD_JSON).read_text())["model"]["trial_id"]
    source = runs[trial_id].info.run_id
    logged = Path(client.download_artifacts(source, "model", str(tmp_path / "download")))
    for name in (MODEL_FILE, CARD_MD, CARD_JSON):
        assert (logged / name).read_bytes() == (model / name).read_bytes(), name
    (version,) = client.search_model_versions("name = 'tiny-models'")
    assert version.source == f"runs:/{source}/model" and version.run_id == source
    # --resume of the finished search logs nothing twice
    again = run_search(search_env, *args, "--resume", "--no-report")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is finished; nothing to run" in again.stdout and "mlflow: 0 run(s) logged" in again.stdout
    assert len(client.search_runs([experiment.experiment_id], max_results=1000)) == len(runs)
    assert len(client.search_model_versions("name = 'tiny-models'")) == 1


#: Kills the process whose id ``DPTUNE_TEST_KILL_PID`` holds when a search starts its logging.
_KILL_BEFORE_LOGGING = """import os, signal, time
import dptune.search.finish.tracking as tracking
_log = tracking._SearchLogger.log
def log(self):
    os.kill(int(os.environ["DPTUNE_TEST_KILL_PID"]), signal.SIGKILL)
    time.sleep(1)
    return _log(self)
tracking._SearchLogger.log = log
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
    mlflow_server: MlflowServer, search_env: dict[str, str], tmp_path: Path
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
        completed = run_search(env, *args, "--set", f"tracking.mlflow={dying}")
    finally:
        forwarder.kill()
        forwarder.wait()
    assert completed.returncode == 0, completed.stderr[-3000:]  # as without tracking
    (warning,) = [line for line in completed.stderr.splitlines() if line.startswith("warning: tracking")]
    assert warning.startswith(f"warning: tracking.mlflow {dying}: opening the experiment ")
    assert "Connection refused" in warning and "--resume to log what is missing" in warning
    root = tmp_path / "dies"
    trials = read_table(str(root), "trials")
    (row,) = read_table(str(root), "search").to_dict("records")  # the search finished and its records are whole
    assert len(trials) == 6 and len(list((root / "models").iterdir())) == 1
    assert "best configuration per cell" in completed.stdout
    # --resume with the server reachable logs what was missing
    again = run_search(search_env, *args, "--resume", "--set", f"tracking.mlflow={mlflow_server.url}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"mlflow: {len(trials) + 1} run(s) logged" in again.stdout
    client = _client(mlflow_server.url)
    experiment = client.get_experiment_by_name(row["search_id"])
    assert set(_runs(client, experiment.experiment_id)) == {*trials["trial_id"], "search"}


# --------------------------------------------------------------------------- a private search: its release only


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[MlflowServer]:
    """A server for one test alone (:func:`serve`): every byte it keeps is that test's."""
    with serve(tmp_path / "mlflow") as server:
        yield server


def test_a_private_search_logs_its_release_and_nothing_of_its_hidden_runs(
    own_server: MlflowServer, search_env: dict[str, str], tmp_path: Path
) -> None:
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
    assert {f.path for f in client.list_artifacts(run.info.run_id)} == {"model", "report", "summary.txt"}
    assert {f.path for f in client.list_artifacts(run.info.run_id, "model")} == {
        f"model/{name}" for name in (MODEL_FILE, CARD_MD, CARD_JSON)
    }
    (version,) = client.search_model_versions("name = 'private-model'")
    assert version.source == f"runs:/{run.info.run_id}/model"
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
