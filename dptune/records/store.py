"""Writing and reading a results dataset: atomic parts, compacted files, consistent reads, quarantine.

A per-trial table (``trials``, ``epochs``, ``classes``, ``diagnostics``) is a folder of two kinds of file:

- *single parts* ``part-<trial_id>.parquet``, each one trial's rows, written as the trial finishes;
- *compacted files* ``part-c-<seq>-<tag>.parquet`` (``seq``: 12 decimal digits, ``tag``: 32 hex digits),
  each many trials' rows sorted by trial id, written by :mod:`dptune.records.compaction` before it
  deletes the files it merged.

Invariants:
- Every file is written whole or not at all: local files go to a temporary name in the same
  folder and are renamed (atomic on POSIX); object stores publish a single PUT atomically.
- A trial's ``trials`` part is written last, so its presence means every other table of that
  trial is complete; readers keep only rows whose trial has a ``trials`` row.
- Precedence (:meth:`ResultsStore.read_plan`): a trial's rows in a table come from exactly one file: its
  single part when it has one, else the newest compacted file (by ``(seq, tag)``) that holds it. So a
  trial written again replaces its rows, and a file merged but not yet deleted shows nothing twice.
- Parts are keyed by trial id, so writing the same trial twice replaces it: a resumed search
  never shows a trial twice.
- Every read is of the current schema: parts written by an older dptune are migrated where they are
  read (:meth:`ResultsStore.read`, by :mod:`dptune.records.migrations`), and nowhere else.
"""

from __future__ import annotations

import contextlib
import posixpath
import re
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dptune.paths import filesystem
from dptune.records.migrations import columns_to_read, migrate
from dptune.records.schemas import SCHEMAS, TABLES, RecordsError

#: Where ``quarantine_part`` moves unreadable parts: ``<root>/quarantine/<table>/part-*.parquet``
#: (outside every table folder, so readers never see them again).
QUARANTINE = "quarantine"


#: The tables with one single part per trial, which compaction merges (``search`` and ``release`` have a
#: part per search and are never compacted).
PER_TRIAL_TABLES = ("trials", "epochs", "classes", "diagnostics")

#: The name of a compacted file: ``part-c-<seq>-<tag>.parquet``; a newer file has a greater ``(seq, tag)``.
COMPACTED_NAME = re.compile(r"part-c-(?P<seq>\d{12})-(?P<tag>[0-9a-f]{32})\.parquet")

#: The key of a compacted file's footer metadata holding its rows' size in memory (bytes, as written).
DATA_BYTES_KEY = b"dptune.data_bytes"


def compacted_name(seq: int) -> str:
    """A new compacted file's name at sequence number ``seq`` (a fresh random tag breaks ties)."""
    return f"part-c-{seq:012d}-{uuid.uuid4().hex}.parquet"


def _order(info: pafs.FileInfo) -> tuple[int, str]:
    """A compacted file's place, oldest first: ``(seq, tag)`` of its name."""
    match = COMPACTED_NAME.fullmatch(info.base_name)
    assert match is not None, info.path
    return int(match["seq"]), match["tag"]


@dataclass(frozen=True)
class TableFiles:
    """One table's files as listed: ``singles`` (``part-<key>.parquet``) by key, ``compacted`` oldest first."""

    singles: Mapping[str, pafs.FileInfo]
    compacted: tuple[pafs.FileInfo, ...]

    @property
    def infos(self) -> list[pafs.FileInfo]:
        """Every file, by path."""
        return sorted([*self.singles.values(), *self.compacted], key=lambda info: info.path)

    def next_seq(self) -> int:
        """The sequence number of a file newer than every compacted file listed (1 when there is none)."""
        return 1 + max((_order(info)[0] for info in self.compacted), default=0)


@dataclass(frozen=True)
class FileIndex:
    """What a compacted file holds: its ``trial_ids`` and ``data_bytes``, its rows' size in memory as written."""

    trial_ids: frozenset[str]
    data_bytes: int


