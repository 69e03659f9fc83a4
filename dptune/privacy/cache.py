"""The memo and the signed on-disk cache of every σ and ε this package computes.

Results are memoised in-process and cached on disk (``dptune.paths.cache_dir("accounting")``), keyed
by the exact inputs, the accuracy settings and the accountant's version: a repeated calibration is
a dict lookup or one small file read.

An end-to-end private search's hidden runs compute their ε at mechanisms they chose (σ, q = B/N
and the steps they took): inside :func:`kept_inside` their entries go to a folder inside the
search's trust boundary (or, for one on an object store, stay in memory), never to the user's cache,
whose entries and times anyone with the user's files could read. They still read the user's cache
(the σ the driver's plan calibrated), with ``O_NOATIME``, so no access time says which they used.

Disk cache format: one small JSON file per key, written to a temporary file in the same folder and
moved into place with ``os.replace``. That rename is atomic on POSIX, so concurrent writers (Ray
trials, several drivers) never leave a partial file and never block each other; the last writer of
an identical value wins. The folder is private to the user (0700, files 0600) and every entry
carries an HMAC-SHA256 under a per-user secret key kept beside it: a reader that finds an
unreadable, foreign or tampered entry treats it as a miss and recomputes it, so a σ that was not
computed here can never set a trial's noise. Chosen over SQLite with WAL because
it needs no locks, works on network file systems where SQLite's locking is unreliable, and each
entry can be read or removed by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path

from dptune.paths import cache_dir
from dptune.privacy.checks import DELTA_ERROR_FRACTION, EPSILON_ERROR, NOISE_MULTIPLIER_RTOL

#: Bump when the calibration procedure changes: it is part of every cache key.
#: 2: the truncated PRV's mean sees log(1 − q); 3: vectorised RDP domain (≥ the library's), ``math`` CDF.
METHOD_VERSION = "prv-coarse-secant-3"

_CACHE_FOLDER = "accounting"
_memo: dict[tuple[object, ...], float] = {}
#: Rounds of read, else write-and-link, before the cache key is given up on.
_KEY_ATTEMPTS = 5
#: The folders :func:`kept_inside` set, innermost last; None: in memory only.
_inside: list[Path | None] = []


@contextlib.contextmanager
def kept_inside(root: str) -> Iterator[None]:
    """Write the entries computed in the ``with`` block under ``<root>/accounting`` (a local folder: the
    trust boundary of a private search), or nowhere but the memo where ``root`` is an object store's
    URI, never to the user's cache folder, which is still read (the public plan's σ), leaving no trace."""
    _inside.append(None if "://" in root else Path(root, _CACHE_FOLDER))
    try:
        yield
    finally:
        _inside.pop()


@lru_cache(maxsize=1)
def _accountant_identity() -> dict[str, object]:
    return {
        "prv_accountant": version("prv-accountant"),
        "method": METHOD_VERSION,
        "epsilon_error": EPSILON_ERROR,
        "delta_error_fraction": DELTA_ERROR_FRACTION,
        "noise_multiplier_rtol": NOISE_MULTIPLIER_RTOL,
    }


def _user_folder() -> Path:
    """The user's accounting cache folder, private to this user (mode 0700): a σ read from it sets
    the noise of every trial, so nobody else may write it."""
    return _owner_only(cache_dir(_CACHE_FOLDER))


def _owner_only(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def _folders() -> tuple[list[Path], Path | None]:
    """Where an entry is looked for, in order, and where a computed one is written (None: nowhere).
    Inside :func:`kept_inside`: the boundary's folder first, then the user's (read without changing
    its access time), written inside only; else the user's folder alone."""
    if not _inside:
        folder = _user_folder()
        return [folder], folder
    inside = _inside[-1]
    if inside is None:
        return [_user_folder()], None
    return [_owner_only(inside), _user_folder()], inside


