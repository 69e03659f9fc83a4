"""A data owner's dataset on an object store (``s3://``, ``gs://``, ...): copied once into the cache.

``ray job submit`` users keep their data in a bucket, as they keep results (``--storage``). A
dataset URI is opened with the filesystem pyarrow opens for it (:func:`dptune.paths.filesystem`:
credentials, region and endpoint come from the environment as for ``--storage``, e.g.
``AWS_ENDPOINT_URL`` for an S3-compatible server) and its file, or its folder (an image folder,
a ``save_to_disk`` dataset), is copied to ``<cache>/datasets/<digest of the URI>/`` on each machine
that reads it. The copy is redone when the listing (path, size, modification time of every file)
differs from the one it was made from, under an exclusive lock, whole or not at all: it is staged in
a temporary sibling and renamed into place. The copy is private data and stays in the cache folder,
on the machines of the search's trust boundary, like the features encoded from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.parse
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from dptune.data.spec import WorkloadError
from dptune.paths import LocationError, cache_dir, exclusive, filesystem

if TYPE_CHECKING:
    import pyarrow.fs as pafs

#: The listing a copy was made from, beside it.
LISTING_FILE = "listing.json"


def is_remote(location: str) -> bool:
    """Whether ``location`` is a URI of a remote filesystem (``file://`` and plain paths are local)."""
    return "://" in location and not location.lower().startswith("file://")


def location_name(location: str) -> str:
    """The last component of a path or URI, without a URI's query (``?endpoint_override=...``)."""
    path = urllib.parse.urlsplit(location).path if is_remote(location) else location
    return path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def local_copy(location: str, where: str) -> str:
    """A local path holding ``location``'s file or folder: ``location`` itself when it is local,
    else the cache's copy of it (made or refreshed here). :class:`WorkloadError` naming ``where``
    (e.g. ``task.dataset.path``) when the URI cannot be opened or names nothing."""
    if not is_remote(location):
        return location
    import pyarrow as pa
    import pyarrow.fs as pafs

    try:
        fs, path = filesystem(location, where)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise WorkloadError(f"{where} {location}: no such file or folder")
        entries = (
            [info] if info.type == pafs.FileType.File else fs.get_file_info(pafs.FileSelector(path, recursive=True))
        )
        listing = sorted(
            [entry.path[len(path) :].lstrip("/"), entry.size, entry.mtime_ns]
            for entry in entries
            if entry.type == pafs.FileType.File
        )
        folder = cache_dir("datasets", hashlib.sha256(location.encode()).hexdigest()[:24])
        target = folder / (location_name(location) or "data")
        with exclusive(folder / ".lock"):
            recorded = folder / LISTING_FILE
            if target.exists() and recorded.is_file() and json.loads(recorded.read_text()) == listing:
                return str(target)
            _copy(fs, path, target)
            recorded.write_text(json.dumps(listing))
        return str(target)
    except LocationError as error:
        raise WorkloadError(str(error)) from None
    except (pa.ArrowException, OSError) as error:
        raise WorkloadError(f"{where} {location}: cannot be read ({str(error).splitlines()[0][:200]})") from None


def _copy(fs: pafs.FileSystem, path: str, target: Path) -> None:
    """Copy ``path`` of ``fs`` to ``target`` through a temporary sibling renamed into place."""
    import pyarrow.fs as pafs

    staging = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        pafs.copy_files(path, str(staging), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
        elif staging.exists():
            staging.unlink()
