"""A data owner's own dataset file (:class:`dptune.contract.DatasetFile`): read, checked, as a :class:`RawDataset`.

Formats (``DatasetFile.format``, ``auto`` by suffix): ``csv``, ``tsv``, ``jsonl`` and ``parquet``,
read with pyarrow, only the two named columns. The input column holds texts (strings: the
``text`` modality, encoded by a text backbone) or embeddings (lists of floats of one length: the
``features`` modality, trained on as they are with backbone ``none``). Labels are ints or strings;
the classes are their distinct values in sorted order (names kept), shared by the test file.

Every check raises :class:`WorkloadError` naming the file, the column or row and what is allowed:
missing file or column, an unknown format, unreadable rows, missing labels, fewer than 2 classes,
a class with fewer than :data:`MIN_ROWS_PER_CLASS` rows, empty texts, NaN or ragged embeddings, a
test file whose input kind or classes differ. The fingerprint (sha256 of the files' bytes, the
format and the columns) keys the feature cache and is recorded, so a changed file is never served
stale features. A file is read once per process per (path, size, mtime).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from dptune.contract import DATASET_FORMATS, DatasetFile
from dptune.data.sources import DatasetInfo, RawDataset, file_digest
from dptune.data.spec import WorkloadError

#: The suffixes ``format: auto`` recognises.
SUFFIX_FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
#: Fewest rows of a class: one to train on and one that the validation or test split may take.
MIN_ROWS_PER_CLASS = 2


def file_format(path: str, declared: str) -> str:
    """The format of ``path``: ``declared``, or by suffix under ``auto``."""
    if declared not in DATASET_FORMATS:
        raise WorkloadError(f"task.dataset.format {declared!r}: choose one of {list(DATASET_FORMATS)}")
    if declared != "auto":
        return declared
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        raise WorkloadError(
            f"task.dataset.path {path}: cannot tell the format from the suffix {suffix!r}; "
            f"name one with task.dataset.format ({', '.join(DATASET_FORMATS[1:])}) or use a suffix of "
            f"{sorted(SUFFIX_FORMATS)}"
        )
    return SUFFIX_FORMATS[suffix]


def dataset_file_info(source: DatasetFile) -> DatasetInfo:
    """The registry-like entry of ``source``: reads and checks the file (once per process per version)."""
    raw = read_dataset_file(source)
    return DatasetInfo(
        name=raw.name,
        modality=raw.modality,
        num_classes=len(raw.class_names),
        load=lambda root, image_size: read_dataset_file(source),
        source=source.path,
        official_test_split=source.test_path is not None and source.test_public,
    )


def read_dataset_file(source: DatasetFile) -> RawDataset:
    """Every row of ``source`` (training file first, then the test file if any) as a :class:`RawDataset`."""
    paths = [source.path] + ([source.test_path] if source.test_path is not None else [])
    stamps = []
    for key, path in zip(("path", "test_path"), paths, strict=False):
        if not os.path.isfile(path):
            raise WorkloadError(f"task.dataset.{key} {path}: no such file")
        stat = os.stat(path)
        stamps.append((stat.st_size, stat.st_mtime_ns))
    return _read(source, tuple(stamps))


@functools.lru_cache(maxsize=8)
def _read(source: DatasetFile, stamps: tuple[tuple[int, int], ...]) -> RawDataset:
    train_inputs, train_labels = _columns(source, source.path)
    inputs, labels = train_inputs, train_labels
    if source.test_path is not None:
        test_inputs, test_labels = _columns(source, source.test_path)
        if isinstance(train_inputs, list) and isinstance(test_inputs, list):
            inputs = train_inputs + test_inputs
        elif isinstance(train_inputs, np.ndarray) and isinstance(test_inputs, np.ndarray):
            if test_inputs.shape[1] != train_inputs.shape[1]:
                raise WorkloadError(
                    f"task.dataset.test_path {source.test_path}: embeddings of length {test_inputs.shape[1]}, the "
                    f"training file's have {train_inputs.shape[1]}"
                )
            inputs = np.concatenate([train_inputs, test_inputs])
        else:
            raise WorkloadError(
                f"task.dataset.test_path {source.test_path}: column {source.input_column!r} holds "
                f"{_kind(test_inputs)}, the training file's holds {_kind(train_inputs)}"
            )
        unknown = sorted(set(test_labels) - set(train_labels), key=str)
        if unknown:
            raise WorkloadError(
                f"task.dataset.test_path {source.test_path}: labels {unknown[:5]} do not occur in the training "
                f"file {source.path}; a test file has the training file's classes"
            )
        labels = train_labels + test_labels
    class_values = sorted(set(train_labels), key=lambda v: (isinstance(v, str), v))
    if len(class_values) < 2:
        raise WorkloadError(
            f"task.dataset {source.path}: column {source.label_column!r} has {len(class_values)} class; a classifier "
            "needs at least 2"
        )
    index = {value: i for i, value in enumerate(class_values)}
    ids = np.array([index[value] for value in labels], dtype=np.int64)
    counts = np.bincount(ids[: len(train_labels)], minlength=len(class_values))
    small = [str(class_values[c]) for c in np.flatnonzero(counts < MIN_ROWS_PER_CLASS)]
    if small:
        raise WorkloadError(
            f"task.dataset {source.path}: class(es) {small[:5]} of column {source.label_column!r} have fewer than "
            f"{MIN_ROWS_PER_CLASS} rows, too few to split into training and validation"
        )
    digest = hashlib.sha256(
        file_digest(*map(Path, [source.path, *([source.test_path] if source.test_path else [])])).encode()
    )
    digest.update(f"{file_format(source.path, source.format)}|{source.input_column}|{source.label_column}".encode())
    return RawDataset(
        name=source.display_name,
        modality="text" if isinstance(inputs, list) else "features",
        class_names=[str(value) for value in class_values],
        inputs=inputs,
        labels=ids,
        num_official_train=len(train_labels) if source.test_path is not None else None,
        fingerprint=digest.hexdigest(),
    )


def _kind(inputs: list[str] | np.ndarray) -> str:
    return "texts" if isinstance(inputs, list) else "embeddings"


def _table(source: DatasetFile, path: str) -> Any:
    """The two columns of ``path`` as a pyarrow Table (every other column is never read)."""
    return read_columns(path, source.format, [source.input_column, source.label_column])


def read_columns(path: str, declared: str, wanted: list[str], *, every_column: bool = False) -> Any:
    """Columns ``wanted`` (``every_column``: all of them, ``wanted`` checked to be there) of the
    ``declared`` (or ``auto``: by suffix) format file ``path`` as a pyarrow Table, read with pyarrow;
    :class:`WorkloadError` naming a missing column or an unreadable file."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    kind = file_format(path, declared)
    try:
        if kind == "parquet":
            names = pq.read_schema(path).names
            _check_columns(path, wanted, names)
            return pq.read_table(path, columns=None if every_column else wanted)
        if kind == "jsonl":
            table = pajson.read_json(path)
            _check_columns(path, wanted, table.column_names)
            return table if every_column else table.select(wanted)
        parse = pacsv.ParseOptions(delimiter="\t" if kind == "tsv" else ",", newlines_in_values=True)
        names = pacsv.open_csv(path, parse_options=parse).schema.names
        _check_columns(path, wanted, names)
        convert = pacsv.ConvertOptions(include_columns=None if every_column else wanted)
        return pacsv.read_csv(path, parse_options=parse, convert_options=convert)
    except pa.ArrowInvalid as error:
        raise WorkloadError(f"{path}: unreadable as {kind} ({error})") from None


