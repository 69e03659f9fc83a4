"""Shared pytest fixtures. Append new fixtures at the end; several people edit this file."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- a local Ray head


@dataclass(frozen=True)
class RayHead:
    """A Ray head started by the ``ray_head`` fixture, configured like dptune's cluster head.

    ``address`` is the GCS address (``host:port``, for ``RAY_ADDRESS``/``ray.init``);
    ``dashboard_url`` the job API (``http://127.0.0.1:PORT``, for ``ray job submit --address``);
    ``env`` the environment a client needs: ``RAY_AUTH_MODE=token``, the cluster's token in
    ``RAY_AUTH_TOKEN``, and the venv's ``bin`` first on ``PATH`` (so ``ray`` and ``python`` are the
    venv's); ``token`` the token itself.
    """

    address: str
    dashboard_url: str
    env: dict[str, str]
    token: str
    pid: int
    temp_dir: Path

    def job_api_status(self, token: str | None) -> int:
        """HTTP status of ``GET /api/jobs/`` sent with ``token`` (or none); 0 if nothing answers."""
        return _job_api_status(self.dashboard_url, token)


_HEAD_START_TIMEOUT_S = 300.0
_HEAD_STOP_TIMEOUT_S = 60.0
#: What keeps the suite's single-node Ray on loopback. On Linux Ray replaces a loopback node address
#: by the machine's routable one: ``ray start --head --node-ip-address 127.0.0.1`` registers the head
#: there, its GCS, raylet, workers, dashboard agent and metrics endpoints listen there or on every
#: interface, and a client's ``ray.init(address="127.0.0.1:PORT")`` dials the routable address. With
#: Ray's multi-node mode off (this variable, Ray's switch for single-machine Windows and macOS) both
#: keep 127.0.0.1, and every process of the head (``ray_head``) or of an embedded Ray (``search_env``)
#: binds 127.0.0.1 only; the drivers that join it need it too. A second node cannot join such a head
#: (``start_two_node_cluster``).
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
RAY_LOOPBACK_HEAD_FLAGS = ("--node-ip-address", "127.0.0.1")
# The ports `ray start --head` would otherwise take at fixed defaults (6379, 8265, 10001, 52365, ...),
# so that this head never collides with another one on the machine.
_PORT_FLAGS = (
    "--port",
    "--dashboard-port",
    "--ray-client-server-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
    "--node-manager-port",
    "--object-manager-port",
)


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that are free right now (held open together while chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _job_api_status(dashboard_url: str, token: str | None) -> int:
    """HTTP status of ``GET /api/jobs/`` (0 while the job server does not answer yet)."""
    request = urllib.request.Request(f"{dashboard_url}/api/jobs/")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _descendants(root: int) -> set[int]:
    """PIDs of every living process below ``root`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended while we looked
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
        children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_head(process: subprocess.Popen, temp_dir: Path) -> None:
    """SIGTERM the ``ray start --block`` process (it stops the Ray processes it started), then
    SIGKILL, by PID, whatever of its process tree outlives it (workers renamed ``ray::IDLE``
    included), and remove its temp folder. Never ``ray stop``: that kills every Ray on the
    machine, other people's included."""
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
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_head() -> Iterator[RayHead]:
    """A real Ray 2.60 head on this machine, set up like the KubeRay head of ``cluster/``.

    Token authentication on (``RAY_AUTH_MODE=token`` with a fresh random token, as KubeRay's
    ``authOptions`` sets on every Ray container); every port of every process it starts (GCS, raylet,
    agents, dashboard and job server, workers) on loopback only (``RAY_LOOPBACK_ENV``, also in ``env``);
    2 CPUs, no GPU; started in the repository root from the venv, as the image starts Ray in
    its WORKDIR, so a job's ``python`` and its relative paths resolve as they do on the cluster.
    Every port is chosen free, the temp folder is private, and teardown stops exactly the
    processes this head started.
    """
    temp_dir = Path(tempfile.mkdtemp(prefix="rayh", dir="/tmp"))  # short: Ray's socket paths are length-limited
    token = secrets.token_hex(32)
    venv_bin = str(Path(sys.executable).parent)
    client_env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    client_env.update(
        {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
            "PATH": f"{venv_bin}{os.pathsep}{client_env.get('PATH', '')}",
            **RAY_LOOPBACK_ENV,
        }
    )
    head_env = {
        **client_env,
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        # stop at once on SIGTERM instead of draining (nothing here needs draining)
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
    command = [
        str(Path(venv_bin, "ray")),
        "start",
        "--head",
        "--block",
        *RAY_LOOPBACK_HEAD_FLAGS,
        "--temp-dir",
        str(temp_dir),
        "--dashboard-host",
        "127.0.0.1",
        "--include-dashboard",
        "true",
        "--num-cpus",
        "2",
        "--num-gpus",
        "0",
        "--disable-usage-stats",
    ]
    for flag, port in ports.items():
        command += [flag, str(port)]
    log_path = temp_dir / "ray-start.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=head_env, stdout=log, stderr=subprocess.STDOUT)
    dashboard_url = f"http://127.0.0.1:{ports['--dashboard-port']}"
    address_file = temp_dir / "ray_current_cluster"  # written once `ray start` has finished starting
    try:
        deadline = time.monotonic() + _HEAD_START_TIMEOUT_S
        while not (address_file.is_file() and _job_api_status(dashboard_url, token) == 200):
            if process.poll() is not None or time.monotonic() > deadline:
                log_tail = log_path.read_text(errors="replace")[-4000:]
                pytest.fail(
                    f"Ray head did not serve its job API at {dashboard_url} within "
                    f"{_HEAD_START_TIMEOUT_S:.0f} s (exit code {process.poll()}); log:\n{log_tail}"
                )
            time.sleep(0.5)
        yield RayHead(
            address=address_file.read_text().strip(),
            dashboard_url=dashboard_url,
            env=client_env,
            token=token,
            pid=process.pid,
            temp_dir=temp_dir,
        )
    finally:
        _stop_head(process, temp_dir)


# --------------------------------------------------------------------------- a real tiny search

#: Caps for every test search, so all of them share one small feature cache entry.
TINY_TRAIN_EXAMPLES = 300
TINY_EVAL_EXAMPLES = 150
#: ``--set`` flags that cut the tiny space to one cell (ε = 8) without AUTO-S and diagnostics: 6 runs
#: recorded, 4 trained (the min-step rule prunes B = 256), in about a minute.
ONE_CELL = (
    "--set",
    "privacy.epsilons=[8]",
    "--set",
    "training.compare_auto_s=false",
    "--set",
    "training.diagnostics=false",
)
#: ``--set`` flags of a private search short enough for a test: K has mean 3, five epochs.
SHORT_PRIVATE = ("--set", "sampler.trials_per_cell=3", "--set", "epochs=[5]")


def search_command(*args: str) -> list[str]:
    """``python -m dptune.search`` with the test caps, for a subprocess."""
    return [
        sys.executable,
        "-m",
        "dptune.search",
        "--max-train-examples",
        str(TINY_TRAIN_EXAMPLES),
        "--max-eval-examples",
        str(TINY_EVAL_EXAMPLES),
        *args,
    ]


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder ``name`` that every pytest-xdist worker of this run shares (the parent of the
    workers' own base folders), or this session's own one without xdist."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


def run_search(env: dict[str, str], *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    """``python -m dptune.search`` with the test caps and ``args``, run to its end in a subprocess."""
    return subprocess.run(
        search_command(*args), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def start_search(env: dict[str, str], *args: str) -> subprocess.Popen:
    """``python -m dptune.search`` with the test caps and ``args``, started in a subprocess that leads its
    own process group (as a shell's foreground job does: a Ctrl+C goes to the group), its output piped."""
    return subprocess.Popen(
        search_command(*args),
        cwd=REPO_ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


@pytest.fixture(scope="session")
def test_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One DPTUNE_CACHE_DIR for the run's subprocesses, every xdist worker's included (features
    encoded once: the cache's own file locks make a second encoder wait and reuse the first's)."""
    return shared_folder(tmp_path_factory, "dptune-cache")


@pytest.fixture(scope="session")
def search_env(test_cache_dir: Path) -> dict[str, str]:
    """Environment for a search subprocess: private cache, no inherited cluster address, Ray on
    loopback (``RAY_LOOPBACK_ENV``: an embedded Ray's sockets, and the address a driver dials)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        {
            "DPTUNE_CACHE_DIR": str(test_cache_dir),
            "OMP_NUM_THREADS": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            **RAY_LOOPBACK_ENV,
        }
    )
    return env


@pytest.fixture
def no_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any feature encoding in this test fails it: what is checked must be refused before compute."""
    import dptune.data.features as features
    import dptune.data.workload as workload

    def encode(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bad dataset reached feature encoding")

    for module in (features, workload):  # workload holds its own reference to the function
        monkeypatch.setattr(module, "cached_features", encode)


@pytest.fixture(scope="session")
def own_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A team's own ``save_pretrained`` folder: a copy of the embedded all-MiniLM-L6-v2 (config,
    weights, tokenizer), named in a space as ``{hf: <folder>}``."""
    from dptune.models.backbones import minilm_folder

    return Path(shutil.copytree(minilm_folder(), tmp_path_factory.mktemp("own-encoder") / "encoder"))


@dataclass(frozen=True)
class SearchRun:
    """A finished search: where its dataset is and what it printed."""

    root: Path
    stdout: str


@pytest.fixture(scope="session")
def tiny_search(tmp_path_factory: pytest.TempPathFactory, search_env: dict[str, str]) -> SearchRun:
    """The real tiny grid search of ``tests/spaces/tiny.yaml`` on an embedded local Ray, run once per
    test run: the first xdist worker to ask runs it under a file lock, the others read its results.
    Tests only read them (a test that changes results works on a copy)."""
    folder = shared_folder(tmp_path_factory, "tiny-search")
    storage, printed = folder / "results", folder / "stdout.txt"
    with FileLock(folder / "lock"):
        if not printed.is_file():
            completed = run_search(
                search_env,
                "--space",
                str(REPO_ROOT / "tests/spaces/tiny.yaml"),
                "--storage",
                str(storage),
                "--no-report",
                timeout=1800,
            )
            assert completed.returncode == 0, (
                f"tiny search failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-5000:]}"
            )
            printed.write_text(completed.stdout)
    return SearchRun(root=storage / "tiny", stdout=printed.read_text())


# --------------------------------------------------------------------------- a private dptune cache


@pytest.fixture(scope="session")
def _dptune_cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_folder(tmp_path_factory, "dptune-cache-in-process")


@pytest.fixture(scope="module")
def dptune_cache_dir(_dptune_cache_root: Path) -> Iterator[Path]:
    """``DPTUNE_CACHE_DIR`` pointed at one temporary folder, shared by every module that asks for it in
    this session (so a σ calibrated by one test module is a cache hit in the next, and subprocesses
    see it too), for the duration of the requesting module only; never the user's ``~/.cache``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPTUNE_CACHE_DIR", str(_dptune_cache_root))
        yield _dptune_cache_root


@contextlib.contextmanager
def start_two_node_cluster(env: dict[str, str], job_api: bool = False) -> Iterator[str]:
    """A head that offers no CPUs and a worker node with 2, both on this machine; yields the address.

    Trials need a CPU, so every trial lands on the worker node. Token authentication is on, as on the
    cluster; ``env`` gets the token. ``job_api``: the head also serves the dashboard and job API on
    127.0.0.1 only, and ``env`` gets its URL as ``RAY_API_SERVER_ADDRESS``, where ``ray job`` looks for
    it. Each node has a temp folder of its own, as two machines have (sharing one, both nodes'
    runtime-env agents would unpack a job's working dir into the same place). Teardown stops both
    nodes by PID.

    Not on loopback: a worker node cannot join a head that ``RAY_LOOPBACK_ENV`` keeps on 127.0.0.1
    (``ray start --address 127.0.0.1:PORT`` dials the machine's routable address instead, and refuses
    to run with that variable), so both nodes register at the routable address, their GCS, raylets,
    workers and agents listen there or on every interface, guarded by the token, and ``env`` loses
    ``RAY_LOOPBACK_ENV`` (a driver with it would look for a raylet at 127.0.0.1). Only the job API is
    on loopback (``test_cluster.py`` checks both).
    """
    temp_dir = Path(tempfile.mkdtemp(prefix="ray2n", dir="/tmp"))
    worker_temp_dir = Path(tempfile.mkdtemp(prefix="ray2w", dir="/tmp"))
    token = secrets.token_hex(32)
    for key in RAY_LOOPBACK_ENV:
        env.pop(key, None)
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    node_env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    ray = str(Path(sys.executable).parent / "ray")
    head_ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
    address = f"127.0.0.1:{head_ports['--port']}"
    dashboard_url = f"http://127.0.0.1:{head_ports['--dashboard-port']}"
    head_cmd = [
        ray,
        "start",
        "--head",
        "--block",
        "--temp-dir",
        str(temp_dir),
        "--num-cpus",
        "0",
        "--num-gpus",
        "0",
        "--disable-usage-stats",
    ]
    head_cmd += (
        ["--dashboard-host", "127.0.0.1", "--include-dashboard", "true"]
        if job_api
        else ["--include-dashboard", "false"]
    )
    for flag, port in head_ports.items():
        if job_api or flag not in ("--dashboard-port", "--ray-client-server-port"):
            head_cmd += [flag, str(port)]
    worker_ports = dict(zip(_PORT_FLAGS[3:], _free_ports(len(_PORT_FLAGS) - 3), strict=True))
    worker_cmd = [ray, "start", "--block", "--address", address, "--temp-dir", str(worker_temp_dir)]
    worker_cmd += ["--num-cpus", "2", "--num-gpus", "0"]
    for flag, port in worker_ports.items():
        worker_cmd += [flag, str(port)]
    processes = []
    try:
        with (temp_dir / "head.log").open("wb") as log:
            processes.append(
                subprocess.Popen(
                    head_cmd,
                    cwd=REPO_ROOT,
                    env=node_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + _HEAD_START_TIMEOUT_S
        while not (
            (temp_dir / "ray_current_cluster").is_file()
            and (not job_api or _job_api_status(dashboard_url, token) == 200)
        ):
            assert processes[0].poll() is None and time.monotonic() < deadline, (temp_dir / "head.log").read_text()[
                -3000:
            ]
            time.sleep(0.5)
        # The worker node starts in a folder that is deleted once it is up, as happens when a
        # node is started from a temporary folder: its worker processes inherit a working
        # directory that no longer exists, which makes oneMKL abort `import torch`.
        worker_cwd = temp_dir / "worker-cwd"
        worker_cwd.mkdir()
        with (temp_dir / "worker.log").open("wb") as log:
            processes.append(
                subprocess.Popen(worker_cmd, cwd=worker_cwd, env=node_env, stdout=log, stderr=subprocess.STDOUT)
            )
        probe = [
            sys.executable,
            "-c",
            f"import ray, time; ray.init(address='{address}', log_to_driver=False)\n"
            "while ray.cluster_resources().get('CPU', 0) < 2: time.sleep(0.5)",
        ]
        subprocess.run(probe, env=env, check=True, timeout=_HEAD_START_TIMEOUT_S, capture_output=True)
        shutil.rmtree(worker_cwd)
        if job_api:
            env["RAY_API_SERVER_ADDRESS"] = dashboard_url
        yield address
    finally:
        for process in reversed(processes):
            _stop_head(process, temp_dir)
        shutil.rmtree(worker_temp_dir, ignore_errors=True)


def listening_sockets(pids: set[int]) -> set[tuple[str, int, str]]:
    """The TCP sockets that processes ``pids`` listen on: (address, port, process name), from /proc."""
    inodes: dict[str, str] = {}
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:  # ended while we looked
            continue
        inodes.update({link[len("socket:[") : -1]: name for link in links if link.startswith("socket:[")})
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            host, port = local.split(":")
            # each 32-bit word of the address is in the host's (little-endian) byte order
            packed = b"".join(bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8))
            ip = ipaddress.ip_address(packed)
            mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
            found.add((f"::ffff:{mapped}" if mapped else str(ip), int(port, 16), inodes[inode]))
    return found


def is_loopback(address: str) -> bool:
    """Whether ``address`` (IPv4, IPv6 or IPv4-mapped IPv6) is a loopback address."""
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


# --------------------------------------------------------------------------- results for analysis and report tests


@pytest.fixture(scope="session", params=["real", "synthetic"])
def result_datasets(request: pytest.FixtureRequest) -> list[str]:
    """The result datasets ``test_analysis.py`` and ``test_report.py`` read; each test runs on both:

    - ``real``: the real tiny search of ``tests/spaces/tiny.yaml`` (one task, trained trials);
    - ``synthetic``: two searches written with ``dptune.records`` by ``tests/tiny_results.py``,
      tasks of known difficulty, so the multi-task views (difficulty ranking, trends across
      tasks) have something to rank.
    """
    if request.param == "real":
        return [str(request.getfixturevalue("tiny_search").root)]
    from tiny_results import results_paths

    return list(results_paths())


# --------------------------------------------------------------------------- fault injection


def fault_injection_env(env: dict[str, str], folder: Path, condition: str, message: str) -> dict[str, str]:
    """``env`` with a ``sitecustomize`` on PYTHONPATH (inherited by Ray's workers) that makes every
    trial whose ``config`` satisfies the Python expression ``condition`` raise
    ``RuntimeError(message)`` inside ``run_trial``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import dptune.search.runs.execution, dptune.runners.trial\n"
        "_real = dptune.runners.trial.run_trial\n"
        "def run_trial(config, report=None, checkpoint=None):\n"
        f"    if {condition}:\n"
        f"        raise RuntimeError({message!r})\n"
        "    return _real(config, report, checkpoint)\n"
        "dptune.runners.trial.run_trial = dptune.search.runs.execution.run_trial = run_trial\n"
    )
    return {**env, "PYTHONPATH": f"{folder}{os.pathsep}{env.get('PYTHONPATH', '')}"}


# --------------------------------------------------------------------------- Ray processes below this one


def ray_processes_below() -> set[int]:
    """PIDs of Ray's processes (raylet, gcs_server, ``ray::`` workers) among this process's descendants.

    A session fixture (``ray_head``) may hold a head open for the whole session: a test that asserts
    "no Ray started" compares this set before and after, rather than asking for it to be empty.
    """
    found = set()
    for pid in _descendants(os.getpid()):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:  # ended while we looked
            continue
        if name in ("raylet", "gcs_server") or name.startswith("ray::"):
            found.add(pid)
    return found


# --------------------------------------------------------------------------- pytest-xdist groups


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (``make test``):

    - every test of the ``ray_head`` fixture runs on one worker, so that one head serves them all
      (a module whose fixtures are costly marks itself ``xdist_group`` likewise);
    - the analysis and report tests (``result_datasets``, one group) are handed out first, so that
      the real tiny search they read starts at once, then the tests that run searches of their own
      (``search_env`` without ``tiny_search``: a minute each), so that no long one is left to run
      alone at the end, then the rest.
    """
    for item in items:
        if "ray_head" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("ray_head"))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_handout_order)


def _handout_order(item: pytest.Item) -> int:
    if "result_datasets" in item.fixturenames:
        return 0
    return 1 if "search_env" in item.fixturenames and "tiny_search" not in item.fixturenames else 2


# --------------------------------------------------------------------------- a job on the head


def ray_job_submit(
    ray_head: RayHead, cache: Path, cwd: Path, entrypoint: list[str], submission_id: str | None = None
) -> subprocess.CompletedProcess:
    """``ray job submit --working-dir <repo> -- <entrypoint>`` to the head, with the session's dptune cache
    and one thread per trial (as ``submission_id`` when given); asserts that it succeeded."""
    runtime_env = {"env_vars": {"OMP_NUM_THREADS": "1", "DPTUNE_CACHE_DIR": str(cache)}}
    command = [
        "ray",
        "job",
        "submit",
        "--address",
        ray_head.dashboard_url,
        "--working-dir",
        str(REPO_ROOT),
        "--runtime-env-json",
        json.dumps(runtime_env),
        *(["--submission-id", submission_id] if submission_id else []),
        "--",
        *entrypoint,
    ]
    completed = subprocess.run(command, cwd=cwd, env=ray_head.env, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, f"ray job submit failed:\n{completed.stdout[-6000:]}\n{completed.stderr[-3000:]}"
    return completed


def s3_client(env: dict[str, str]) -> Any:
    """A boto3 S3 client of the server and credentials ``env`` names (:func:`s3_server`)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )


@contextlib.contextmanager
def s3_server(bucket: str) -> Iterator[dict[str, str]]:
    """An S3-compatible server (moto) on loopback with the bucket ``bucket``: the environment that points
    pyarrow's and boto3's S3 clients at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "dptune-test",
        "AWS_SECRET_ACCESS_KEY": "dptune-test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    s3_client(env).create_bucket(Bucket=bucket)
    try:
        yield env
    finally:
        server.stop()