@lru_cache(maxsize=64)
def _cache_key_secret(folder: Path) -> bytes:
    """The per-user secret (32 random bytes in a 0600 file of the cache ``folder``) that signs its
    entries; one per folder, so that a process whose ``DPTUNE_CACHE_DIR`` changes signs each
    folder's entries with that folder's own key.

    An entry whose HMAC does not verify (edited, copied from elsewhere, written by another user,
    truncated) is recomputed, never trusted: a tampered σ cannot weaken a trial's guarantee.

    Many processes may meet a folder without a key at once (a search's trial workers on a cold
    cache): each writes a candidate and links it into place, the first link wins and every process
    reads the winner. Only a key read and found unusable (wrong size, owner or mode) is removed,
    never a missing one (that would delete a key another process just linked).
    """
    path = folder / ".hmac-key"
    for _ in range(_KEY_ATTEMPTS):
        try:
            secret, status = path.read_bytes(), path.stat()
            if len(secret) == 32 and status.st_uid == os.getuid() and not status.st_mode & 0o077:
                return secret
            path.unlink(missing_ok=True)  # unusable: replaced
        except FileNotFoundError:
            pass  # none yet: write one
        except OSError:
            path.unlink(missing_ok=True)  # unreadable (another user's): replaced
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".hmac-key.", suffix=".tmp")  # mode 0600
        with os.fdopen(fd, "wb") as handle:
            handle.write(os.urandom(32))
        with contextlib.suppress(FileExistsError):  # a link is created whole or not at all: the first writer wins
            os.link(temporary, path)
        os.unlink(temporary)
    raise OSError(f"{path}: no usable cache key after {_KEY_ATTEMPTS} attempts (another process keeps replacing it)")


def keyed_digest(folder: Path, message: bytes) -> str:
    """HMAC-SHA256 of ``message`` (hex) under the per-user secret of the cache ``folder``: a name for
    private bytes that says nothing of them to whoever lacks the secret."""
    return hmac.new(_cache_key_secret(folder), message, hashlib.sha256).hexdigest()


def _signature(folder: Path, key: dict[str, object], value: float) -> str:
    return keyed_digest(folder, json.dumps({"key": key, "value": value}, sort_keys=True).encode())


def _file_name(key: dict[str, object]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]
    return f"{key['kind']}-{digest}.json"


def _read_cached(folder: Path, key: dict[str, object]) -> float | None:
    """The entry of ``key`` in ``folder`` if it verifies, else None. Read without updating the file's
    access time (``O_NOATIME``, on the owner's files): a read leaves no trace of which entry was used."""
    try:
        descriptor = os.open(folder / _file_name(key), os.O_RDONLY | getattr(os, "O_NOATIME", 0))
        with os.fdopen(descriptor) as handle:
            record = json.loads(handle.read())
        value = record["value"]
        if (
            record["key"] == key
            and isinstance(value, float)
            and math.isfinite(value)
            and hmac.compare_digest(str(record["hmac"]), _signature(folder, key, value))
        ):
            return value
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing, partial (crash), foreign or tampered file: a miss; it is rewritten below
    return None


def _write_cached(folder: Path, key: dict[str, object], value: float) -> None:
    """Write atomically: temporary file (mode 0600) in the same folder, then ``os.replace``."""
    path = folder / _file_name(key)
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump({"key": key, "value": value, "hmac": _signature(folder, key, value)}, handle, sort_keys=True)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def cached(kind: str, inputs: Mapping[str, float | int | str], compute: Callable[[], float]) -> float:
    """``compute()`` once per exact inputs: in-process memo, then the on-disk cache, then compute.
    A value found in a folder other than the one written (:func:`_folders`) is written there too."""
    memo_key = (kind, *inputs.values())
    if memo_key in _memo:
        return _memo[memo_key]
    key: dict[str, object] = {"kind": kind, **inputs, **_accountant_identity()}
    readable, writable = _folders()
    found = next(((folder, value) for folder in readable if (value := _read_cached(folder, key)) is not None), None)
    value = compute() if found is None else found[1]
    if writable is not None and (found is None or found[0] != writable):
        _write_cached(writable, key, value)
    _memo[memo_key] = value
    return value


def forget() -> None:
    """Forget the in-process memo and the key secret (the on-disk cache stays)."""
    _memo.clear()
    _cache_key_secret.cache_clear()
