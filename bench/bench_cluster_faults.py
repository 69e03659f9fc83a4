"""Faults on a real two-node Ray cluster: a unit that fails before its charge, ``ray job stop``, resume.

Issue 49's cluster acceptance check, too long for the test suite. On this host it starts a Ray head
that offers no CPUs (``--num-cpus 0``), token authentication on (``RAY_AUTH_MODE=token``, a fresh random
``RAY_AUTH_TOKEN`` in the environment of ``ray start`` and of every client), its dashboard and job API
on 127.0.0.1, and ``RAY_JOB_STOP_WAIT_TIME_S=120`` in its environment as ``cluster/raycluster.yaml`` sets
it on every Ray container; and a worker node with 2 CPUs that joins it, so every trial runs on the
worker node and the search's driver (the job's entrypoint) on the head. Then, with
``ray job submit --working-dir <repo>``, one small search of ``tests/spaces/tiny.yaml`` (two cells,
ε = 1 and 2, E = 5, 2 C × 3 B × 2 η₀, one trial process per run, no retries; the runs and
configurations every check expects are the search's own plan, read from its ``--dry-run``: 8 per cell
at the default 5 epochs, where the min-step rule prunes B = 256):

1. with a ``sitecustomize`` on the job's PYTHONPATH that makes ``charge_runs`` raise a
   ``ConnectionError`` in Ray's worker processes for the cell ``eps1-*`` (a unit that fails before it
   charges anything, as an object store that does not answer does): the job must fail (exit 1)
   with one line naming the cell and ``--resume``, and write no ``search`` table;
2. ``--resume`` without the fault, stopped with ``ray job stop`` once a run of it has ended: the job
   must be STOPPED with one line counting the runs recorded and naming ``--resume``, well inside the
   120 s before Ray's SIGKILL;
3. ``--resume`` again, to the end: it must succeed with every planned (configuration, replicate) of
   both cells recorded exactly once, a ``search`` row per cell, and a whole-search ε no smaller than
   an independent PLD composition (dp_accounting) of the privacy ledger read with plain ``json``.

Every port is chosen free, Ray's temp folder is private, and the teardown stops exactly the processes
this script started (by PID, never ``ray stop``). Result: JSON (``--out``), and a summary on stdout;
the exit status is 1 when a check failed.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_cluster_faults.py [--epochs 5] [--cache-dir DIR]
        [--keep] [--out bench/results/cluster_faults.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# the suite's own helpers: Ray's ports and processes (conftest), the ledger read with plain json and an
# independent dp_accounting PLD of it (test_faults)
from conftest import (  # noqa: E402
    _HEAD_START_TIMEOUT_S,
    _HEAD_STOP_TIMEOUT_S,
    _PORT_FLAGS,
    _alive,
    _descendants,
    _free_ports,
    _job_api_status,
)
from test_faults import expected_search_epsilon, ledger_entries, recorded  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SPACE = ROOT / "tests/spaces/tiny.yaml"
#: The tests' caps (tests/conftest.py ``search_command``).
MAX_TRAIN, MAX_EVAL = 300, 150
DELTA = 1e-5
EPSILONS = (1, 2)
CLIP_BOUNDS = (0.1, 1.0)
#: The space's min-step rule prunes the B that take too few steps on 300 examples (B = 256 at 5 epochs);
#: they are recorded without compute (status ``pruned_min_steps``) and are not among the planned runs.
BATCH_SIZES = (32, 64, 256)
LEARNING_RATES = (0.01, 0.001)
#: The cell whose units fail before they charge (its key starts with this).
FAILING_CELL = "eps1-"
#: What ``ray job stop`` waits before SIGKILL, in the nodes' environment (cluster/raycluster.yaml).
JOB_STOP_WAIT_S = 120
FAULT_MESSAGE = "injected: the object store did not answer"
#: In Ray's worker processes only (never the job's driver): every unit of the cells whose key begins
#: with DPTUNE_BENCH_FAIL_CELL fails before it charges anything (tests/test_faults.py ``_FAIL_BEFORE_CHARGE``).
SITECUSTOMIZE = f"""
import os, sys
if sys.argv and sys.argv[0].endswith("default_worker.py") and os.environ.get("DPTUNE_BENCH_FAIL_CELL"):
    import dptune.search.runs.execution as execution
    _real = execution.charge_runs
    def charge_runs(context, runs):
        if context.cell_key.startswith(os.environ["DPTUNE_BENCH_FAIL_CELL"]):
            raise ConnectionError({FAULT_MESSAGE!r})
        return _real(context, runs)
    execution.charge_runs = charge_runs
