"""One live search per results folder: an exclusive lease held for the whole command.

A search (not ``--dry-run``) takes the lease on ``<storage>/<name>`` before it loads data and
holds it until the command ends, whatever way it ends. A second search on the same folder, with
or without ``--resume``, is refused at once (``LeaseHeld``, exit status 2) with the holder's host,
pid and start time and what to do.

- Local and network file systems (a path, or a ``file://`` URI): an OS lock, ``fcntl.flock`` on
  ``<results>/.lease`` (on Linux NFS clients it is a lock on the server). The kernel releases it
  when the holder exits or is killed (SIGKILL included), so a dead holder's lease is taken over by
  the next search with no stale-lock clean-up; the file is never deleted (deleting a lock file
  lets two processes lock two different files). The holder writes its host, pid and start time
  into the file for the refusal message and empties it on release.
- Object stores (``s3://``, ``gs://``...), which have no lock: a lease object
  ``<results>/.lease.json`` (holder, a random token, an expiry) renewed by a heartbeat thread
  every ``HEARTBEAT_S`` and valid for ``LEASE_EXPIRY_S``; a lease whose expiry has passed (its
  holder died) is taken over. pyarrow's file systems have no conditional write, so two searches
  starting within the same second could both write one; the taker reads the object back after
  ``SETTLE_S`` and refuses if another token replaced its own, which closes that window to the
  store's write propagation time, not to zero.

The holder's random token is also what its trial workers check before each write
(:func:`check_holder`): a worker whose search ended, or was killed and its folder taken over by
a new search, starts no run and writes no entry or row (Ray ends such workers within seconds;
this closes those seconds).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from dptune.errors import DptuneError, shown
from dptune.paths import filesystem, read_file, write_file_atomic

#: The lock file of a results folder on a local or network file system.
LEASE_FILE = ".lease"
#: The lease object of a results folder on an object store.
LEASE_OBJECT = ".lease.json"
#: Seconds between two renewals of an object-store lease, and how long one stays valid.
HEARTBEAT_S = 30.0
LEASE_EXPIRY_S = 120.0
#: Seconds an object-store taker waits before reading its lease back.
SETTLE_S = 1.0


class LeaseHeld(DptuneError, ValueError):
    """Another live search holds the results folder; the message names it and how to proceed."""


class LeaseUnusable(DptuneError, ValueError):
    """The results folder's ``.lease`` is not a lock file dptune can take (a folder, a link)."""


class SearchGone(DptuneError, RuntimeError):
    """A trial worker's search no longer holds its results folder: the worker writes nothing more."""


def _holder_info(token: str) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": token,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _refusal(results_root: str, where: str, holder: dict[str, Any] | None) -> LeaseHeld:
    who = (
        "a search that is still starting"
        if not holder
        else f"the search of pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started_at')}"
    )
    return LeaseHeld(
        f"{where} {shown(results_root)}: another search is running on this results folder ({who}); only one search "
        "may use a results folder at a time. Wait for it to end, or stop it (`ray job stop`, or kill that pid), then "
        "run this command again with --resume (what it finished is kept); or choose another --name or --storage"
    )


@contextlib.contextmanager
def hold_lease(results_root: str, where: str = "--storage/--name") -> Iterator[str]:
    """Hold the exclusive lease on ``results_root`` (created if missing) while the block runs; yields
    the holder's token (:func:`check_holder`).

    Raises ``LeaseHeld`` at once when another live process holds it. ``where`` names the flags
    that chose the folder, for the message.
    """
    import pyarrow.fs as pafs

    fs, path = filesystem(results_root, where)
    if isinstance(fs, pafs.LocalFileSystem):
        with _file_lock(path, results_root, where) as token:
            yield token
    else:
        with _object_lease(results_root, where) as token:
            yield token


def _lease(results_root: str) -> tuple[bool, bytes | None]:
    """Whether ``results_root`` is on a file system (else an object store), and the bytes of its lease
    file (or object) as this process sees them: None when there is none."""
    import pyarrow.fs as pafs

    fs, _ = filesystem(results_root)
    local = isinstance(fs, pafs.LocalFileSystem)
    return local, read_file(results_root, LEASE_FILE if local else LEASE_OBJECT)


