"""``ray job stop`` of a search submitted with ``ray job submit`` to the suite's token-authenticated head,
with the runtime environment cluster/README.md documents (``RAY_JOB_STOP_WAIT_TIME_S`` raised from Ray's
3 s): the search stops through its own graceful path (one line counting the recorded runs), releases its
results folder, and a ``--resume`` submitted right after runs every planned run exactly once."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import REPO_ROOT, RayHead, search_command
from dptune.records import read_table
from dptune.search.preflight import JOB_STOP_WAIT_S

#: One cell of 2 C × 2 B × 2 η₀ = 8 runs of five epochs, one trial process each (the runs of
#: tests/test_faults.py's stop test); B = 256 is pruned by the min-step rule and recorded without compute.
STOPPED_SEARCH = (
    "--space",
    str(REPO_ROOT / "tests/spaces/tiny.yaml"),
    "--no-report",
    "--set",
    "privacy.epsilons=[2]",
    "--set",
    "training.compare_auto_s=false",
    "--set",
    "training.diagnostics=false",
    "--set",
    "training.runner=trial",
    "--set",
    "epochs=[5]",
    "--set",
    "batch_size.values=[32, 64, 256]",
    "--set",
    "base_learning_rate.values=[0.01, 0.001]",
)
PLANNED_RUNS = 8
#: Seconds the stopped search's graceful stop is made to take, as on an object store (15 s measured on
#: S3): more than Ray's default stop wait of 3 s, which would SIGKILL the search before its line.
SLOW_STOP_S = 5
#: A ``sitecustomize`` for the job's processes: in its driver only (the one process to which Ray gives
#: RAY_JOB_CONFIG_JSON_ENV_VAR), a stop signal's graceful path first waits ``SLOW_STOP_S``.
_SLOW_STOP = f"""
import os
if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
    import time
    import dptune.search.finish.outcome as outcome
    _stopped_by_signal = outcome.stopped_by_signal
    def stopped_by_signal(signals, *args, **kwargs):
        if signals:
            time.sleep({SLOW_STOP_S})
        return _stopped_by_signal(signals, *args, **kwargs)
    outcome.stopped_by_signal = stopped_by_signal
"""


def _ray(ray_head: RayHead, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``ray job ARGS[0] --address <head> ARGS[1:]``, as a user runs it with the token in the environment."""
    completed = subprocess.run(
        ["ray", "job", args[0], "--address", ray_head.dashboard_url, *args[1:]],
        env=ray_head.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert completed.returncode == 0, (
        f"ray job {args[0]} failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
    )
    return completed


def _submit(ray_head: RayHead, cache: Path, storage: Path, *flags: str, wait: bool) -> str:
    """Submit the search with the documented runtime environment (and the session's dptune cache, one
    thread per trial, a graceful stop of ``SLOW_STOP_S``); returns its submission id. ``wait``: until it
    ends (and it must succeed)."""
    site = storage / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SLOW_STOP)
    env_vars = {"OMP_NUM_THREADS": "1", "DPTUNE_CACHE_DIR": str(cache), "PYTHONPATH": str(site)}
    runtime_env = {"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(JOB_STOP_WAIT_S), **env_vars}}
    entrypoint = search_command(*STOPPED_SEARCH, "--storage", str(storage), *flags)
    entrypoint[0] = "python"  # resolved on the head's PATH (the venv it was started from)
    submission = f"dptune-stop-{uuid.uuid4().hex[:8]}"
    _ray(
        ray_head,
        "submit",
        "--working-dir",
        str(REPO_ROOT),
        "--runtime-env-json",
        json.dumps(runtime_env),
        "--submission-id",
        submission,
        *([] if wait else ["--no-wait"]),
        "--",
        *entrypoint,
    )
    return submission


def _job(ray_head: RayHead, submission: str, what: str = "") -> dict | str:
    """``GET /api/jobs/<submission><what>`` of the job API: the job's record (``what`` empty) or its logs."""
    request = urllib.request.Request(f"{ray_head.dashboard_url}/api/jobs/{submission}{what}")
    request.add_header("Authorization", f"Bearer {ray_head.token}")
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    return str(answer["logs"]) if what == "/logs" else dict(answer)


@pytest.mark.ray
def test_ray_job_stop_ends_the_search_cleanly_and_a_resume_right_after_runs_the_rest_once(
    ray_head: RayHead, test_cache_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "tiny"
    stopped = _submit(ray_head, test_cache_dir, tmp_path, wait=False)
    deadline = time.monotonic() + 900
    while not list((root / "ledger").glob("end-*.json")):  # a run has ended
        job = _job(ray_head, stopped)
        assert isinstance(job, dict) and job["status"] in ("PENDING", "RUNNING"), _job(ray_head, stopped, "/logs")
        assert time.monotonic() < deadline, "no run ended in 15 minutes"
        time.sleep(0.5)
    sent = time.monotonic()
    _ray(ray_head, "stop", stopped)  # returns once the job is STOPPED: its driver has exited
    took = time.monotonic() - sent
    logs = _job(ray_head, stopped, "/logs")
    assert isinstance(logs, str)
    last = logs.strip().splitlines()[-1]
    assert last.startswith("error: stopped by SIGTERM before the search finished: "), logs[-3000:]
    assert f"of {PLANNED_RUNS} runs recorded" in last and "--resume" in last, last
    assert "Traceback" not in logs and "RAY_JOB_STOP_WAIT_TIME_S" not in logs  # dptune's stop, no warning
    assert SLOW_STOP_S < took < JOB_STOP_WAIT_S, f"the stop took {took:.0f} s"
    assert not (root / "search").exists()
    trials = read_table(str(root), "trials")
    before = trials[trials["status"] != "pruned_min_steps"]
    assert 1 <= len(before) < PLANNED_RUNS and before["trial_id"].is_unique

    resumed = _submit(ray_head, test_cache_dir, tmp_path, "--resume", wait=True)  # the lease is free at once
    logs = _job(ray_head, resumed, "/logs")
    assert isinstance(logs, str) and "another search is running" not in logs and "search finished" in logs, logs[-3000:]
    trials = read_table(str(root), "trials")
    ran = trials[trials["status"] != "pruned_min_steps"]
    configurations = ran[["clip_bound", "batch_size", "base_learning_rate"]].apply(tuple, axis=1)
    assert len(ran) == PLANNED_RUNS and configurations.is_unique and set(ran["status"]) == {"ok"}
    assert set(before["trial_id"]) <= set(ran["trial_id"])  # what finished before the stop is kept
    assert (root / "search").is_dir()