"""
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def search_flags(epochs: int) -> list[str]:
    return [
        "--max-train-examples",
        str(MAX_TRAIN),
        "--max-eval-examples",
        str(MAX_EVAL),
        "--space",
        str(SPACE),
        "--no-report",
        "--set",
        f"privacy.epsilons=[{', '.join(map(str, EPSILONS))}]",
        "--set",
        "training.compare_auto_s=false",
        "--set",
        "training.diagnostics=false",
        "--set",
        "training.runner=trial",
        "--set",
        f"epochs=[{epochs}]",
        "--set",
        f"batch_size.values=[{', '.join(map(str, BATCH_SIZES))}]",
        "--set",
        f"base_learning_rate.values=[{', '.join(map(str, LEARNING_RATES))}]",
        "--set",
        "resources.max_retries=0",
    ]


# --------------------------------------------------------------------------- the search's plan

_PLAN_CELL = re.compile(r"^cell (?P<cell>\S+) \[[^\]]+\]: (?P<configurations>\d+) configurations", re.MULTILINE)
_PLAN_ROW = re.compile(r"^\s+(?P<b>\d+)\s+\d+\s+[0-9.]+\s+[0-9.]+$")
_PLAN_TOTAL = re.compile(r"^total: \d+ configurations.* = (?P<runs>\d+) trials in \d+ cell runs$", re.MULTILINE)


@dataclass(frozen=True)
class Plan:
    """What the search will run, as its own ``--dry-run`` prints it."""

    runs: int  # every cell's configurations × replicates
    configurations: dict[str, int]  # per cell id
    batch_sizes: dict[str, tuple[int, ...]]  # per cell id: the B the min-step rule keeps


def parse_plan(printed: str) -> Plan:
    """The :class:`Plan` in a ``--dry-run``'s output (``dptune.search.planning.cells.format_cell_plans``)."""
    configurations: dict[str, int] = {}
    batch_sizes: dict[str, tuple[int, ...]] = {}
    cell = None
    for line in printed.splitlines():
        if match := _PLAN_CELL.match(line):
            cell = match["cell"]
            configurations[cell], batch_sizes[cell] = int(match["configurations"]), ()
        elif cell is not None and (row := _PLAN_ROW.match(line)):
            batch_sizes[cell] += (int(row["b"]),)
    total = _PLAN_TOTAL.search(printed)
    if total is None or not configurations:
        raise RuntimeError(f"no plan in the --dry-run's output:\n{printed[-3000:]}")
    return Plan(int(total["runs"]), configurations, batch_sizes)


def search_plan(flags: list[str], cache: Path, storage: Path) -> Plan:
    """The plan of the search ``flags`` describe, from its ``--dry-run`` (which also fills ``cache`` with its
    features, as the jobs' first driver would)."""
    completed = subprocess.run(
        [sys.executable, "-m", "dptune.search", *flags, "--storage", str(storage), "--dry-run"],
        cwd=ROOT,
        env={**os.environ, "DPTUNE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"--dry-run failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-3000:]}")
    return parse_plan(completed.stdout)


# --------------------------------------------------------------------------- processes and ports


