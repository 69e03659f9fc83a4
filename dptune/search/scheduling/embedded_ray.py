"""The Ray an embedded search starts is gone once the search is, also when its driver was killed.

An embedded ``ray.init`` starts Ray's processes (GCS, raylet, and the raylet's agents, log monitor
and workers) below the driver. Ray ends them at a normal exit, and its head processes die with a
SIGKILLed driver, but the raylet's agents outlive it (seen: ``ray::DashboardAgent`` and
``ray::RuntimeEnvAgent`` still running 30 s after a driver was killed mid-search). So an embedded
driver records its Ray session folder in ``<cache>/embedded-ray/<pid>.json`` once Ray has started
(the record goes at a normal exit), and the next embedded start ends every process of a record
whose driver is gone (each names the session folder on its command line or holds its log files
there open), removes the session folder of a private search (its owner-only ``dptune-ray-*``
folder, left by the kill), and drops the record. Linux only (``/proc``); elsewhere nothing is recorded or ended.

A private search keeps what Ray writes on its machine in an owner-only folder of its own
(:func:`private_ray_folder`): the session folder of its embedded Ray and Tune's lock files.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dptune.paths import cache_dir, write_file_atomic

#: Where :func:`private_ray_folder` puts the session folder of a private search's embedded Ray (set
#: while the search runs; read by ``ray_session.init_ray``).
PRIVATE_RAY_FOLDER_ENV = "DPTUNE_PRIVATE_RAY_FOLDER"

#: The subfolder of :func:`private_ray_folder` that an embedded Ray keeps its session folder in.
RAY_SESSION_SUBFOLDER = "ray"

#: The longest session folder parent Ray can use: it adds ``/session_<date>_<time>_<pid>/sockets/plasma_store``
#: (about 63 characters) below it, and a Unix socket's path holds at most 107 bytes.
RAY_FOLDER_MAX_CHARS = 40

#: The cache folder of the records.
RECORDS = "embedded-ray"
_PROC = Path("/proc")


@contextlib.contextmanager
def private_ray_folder() -> Iterator[str]:
    """An owner-only (0700) temporary folder for what Ray writes of a private search on this machine:
    Tune's lock files (``RAY_TMPDIR``: the driver's, and an embedded Ray's workers') and, below it in
    ``RAY_SESSION_SUBFOLDER``, the session folder of an embedded Ray (its logs, Tune's staging folders,
    its object spill), which a shared ``/tmp/ray`` would leave world-readable. Ray opens the session
    folder it is given to everyone (mode 0777); the 0700 parent still closes it. On the way out Ray is
    shut down and the folder removed, whatever ended the search."""
    folder = tempfile.mkdtemp(prefix="dptune-ray-")
    if len(folder) + len(RAY_SESSION_SUBFOLDER) + 1 > RAY_FOLDER_MAX_CHARS:  # a socket's path has ≤ 107 bytes
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix="dptune-ray-", dir="/tmp")
    saved = {name: os.environ.get(name) for name in (PRIVATE_RAY_FOLDER_ENV, "RAY_TMPDIR")}
    os.environ[PRIVATE_RAY_FOLDER_ENV] = folder
    os.environ["RAY_TMPDIR"] = folder
    try:
        yield folder
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def private_session_folder(*, parent: bool = False) -> str | None:
    """Where a private search's embedded Ray keeps its session folder (``parent``: the owner-only
    folder above it), while :func:`private_ray_folder` holds one; else None."""
    folder = os.environ.get(PRIVATE_RAY_FOLDER_ENV)
    return folder if folder is None or parent else os.path.join(folder, RAY_SESSION_SUBFOLDER)


def _started(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot: with the pid, it names one process), or None."""
    try:
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def record_session(session_dir: str, private_folder: str | None) -> None:
    """Record that this process's embedded Ray keeps its session in ``session_dir`` (and, for a
    private search, lives in ``private_folder``); the record is removed at a normal exit."""
    if not _PROC.is_dir():
        return
    pid = os.getpid()
    record = {"pid": pid, "started": _started(pid), "session_dir": session_dir, "private_folder": private_folder}
    folder = cache_dir(RECORDS)
    write_file_atomic(str(folder), f"{pid}.json", json.dumps(record).encode())
    atexit.register(lambda: (folder / f"{pid}.json").unlink(missing_ok=True))


def end_orphans() -> list[int]:
    """End the Ray processes of every recorded embedded session whose driver is gone; return their pids."""
    if not _PROC.is_dir():
        return []
    ended: list[int] = []
    for path in sorted(cache_dir(RECORDS).glob("*.json")):
        try:
            record = json.loads(path.read_text())
            pid, session = int(record["pid"]), str(record["session_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)  # a record cut short: nothing to go by
            continue
        if record.get("started") is not None and _started(pid) == record["started"]:
            continue  # its driver is still running
        ended += _end_processes_naming(session)
        folder = record.get("private_folder")
        if folder and Path(folder).name.startswith("dptune-ray-"):
            shutil.rmtree(folder, ignore_errors=True)
        path.unlink(missing_ok=True)
    return ended


def _end_processes_naming(session: str) -> list[int]:
    """SIGKILL every process of this user that names ``session`` on its command line or holds a file
    below it open (the raylet's agents retitle themselves ``ray::DashboardAgent`` and so on, but keep
    their log files in the session folder open)."""
    ended = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            named = session in command or any(
                os.readlink(descriptor).startswith(session + os.sep) for descriptor in (entry / "fd").iterdir()
            )
        except OSError:
            continue  # gone meanwhile, or another user's
        if named:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)
                ended.append(int(entry.name))
    return ended
