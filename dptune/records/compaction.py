"""Compaction: a results dataset's many small files merged into a few large ones, crash-safe at every step.

A run writes its rows as single parts (``<table>/part-<trial_id>.parquet``) and its weights as
``weights/<trial_id>.safetensors`` as it finishes. :func:`compact_records` merges them:

- at a unit's end, the unit's own trials (``trial_ids``): no other process writes them then;
- at the finishing step, every single part and weights file (``trial_ids=None``), after every unit ended.

Each table's single parts become one compacted file (``part-c-<seq>-<tag>.parquet``, rows sorted by trial
id, row groups of about :data:`ROW_GROUP_BYTES`, a new file after each :data:`FILE_BYTES` of rows in
memory), written atomically, and only then are the parts deleted. Compacted files are merged in turn,
size-tiered (:func:`tier_group`): :data:`FANOUT` loose files (under :data:`FULL_BYTES`) of one tier of size
become one file; the finishing step also merges the loose files left when more than one. A table holds
at most about (FANOUT − 1) loose files per tier (a handful) besides its full files, and each row is
rewritten about once per tier it climbs (log_FANOUT of the table's size over :data:`TIER_BYTES`).

Crash safety, with the precedence rule of :mod:`dptune.records.store` (a trial's rows come from its
single part, else from the newest compacted file holding it): a new file is newer than every compacted
file listed before it was written (``seq`` one more than theirs), and holds, for every trial of the
files it replaces, the rows those files showed. So whatever step a kill interrupts — a merged file
written or half-written (a temporary, never read), its inputs partly deleted — every trial reads the
same rows exactly once, and the next compaction finishes the work. Memory: at most about two
:data:`FILE_BYTES` of rows, whatever the number of trials.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from dptune.records.schemas import RecordsError
from dptune.records.store import (
    DATA_BYTES_KEY,
    PER_TRIAL_TABLES,
    ResultsStore,
    TableFiles,
    compacted_name,
)
from dptune.records.weights import bundle_weights

#: Rows in memory (bytes, Arrow) after which a merge starts a new compacted file.
FILE_BYTES = 64 * 2**20
#: A compacted file holding at least this many bytes of rows is full: never merged again.
FULL_BYTES = FILE_BYTES // 2
#: Loose files of one tier merged at once, and the ratio of sizes between tiers.
FANOUT = 4
#: Files under this size (bytes) form tier 0; tier t holds sizes in [TIER_BYTES·FANOUTᵗ, TIER_BYTES·FANOUTᵗ⁺¹).
TIER_BYTES = 256 * 2**10
#: Rows per row group of a compacted file: about this many bytes of rows in memory.
ROW_GROUP_BYTES = 16 * 2**20
#: Single parts read at once while compacting them.
SINGLES_PER_READ = 512

T = TypeVar("T")


def compact_records(runs: str, trial_ids: Collection[str] | None = None) -> None:
    """Compact the per-trial tables and bundle the weights under ``runs`` (a search's runs root): the
    single parts and weights files of ``trial_ids`` (a unit's own, at its end), or of every trial (None:
    the finishing step, when no unit writes), then merge what :func:`tier_group` selects. Files are
    written before the ones they replace are deleted; ``trials`` goes last, as when a trial is written."""
    store = ResultsStore(runs, cache=None)
    for table in (*[t for t in PER_TRIAL_TABLES if t != "trials"], "trials"):
        compact_table(store, table, trial_ids)
    bundle_weights(runs, trial_ids, lambda sizes: tier_group(sizes, FULL_BYTES, final=False))


def compact_table(store: ResultsStore, table: str, trial_ids: Collection[str] | None = None) -> None:
    """Compact one per-trial table: its single parts of ``trial_ids`` (None: all) into new compacted files,
    then the loose compacted files :func:`tier_group` selects, until it selects none. Cheap on a compact
    table: one listing and the (kept) index of its few compacted files."""
    files = store.table_files(table)
    singles = [info for key, info in sorted(files.singles.items()) if trial_ids is None or key in trial_ids]
    if singles:
        _write_merged(store, table, _read_singles(store, table, singles), files.next_seq())
        store.delete_files(info.path for info in singles)
    while True:
        files = store.table_files(table)
        sizes = [(info, store.file_index(table, info).data_bytes) for info in files.compacted]
        group = tier_group(sizes, FULL_BYTES, final=trial_ids is None)
        if not group:
            return
        try:
            _write_merged(store, table, _read_compacted(store, table, files, group), files.next_seq())
        except (pa.ArrowException, OSError, RecordsError):
            if {info.path for info in group} <= {info.path for info in store.table_files(table).compacted}:
                raise
            continue  # another unit merged some of them meanwhile (what it wrote holds their rows): list again
        store.delete_files(info.path for info in group)


def tier_group(sizes: Sequence[tuple[T, int]], full: int, *, final: bool) -> list[T]:
    """Which files to merge, from ``(file, bytes)``: the files of the smallest tier (:data:`TIER_BYTES`,
    :data:`FANOUT`) that has FANOUT loose files (under ``full`` bytes); else, when ``final`` and more than
    one file is loose, every loose file; else none."""
    loose = [(item, size) for item, size in sizes if size < full]
    tiers: dict[int, list[T]] = {}
    for item, size in loose:
        tiers.setdefault(int(math.log(max(size, TIER_BYTES) / TIER_BYTES, FANOUT)), []).append(item)
    for tier in sorted(tiers):
        if len(tiers[tier]) >= FANOUT:
            return tiers[tier]
    return [item for item, _ in loose] if final and len(loose) > 1 else []


def _read_singles(store: ResultsStore, table: str, singles: list[pafs.FileInfo]) -> Iterator[pa.Table]:
    """The rows of ``singles``, :data:`SINGLES_PER_READ` files at a time."""
    for start in range(0, len(singles), SINGLES_PER_READ):
        paths = [info.path for info in singles[start : start + SINGLES_PER_READ]]
        yield store.read_files(table, paths)


def _read_compacted(
    store: ResultsStore, table: str, files: TableFiles, group: list[pafs.FileInfo]
) -> Iterator[pa.Table]:
    """The rows of compacted files ``group`` that no newer compacted file holds (:meth:`ResultsStore.read_plan`
    without single parts: a single part may be compacted and deleted meanwhile, so a merge keeps its trials)."""
    merged = {info.path for info in group}
    for info, keep in store.read_plan(table, files, singles_win=False):
        if info.path in merged:
            data = store.read_files(table, [info.path])
            yield data if keep is None else data.filter(pc.is_in(data["trial_id"], pa.array(sorted(keep), pa.string())))


def _write_merged(store: ResultsStore, table: str, pieces: Iterable[pa.Table], seq: int) -> None:
    """Write ``pieces`` (each whole trials' rows) as compacted files at ``seq``: a new file once
    :data:`FILE_BYTES` of rows are held (so a trial's rows stay in one file)."""
    held: list[pa.Table] = []
    size = 0
    for piece in pieces:
        held.append(piece)
        size += piece.nbytes
        if size >= FILE_BYTES:
            _write_compacted(store, table, pa.concat_tables(held), seq)
            held, size = [], 0
    if held:
        _write_compacted(store, table, pa.concat_tables(held), seq)


def _write_compacted(store: ResultsStore, table: str, data: pa.Table, seq: int) -> None:
    """One compacted file of ``data``: sorted by trial id (stable), row groups of about
    :data:`ROW_GROUP_BYTES`, its size in memory in the footer (:data:`DATA_BYTES_KEY`). Empty: none."""
    if not data.num_rows:
        return
    data = data.take(pc.sort_indices(data, [("trial_id", "ascending")])).combine_chunks()
    data = data.replace_schema_metadata({DATA_BYTES_KEY: str(data.nbytes).encode()})
    rows_per_group = max(1, data.num_rows * ROW_GROUP_BYTES // max(1, data.nbytes))
    store.write_file(table, compacted_name(seq), data, row_group_size=rows_per_group)