def _check_columns(path: str, wanted: list[str], names: list[str]) -> None:
    roles = ("task.dataset.input_column", "task.dataset.label_column") if len(wanted) == 2 else ("column",)
    for role, column in zip(roles, wanted, strict=True):
        if column not in names:
            raise WorkloadError(f"{role} {column!r} is not a column of {path}; its columns: {names}")


def _columns(source: DatasetFile, path: str) -> tuple[list[str] | np.ndarray, list[int | str]]:
    """(inputs, labels) of ``path``: texts as a list, embeddings as float32 ``(n, d)``; labels as values."""
    import pyarrow as pa

    table = _table(source, path)
    if table.num_rows == 0:
        raise WorkloadError(f"task.dataset {path}: no rows")
    label = table.column(source.label_column)
    if label.null_count:
        row = int(np.flatnonzero(label.is_null().to_numpy(zero_copy_only=False))[0])
        raise WorkloadError(f"task.dataset {path}: row {row} has no {source.label_column!r} (labels must be set)")
    if not (pa.types.is_integer(label.type) or pa.types.is_string(label.type) or pa.types.is_large_string(label.type)):
        raise WorkloadError(
            f"task.dataset.label_column {source.label_column!r} of {path} holds {label.type}; "
            "labels are ints or strings"
        )
    labels = label.to_pylist()
    column = table.column(source.input_column)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        texts = column.to_pylist()
        empty = [row for row, text in enumerate(texts) if text is None or not text.strip()]
        if empty:
            raise WorkloadError(
                f"task.dataset {path}: row {empty[0]} has an empty {source.input_column!r} "
                f"({len(empty)} empty in all); every text must be non-empty"
            )
        return texts, labels
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        if not (pa.types.is_floating(column.type.value_type) or pa.types.is_integer(column.type.value_type)):
            raise WorkloadError(
                f"task.dataset.input_column {source.input_column!r} of {path} holds lists of "
                f"{column.type.value_type}; an embedding is a list of numbers"
            )
        rows = column.to_pylist()
        lengths = np.array([-1 if row is None else len(row) for row in rows])
        ragged = np.flatnonzero(lengths != lengths[0])
        if lengths[0] < 1 or len(ragged):
            bad = int(ragged[0]) if len(ragged) else 0
            raise WorkloadError(
                f"task.dataset {path}: row {bad} of {source.input_column!r} has {max(int(lengths[bad]), 0)} numbers, "
                f"row 0 has {int(lengths[0])}; every embedding has one length ≥ 1"
            )
        values = np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=np.float32)
        finite = np.isfinite(values).all(axis=1)
        if not finite.all():
            raise WorkloadError(
                f"task.dataset {path}: row {int(np.flatnonzero(~finite)[0])} of {source.input_column!r} holds NaN, "
                "infinity or a missing number; embeddings must be finite"
            )
        return values, labels
    raise WorkloadError(
        f"task.dataset.input_column {source.input_column!r} of {path} holds {column.type}; it holds texts (strings) "
        "or embeddings (lists of numbers)"
    )