def holder_token(results_root: str) -> str | None:
    """The token of the search that holds (or, killed, last held) the lease on ``results_root``; None
    when none does (released, or never taken)."""
    token = (_parse(_lease(results_root)[1]) or {}).get("token")
    return None if token is None else str(token)


#: The (results folder, token) pairs whose lease this process has seen held by that token
#: (:func:`check_holder`): a lease file that is gone afterwards was removed, not never there.
_SEEN_HELD: set[tuple[str, str]] = set()


def check_holder(results_root: str, token: str | None) -> None:
    """Raise ``SearchGone`` unless the search whose lease token is ``token`` still holds ``results_root``
    (``token`` None: no search to check, as when a runner is called directly).

    The message names the likely cause. On a file system the lease file is never deleted, so one this
    process never saw there means the folder it sees is not its search's: ``--storage`` is a path the
    cluster's nodes do not share. One it saw and that is gone now was removed with the folder. An empty
    lease (released) or another token means the search ended, or was stopped and another search took
    the folder over."""
    if token is None:
        return
    local, data = _lease(results_root)
    if (_parse(data) or {}).get("token") == token:
        _SEEN_HELD.add((results_root, token))
        return
    if local and data is None and (results_root, token) not in _SEEN_HELD:
        raise SearchGone(
            f"{results_root}: this results folder is not visible on this node ({socket.gethostname()}): its search's "
            f"lease file {LEASE_FILE} is not there. --storage must be a path every node of the cluster shares (a "
            "volume mounted at the same path on each, as cluster/storage.yaml's), or an object-store URI (s3://, "
            "gs://); this trial worker starts and writes nothing"
        )
    if local and data is None:
        raise SearchGone(
            f"{results_root}: the results folder was removed while its search ran (its lease file {LEASE_FILE} is "
            "gone); this trial worker starts and writes nothing more"
        )
    raise SearchGone(
        f"{results_root}: the search that started this trial worker no longer holds its results folder (it "
        "ended, or was stopped and another search took the folder over); this worker starts and writes nothing more"
    )


@contextlib.contextmanager
def _file_lock(path: str, results_root: str, where: str) -> Iterator[str]:
    os.makedirs(path, exist_ok=True)
    lease_path = os.path.join(path, LEASE_FILE)
    if os.path.isdir(lease_path) or os.path.islink(lease_path):
        raise LeaseUnusable(
            f"{lease_path} is a folder or a link, not the lock file dptune keeps there; move it away (nothing of "
            "the search is in it), then run the command again"
        )
    descriptor = os.open(lease_path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _refusal(results_root, where, _parse(os.pread(descriptor, 4096, 0))) from None
        token = uuid.uuid4().hex
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps(_holder_info(token)).encode(), 0)
        os.fsync(descriptor)
        try:
            yield token
        finally:
            with contextlib.suppress(OSError):  # a full disk must not hide the error being raised
                os.ftruncate(descriptor, 0)
    finally:
        os.close(descriptor)  # releases the lock


def _parse(data: bytes | None) -> dict[str, Any] | None:
    try:
        holder = json.loads(data or b"")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


@contextlib.contextmanager
def _object_lease(results_root: str, where: str) -> Iterator[str]:
    token = uuid.uuid4().hex
    held = _parse(read_file(results_root, LEASE_OBJECT))
    if held is not None and float(held.get("expires_at", 0)) > time.time():
        raise _refusal(results_root, where, held)
    info = _holder_info(token)

    def renew() -> None:
        write_file_atomic(
            results_root, LEASE_OBJECT, json.dumps({**info, "expires_at": time.time() + LEASE_EXPIRY_S}).encode()
        )

    renew()
    time.sleep(SETTLE_S)
    current = _parse(read_file(results_root, LEASE_OBJECT))
    if current is None or current.get("token") != token:
        raise _refusal(results_root, where, current)
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a failed renewal is retried; expiry bounds the damage
                renew()

    thread = threading.Thread(target=heartbeat, name="dptune-lease-heartbeat", daemon=True)
    thread.start()
    try:
        yield token
    finally:
        stop.set()
        thread.join(timeout=5)
        with contextlib.suppress(Exception):
            if (_parse(read_file(results_root, LEASE_OBJECT)) or {}).get("token") == token:
                fs, path = filesystem(results_root)
                fs.delete_file(f"{path}/{LEASE_OBJECT}")