#: The index of every compacted file read, by (path, size, mtime in ns): compacted files are never
#: rewritten in place, so an entry is valid as long as its file is listed the same. At most this many.
_INDEX_ENTRIES = 4096
_INDEX: dict[tuple[str, int, int], FileIndex] = {}


#: Listings a read takes at most when files it listed are deleted meanwhile (compactions elsewhere).
RELISTS = 5

T = TypeVar("T")

#: Which trials of a file a read keeps: None for all of them.
ReadPlan = list[tuple[pafs.FileInfo, frozenset[str] | None]]


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
        self.write_file(table, f"part-{key}.parquet", pa.Table.from_pylist(list(rows), schema=SCHEMAS[table]))

    def write_file(self, table: str, name: str, data: pa.Table, **options: Any) -> str:
        """Write ``data`` (of ``SCHEMAS[table]``) as ``<table>/<name>`` atomically; ``options`` go to
        ``pq.write_table`` (row group size, footer metadata). Returns the file's path."""
        directory = self._table_dir(table)
        self._fs.create_dir(directory, recursive=True)
        final = f"{directory}/{name}"
        if isinstance(self._fs, pafs.LocalFileSystem):
            temporary = f"{directory}/.tmp-{uuid.uuid4().hex}-{name}"
            try:
                pq.write_table(data, temporary, filesystem=self._fs, **options)
                self._fs.move(temporary, final)  # os.rename: atomic within one folder
            except BaseException:  # a full disk: leave no half-written temporary behind
                with contextlib.suppress(Exception):
                    self._fs.delete_file(temporary)
                raise
        else:
            pq.write_table(data, final, filesystem=self._fs, **options)
        return final

    def read_files(self, table: str, paths: list[str]) -> pa.Table:
        """Every row and column of the files at ``paths`` of ``table``, in their order, as ``SCHEMAS[table]``
        (a column a file lacks reads as null)."""
        return pq.ParquetDataset(paths, filesystem=self._fs, schema=SCHEMAS[table]).read()

    def delete_files(self, paths: Iterable[str]) -> None:
        """Delete files of the dataset; one already gone (another process deleted it) is no error."""
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                self._fs.delete_file(path)

    def write_trial(self, rows_by_table: Mapping[str, list[dict[str, Any]]], trial_id: str) -> None:
        """Write a trial's rows; the ``trials`` part goes last and marks the trial complete."""
        for table, rows in rows_by_table.items():
            if table != "trials":
                self.write_part(table, trial_id, rows)
        self.write_part("trials", trial_id, rows_by_table["trials"])

    def has_trial(self, trial_id: str) -> bool:
        """Whether the trial has a ``trials`` row (its single part, or a compacted file holding it)."""
        info = self._fs.get_file_info(f"{self._table_dir('trials')}/part-{trial_id}.parquet")
        return info.type == pafs.FileType.File or trial_id in self.completed_trial_ids()

    def completed_trial_ids(self) -> set[str]:
        """Ids of trials with a ``trials`` row (they are complete): one listing of the ``trials`` folder (its
        single parts' names) and the trial ids of its few compacted files (:meth:`file_index`, read once
        per file and process). Never opens a single part."""
        return self._on_listing("trials", self._completed)

    def _completed(self, files: TableFiles) -> set[str]:
        """The trial ids of the ``trials`` files ``files``."""
        ids = set(files.singles)
        for info in files.compacted:
            ids |= self.file_index("trials", info).trial_ids
        return ids

    def _on_listing(self, table: str, action: Callable[[TableFiles], T]) -> T:
        """``action`` on a listing of ``table``; listed again (at most :data:`RELISTS` times) when it fails and
        a file it listed is gone: a compaction elsewhere deleted it, once what replaces it was written."""
        files = self.table_files(table)
        for _ in range(RELISTS):
            try:
                return action(files)
            except (pa.ArrowException, OSError, RecordsError):
                again = self.table_files(table)
                if {info.path for info in files.infos} <= {info.path for info in again.infos}:
                    raise
                files = again
        return action(files)

    def part_infos(self, table: str) -> list[pafs.FileInfo]:
        """The files of ``table`` (single parts and compacted files), by path (none: an empty list)."""
        return self.table_files(table).infos

    def table_files(self, table: str) -> TableFiles:
        """The files of ``table`` from one listing of its folder (none: empty)."""
        infos = self._fs.get_file_info(pafs.FileSelector(self._table_dir(table), allow_not_found=True))
        singles, compacted = {}, []
        for info in infos:
            name = info.base_name
            if COMPACTED_NAME.fullmatch(name):
                compacted.append(info)
            elif name.startswith("part-") and name.endswith(".parquet"):
                singles[name[len("part-") : -len(".parquet")]] = info
        return TableFiles(singles, tuple(sorted(compacted, key=_order)))

    def file_index(self, table: str, info: pafs.FileInfo) -> FileIndex:
        """The trial ids a compacted file of ``table`` holds (its ``trial_id`` column only, and its
        footer), kept for the process. Raises ``RecordsError`` naming the file when it cannot be read."""
        key = (info.path, info.size, info.mtime_ns)
        if (kept := _INDEX.get(key)) is not None:
            return kept
        try:
            with self._fs.open_input_file(info.path) as source:
                parquet = pq.ParquetFile(source)
                ids = parquet.read(columns=["trial_id"]).column("trial_id").unique().to_pylist()
                metadata = parquet.schema_arrow.metadata or {}
        except (pa.ArrowException, OSError) as exc:
            if (problem := self._unreadable(table, [info])) is None:
                raise
            raise problem from exc
        index = FileIndex(frozenset(ids), int(metadata.get(DATA_BYTES_KEY, b"0")))
        while len(_INDEX) >= _INDEX_ENTRIES:
            del _INDEX[next(iter(_INDEX))]
        _INDEX[key] = index
        return index

    def read_plan(self, table: str, files: TableFiles, singles_win: bool = True) -> ReadPlan:
        """Which rows of which file a read of ``table`` takes: each file with the trials kept from it (None:
        all of them; a file none of whose trials is kept is left out), so that every trial's rows come from
        one file: its single part (unless not ``singles_win``: compaction merging compacted files), else the
        newest compacted file holding it. Compacted files first, oldest first, then single parts by key."""
        claimed = set(files.singles) if singles_win else set()
        plan: ReadPlan = []
        for info in reversed(files.compacted):
            ids = self.file_index(table, info).trial_ids
            if not ids.isdisjoint(claimed):
                if kept := ids - claimed:
                    plan.append((info, frozenset(kept)))
            else:
                plan.append((info, None))
            claimed |= ids
        plan.reverse()
        return plan + [(files.singles[key], None) for key in sorted(files.singles)] if singles_win else plan

    def _restricted(self, table: str, files: TableFiles, plan: ReadPlan, trial_ids: frozenset[str]) -> ReadPlan:
        """``plan`` with each file's trials narrowed to ``trial_ids`` (a single part holds its key's; a
        compacted file those of its index), and the files left with none dropped."""
        key_of = {info.path: key for key, info in files.singles.items()}
        narrowed: ReadPlan = []
        for info, keep in plan:
            held = keep
            if held is None:
                held = frozenset({key_of[info.path]}) if info.path in key_of else self.file_index(table, info).trial_ids
            if wanted := held & trial_ids:
                narrowed.append((info, frozenset(wanted)))
        return narrowed

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
        """Every file of the dataset that cannot be read: ``(table, path, problem)``. One footer per file
        that exists: after compaction, a few per table whatever the number of trials."""
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

    def read(
        self, table: str, columns: list[str] | None = None, trial_ids: Collection[str] | None = None
    ) -> pd.DataFrame:
        """Read one table into pandas, as the current schema (empty with the schema's columns if none).

        Only ``columns`` are read (and those their migrations and the trial filter need); of a per-trial
        table, only the rows of ``trial_ids`` when given (the files holding none of them are not opened, and
        a compacted file's row groups are skipped by their trial-id statistics), so memory follows the
        rows asked, not the table. Each trial's rows
        come from one file (:meth:`read_plan`); a per-trial table's rows are sorted by trial id (stable: in
        the order written within a trial), whatever files hold them. Rows of per-trial tables whose trial has
        no ``trials`` row yet (a write in progress) are dropped, so a search that is still running reads
        consistently. Rows written by an older dptune are migrated (:func:`dptune.records.migrations.migrate`):
        e.g. trials written before schema 3 read as their own configuration (``configuration_id = trial_id``,
        ``replicate = 0``). Raises ``RecordsError`` naming the part when one cannot be read.
        """
        self._table_dir(table)  # checks the table's name
        schema = SCHEMAS[table]
        selected = list(columns or schema.names)
        per_trial = table in PER_TRIAL_TABLES
        wanted = columns_to_read(table, selected)
        wanted += ["trial_id"] if per_trial and "trial_id" not in wanted else []
        only = frozenset(trial_ids) if trial_ids is not None and per_trial else None
        data = self._on_listing(table, lambda files: self._read_listed(table, files, wanted, only))
        if per_trial and table != "trials":
            data = data.filter(pc.is_in(data["trial_id"], pa.array(sorted(self.completed_trial_ids()), pa.string())))
        if not data.num_rows:
            return schema.empty_table().select(selected).to_pandas()
        return migrate(table, data.to_pandas())[selected]

    def _read_listed(
        self, table: str, files: TableFiles, columns: list[str], trial_ids: frozenset[str] | None
    ) -> pa.Table:
        """:meth:`_read_files`; a failure names the first unreadable file (``RecordsError``) when there is one."""
        try:
            return self._read_files(table, files, columns, trial_ids)
        except (pa.ArrowException, OSError) as exc:
            if (problem := self._unreadable(table, files.infos)) is None:
                raise
            raise problem from exc

    def _unreadable(self, table: str, infos: list[pafs.FileInfo]) -> RecordsError | None:
        """Why a read of ``infos`` failed: a ``RecordsError`` naming the first unreadable file, or None."""
        bad = [(info.path, problem) for info in infos if (problem := self.part_problem(table, info.path))]
        if not bad:
            return None
        part, problem = bad[0]
        return RecordsError(
            f"{part}: {problem} ({len(bad)} unreadable part(s) in table '{table}'; move "
            "them aside, or run python -m dptune.search --resume --quarantine-corrupt)"
        )

    def _read_files(
        self, table: str, files: TableFiles, columns: list[str], trial_ids: frozenset[str] | None = None
    ) -> pa.Table:
        """``columns`` of ``table`` as :meth:`read_plan` takes them (only ``trial_ids``' rows when given), kept
        in :attr:`cache` (local folders only, whole tables only)."""
        cache = self.cache if isinstance(self._fs, pafs.LocalFileSystem) and trial_ids is None else None
        listing = tuple((info.path, info.size, info.mtime_ns) for info in files.infos)
        key = (self._path, table, tuple(columns))
        if cache is not None and (kept := cache.get(key, listing)) is not None:
            return kept
        schema = SCHEMAS[table]
        if not files.infos:
            return schema.empty_table().select(columns)
        plan: ReadPlan = self.read_plan(table, files) if table in PER_TRIAL_TABLES else [(i, None) for i in files.infos]
        if trial_ids is not None:
            plan = self._restricted(table, files, plan, trial_ids)
        whole = [info.path for info, keep in plan if keep is None]
        pieces = [pq.ParquetDataset(whole, filesystem=self._fs, schema=schema).read(columns=columns)] if whole else []
        for info, keep in plan:
            if keep is not None:
                only = ds.field("trial_id").isin(pa.array(sorted(keep), pa.string()))
                dataset = pq.ParquetDataset([info.path], filesystem=self._fs, schema=schema, filters=only)
                pieces.append(dataset.read(columns=columns))
        data = pa.concat_tables(pieces) if pieces else schema.empty_table().select(columns)
        if table in PER_TRIAL_TABLES:
            data = data.take(pc.sort_indices(data, [("trial_id", "ascending")]))
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
