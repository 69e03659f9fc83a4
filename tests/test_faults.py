"""Faults that must never make ε undercount: two searches on one folder, a full disk, a lost trial
process. Real searches (embedded Ray, tiny space), real processes, real file systems; a fault is
injected only where it cannot be produced for real (a SIGKILL at a chosen moment; ENOSPC where no
small tmpfs can be mounted)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO_ROOT, run_search, search_command, start_search
from dptune import search
from dptune.records import lease, read_table
from expected import pld_epsilon

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"
#: One cell, 4 configurations (C × B = 2 × 2), pruned B = 256 recorded without compute.
SMALL = ("--space", str(TINY), "--no-report", "--set", "privacy.epsilons=[2]", "--set", "training.compare_auto_s=false")


def ledger_entries(root: Path) -> tuple[list[dict], list[dict]]:
    """(start entries, end entries), read with plain json, independently of dptune.records.ledger."""
    starts, ends = [], []
    for path in sorted((root / "ledger").glob("*.json")):
        entries = json.loads(path.read_text())["entries"]
        (starts if path.name.startswith("start-") else ends).extend(entries)
    return starts, ends


def expected_search_epsilon(root: Path, delta: float) -> float:
    """PLD (dp_accounting) of every run that started: at the steps its end entry took, else at its
    planned steps; a diverged run at its planned steps."""
    starts, ends = ledger_entries(root)
    by_run = {end["run"]: end for end in ends if end.get("run")}
    mechanisms = []
    for start in starts:
        end = by_run.get(start["run"])
        steps = start["steps"] if end is None or end["status"] == "diverged" else end["steps_taken"]
        if steps:
            mechanisms.append((start["noise_multiplier"], start["sample_rate"], int(steps)))
    return pld_epsilon(mechanisms, delta)


def recorded(root: Path):
    trials = read_table(str(root), "trials")
    return trials[trials["status"] != "pruned_min_steps"]


# --------------------------------------------------------------------------- one search per folder


_HOLDER = """
import sys, time
from dptune.records.lease import hold_lease
with hold_lease(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_search_on_a_held_folder_is_refused_at_once_and_a_dead_holders_lease_is_taken_over(
    search_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = tmp_path / "tiny"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root)], env=search_env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for resume in ((), ("--resume",)):  # a search that waited for the lease would outlive the holder's 600 s
            with pytest.raises(SystemExit) as info:
                search.main([*SMALL, "--storage", str(tmp_path), *resume])
            assert info.value.code == 2
            message = capsys.readouterr()
            assert f"pid {holder.pid}" in message.err and "another search is running" in message.err
            assert "--resume" in message.err and "--name" in message.err
            assert "loading" not in message.out  # refused before any data is loaded
        assert sorted(p.name for p in root.iterdir()) == [lease.LEASE_FILE]
    finally:
        holder.kill()
        holder.wait()
    with lease.hold_lease(str(root)):  # the kernel released the killed holder's lock
        assert json.loads((root / lease.LEASE_FILE).read_text())["pid"] == os.getpid()
    assert (root / lease.LEASE_FILE).read_text() == ""


def test_object_store_lease_refuses_a_live_holder_and_takes_over_an_expired_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    root = str(tmp_path / "store")
    with lease._object_lease(root, "--storage"):
        with pytest.raises(lease.LeaseHeld, match=f"pid {os.getpid()}"):
            with lease._object_lease(root, "--storage"):
                pass
        stale = json.loads(Path(root, lease.LEASE_OBJECT).read_text())
    assert not Path(root, lease.LEASE_OBJECT).exists()  # released
    Path(root, lease.LEASE_OBJECT).write_text(json.dumps({**stale, "expires_at": time.time() - 1}))
    with lease._object_lease(root, "--storage"):  # a dead holder's expired lease is taken over
        assert json.loads(Path(root, lease.LEASE_OBJECT).read_text())["token"] != stale["token"]


