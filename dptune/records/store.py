"""Writing and reading a results dataset: atomic parts, consistent reads, quarantine of bad parts.

Invariants:
- Every part is written whole or not at all: local parts go to a temporary name in the same
  folder and are renamed (atomic on POSIX); object stores publish a single PUT atomically.
- A trial's ``trials`` part is written last, so its presence means every other table of that
  trial is complete; readers keep only rows whose trial has a ``trials`` row.
- Parts are keyed by trial id, so writing the same trial twice replaces it: a resumed search
  never shows a trial twice.
- Every read is of the current schema: parts written by an older dptune are migrated where they are
  read (:meth:`ResultsStore.read`, by :mod:`dptune.records.migrations`), and nowhere else.
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
from dptune.records.migrations import columns_to_read, migrate
from dptune.records.schemas import SCHEMAS, TABLES, RecordsError

#: Where ``quarantine_part`` moves unreadable parts: ``<root>/quarantine/<table>/part-*.parquet``
#: (outside every table folder, so readers never see them again).
QUARANTINE = "quarantine"


#: A part's identity in a listing: (path, bytes, mtime in ns); any part written, replaced or removed
#: changes the listing of its table.
Listing = tuple[tuple[str, int, int], ...]


class TableCache:
    """Tables read from local folders, each kept (by its folder, table and columns) with the listing of
    the parts it was read from, and served again while that listing is the same.

    The end of a search reads its ``trials`` table several times (the composition, the models, the
    summary), and a table of one part per trial costs a file open per trial at each read: 2,000 parts
    read in ~2.7 s anew against ~0.1 s from here (listing them included). Object stores are read anew
    every time. At most ``entries`` tables are kept (the oldest goes first).
    """

    def __init__(self, entries: int = 8) -> None:
        self.entries = entries
        self._tables: dict[tuple[str, str, tuple[str, ...]], tuple[Listing, pa.Table]] = {}

    def get(self, key: tuple[str, str, tuple[str, ...]], listing: Listing) -> pa.Table | None:
        """The table kept under ``key`` if it was read from the parts of ``listing``, else None."""
        kept = self._tables.get(key)
        return kept[1] if kept is not None and kept[0] == listing else None

    def put(self, key: tuple[str, str, tuple[str, ...]], listing: Listing, table: pa.Table) -> None:
        """Keep ``table``, read from the parts of ``listing``, under ``key`` (replacing what was kept)."""
        self._tables.pop(key, None)
        while self._tables and len(self._tables) >= self.entries:
            del self._tables[next(iter(self._tables))]
        self._tables[key] = (listing, table)

    def clear(self) -> None:
        """Forget every table kept."""
        self._tables.clear()


#: The process's tables read (:class:`TableCache`): what a :class:`ResultsStore` uses unless given its own.
TABLE_CACHE = TableCache()


class ResultsStore:
    """Writes and reads one search's dataset under ``root`` (local path or URI). ``cache``: where its
    reads of local tables are kept (:data:`TABLE_CACHE`, shared by the process); None: read anew."""

    def __init__(self, root: str, cache: TableCache | None = TABLE_CACHE) -> None:
        self.root = root
        self.cache = cache
        self._fs, self._path = filesystem(root)

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
        return set(self.read("trials", columns=["trial_id"])["trial_id"])

    def part_infos(self, table: str) -> list[pafs.FileInfo]:
        """The parts of ``table``, by path (none: an empty list)."""
        infos = self._fs.get_file_info(pafs.FileSelector(self._table_dir(table), allow_not_found=True))
        parts = [i for i in infos if i.base_name.startswith("part-") and i.base_name.endswith(".parquet")]
        return sorted(parts, key=lambda info: info.path)

    def part_problem(self, table: str, part: str) -> str | None:
        """Why the part at ``part`` cannot be read as table ``table``, or None if it can.

        Reads the Parquet footer only (cheap): a file that is not Parquet, is cut short, or has a
        column whose type differs from ``SCHEMAS[table]`` is unreadable. Missing columns are not a
        problem (older parts read them as null, and :mod:`dptune.records.migrations` fills them).
        """
        try:
            found = pq.read_schema(part, filesystem=self._fs)
        except (pa.ArrowException, OSError) as exc:
            first = str(exc).strip().splitlines()[0][:160] if str(exc) else "unreadable"
            return f"not a readable Parquet file ({first})"
        expected = SCHEMAS[table]
        wrong = [
            f"{field.name} is {field.type}, expected {expected.field(field.name).type}"
            for field in found
            if field.name in expected.names and not field.type.equals(expected.field(field.name).type)
        ]
        return f"its schema differs from table '{table}': {'; '.join(wrong)[:200]}" if wrong else None

    def unreadable_parts(self) -> list[tuple[str, str, str]]:
        """Every part of the dataset that cannot be read: ``(table, path, problem)``."""
        return [
            (table, info.path, problem)
            for table in TABLES
            for info in self.part_infos(table)
            if (problem := self.part_problem(table, info.path)) is not None
        ]

    def quarantine(self, table: str, part: str) -> str:
        """Move an unreadable part to ``<root>/quarantine/<table>/`` and return its new path."""
        folder = f"{self._path}/{QUARANTINE}/{table}"
        self._fs.create_dir(folder, recursive=True)
        target = f"{folder}/{posixpath.basename(part)}"
        self._fs.move(part, target)
        return target

    def read(self, table: str, columns: list[str] | None = None) -> pd.DataFrame:
        """Read one table into pandas, as the current schema (empty with the schema's columns if none).

        Rows of per-trial tables whose trial has no ``trials`` row yet (a write in progress) are
        dropped, so a search that is still running reads consistently. Rows written by an older
        dptune are migrated (:func:`dptune.records.migrations.migrate`): e.g. trials written before
        schema 3 read as their own configuration (``configuration_id = trial_id``, ``replicate = 0``).
        Raises ``RecordsError`` naming the part when one cannot be read.
        """
        parts = self.part_infos(table)  # checks the table's name
        schema = SCHEMAS[table]
        selected = list(columns or schema.names)
        if not parts:
            return schema.empty_table().select(selected).to_pandas()
        try:
            frame = self._read_parts(table, parts, columns_to_read(table, selected)).to_pandas()
        except (pa.ArrowException, OSError) as exc:
            bad = [(info.path, problem) for info in parts if (problem := self.part_problem(table, info.path))]
            if not bad:
                raise
            part, problem = bad[0]
            raise RecordsError(
                f"{part}: {problem} ({len(bad)} unreadable part(s) in table '{table}'; move "
                "them aside, or run python -m dptune.search --resume --quarantine-corrupt)"
            ) from exc
        if table not in ("trials", "search", "release") and "trial_id" in frame:
            frame = frame[frame["trial_id"].isin(self.completed_trial_ids())].reset_index(drop=True)
        return migrate(table, frame)[selected]

    def _read_parts(self, table: str, parts: list[pafs.FileInfo], columns: list[str]) -> pa.Table:
        """``columns`` of ``parts`` of ``table``, kept in :attr:`cache` (local folders only)."""
        cache = self.cache if isinstance(self._fs, pafs.LocalFileSystem) else None
        listing = tuple((info.path, info.size, info.mtime_ns) for info in parts)
        key = (self._path, table, tuple(columns))
        if cache is not None and (kept := cache.get(key, listing)) is not None:
            return kept
        paths = [info.path for info in parts]
        data = pq.ParquetDataset(paths, filesystem=self._fs, schema=SCHEMAS[table]).read(columns=columns)
        if cache is not None:
            cache.put(key, listing, data)
        return data


def part_problem(store: ResultsStore, table: str, part: str) -> str | None:
    """Why ``part`` cannot be read as ``table`` (:meth:`ResultsStore.part_problem`)."""
    return store.part_problem(table, part)


def unreadable_parts(root: str) -> list[tuple[str, str, str]]:
    """Every part of the dataset at ``root`` that cannot be read (:meth:`ResultsStore.unreadable_parts`)."""
    return ResultsStore(root).unreadable_parts()


def quarantine_part(root: str, table: str, part: str) -> str:
    """Move an unreadable part of the dataset at ``root`` aside (:meth:`ResultsStore.quarantine`)."""
    return ResultsStore(root).quarantine(table, part)


def read_table(root: str, table: str, columns: list[str] | None = None) -> pd.DataFrame:
    """Read one table of the results dataset at ``root`` into pandas, as the current schema
    (:meth:`ResultsStore.read`)."""
    return ResultsStore(root).read(table, columns)
