"""Writing and reading a results dataset: atomic parts, consistent reads, quarantine of bad parts.

Invariants:
- Every part is written whole or not at all: local parts go to a temporary name in the same
  folder and are renamed (atomic on POSIX); object stores publish a single PUT atomically.
- A trial's ``trials`` part is written last, so its presence means every other table of that
  trial is complete; readers keep only rows whose trial has a ``trials`` row.
- Parts are keyed by trial id, so writing the same trial twice replaces it: a resumed search
  never shows a trial twice.
"""

from __future__ import annotations

import contextlib
import posixpath
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dptune.paths import filesystem
from dptune.records.schemas import SCHEMAS, TABLES, RecordsError

#: Where ``quarantine_part`` moves unreadable parts: ``<root>/quarantine/<table>/part-*.parquet``
#: (outside every table folder, so readers never see them again).
QUARANTINE = "quarantine"


def _filesystem(root: str) -> tuple[pafs.FileSystem, str]:
    """Resolve a local path or URI into a pyarrow filesystem and a path inside it."""
    return filesystem(root)


class ResultsStore:
    """Writes and reads one search's dataset under ``root`` (local path or URI)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._fs, self._path = _filesystem(root)

    def _table_dir(self, table: str) -> str:
        if table not in SCHEMAS:
            raise RecordsError(f"unknown table {table!r}; tables are {', '.join(TABLES)}")
        return f"{self._path}/{table}"

    def write_part(self, table: str, key: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Write ``rows`` as ``<table>/part-<key>.parquet`` atomically (replacing an older part)."""
        directory = self._table_dir(table)
        self._fs.create_dir(directory, recursive=True)
        data = pa.Table.from_pylist(list(rows), schema=SCHEMAS[table])
        final = f"{directory}/part-{key}.parquet"
        if isinstance(self._fs, pafs.LocalFileSystem):
            temporary = f"{directory}/.tmp-{key}-{uuid.uuid4().hex}.parquet"
            try:
                pq.write_table(data, temporary, filesystem=self._fs)
                self._fs.move(temporary, final)  # os.rename: atomic within one folder
            except BaseException:  # a full disk: leave no half-written temporary behind
                with contextlib.suppress(Exception):
                    self._fs.delete_file(temporary)
                raise
        else:
            pq.write_table(data, final, filesystem=self._fs)

    def write_trial(self, rows_by_table: Mapping[str, list[dict[str, Any]]], trial_id: str) -> None:
        """Write a trial's rows; the ``trials`` part goes last and marks the trial complete."""
        for table, rows in rows_by_table.items():
            if table != "trials":
                self.write_part(table, trial_id, rows)
        self.write_part("trials", trial_id, rows_by_table["trials"])

    def has_trial(self, trial_id: str) -> bool:
        """Whether the trial's ``trials`` part exists (the trial is complete)."""
        info = self._fs.get_file_info(f"{self._table_dir('trials')}/part-{trial_id}.parquet")
        return info.type == pafs.FileType.File

    def completed_trial_ids(self) -> set[str]:
        """Ids of trials whose ``trials`` part exists (they are complete)."""
        return set(read_table(self.root, "trials", columns=["trial_id"])["trial_id"])


def _part_infos(store: ResultsStore, table: str) -> list[pafs.FileInfo]:
    infos = store._fs.get_file_info(pafs.FileSelector(store._table_dir(table), allow_not_found=True))
    parts = [i for i in infos if i.base_name.startswith("part-") and i.base_name.endswith(".parquet")]
    return sorted(parts, key=lambda info: info.path)


def _part_paths(store: ResultsStore, table: str) -> list[str]:
    return [info.path for info in _part_infos(store, table)]


#: Tables read from local folders, each kept (by its columns) with the listing (path, bytes, mtime in
#: ns) of the parts it was read from, and served again while that listing is the same: the end of a
#: search reads its ``trials`` table five times (the composition, the models, the summary), and a
#: table of one part per trial costs a file open per trial at each read. Any part written, replaced
#: or removed changes the listing. Object stores are read anew every time.
_TABLE_CACHE: dict[tuple[str, str, tuple[str, ...]], tuple[tuple[tuple[str, int, int], ...], pa.Table]] = {}
#: Tables kept at once (the oldest goes first).
TABLE_CACHE_ENTRIES = 8