def stop_node(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the ``ray start --block`` process (it stops the Ray processes it started), then SIGKILL,
    by PID, whatever of its process tree outlives it. Never ``ray stop``: it would stop every Ray here."""
    tree = _descendants(process.pid)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=_HEAD_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    deadline = time.monotonic() + 10
    while (leftovers := [pid for pid in tree if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class Cluster:
    address: str
    dashboard_url: str
    env: dict[str, str]  # a client's: the token, the venv first on PATH
    token: str
    temp_dir: Path
    started_s: float


def job_api(cluster_url: str, token: str, path: str) -> Any:
    """``GET <dashboard>/api/jobs/<path>`` with the bearer token, decoded."""
    request = urllib.request.Request(f"{cluster_url}/api/jobs/{path}")
    request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def two_node_cluster(keep: bool) -> Iterator[Cluster]:
    """A head without CPUs (dashboard and job API on loopback) and a worker node with 2 CPUs, both
    started from the repository root with the venv first on PATH, token authentication on.

    Each node has a temp folder of its own, as two machines have: a worker node started without
    ``--temp-dir`` takes the head's, so both nodes' runtime-env agents unpack the job's working dir into
    one folder, and the first job's driver lost its working directory under it (run of 2026-12-06,
    bench/RESULTS.md). ``keep``: leave both folders (Ray's session logs) in place."""
    begun = time.monotonic()
    temp_dir = Path(tempfile.mkdtemp(prefix="raycf", dir="/tmp"))  # short: socket paths are length-limited
    worker_temp_dir = Path(tempfile.mkdtemp(prefix="raycw", dir="/tmp"))
    token = secrets.token_hex(32)
    client_env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    client_env.update(
        {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
            "PATH": f"{VENV_BIN}{os.pathsep}{client_env.get('PATH', '')}",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
    )
    node_env = {
        **client_env,
        "OMP_NUM_THREADS": "1",
        "RAY_JOB_STOP_WAIT_TIME_S": str(JOB_STOP_WAIT_S),  # as cluster/raycluster.yaml sets on every container
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # the teardown stops at once
    }
    ray = str(VENV_BIN / "ray")
    head_ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
    head_cmd = [
        ray,
        "start",
        "--head",
        "--block",
        "--temp-dir",
        str(temp_dir),
        "--dashboard-host",
        "127.0.0.1",
        "--include-dashboard",
        "true",
        "--num-cpus",
        "0",
        "--num-gpus",
        "0",
        "--disable-usage-stats",
    ]
    for flag, port in head_ports.items():
        head_cmd += [flag, str(port)]
    dashboard_url = f"http://127.0.0.1:{head_ports['--dashboard-port']}"
    processes: list[subprocess.Popen[bytes]] = []
    try:
        with (temp_dir / "head.log").open("wb") as log:
            processes.append(subprocess.Popen(head_cmd, cwd=ROOT, env=node_env, stdout=log, stderr=subprocess.STDOUT))
        address_file = temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + _HEAD_START_TIMEOUT_S
        while not (address_file.is_file() and _job_api_status(dashboard_url, token) == 200):
            if processes[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the head did not serve its job API at {dashboard_url}:\n"
                    + (temp_dir / "head.log").read_text(errors="replace")[-3000:]
                )
            time.sleep(0.5)
        address = address_file.read_text().strip()
        worker_ports = dict(zip(_PORT_FLAGS[3:], _free_ports(len(_PORT_FLAGS) - 3), strict=True))
        worker_cmd = [ray, "start", "--block", "--address", address, "--temp-dir", str(worker_temp_dir)]
        worker_cmd += ["--num-cpus", "2", "--num-gpus", "0"]
        for flag, port in worker_ports.items():
            worker_cmd += [flag, str(port)]
        with (temp_dir / "worker.log").open("wb") as log:
            processes.append(subprocess.Popen(worker_cmd, cwd=ROOT, env=node_env, stdout=log, stderr=subprocess.STDOUT))
        probe = [
            sys.executable,
            "-c",
            f"import ray, time; ray.init(address={address!r}, log_to_driver=False)\n"
            "while ray.cluster_resources().get('CPU', 0) < 2: time.sleep(0.5)",
        ]
        subprocess.run(probe, cwd=ROOT, env=client_env, check=True, timeout=_HEAD_START_TIMEOUT_S, capture_output=True)
        yield Cluster(address, dashboard_url, client_env, token, temp_dir, time.monotonic() - begun)
    finally:
        for process in reversed(processes):
            stop_node(process)
        if keep:
            print(f"kept Ray's folders: {temp_dir} (head), {worker_temp_dir} (worker node)")
        else:
            shutil.rmtree(temp_dir, ignore_errors=True)
            shutil.rmtree(worker_temp_dir, ignore_errors=True)


# --------------------------------------------------------------------------- jobs


def ray_job(cluster: Cluster, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """``ray job ARGS[0] --address <head> ARGS[1:]``, as a user runs it with the token in the environment."""
    return subprocess.run(
        [str(VENV_BIN / "ray"), "job", args[0], "--address", cluster.dashboard_url, *args[1:]],
        cwd=ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def submit(cluster: Cluster, entrypoint: list[str], env_vars: dict[str, str]) -> str:
    """Submit ``entrypoint`` with the repository as working dir and ``env_vars``, without waiting."""
    submission = f"dptune-faults-{uuid.uuid4().hex[:8]}"
    done = ray_job(
        cluster,
        "submit",
        "--working-dir",
        str(ROOT),
        "--runtime-env-json",
        json.dumps({"env_vars": env_vars}),
        "--submission-id",
        submission,
        "--no-wait",
        "--",
        *entrypoint,
    )
    if done.returncode != 0:
        raise RuntimeError(f"ray job submit failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return submission


def job_record(cluster: Cluster, submission: str) -> dict[str, Any]:
    return dict(job_api(cluster.dashboard_url, cluster.token, submission))


def job_logs(cluster: Cluster, submission: str) -> str:
    return str(job_api(cluster.dashboard_url, cluster.token, f"{submission}/logs")["logs"])


def wait_for_end(cluster: Cluster, submission: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (record := job_record(cluster, submission))["status"] not in TERMINAL:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"job {submission} did not end in {timeout:.0f} s:\n{job_logs(cluster, submission)[-3000:]}"
            )
        time.sleep(1)
    return record


def last_line(logs: str) -> str:
    lines = logs.strip().splitlines()
    return lines[-1] if lines else ""


def describe(cluster: Cluster, submission: str, record: dict[str, Any], wall_s: float) -> dict[str, Any]:
    logs = job_logs(cluster, submission)
    started, ended = record.get("start_time"), record.get("end_time")
    return {
        "submission_id": submission,
        "status": record["status"],
        "driver_exit_code": record.get("driver_exit_code"),
        "message": record.get("message"),
        "exit_line": last_line(logs),
        "wall_s": round(wall_s, 1),
        "job_s": round((ended - started) / 1000, 1) if started and ended else None,
        "log_tail": logs.strip().splitlines()[-12:],
        "_logs": logs,
    }


# --------------------------------------------------------------------------- what the results folder holds


def recorded_with_pruned(root: Path) -> Any:
    from dptune.records import read_table

    return read_table(str(root), "trials")


def end_files(root: Path) -> set[str]:
    return {path.name for path in (root / "ledger").glob("end-*.json")}


# --------------------------------------------------------------------------- the three submissions


def lscpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    storage, site = work / "st", work / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    cache = args.cache_dir or work / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    root = storage / "tiny"
    plan = search_plan(search_flags(args.epochs), cache, work / "dry-run")
    cells = set(plan.configurations)
    grids = {cell: set(itertools.product(CLIP_BOUNDS, plan.batch_sizes[cell], LEARNING_RATES)) for cell in cells}
    if any(len(grids[cell]) != plan.configurations[cell] for cell in cells):
        raise RuntimeError(f"the plan {plan} is not the grid C × kept B × η₀ this benchmark checks")
    planned = plan.runs
    passing_cell = f"eps=2|epochs={args.epochs}"
    entrypoint = [
        "python",
        "-m",
        "dptune.search",
        *search_flags(args.epochs),
        "--storage",
        str(storage),
        "--name",
        "tiny",
    ]
    base_env = {"OMP_NUM_THREADS": "1", "DPTUNE_CACHE_DIR": str(cache)}
    fault_env = {**base_env, "PYTHONPATH": str(site), "DPTUNE_BENCH_FAIL_CELL": FAILING_CELL}
    checks: dict[str, bool] = {}
    out: dict[str, Any] = {"planned_runs": planned, "planned_per_cell": plan.configurations, "checks": checks}

    with two_node_cluster(args.keep) as cluster:
        out["cluster_start_s"] = round(cluster.started_s, 1)
        print(
            f"cluster up in {cluster.started_s:.0f} s: head {cluster.address} (0 CPUs), worker node 2 CPUs", flush=True
        )

        # 1. a unit of the cell ε = 1 fails before its charge
        sent = time.monotonic()
        sid = submit(cluster, entrypoint, fault_env)
        first = describe(cluster, sid, wait_for_end(cluster, sid, args.timeout), time.monotonic() - sent)
        line = first["exit_line"]
        ran = recorded(root)
        starts, _ = ledger_entries(root)
        failing_key = f"{FAILING_CELL}E{args.epochs}"
        first.update(
            recorded=len(ran),
            recorded_cells=sorted(set(ran["cell_id"])),
            ledger_starts=len(starts),
            ledger_starts_failing_cell=sum(str(s.get("trial_id", "")).startswith(FAILING_CELL) for s in starts),
        )
        checks["1 job FAILED, driver exit 1"] = first["status"] == "FAILED" and first["driver_exit_code"] == 1
        checks["1 exit line: error naming the cell, the fault and --resume"] = (
            line.startswith("error: ") and failing_key in line and FAULT_MESSAGE in line and "--resume" in line
        )
        checks["1 no search table"] = not (root / "search").exists()
        checks["1 only the cell ε = 2 recorded, each run once"] = (
            set(ran["cell_id"]) == {passing_cell}
            and len(ran) == plan.configurations[passing_cell]
            and bool(ran["trial_id"].is_unique)
        )
        checks["1 the failed units charged nothing"] = first["ledger_starts_failing_cell"] == 0
        print(f"1 {first['status']} in {first['wall_s']:.0f} s: {line[:200]}", flush=True)

        # 2. --resume, stopped by `ray job stop` once one of its runs has ended
        before_ends, before_rows = end_files(root), set(ran["trial_id"])
        sent = time.monotonic()
        sid = submit(cluster, [*entrypoint, "--resume"], base_env)
        deadline = time.monotonic() + args.timeout
        while not (end_files(root) - before_ends):
            status = job_record(cluster, sid)["status"]
            if status not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        ended_when_asked, rows_when_asked = len(end_files(root) - before_ends), len(recorded(root))
        asked = time.monotonic()
        stopped = ray_job(cluster, "stop", sid, timeout=JOB_STOP_WAIT_S + 120)
        stop_s = time.monotonic() - asked
        second = describe(cluster, sid, job_record(cluster, sid), time.monotonic() - sent)
        line = second["exit_line"]
        ran = recorded(root)
        counted = re.search(r"(\d+) of (\d+) runs recorded", line)
        second.update(
            stop_s=round(stop_s, 1),
            stop_exit_code=stopped.returncode,
            stop_output=(stopped.stdout + stopped.stderr).strip().splitlines()[-3:],
            new_end_files_when_stop_asked=ended_when_asked,
            rows_when_stop_asked=rows_when_asked,
            new_end_files_after_stop=len(end_files(root) - before_ends),
            recorded=len(ran),
            recorded_with_pruned_rows=len(recorded_with_pruned(root)),
            recorded_by_the_line=int(counted.group(1)) if counted else None,
            planned_by_the_line=int(counted.group(2)) if counted else None,
        )
        kept = set(ran["trial_id"])
        checks["2 job STOPPED by ray job stop"] = second["status"] == "STOPPED" and stopped.returncode == 0
        checks["2 exit line: stopped by SIGTERM, k of N runs recorded, --resume"] = (
            line.startswith("error: stopped by SIGTERM before the search finished")
            and counted is not None
            and int(counted.group(2)) == planned
            and "--resume" in line
        )
        # k counts what N counts: the planned runs recorded (the driver has exited: no row comes later);
        # the rows of B = 256, recorded without compute (pruned_min_steps), are not among the N.
        checks["2 the line's k is the planned runs recorded when it stopped"] = counted is not None and int(
            counted.group(1)
        ) == len(ran) <= int(counted.group(2))
        checks["2 no traceback, no stop-wait warning"] = (
            "Traceback" not in second["_logs"] and "RAY_JOB_STOP_WAIT_TIME_S" not in second["_logs"]
        )
        checks[f"2 the stop took less than {JOB_STOP_WAIT_S} s"] = stop_s < JOB_STOP_WAIT_S
        checks["2 no search table"] = not (root / "search").exists()
        checks["2 some but not all runs recorded, each once"] = (
            before_rows < kept and len(ran) < planned and bool(ran["trial_id"].is_unique)
        )
        print(f"2 {second['status']} after `ray job stop` of {stop_s:.1f} s: {line[:200]}", flush=True)

        # 3. --resume to the end
        sent = time.monotonic()
        sid = submit(cluster, [*entrypoint, "--resume"], base_env)
        third = describe(cluster, sid, wait_for_end(cluster, sid, args.timeout), time.monotonic() - sent)
        logs = third["_logs"]

    from dptune.records import read_table

    ran = recorded(root)
    starts, ends = ledger_entries(root)
    search = read_table(str(root), "search")
    per_cell = {
        cell: set(
            map(tuple, ran[ran["cell_id"] == cell][["clip_bound", "batch_size", "base_learning_rate"]].values.tolist())
        )
        for cell in cells
    }
    printed = re.search(r"whole search: ε = ([0-9.eE+-]+)", logs)
    expected = expected_search_epsilon(root, DELTA)
    row = search.iloc[0] if len(search) else None
    third.update(
        recorded=len(ran),
        recorded_per_cell=ran.groupby("cell_id").size().to_dict(),
        ledger_starts=len(starts),
        ledger_ends=len(ends),
        search_rows=len(search),
        runs_charged=int(row["runs_charged"]) if row is not None else None,
        runs_unrecorded=int(row["runs_unrecorded"]) if row is not None else None,
        epsilon_search=float(row["epsilon_search"]) if row is not None else None,
        epsilon_printed=float(printed.group(1)) if printed else None,
        epsilon_independent=expected,
    )
    checks["3 job SUCCEEDED"] = third["status"] == "SUCCEEDED" and third["driver_exit_code"] == 0
    checks["3 not refused: the stopped search's lease was free"] = "another search is running" not in logs
    checks["3 every planned (configuration, replicate) recorded exactly once"] = (
        len(ran) == planned
        and all(found == grids[cell] for cell, found in per_cell.items())
        and bool(ran["trial_id"].is_unique)
        and not ran.duplicated(["configuration_id", "replicate"]).any()
        and set(ran["status"]) == {"ok"}
    )
    checks["3 what finished before the stop is kept"] = kept <= set(ran["trial_id"])
    checks["3 ledger start entries >= rows"] = len(starts) >= len(ran)
    checks["3 a search row per cell"] = set(search["cell_id"]) == cells and len(search) == len(cells)
    checks["3 whole-search ε (row and printed) >= independent PLD of the ledger"] = (
        row is not None
        and printed is not None
        and float(row["epsilon_search"]) >= expected * (1 - 1e-9)
        and float(printed.group(1)) >= expected * (1 - 1e-9)
    )
    print(f"3 {third['status']} in {third['wall_s']:.0f} s: {third['exit_line'][:200]}", flush=True)
    out["submissions"] = {"1_fault_before_charge": first, "2_ray_job_stop": second, "3_resume": third}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, help="DPTUNE_CACHE_DIR of the jobs (default: a fresh one)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each submission may take")
    parser.add_argument("--keep", action="store_true", help="keep the results, the jobs' logs and Ray's folders")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/cluster_faults.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dptune-cluster-faults-"))
    began = time.monotonic()
    try:
        result = {
            "machine": lscpu_model(),
            "load_average_at_start": os.getloadavg(),
            "ray_job_stop_wait_time_s": JOB_STOP_WAIT_S,
            **run(args, work),
        }
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result["total_s"] = round(time.monotonic() - began, 1)
    result["load_average_at_end"] = os.getloadavg()
    result["passed"] = all(result["checks"].values())
    for name, submission in result["submissions"].items():
        logs = submission.pop("_logs")
        if args.keep:
            (work / f"{name}.log").write_text(logs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")

    print(f"\n{result['machine']}; total {result['total_s']:.0f} s (cluster start {result['cluster_start_s']:.0f} s)")
    for name, submission in result["submissions"].items():
        extra = f", `ray job stop` {submission['stop_s']:.1f} s" if "stop_s" in submission else ""
        print(
            f"{name}: {submission['status']} (exit {submission['driver_exit_code']}) "
            f"in {submission['wall_s']:.0f} s{extra}"
        )
        print(f"    {submission['exit_line'][:400]}")
    third = result["submissions"]["3_resume"]
    print(
        f"planned {result['planned_runs']}, recorded {third['recorded']}, ledger starts {third['ledger_starts']}, "
        f"charged {third['runs_charged']} (unrecorded {third['runs_unrecorded']}); "
        f"ε printed {third['epsilon_printed']}, "
        f"row {third['epsilon_search']}, independent {third['epsilon_independent']:.6g}"
    )
    for name, ok in result["checks"].items():
        print(f"  [{'pass' if ok else 'FAIL'}] {name}")
    print(f"written: {args.out}")
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
