"""Where dptune reads and writes: the cache folder, result locations, and their checks.

``DPTUNE_CACHE_DIR`` overrides the default ``~/.cache/dptune``; tests point it at a temporary
folder. Nothing in the cache is results: results go where ``--storage`` says.

A result or report location is a local path or a URI of a filesystem pyarrow opens
(``ALLOWED_SCHEMES``). ``probe_writable`` proves a location writable by creating and removing a
file there (``os.access`` says nothing about read-only mounts, ``/proc``, quotas or object
stores); ``check_name`` keeps a name to one folder inside its parent.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from dptune.errors import DptuneError, shown

if TYPE_CHECKING:
    import pyarrow.fs as pafs

CACHE_ENV = "DPTUNE_CACHE_DIR"

#: URI schemes a location may use: the filesystems pyarrow opens (``pyarrow.fs.FileSystem.from_uri``).
ALLOWED_SCHEMES = ("file", "s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs")

#: A name (of a search, a folder under ``--storage``) is one path component of these characters...
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
#: ...and at most this long: file names are limited to 255 bytes, and a name is embedded in
#: longer ones (``part-<name>-<spec hash>.parquet``).
MAX_NAME_CHARS = 100


class LocationError(DptuneError, ValueError):
    """A location that cannot be used: empty, an unknown URI scheme, not a folder or not writable."""


def cache_dir(*parts: str) -> Path:
    """Return (and create) the cache folder, or a sub-folder of it."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dptune").expanduser()
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing) for the ``with`` block: a
    second process asking for it waits until the first leaves."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_name(name: str, where: str = "name") -> str:
    """Return ``name`` if it names one folder inside its parent, else raise ``LocationError``.

    Refused: characters other than letters, digits, ``-``, ``_`` and ``.`` (so no path
    separator), a name made of dots only (``.`` is the parent itself, ``..`` its parent), and
    names longer than ``MAX_NAME_CHARS``.
    """
    allowed = f"letters, digits, '-', '_' and '.' only, at most {MAX_NAME_CHARS} characters, not only dots"
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise LocationError(f"{where} {shown(name)}: use {allowed}")
    if set(name) == {"."}:
        raise LocationError(
            f"{where} {name!r}: names the folder itself or its parent, not a folder inside it (use {allowed})"
        )
    if len(name) > MAX_NAME_CHARS:
        raise LocationError(f"{where} {shown(name)}: {len(name)} characters is too long (use {allowed})")
    return name


def filesystem(location: str, where: str | None = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a local path or URI and the path inside it (``LocationError`` if unusable).

    ``where`` (e.g. ``--storage``) prefixes error messages; the location itself by default.
    """
    import pyarrow as pa
    import pyarrow.fs as pafs

    where = where or shown(location)
    if not location or not location.strip():
        raise LocationError(
            f"{where}: an empty location (give a folder, e.g. results, or a URI such as s3://bucket/prefix)"
        )
    if "://" not in location:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(location))
    scheme = location.split("://", 1)[0].lower()
    if scheme not in ALLOWED_SCHEMES:
        raise LocationError(
            f"{where} {shown(location)}: unknown URI scheme {shown(scheme)} "
            f"(allowed: a local path or {', '.join(s + '://' for s in ALLOWED_SCHEMES)})"
        )
    try:
        return pafs.FileSystem.from_uri(location)
    except (pa.ArrowException, OSError) as exc:
        raise LocationError(f"{where} {shown(location)}: cannot open its filesystem: {_first_line(exc)}") from None


def probe_writable(location: str, where: str | None = None) -> None:
    """Prove that files can be created in the folder ``location`` (a local path or a URI).

    Creates the folder (and any missing parents), writes and deletes a probe file there, then, on a
    local disk, removes the folders it created while they are empty (``rmdir``: never what another
    process wrote there meanwhile, such as a search's ``.lease``), so a successful probe leaves
    nothing behind. On an object store its folders (empty prefixes) are left: deleting one there
    deletes every object under it. Raises
    ``LocationError`` naming ``where`` (e.g. ``--storage``) when the location is empty, has an
    unknown scheme, is (or lies under) a file, or refuses the write (read-only, ``/proc``, ...).
    """
    import pyarrow as pa

    where = where or shown(location)
    fs, path = filesystem(location, where)
    created = _missing_folders(fs, path, where)
    probe = f"{path.rstrip('/')}/.dptune-probe-{uuid.uuid4().hex}"
    try:
        fs.create_dir(path, recursive=True)
        with fs.open_output_stream(probe) as stream:
            stream.write(b"dptune write probe\n")
        fs.delete_file(probe)
    except (pa.ArrowException, OSError) as exc:
        raise LocationError(
            f"{where} {shown(location)}: not writable: {_first_line(exc)} (a folder this user can create files in)"
        ) from None
    finally:
        for folder in reversed(created if fs.type_name == "local" else []):  # innermost first
            try:
                os.rmdir(folder)  # pyarrow's delete_dir would delete what another process wrote inside
            except OSError:
                break  # not ours to clean any more (someone wrote into it meanwhile)


def _missing_folders(fs: pafs.FileSystem, path: str, where: str) -> list[str]:
    """Folders from the first missing ancestor of ``path`` down to ``path`` (outermost first).

    ``LocationError`` when ``path`` or an ancestor exists and is not a folder.
    """
    import pyarrow.fs as pafs

    missing: list[str] = []
    current = path.rstrip("/") or "/"
    while True:
        kind = fs.get_file_info(current).type
        if kind == pafs.FileType.Directory:
            return missing
        if kind != pafs.FileType.NotFound:
            raise LocationError(f"{where}: {shown(current)} exists and is not a folder")
        missing.insert(0, current)
        parent = posixpath.dirname(current)
        if not parent or parent == current:
            return missing
        current = parent


def _first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, cut to ``limit`` characters."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[0][:limit]


def write_file_atomic(folder: str, file_name: str, data: bytes, *, durable: bool = False) -> str:
    """Write ``data`` as ``<folder>/<file_name>`` whole or not at all (the folder is created): a
    temporary file renamed into place locally, one PUT on object stores. Returns the file's location.

    ``durable``: on a local file system the file's bytes and its name are on disk (``fsync`` of the
    file, then of the folder) when this returns, so a crash or power loss right after cannot lose it;
    an object store's PUT is durable once it returns.
    """
    import pyarrow.fs as pafs

    fs, root = filesystem(folder)
    fs.create_dir(root, recursive=True)
    final = f"{root}/{file_name}"
    if durable and isinstance(fs, pafs.LocalFileSystem):
        _write_local_durable(root, file_name, data)
        return final
    temporary = f"{root}/.{file_name}.tmp-{uuid.uuid4().hex}" if isinstance(fs, pafs.LocalFileSystem) else final
    try:
        with fs.open_output_stream(temporary) as stream:
            stream.write(data)
        if temporary != final:
            fs.move(temporary, final)
    except BaseException:  # a full disk: leave no half-written temporary behind
        if temporary != final:
            with contextlib.suppress(Exception):
                fs.delete_file(temporary)
        raise
    return final


def _write_local_durable(root: str, file_name: str, data: bytes) -> None:
    """Write, fsync and rename a local file into place, then fsync its folder (the rename itself)."""
    temporary = os.path.join(root, f".{file_name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, os.path.join(root, file_name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    folder = os.open(root, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_file(folder: str, file_name: str) -> bytes | None:
    """The bytes of ``<folder>/<file_name>``, or None when there is no such file."""
    import pyarrow.fs as pafs

    fs, root = filesystem(folder)
    path = f"{root}/{file_name}"
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_file(path) as file:
        return file.readall()
