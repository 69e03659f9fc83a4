"""The memo and the signed on-disk cache of every σ and ε this package computes.

Results are memoised in-process and cached on disk (``dptune.paths.cache_dir("accounting")``), keyed
by the exact inputs, the accuracy settings and the accountant's version: a repeated calibration is
a dict lookup or one small file read.

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
from collections.abc import Callable, Mapping
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


@lru_cache(maxsize=1)
def _accountant_identity() -> dict[str, object]:
    return {
        "prv_accountant": version("prv-accountant"),
        "method": METHOD_VERSION,
        "epsilon_error": EPSILON_ERROR,
        "delta_error_fraction": DELTA_ERROR_FRACTION,
        "noise_multiplier_rtol": NOISE_MULTIPLIER_RTOL,
    }


def _cache_folder() -> Path:
    """The accounting cache folder, private to this user (mode 0700): a σ read from it sets the
    noise of every trial, so nobody else may write it."""
    folder = cache_dir(_CACHE_FOLDER)
    os.chmod(folder, 0o700)
    return folder


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


def _signature(key: dict[str, object], value: float) -> str:
    message = json.dumps({"key": key, "value": value}, sort_keys=True).encode()
    return hmac.new(_cache_key_secret(_cache_folder()), message, hashlib.sha256).hexdigest()


def _cache_path(key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]
    return _cache_folder() / f"{key['kind']}-{digest}.json"


def _read_cached(path: Path, key: dict[str, object]) -> float | None:
    try:
        record = json.loads(path.read_text())
        value = record["value"]
        if (
            record["key"] == key
            and isinstance(value, float)
            and math.isfinite(value)
            and hmac.compare_digest(str(record["hmac"]), _signature(key, value))
        ):
            return value
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing, partial (crash), foreign or tampered file: a miss; it is rewritten below
    return None


def _write_cached(path: Path, key: dict[str, object], value: float) -> None:
    """Write atomically: temporary file (mode 0600) in the same folder, then ``os.replace``."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump({"key": key, "value": value, "hmac": _signature(key, value)}, handle, sort_keys=True)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def cached(kind: str, inputs: Mapping[str, float | int | str], compute: Callable[[], float]) -> float:
    """``compute()`` once per exact inputs: in-process memo, then the on-disk cache, then compute."""
    memo_key = (kind, *inputs.values())
    if memo_key in _memo:
        return _memo[memo_key]
    key: dict[str, object] = {"kind": kind, **inputs, **_accountant_identity()}
    path = _cache_path(key)
    value = _read_cached(path, key)
    if value is None:
        value = compute()
        _write_cached(path, key, value)
    _memo[memo_key] = value
    return value


def forget() -> None:
    """Forget the in-process memo and the key secret (the on-disk cache stays)."""
    _memo.clear()
    _cache_key_secret.cache_clear()