def test_a_trial_worker_whose_search_is_gone_starts_and_writes_nothing(tmp_path: Path) -> None:
    """A worker of a search that was killed, whose folder a new search then took over (or that ended
    and released it), is refused before its start entry and before its end entry and rows."""
    from dataclasses import replace

    from dptune.plan.mechanism import wrapped
    from dptune.search.planning.cells import CellPlan, base_trial_config
    from dptune.search.runs.execution import (
        FinishedRun,
        TrialContext,
        charge_runs,
        failed_result,
        run_spec,
        write_results,
    )
    from dptune.space import Cell, load_space

    space = load_space(TINY).space
    mechanisms = wrapped({32: 1.0, 64: 1.5}, 2.0, space.privacy.delta, 1000, 3)
    plan = CellPlan(Cell(2.0, 3), "normalized", 1000, (32, 64), (), mechanisms, 1)
    runs = str(tmp_path / "tiny")
    with lease.hold_lease(runs) as killed:  # the first search, and its workers' token
        pass
    context = TrialContext(
        base=base_trial_config(space, plan, None, None),
        results_root=runs,
        search_id="tiny-0",
        cell_id=plan.cell.cell_id,
        cell_key=plan.cell_key,
        coupling="sqrt",
        reference_batch_size=64,
        num_train=1000,
        mechanisms=plan.mechanisms,
        lease_token=killed,
    )
    params = {"clip_bound": 1.0, "batch_size": 32, "base_learning_rate": 0.01}
    pending = [run_spec(context, params)]
    ended = [FinishedRun(pending[0], failed_result(pending[0].config, "lost"), "r1")]
    with lease.hold_lease(runs) as token:  # the new search holds the folder
        for late in (lambda: charge_runs(context, pending), lambda: write_results(context, ended)):
            with pytest.raises(lease.SearchGone, match="no longer holds its results folder"):
                late()
        assert sorted(p.name for p in Path(runs).iterdir()) == [lease.LEASE_FILE]  # nothing written
        mine = replace(context, lease_token=token)
        (run_id,) = charge_runs(mine, pending)
        write_results(mine, [replace(ended[0], run_id=run_id)])
        assert len(recorded(Path(runs))) == 1 and len(ledger_entries(Path(runs))[1]) == 1
    with pytest.raises(lease.SearchGone):  # released: its own late workers write nothing either
        write_results(mine, ended)