def _read_parts(store: ResultsStore, table: str, parts: list[pafs.FileInfo], columns: list[str]) -> pa.Table:
    """``columns`` of ``parts`` of ``table`` (see :data:`_TABLE_CACHE`)."""
    local = isinstance(store._fs, pafs.LocalFileSystem)
    listing = tuple((info.path, info.size, info.mtime_ns) for info in parts)
    key = (store._path, table, tuple(columns))
    if local and key in _TABLE_CACHE and _TABLE_CACHE[key][0] == listing:
        return _TABLE_CACHE[key][1]
    paths = [info.path for info in parts]
    data = pq.ParquetDataset(paths, filesystem=store._fs, schema=SCHEMAS[table]).read(columns=columns)
    if local:
        _TABLE_CACHE.pop(key, None)
        while len(_TABLE_CACHE) >= TABLE_CACHE_ENTRIES:
            del _TABLE_CACHE[next(iter(_TABLE_CACHE))]
        _TABLE_CACHE[key] = (listing, data)
    return data


def part_problem(store: ResultsStore, table: str, part: str) -> str | None:
    """Why the part at ``part`` cannot be read as table ``table``, or None if it can.

    Reads the Parquet footer only (cheap): a file that is not Parquet, is cut short, or has a
    column whose type differs from ``SCHEMAS[table]`` is unreadable. Missing columns are not a
    problem (older parts read them as null).
    """
    try:
        found = pq.read_schema(part, filesystem=store._fs)
    except (pa.ArrowException, OSError) as exc:
        return f"not a readable Parquet file ({str(exc).strip().splitlines()[0][:160] if str(exc) else 'unreadable'})"
    expected = SCHEMAS[table]
    wrong = [
        f"{field.name} is {field.type}, expected {expected.field(field.name).type}"
        for field in found
        if field.name in expected.names and not field.type.equals(expected.field(field.name).type)
    ]
    return f"its schema differs from table '{table}': {'; '.join(wrong)[:200]}" if wrong else None


def unreadable_parts(root: str) -> list[tuple[str, str, str]]:
    """Every part of the dataset at ``root`` that cannot be read: ``(table, path, problem)``."""
    store = ResultsStore(root)
    return [
        (table, part, problem)
        for table in TABLES
        for part in _part_paths(store, table)
        if (problem := part_problem(store, table, part)) is not None
    ]


def quarantine_part(root: str, table: str, part: str) -> str:
    """Move an unreadable part to ``<root>/quarantine/<table>/`` and return its new path."""
    store = ResultsStore(root)
    folder = f"{store._path}/{QUARANTINE}/{table}"
    store._fs.create_dir(folder, recursive=True)
    target = f"{folder}/{posixpath.basename(part)}"
    store._fs.move(part, target)
    return target


def read_table(root: str, table: str, columns: list[str] | None = None) -> pd.DataFrame:
    """Read one table of a results dataset into pandas (empty with the schema's columns if none).

    Rows of per-trial tables whose trial has no ``trials`` row yet (a write in progress) are
    dropped, so a search that is still running reads consistently. Trials written before schema
    3 read as their own configuration: ``configuration_id = trial_id``, ``replicate = 0``.
    Raises ``RecordsError`` naming the part when one cannot be read.
    """
    store = ResultsStore(root)
    parts = _part_infos(store, table)  # checks the table's name
    schema = SCHEMAS[table]
    selected = list(columns or schema.names)
    if not parts:
        return schema.empty_table().select(selected).to_pandas()
    fill_ids = "configuration_id" in selected and "trial_id" not in selected
    try:
        frame = _read_parts(store, table, parts, [*selected, "trial_id"] if fill_ids else selected).to_pandas()
    except (pa.ArrowException, OSError) as exc:
        bad = [(part.path, problem) for part in parts if (problem := part_problem(store, table, part.path)) is not None]
        if not bad:
            raise
        part, problem = bad[0]
        raise RecordsError(
            f"{part}: {problem} ({len(bad)} unreadable part(s) in table '{table}'; move "
            "them aside, or run python -m dptune.search --resume --quarantine-corrupt)"
        ) from exc
    if table not in ("trials", "search", "release") and "trial_id" in frame:
        frame = frame[frame["trial_id"].isin(store.completed_trial_ids())].reset_index(drop=True)
    if table == "trials":
        frame = _with_configuration_keys(frame)
    return frame[selected]


def _with_configuration_keys(trials: pd.DataFrame) -> pd.DataFrame:
    """Fill the schema-3 keys of trials written before them: each is replicate 0 of its own configuration."""
    if "configuration_id" in trials:
        trials["configuration_id"] = trials["configuration_id"].fillna(trials["trial_id"])
    if "replicate" in trials:
        trials["replicate"] = trials["replicate"].fillna(0).astype("int64")
    return trials
