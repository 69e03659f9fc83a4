"""Share encoded features between the nodes of a Ray cluster whose caches are node-local.

Each Pod of ``cluster/raycluster.yaml`` keeps ``DPTUNE_CACHE_DIR`` on its own disk (an ``emptyDir``),
so without help every node encodes a dataset's features itself (157 s against 12 s from a warm cache,
issue 51). ``DPTUNE_CACHE_SEED`` names a folder or URI every Pod can read (on the shared claim, or a
cache bucket with object storage):

- ``push`` copies the features of this node's cache there (run on the head once a search, or its
  ``--dry-run``, has encoded them: the driver encodes them before any trial starts);
- ``pull`` copies the features found there into this node's cache (the ``cache-seed`` init container
  of every Ray Pod runs it before Ray starts).

A feature file is named by the digest of everything that made it (data, weights, precision, ...), so
a copy is never stale: files already at the destination with the same size are skipped, and a search
that finds no entry encodes its own as before. Each file is written whole or not at all (the feature
cache reads a partial file as missing). Pure pyarrow filesystems: a local path, ``s3://``, ``gs://``
or ``abfs://`` with the credentials ``--storage`` uses.

    python cluster/node_cache.py push|pull [--seed LOCATION] [--cache DIR]
"""

from __future__ import annotations

import argparse
import os
import posixpath
import sys
from pathlib import Path

import pyarrow.fs as pafs

from dptune.paths import CACHE_ENV, cache_dir, filesystem, write_file_atomic

#: Environment variable naming the shared folder or URI of the feature cache.
SEED_ENV = "DPTUNE_CACHE_SEED"
#: The part of the cache that is copied: encoded features (``.npy`` with their ``.json`` keys).
FEATURES = "features"
SUFFIXES = (".npy", ".json")


def _files(location: str) -> dict[str, int]:
    """Feature files directly in ``location`` (a local folder or URI): name → size; none if it is missing."""
    fs, root = filesystem(location)
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    return {
        posixpath.basename(info.path): info.size
        for info in infos
        if info.type == pafs.FileType.File and info.path.endswith(SUFFIXES)
    }


def copy_features(source: str, destination: str) -> list[str]:
    """Copy the feature files of ``source`` missing from ``destination`` (or of another size); returns
    their names. Keys (``.json``) after their arrays, so that a reader never finds a key without data."""
    have = _files(destination)
    wanted = sorted(
        (name for name, size in _files(source).items() if have.get(name) != size),
        key=lambda name: (name.endswith(".json"), name),
    )
    fs, root = filesystem(source)
    for name in wanted:
        with fs.open_input_stream(posixpath.join(root, name)) as stream:
            write_file_atomic(destination, name, stream.read())
    return wanted


def main(argv: list[str] | None = None) -> int:
    """``push`` or ``pull`` the features between this node's cache and the seed; prints what it copied."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["push", "pull"])
    parser.add_argument("--seed", default=os.environ.get(SEED_ENV), help=f"shared folder or URI (default: ${SEED_ENV})")
    parser.add_argument("--cache", type=Path, help=f"this node's cache (default: ${CACHE_ENV} or ~/.cache/dptune)")
    args = parser.parse_args(argv)
    if not args.seed:
        print(f"node_cache: no seed (set {SEED_ENV} or pass --seed); nothing copied")
        return 0
    if args.cache is not None:
        os.environ[CACHE_ENV] = str(args.cache)
    local = str(cache_dir(FEATURES))
    seed = f"{args.seed.rstrip('/')}/{FEATURES}"
    source, destination = (local, seed) if args.direction == "push" else (seed, local)
    copied = copy_features(source, destination)
    print(f"node_cache {args.direction}: {len(copied)} file(s) from {source} to {destination}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