def test_two_searches_on_one_folder_run_one_and_refuse_the_other(search_env: dict[str, str], tmp_path: Path) -> None:
    args = (*SMALL, "--storage", str(tmp_path), "--set", "training.runner=trial")
    first = start_search(search_env, *args, "--resume")  # its embedded Ray's processes in its session
    lease_file = tmp_path / "tiny" / lease.LEASE_FILE
    deadline = time.monotonic() + 900  # generous: a machine at load 10 starts Python slowly
    while not (lease_file.is_file() and lease_file.read_text()):
        assert first.poll() is None and time.monotonic() < deadline, "the first search never took its lease"
        time.sleep(0.2)
    # two more searches on the folder, with and without --resume, at once: each is refused
    seconds = [
        subprocess.Popen(
            search_command(*args, *resume),
            cwd=REPO_ROOT,
            env=search_env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for resume in (("--resume",), ())
    ]
    for second in seconds:
        out, err = second.communicate(timeout=900)
        assert second.returncode == 2, err[-2000:]
        assert f"pid {first.pid}" in err and "Traceback" not in err
        assert "loading" not in out  # refused before any data loads (no timing: the machine may be busy)
    out, err = first.communicate(timeout=1800)
    assert first.returncode == 0, err[-3000:]
    # it shut its embedded Ray down (in a thread, beside the composition) before exiting: nothing is left
    deadline = time.monotonic() + 10
    while _in_session(first.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _in_session(first.pid)
    ran = recorded(tmp_path / "tiny")
    assert len(ran) == 4 and ran["trial_id"].is_unique and set(ran["status"]) == {"ok"}
    starts, _ = ledger_entries(tmp_path / "tiny")
    assert sorted(s["trial_id"] for s in starts) == sorted(ran["trial_id"])  # no configuration trained twice


def test_a_cut_start_entry_charged_by_the_flag_keeps_the_printed_epsilon_above_what_ran(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    """A start file cut in half (what it charged is unknown): ``--resume`` is refused naming the file
    and the flag, then ``--resume --charge-unreadable-ledger`` charges it as every run one start file
    of the plan can hold (2 configurations × 1 replicate) at each planned (σ_B, q_B, T_B) (B = 32, 64),
    trains the search, and its ε composes the real runs and the stand-in's (above any real unit more)."""
    args = (*SMALL, "--storage", str(tmp_path), "--set", "clip_bound.values=[1.0]", "--resume")
    ledger = tmp_path / "tiny" / "ledger"
    ledger.mkdir(parents=True)
    cut = ledger / "start-cut.json"
    cut.write_text('{"version": 1, "entries": [{"run": "r1", "trial_id": "t1", "noise_multip')
    refused = run_search(search_env, *args)
    assert refused.returncode == 2 and f"{cut}: unreadable privacy ledger entry" in refused.stderr
    assert "--charge-unreadable-ledger" in refused.stderr and sorted(ledger.iterdir()) == [cut]
    done = run_search(search_env, *args, "--charge-unreadable-ledger")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{cut}: an unreadable privacy ledger entry, charged conservatively as 4 run(s)" in done.stderr
    assert (ledger / "unreadable" / cut.name).read_text().startswith('{"version": 1') and not cut.exists()
    stand_in = json.loads((ledger / "start-cut-conservative.json").read_text())
    assert stand_in["replaces"] == cut.name
    ran = recorded(tmp_path / "tiny")
    assert len(ran) == 2 and set(ran["status"]) == {"ok"}
    starts, _ = ledger_entries(tmp_path / "tiny")
    real = [
        (s["noise_multiplier"], s["sample_rate"], s["steps"]) for s in starts if s["trial_id"] in set(ran["trial_id"])
    ]
    assert len(real) == 2 and len(starts) == 6
    # each planned mechanism (B = 32, 64) twice: the 2 real runs (1 per B) twice over, σ, q and T alike
    assert sorted((e["noise_multiplier"], e["sample_rate"], e["steps"]) for e in stand_in["entries"]) == sorted(
        real * 2
    )
    row = _search_row(tmp_path / "tiny")
    assert row["epsilon_search"] >= pld_epsilon(real * 3, 1e-5) * (1 - 1e-9) > pld_epsilon(real, 1e-5)
    assert "charged but unrecorded: 4 of the 6 runs composed above" in done.stdout
    assert row["epsilon_search"] >= expected_search_epsilon(tmp_path / "tiny", 1e-5) * (1 - 1e-9)


# --------------------------------------------------------------------------- a lost trial process

# Only in Ray's worker processes (Ray's own Python processes must not import torch at start-up).
# A B = 32 configuration's process is SIGKILLed once it trained and before it recorded: that of
# C = 0.1 on every attempt, that of C = 1.0 on its first attempt only (one kill mark per attempt).
_KILLER = """
import os, pathlib, signal, sys
if sys.argv and sys.argv[0].endswith("default_worker.py"):
    import dptune.runners.fused as fused
    _real = fused.run_fused
    marks = pathlib.Path(os.environ["DPTUNE_TEST_KILLS"])
    def run_fused(configs, on_done=None, **kwargs):
        def done(positions, results):
            for config in (configs[p] for p in positions if configs[p].batch_size == 32):
                tries = len(list(marks.glob(f"C{config.clip_bound:g}-*")))
                if config.clip_bound == 0.1 or tries == 0:
                    (marks / f"C{config.clip_bound:g}-{tries}").write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)  # trained, not yet recorded: the worst moment
            if on_done is not None:
                on_done(positions, results)
        return _real(configs, on_done=done, **kwargs)
    fused.run_fused = run_fused
"""


def _killer_env(env: dict[str, str], tmp_path: Path) -> tuple[dict[str, str], Path]:
    hook, marks = tmp_path / "hook", tmp_path / "kills"
    hook.mkdir()
    marks.mkdir()
    (hook / "sitecustomize.py").write_text(_KILLER)
    killer = {
        **env,
        "PYTHONPATH": os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH", "")) if p),
        "DPTUNE_TEST_KILLS": str(marks),
    }
    return killer, marks


def _search_row(root: Path):
    return read_table(str(root), "search").iloc[0]


def test_lost_trial_processes_are_retried_charged_and_fail_the_command_until_resume_runs_them(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    """One search, one configuration per trial process, one retry: the process of (C = 1.0, B = 32)
    is lost once and its retry records it; that of (C = 0.1, B = 32) is lost on both attempts, so
    the command fails naming --resume, and the resumed search runs it. Every lost attempt stays
    charged in the ledger and in the whole-search ε."""
    env, marks = _killer_env(search_env, tmp_path)
    args = (
        *SMALL,
        "--storage",
        str(tmp_path),
        "--set",
        "training.runner=fused",
        "--set",
        "resources.max_retries=1",
        "--set",
        "resources.configurations_per_trial=1",
    )
    failed = run_search(env, *args)
    assert failed.returncode == 1, failed.stderr[-3000:]
    last = failed.stderr.strip().splitlines()[-1]  # Tune logs each lost process above; the command ends in one line
    assert last.startswith("error: 1 run(s) of this search have no record (cell(s) eps2-E3)") and "--resume" in last, (
        last
    )
    assert sorted(mark.name for mark in marks.iterdir()) == ["C0.1-0", "C0.1-1", "C1-0"]
    root = tmp_path / "tiny"
    ran = recorded(root)
    # the configuration lost once was retried within the search and recorded; the other B = 32 was not
    assert sorted(map(tuple, ran[["clip_bound", "batch_size"]].values.tolist())) == [(0.1, 64), (1.0, 32), (1.0, 64)]
    assert ran["trial_id"].is_unique and set(ran["status"]) == {"ok"}
    starts, ends = ledger_entries(root)
    lost = [s for s in starts if s["run"] not in {e["run"] for e in ends}]
    assert len(lost) == 3 and len(starts) == 6  # every attempt charged before it took a step
    retried = ran[(ran["clip_bound"] == 1.0) & (ran["batch_size"] == 32)]["trial_id"].item()
    assert [s["trial_id"] for s in lost].count(retried) == 1  # killed, then run again and recorded
    assert not (root / "search").exists()  # not finished: --resume must run the rest
    resumed = run_search(search_env, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ran = recorded(root)
    assert len(ran) == 4 and ran["trial_id"].is_unique and set(ran["status"]) == {"ok"}
    starts, _ = ledger_entries(root)
    row = _search_row(root)
    assert row["runs_unrecorded"] == 3 and row["runs_charged"] == len(starts) == 4 + 3
    assert row["epsilon_search"] == pytest.approx(expected_search_epsilon(root, 1e-5), rel=1e-9)
    rows_only = pld_epsilon(
        list(zip(ran["noise_multiplier"], ran["sample_rate"], ran["steps_taken"].astype(int), strict=True)), 1e-5
    )
    assert row["epsilon_search"] > rows_only  # the lost attempts are in it
    assert "charged but unrecorded: 3 of the 7 runs" in resumed.stdout


# In the search's trial processes: every unit of the cells whose key begins with DPTUNE_TEST_FAIL_CELL
# fails before it charges anything (as a transient object-store error, a node without the volume or a
# failed worker start do).
_FAIL_BEFORE_CHARGE = """
import os, sys
if sys.argv and sys.argv[0].endswith("default_worker.py"):
    import dptune.search.runs.execution as execution
    _real = execution.charge_runs
    def charge_runs(context, runs):
        if context.cell_key.startswith(os.environ["DPTUNE_TEST_FAIL_CELL"]):
            raise ConnectionError("injected: the object store did not answer")
        return _real(context, runs)
    execution.charge_runs = charge_runs
"""


def test_a_cell_whose_units_fail_before_they_charge_fails_the_command_and_resume_runs_it(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_FAIL_BEFORE_CHARGE)
    failing = {
        **search_env,
        "PYTHONPATH": os.pathsep.join(p for p in (str(hook), search_env.get("PYTHONPATH", "")) if p),
        "DPTUNE_TEST_FAIL_CELL": "eps1-",
    }
    args = (*SMALL, "--storage", str(tmp_path), "--set", "privacy.epsilons=[1, 2]", "--set", "resources.max_retries=0")
    failed = run_search(failing, *args)
    assert failed.returncode == 1, failed.stderr[-3000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 4 run(s) of this search have no record (cell(s) eps1-E3): a unit failed (")
    assert "injected: the object store did not answer" in last and "--resume" in last, last
    root = tmp_path / "tiny"
    assert not (root / "search").exists()  # not a finished search: its cell ε = 1 never ran
    assert set(recorded(root)["cell_id"]) == {"eps=2|epochs=3"}
    resumed = run_search(search_env, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ran = recorded(root)
    assert len(ran) == 8 and ran["trial_id"].is_unique and set(ran["status"]) == {"ok"}
    assert ran.groupby("cell_id").size().to_dict() == {"eps=1|epochs=3": 4, "eps=2|epochs=3": 4}
    starts, _ = ledger_entries(root)
    assert len(starts) == 8  # the failed units charged nothing: each run was charged once, when it ran
    assert set(read_table(str(root), "search")["cell_id"]) == {"eps=1|epochs=3", "eps=2|epochs=3"}


# --------------------------------------------------------------------------- a full disk


# In every Python process of the search (the driver and Ray's workers inherit PYTHONPATH): once
# the file DPTUNE_TEST_DISK_FULL exists, each attempt to create or write a file under the folder
# DPTUNE_TEST_DISK (Python's open/os.open for writing, pyarrow's local output streams, Parquet
# included) creates the file, as a full disk does, and then fails with ENOSPC, as the first write
# to a full disk does. Reads, renames and deletions work as they do on a full disk.
_FULL_DISK = """
import errno, io, os

_ROOT = os.environ.get("DPTUNE_TEST_DISK")
_FLAG = os.environ.get("DPTUNE_TEST_DISK_FULL", "")


def _full(path):
    if not isinstance(path, (str, bytes, os.PathLike)) or not os.path.exists(_FLAG):
        return False
    path = os.path.abspath(os.fsdecode(path))
    return path == _ROOT or path.startswith(_ROOT + os.sep)


def _no_space(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fsdecode(path))


if _ROOT:
    _open, _os_open = io.open, os.open

    def open(file, mode="r", *args, **kwargs):
        handle = _open(file, mode, *args, **kwargs)
        if any(m in mode for m in "wax+") and _full(file):
            handle.close()
            raise _no_space(file)
        return handle

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        descriptor = _os_open(path, flags, mode, dir_fd=dir_fd)
        if dir_fd is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and _full(path):
            os.close(descriptor)
            raise _no_space(path)
        return descriptor

    import builtins
    builtins.open = io.open = open
    os.open = os_open

    import pyarrow.fs as pafs
    _Local = pafs.LocalFileSystem

    class _AnyLocal(type):  # isinstance() of every local file system holds as before the patch
        def __instancecheck__(cls, instance):
            return isinstance(instance, _Local)

        def __subclasscheck__(cls, subclass):
            return issubclass(subclass, _Local)

    class LocalFileSystem(_Local, metaclass=_AnyLocal):
        def open_output_stream(self, path, *args, **kwargs):
            stream = _Local.open_output_stream(self, path, *args, **kwargs)
            if _full(path):
                stream.close()
                raise _no_space(path)
            return stream

        def open_append_stream(self, path, *args, **kwargs):
            stream = _Local.open_append_stream(self, path, *args, **kwargs)
            if _full(path):
                stream.close()
                raise _no_space(path)
            return stream

    pafs.LocalFileSystem = LocalFileSystem
"""


@dataclass(frozen=True)
class Disk:
    """Where a search writes its results and how the test fills that disk and frees it again.

    ``env`` is the search's environment; ``fill`` makes every later write under ``storage`` fail
    with ENOSPC; ``free`` undoes it."""

    storage: Path
    env: dict[str, str]
    fill: Callable[[], None]
    free: Callable[[], None]


@pytest.fixture
def full_disk(tmp_path: Path, search_env: dict[str, str]) -> Iterator[Disk]:
    """A disk that the test fills mid-search: a real 16 MiB tmpfs at ``tmp_path/disk`` filled by a
    file where one can be mounted (the tests run as root on Linux); elsewhere a plain folder whose
    writes fail with ENOSPC once a flag file exists (``_FULL_DISK``, a fault injected into the
    driver and the Ray workers). Either way the test's checks are the same."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        hook, flag = tmp_path / "hook", tmp_path / "disk-is-full"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_FULL_DISK)
        env = {
            **search_env,
            "DPTUNE_TEST_DISK": str(disk),
            "DPTUNE_TEST_DISK_FULL": str(flag),
            "PYTHONPATH": os.pathsep.join(p for p in (str(hook), search_env.get("PYTHONPATH", "")) if p),
        }
        yield Disk(disk, env, fill=flag.touch, free=flag.unlink)
        return
    filler = disk / "filler"
    try:
        yield Disk(disk, search_env, fill=lambda: _fill(filler), free=filler.unlink)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(filler: Path) -> None:
    with filler.open("wb") as file:
        try:
            while True:
                file.write(b"\0" * 65536)
                file.flush()
        except OSError:
            pass


def test_a_full_disk_stops_the_search_cleanly_and_resume_charges_every_training(full_disk: Disk) -> None:
    storage = full_disk.storage
    args = (
        *SMALL,
        "--storage",
        str(storage),
        "--set",
        "training.runner=trial",
        "--set",
        "clip_bound.values=[0.1,0.3,1.0]",
    )
    process = subprocess.Popen(
        search_command(*args),
        cwd=REPO_ROOT,
        env=full_disk.env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    root = storage / "tiny"
    deadline = time.monotonic() + 900  # generous: a machine at load 10 starts Ray slowly
    while not (root / "trials").is_dir() or len(recorded(root)) < 1:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    full_disk.fill()
    out, err = process.communicate(timeout=1500)
    assert process.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: --storage") and str(storage) in last and "No space left on device" in last
    assert "--resume" in last
    assert not list(root.rglob(".tmp-*")) and not list(root.rglob("*.tmp-*"))
    assert len(recorded(root)) < 6  # the disk filled mid-search
    full_disk.free()
    resumed = run_search(full_disk.env, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ran = recorded(root)
    assert len(ran) == 6 and ran["trial_id"].is_unique and set(ran["status"]) == {"ok"}
    row = _search_row(root)
    starts, _ = ledger_entries(root)
    assert row["runs_charged"] == len(starts) >= 6
    assert row["epsilon_search"] == pytest.approx(expected_search_epsilon(root, 1e-5), rel=1e-9)


_UNFETCHED = """
import gc, time, ray
from dptune.search.scheduling.ray_session import init_ray
print(init_ray(None, 1), flush=True)
lost = ray.remote(num_cpus=0)(lambda: open("/proc/dptune-full", "w"))
ref = lost.remote()
time.sleep(4)  # failed by now
del ref  # an error object no one fetched: Ray's driver logs it as its reference goes
gc.collect()
time.sleep(4)
ray.shutdown()
"""


def test_an_error_no_one_fetched_prints_no_ray_traceback(search_env: dict[str, str]) -> None:
    """dptune's one-line fault messages come without Ray's "Unhandled error" traceback above them."""
    done = subprocess.run(
        [sys.executable, "-c", _UNFETCHED], cwd=REPO_ROOT, env=search_env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "started embedded local Ray" in done.stdout, done.stderr[-3000:]
    assert "Unhandled error" not in done.stderr and "ray::" not in done.stderr, done.stderr[-3000:]


_NEXT_START = """
import ray
from dptune.search.scheduling.ray_session import init_ray
print(init_ray(None, 1), flush=True)
ray.shutdown()
"""


def _in_session(session: int) -> list[int]:
    """Every process of the process session ``session`` but its leader."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and int(entry.name) != session and os.getsid(int(entry.name)) == session:
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Ray's processes are found through /proc")
def test_ray_processes_a_killed_driver_left_are_ended_by_the_next_embedded_start(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    """The driver alone is SIGKILLed mid-search (its Ray agents outlive it); the next embedded start
    ends every process the killed driver's Ray left (they are in its process session) and its record."""
    records = Path(search_env["DPTUNE_CACHE_DIR"]) / "embedded-ray"
    driver = subprocess.Popen(
        search_command(*SMALL, "--storage", str(tmp_path), "--set", "training.runner=trial"),
        cwd=REPO_ROOT,
        env=search_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 900  # generous: a machine at load 10 starts Ray slowly
        while not list((tmp_path / "tiny" / "ledger").glob("start-*.json")):
            assert driver.poll() is None and time.monotonic() < deadline, "the search never started a run"
            time.sleep(0.2)
        assert (records / f"{driver.pid}.json").is_file()
        driver.kill()
        driver.wait()
        again = subprocess.run(
            [sys.executable, "-c", _NEXT_START], cwd=REPO_ROOT, env=search_env, capture_output=True, timeout=600
        )
        assert again.returncode == 0, again.stderr[-3000:]
        deadline = time.monotonic() + 30
        while _in_session(driver.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _in_session(driver.pid) and not (records / f"{driver.pid}.json").exists()
    finally:
        driver.kill()
        for pid in _in_session(driver.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- joining a token-protected cluster


def test_joining_a_token_protected_head_without_its_token_fails_before_data_loads(
    ray_head, search_env: dict[str, str], tmp_path: Path
) -> None:
    # Both drivers at once, each in its own folder: most of their time is spent waiting on the head.
    drivers = {}
    try:
        for case, token in (("missing token", None), ("wrong token", "0" * 64)):
            folder = tmp_path / case.replace(" ", "-")
            folder.mkdir()
            env = {k: v for k, v in search_env.items() if not k.startswith("RAY_AUTH")}
            env["HOME"] = str(folder)  # no ~/.ray/auth_token of the user's
            if token is not None:
                env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
            command = search_command(*SMALL, "--storage", str(folder), "--address", ray_head.address)
            drivers[case] = (
                folder,
                subprocess.Popen(
                    command, cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
                ),
            )
        for case, (folder, driver) in drivers.items():
            out, err = driver.communicate(timeout=900)
            assert driver.returncode == 2, (case, err[-3000:])
            last = err.strip().splitlines()[-1]
            assert last.startswith(f"error: --address '{ray_head.address}': could not join the Ray cluster"), last
            assert ("set RAY_AUTH_MODE=token" if case == "missing token" else "check that the token") in last, last
            assert "Traceback" not in err and "loading" not in out, case
            assert not (folder / "tiny" / "manifest.json").exists(), case  # refused before anything was written
    finally:
        for _, driver in drivers.values():
            driver.kill()
            driver.wait()


def test_a_tune_state_cut_short_by_a_full_disk_is_set_aside_only_when_the_proposals_repeat(tmp_path: Path) -> None:
    import pickle

    from dptune.search import preflight

    experiment = tmp_path / preflight.TUNE_EXPERIMENT
    experiment.mkdir(parents=True)
    (experiment / "tuner.pkl").write_bytes(pickle.dumps({"state": 1}))
    (experiment / "experiment_state-2026.json").write_text('{"trial_data": [["cut sho')
    with pytest.raises(preflight.PreflightError, match="Tune's state is not valid JSON"):
        preflight.check_tune_state(str(tmp_path))  # TPE or private selection: refused, as before
    (note,) = preflight.check_tune_state(str(tmp_path), set_aside=True)
    assert "starting Tune afresh" in note and not experiment.exists()
    (aside,) = experiment.parent.glob("search.unreadable-*")
    assert (aside / "experiment_state-2026.json").is_file()  # kept, not deleted


# --------------------------------------------------------------------------- Ctrl+C and SIGTERM


@pytest.mark.parametrize(
    ("signal_name", "to_group", "status"),
    [("SIGINT", True, 130), ("SIGTERM", False, 143)],
    ids=["ctrl-c-to-the-process-group", "sigterm-to-the-driver"],
)
def test_a_stop_signal_leaves_the_search_unfinished_and_resume_runs_the_rest_once(
    search_env: dict[str, str], tmp_path: Path, signal_name: str, to_group: bool, status: int
) -> None:
    """Ctrl+C (SIGINT to the terminal's process group) or SIGTERM (``ray job stop``, ``kill``) once a
    run has ended: the command exits 128 + the signal's number with one line naming --resume, writes
    no search row; --resume runs every planned configuration exactly once, and the whole-search ε
    composes every start in the ledger (the stopped attempts included)."""
    import signal

    args = (
        *SMALL,
        "--storage",
        str(tmp_path),
        "--set",
        "training.runner=trial",
        "--set",
        "epochs=[5]",
        "--set",
        "batch_size.values=[32, 64]",
        "--set",
        "base_learning_rate.values=[0.01, 0.001]",
    )
    driver = start_search(search_env, *args)
    root = tmp_path / "tiny"
    deadline = time.monotonic() + 900
    while not list((root / "ledger").glob("end-*.json")):
        assert driver.poll() is None and time.monotonic() < deadline, "no run ended before the search did"
        time.sleep(0.2)
    number = getattr(signal, signal_name)
    os.killpg(driver.pid, number) if to_group else os.kill(driver.pid, number)
    out, err = driver.communicate(timeout=900)
    assert driver.returncode == status, err[-3000:]
    last = err.strip().splitlines()[-1]
    how = "Ctrl+C (SIGINT)" if signal_name == "SIGINT" else signal_name
    assert last.startswith(f"error: stopped by {how} before the search finished: "), last
    assert "of 8 runs recorded" in last and "--resume" in last and "search finished" not in out
    assert not (root / "search").exists()  # stopped is not finished
    stopped = recorded(root)
    assert f": {len(stopped)} of 8 runs recorded" in last  # the pruned B = 256 rows are not runs
    assert 1 <= len(stopped) < 8 and stopped["trial_id"].is_unique
    resumed = run_search(search_env, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ran = recorded(root)
    configurations = ran[["clip_bound", "batch_size", "base_learning_rate"]].apply(tuple, axis=1)
    assert len(ran) == 8 and configurations.is_unique and set(ran["status"]) == {"ok"}  # 2 C × 2 B × 2 η₀
    assert set(stopped["trial_id"]) <= set(ran["trial_id"])  # what finished before the signal is kept
    row = _search_row(root)
    assert row["epsilon_search"] == pytest.approx(expected_search_epsilon(root, 1e-5), rel=1e-9)
