"""A data owner's own dataset (:class:`dptune.contract.DatasetFile`): read, checked, as a :class:`RawDataset`.

Formats (``DatasetFile.format``, ``auto`` by suffix, or for a folder by its content):

- ``csv``, ``tsv``, ``jsonl`` and ``parquet``, read with pyarrow, only the two named columns (a csv or
  tsv file split at ``DatasetFile.sep``, by default ``,`` or a tab);
- ``hf_disk``, a Hugging Face dataset saved with ``save_to_disk`` (``datasets.load_from_disk``,
  memory-mapped), the two named columns; a ``ClassLabel`` label column keeps its class names;
- ``imagefolder``, torchvision's layout ``<path>/<class>/<image>``: every image file (torchvision's
  suffixes; hidden files and others are skipped) is a row, its folder's name its label. Each image's
  header is read here (a file that is no image is refused by name); pixels are read when encoded.

The input column holds texts (strings: the ``text`` modality, encoded by a text backbone), image
paths (strings that all end in an image suffix, relative to the table's folder: the ``image``
modality, each header read here as in an image folder) or embeddings (lists of floats of one length:
the ``features`` modality, trained on as they are with backbone ``none``). Labels are ints or
strings; the classes are their distinct values in sorted order (names kept), shared by the test
file. A path may be an object-store URI (:mod:`dptune.data.remote`: copied once into the cache;
a table of image paths is read from local files only, as its images are not copied).

Every check raises :class:`WorkloadError` naming the file, the column or row and what is allowed:
missing file or column, an unknown format, unreadable rows or images, missing labels (null, NaN, blank
or ``nan``: the rows named, to drop or fill), fewer than 2 classes, a class with fewer than
:data:`MIN_ROWS_PER_CLASS` rows, empty texts, NaN or ragged embeddings, a test file whose input kind
or classes differ. The fingerprint (sha256 of the files' bytes, for an image folder of its listing:
each image's path, size and modification time, plus the format, the columns and any ``sep``) keys the
feature cache and is recorded, so a changed file is never served stale features. A dataset is read
once per process per version (the same listing).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dptune.contract import DATASET_FORMATS, DELIMITED_FORMATS, DatasetFile
from dptune.data.remote import local_copy
from dptune.data.sources import FOLDER_IMAGE_SIZE, DatasetInfo, ImageFiles, RawDataset, file_digest
from dptune.data.spec import WorkloadError

#: The suffixes ``format: auto`` recognises for a file.
SUFFIX_FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
#: The formats whose ``path`` is a folder.
FOLDER_FORMATS = ("imagefolder", "hf_disk")
#: The files of an image folder that are images (torchvision's ``IMG_EXTENSIONS``).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: Fewest rows of a class: one to train on and one that the validation or test split may take.
MIN_ROWS_PER_CLASS = 2
#: Delimiters a csv or tsv file's one-column header is searched for, to hint at ``task.dataset.sep``.
LIKELY_DELIMITERS = (",", ";", "\t", "|")

#: A dataset's inputs as read: texts, image files, or embeddings ``(n, d)`` float32.
Inputs = list[str] | list[Path] | np.ndarray


def file_format(path: str, declared: str) -> str:
    """The format of the local ``path``: ``declared``, or under ``auto`` by suffix (a file) or by
    content (a folder: ``hf_disk`` if it holds a ``save_to_disk`` dataset, else ``imagefolder``)."""
    if declared not in DATASET_FORMATS:
        raise WorkloadError(f"task.dataset.format {declared!r}: choose one of {list(DATASET_FORMATS)}")
    if declared != "auto":
        return declared
    if os.path.isdir(path):
        marks = ("state.json", "dataset_dict.json", "dataset_info.json")
        return "hf_disk" if any(os.path.isfile(os.path.join(path, mark)) for mark in marks) else "imagefolder"
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        raise WorkloadError(
            f"task.dataset.path {path}: cannot tell the format from the suffix {suffix!r}; "
            f"name one with task.dataset.format ({', '.join(DATASET_FORMATS[1:])}) or use a suffix of "
            f"{sorted(SUFFIX_FORMATS)}"
        )
    return SUFFIX_FORMATS[suffix]


def dataset_file_info(source: DatasetFile) -> DatasetInfo:
    """The registry-like entry of ``source``: reads and checks it (once per process per version).

    Its ``load(root, image_size)`` sizes an image folder's images to the backbone's ``image_size``."""
    raw = read_dataset_file(source)
    return DatasetInfo(
        name=raw.name,
        modality=raw.modality,
        num_classes=len(raw.class_names),
        load=lambda root, image_size: _sized(read_dataset_file(source), image_size),
        source=source.path,
        official_test_split=source.test_path is not None and source.test_public,
    )


def _sized(raw: RawDataset, image_size: int | None) -> RawDataset:
    if not isinstance(raw.inputs, ImageFiles) or image_size in (None, raw.inputs.size):
        return raw
    return dataclasses.replace(raw, inputs=ImageFiles(raw.inputs.files, image_size))


def read_dataset_file(source: DatasetFile) -> RawDataset:
    """Every row of ``source`` (training file first, then the test file if any) as a :class:`RawDataset`.

    A URI is read from its local copy (:func:`dptune.data.remote.local_copy`); messages name the URI."""
    keys = ("path", "test_path") if source.test_path is not None else ("path",)
    given = [getattr(source, key) for key in keys]
    local = [local_copy(location, f"task.dataset.{key}") for key, location in zip(keys, given, strict=True)]
    try:
        kind = file_format(local[0], source.format)
        if source.sep is not None and kind not in DELIMITED_FORMATS:
            raise WorkloadError(
                f"task.dataset.sep {source.sep!r}: applies to csv and tsv files; {local[0]} is {kind}: drop sep"
            )
        stamps = tuple(_stamp(key, path, kind) for key, path in zip(keys, local, strict=True))
        return _read(source, tuple(local), kind, stamps)
    except WorkloadError as error:
        message = str(error)
        for uri, path in zip(given, local, strict=True):
            message = message.replace(path, uri)
        raise WorkloadError(message) from None


def _stamp(key: str, path: str, kind: str) -> tuple[Any, ...]:
    """What changes when the file or folder ``path`` changes: (size, mtime) of a file, a folder's listing."""
    if kind in FOLDER_FORMATS:
        if not os.path.isdir(path):
            raise WorkloadError(f"task.dataset.{key} {path}: no such folder (a {kind} dataset is a folder)")
        return tuple(_listing(path))
    if not os.path.isfile(path):
        raise WorkloadError(f"task.dataset.{key} {path}: no such file")
    stat = os.stat(path)
    return (stat.st_size, stat.st_mtime_ns)


def _listing(folder: str) -> list[tuple[str, int, int]]:
    """(path relative to ``folder``, size, mtime ns) of every file below ``folder``, sorted."""
    listing = []
    for parent, folders, files in os.walk(folder):
        folders.sort()
        for name in sorted(files):
            stat = os.stat(os.path.join(parent, name))
            listing.append((os.path.relpath(os.path.join(parent, name), folder), stat.st_size, stat.st_mtime_ns))
    return listing


@functools.lru_cache(maxsize=8)
def _read(source: DatasetFile, paths: tuple[str, ...], kind: str, stamps: tuple[Any, ...]) -> RawDataset:
    (train_inputs, train_labels, names), *test = (_columns(source, path, kind) for path in paths)
    inputs, labels = train_inputs, train_labels
    if test:
        ((test_inputs, test_labels, _),) = test
        test_path = paths[1]
        if _kind(test_inputs) != _kind(train_inputs):
            raise WorkloadError(
                f"task.dataset.test_path {test_path}: holds {_kind(test_inputs)}, the training "
                f"{'folder' if kind in FOLDER_FORMATS else 'file'}'s holds {_kind(train_inputs)}"
            )
        if isinstance(train_inputs, np.ndarray) and isinstance(test_inputs, np.ndarray):
            if test_inputs.shape[1] != train_inputs.shape[1]:
                raise WorkloadError(
                    f"task.dataset.test_path {test_path}: embeddings of length {test_inputs.shape[1]}, the "
                    f"training file's have {train_inputs.shape[1]}"
                )
            inputs = np.concatenate([train_inputs, test_inputs])
        else:
            inputs = [*train_inputs, *test_inputs]
        unknown = sorted(set(test_labels) - set(train_labels), key=str)
        if unknown:
            raise WorkloadError(
                f"task.dataset.test_path {test_path}: labels {unknown[:5]} do not occur in the training "
                f"file {paths[0]}; a test file has the training file's classes"
            )
        labels = train_labels + test_labels
    class_values = sorted(set(train_labels), key=lambda v: (isinstance(v, str), v))
    label_column = "the class folders" if kind == "imagefolder" else f"column {source.label_column!r}"
    if len(class_values) < 2:
        raise WorkloadError(
            f"task.dataset {paths[0]}: {label_column} has {len(class_values)} class; a classifier needs at least 2"
        )
    index = {value: i for i, value in enumerate(class_values)}
    ids = np.array([index[value] for value in labels], dtype=np.int64)
    counts = np.bincount(ids[: len(train_labels)], minlength=len(class_values))
    small = [str(class_values[c]) for c in np.flatnonzero(counts < MIN_ROWS_PER_CLASS)]
    if small:
        raise WorkloadError(
            f"task.dataset {paths[0]}: class(es) {small[:5]} of {label_column} have fewer than "
            f"{MIN_ROWS_PER_CLASS} rows, too few to split into training and validation"
        )
    digest = hashlib.sha256(repr(stamps).encode() if kind == "imagefolder" else _bytes_digest(paths).encode())
    if _kind(inputs) == "images" and kind != "imagefolder":  # a table of image paths: the images' listing too
        stats = [(str(file), os.stat(file).st_size, os.stat(file).st_mtime_ns) for file in inputs]
        digest.update(repr(stats).encode())
    digest.update(f"{kind}|{source.input_column}|{source.label_column}".encode())
    if source.sep is not None:  # files read with another delimiter (None keeps the digests made before sep)
        digest.update(f"|sep={source.sep}".encode())
    return RawDataset(
        name=source.display_name,
        modality={"texts": "text", "images": "image", "embeddings": "features"}[_kind(inputs)],  # type: ignore[arg-type]
        class_names=[names[value] if names else str(value) for value in class_values],  # type: ignore[index]
        inputs=ImageFiles(inputs, FOLDER_IMAGE_SIZE) if _kind(inputs) == "images" else inputs,  # type: ignore[arg-type]
        labels=ids,
        num_official_train=len(train_labels) if source.test_path is not None else None,
        fingerprint=digest.hexdigest(),
    )


def _bytes_digest(paths: tuple[str, ...]) -> str:
    """sha256 of the bytes of the files ``paths`` and, for a folder, of every file below it (sorted)."""
    files: list[Path] = []
    for path in paths:
        files += [Path(path, name) for name, _, _ in _listing(path)] if os.path.isdir(path) else [Path(path)]
    return file_digest(*files)


def _kind(inputs: Inputs) -> str:
    if isinstance(inputs, np.ndarray):
        return "embeddings"
    return "images" if inputs and isinstance(inputs[0], Path) else "texts"


def read_columns(
    path: str, declared: str, wanted: list[str], *, every_column: bool = False, sep: str | None = None
) -> Any:
    """Columns ``wanted`` (``every_column``: all of them, ``wanted`` checked to be there) of the
    ``declared`` (or ``auto``: by suffix) format file ``path`` as a pyarrow Table, read with pyarrow
    (a csv or tsv file split at ``sep``, None: ``,`` or a tab); :class:`WorkloadError` naming a missing
    column (with a hint at ``sep`` when a delimited file's header is one column holding a likely
    delimiter) or an unreadable file."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    kind = file_format(path, declared)
    if kind == "imagefolder":
        raise WorkloadError(f"{path}: an image folder has no columns; give a csv, tsv, jsonl, parquet or hf_disk table")
    try:
        if kind == "hf_disk":
            return _saved_dataset(path, wanted, every_column).with_format("arrow")[:]
        if kind == "parquet":
            names = pq.read_schema(path).names
            _check_columns(path, wanted, names)
            return pq.read_table(path, columns=None if every_column else wanted)
        if kind == "jsonl":
            table = pajson.read_json(path)
            _check_columns(path, wanted, table.column_names)
            return table if every_column else table.select(wanted)
        delimiter = sep or ("\t" if kind == "tsv" else ",")
        parse = pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
        names = pacsv.open_csv(path, parse_options=parse).schema.names
        _check_columns(path, wanted, names, _delimiter_hint(names, delimiter))
        convert = pacsv.ConvertOptions(include_columns=None if every_column else wanted)
        return pacsv.read_csv(path, parse_options=parse, convert_options=convert)
    except pa.ArrowInvalid as error:
        raise WorkloadError(f"{path}: unreadable as {kind} ({error})") from None


def _check_columns(path: str, wanted: list[str], names: list[str], hint: str = "") -> None:
    roles = ("task.dataset.input_column", "task.dataset.label_column") if len(wanted) == 2 else ("column",)
    for role, column in zip(roles, wanted, strict=True):
        if column not in names:
            raise WorkloadError(f"{role} {column!r} is not a column of {path}; its columns: {names}{hint}")


def _delimiter_hint(names: list[str], delimiter: str) -> str:
    """When a delimited file's header reads as one column holding another likely delimiter (``text;label``
    split at ``,``): the ``sep`` to set, else ""."""
    counts = {mark: names[0].count(mark) for mark in LIKELY_DELIMITERS if mark != delimiter} if len(names) == 1 else {}
    mark = max(counts, key=counts.__getitem__, default=None)
    if mark is None or not counts[mark]:
        return ""
    return (
        f"; the header is one column holding {mark!r}: if that is the file's delimiter, set "
        f"task.dataset.sep: {json.dumps(mark)}"
    )


def _saved_dataset(path: str, wanted: list[str], every_column: bool) -> Any:
    """The ``datasets.Dataset`` saved at ``path`` (its columns ``wanted``, or all), memory-mapped."""
    import datasets

    try:
        dataset = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise WorkloadError(f"{path}: not a dataset saved with save_to_disk ({str(error)[:200]})") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise WorkloadError(
            f"{path}: a DatasetDict of the splits {sorted(dataset)}; name one split's folder as path "
            f"(e.g. {path}/{next(iter(dataset))}) and another as test_path"
        )
    _check_columns(path, wanted, dataset.column_names)
    return dataset if every_column else dataset.select_columns(wanted)


def _class_names(path: str, kind: str, column: str) -> dict[int, str] | None:
    """The names of a ``save_to_disk`` dataset's ``ClassLabel`` column by class id, else None."""
    if kind != "hf_disk":
        return None
    import datasets

    feature = datasets.load_from_disk(path).features[column]
    return dict(enumerate(feature.names)) if isinstance(feature, datasets.ClassLabel) else None


def _columns(source: DatasetFile, path: str, kind: str) -> tuple[Inputs, list[int | str], dict[int, str] | None]:
    """(inputs, labels, class names by id or None) of ``path``: texts as a list, image files as a list of
    paths, embeddings as float32 ``(n, d)``; labels as values."""
    import pyarrow as pa

    if kind == "imagefolder":
        images, classes = image_folder(path)
        return images, list[int | str](classes), None
    input_column, label_column = source.input_column, source.label_column
    if input_column is None or label_column is None:
        role = "input_column" if input_column is None else "label_column"
        raise WorkloadError(f"task.dataset.{role}: required for a {kind} dataset (only an image folder has none)")
    table = read_columns(path, kind, [input_column, label_column], sep=source.sep)
    if table.num_rows == 0:
        raise WorkloadError(f"task.dataset {path}: no rows")
    label = table.column(label_column)
    labels = label.to_pylist()
    names = _class_names(path, kind, label_column)
    unlabelled = _unlabelled(labels, class_label=names is not None)
    if unlabelled:
        raise WorkloadError(
            f"task.dataset {path}: data row {unlabelled[0]} has no {label_column!r} (a missing label: empty, blank, "
            f"NaN or null{', or -1 in a ClassLabel column' if names else ''}); {len(unlabelled)} row(s) in all: "
            f"{_rows(kind, unlabelled)}; drop those rows or fill in their labels"
        )
    if not (pa.types.is_integer(label.type) or pa.types.is_string(label.type) or pa.types.is_large_string(label.type)):
        raise WorkloadError(
            f"task.dataset.label_column {label_column!r} of {path} holds {label.type}; labels are ints or strings"
        )
    column = table.column(input_column)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        texts = column.to_pylist()
        empty = [row for row, text in enumerate(texts) if text is None or not text.strip()]
        if empty:
            raise WorkloadError(
                f"task.dataset {path}: row {empty[0]} has an empty {input_column!r} "
                f"({len(empty)} empty in all); every text must be non-empty"
            )
        if all(text.lower().endswith(IMAGE_SUFFIXES) for text in texts):  # image paths, relative to the file
            files = [Path(os.path.dirname(path), text) for text in texts]
            _check_images(path, files)
            return files, labels, names
        return texts, labels, names
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        if not (pa.types.is_floating(column.type.value_type) or pa.types.is_integer(column.type.value_type)):
            raise WorkloadError(
                f"task.dataset.input_column {input_column!r} of {path} holds lists of "
                f"{column.type.value_type}; an embedding is a list of numbers"
            )
        rows = column.to_pylist()
        lengths = np.array([-1 if row is None else len(row) for row in rows])
        ragged = np.flatnonzero(lengths != lengths[0])
        if lengths[0] < 1 or len(ragged):
            bad = int(ragged[0]) if len(ragged) else 0
            raise WorkloadError(
                f"task.dataset {path}: row {bad} of {input_column!r} has {max(int(lengths[bad]), 0)} numbers, "
                f"row 0 has {int(lengths[0])}; every embedding has one length ≥ 1"
            )
        values = np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=np.float32)
        finite = np.isfinite(values).all(axis=1)
        if not finite.all():
            raise WorkloadError(
                f"task.dataset {path}: row {int(np.flatnonzero(~finite)[0])} of {input_column!r} holds NaN, "
                "infinity or a missing number; embeddings must be finite"
            )
        return values, labels, names
    raise WorkloadError(
        f"task.dataset.input_column {input_column!r} of {path} holds {column.type}; it holds texts (strings) "
        "or embeddings (lists of numbers)"
    )


def _unlabelled(labels: list[Any], *, class_label: bool) -> list[int]:
    """The rows (0-based) whose label is missing: null, NaN, a blank string or ``nan`` (pandas' NaN written
    as text), or -1 in a ``ClassLabel`` column (``class_label``: Hugging Face's "no label")."""
    return [
        row
        for row, value in enumerate(labels)
        if value is None
        or (isinstance(value, float) and math.isnan(value))
        or (isinstance(value, str) and value.strip().lower() in ("", "nan"))
        or (class_label and value == -1)
    ]


def _rows(kind: str, rows: Sequence[int], most: int = 5) -> str:
    """Data rows ``rows`` (0-based, the header not counted) named for the user, at most ``most``: with the
    rows a spreadsheet shows them at (csv, tsv: the header is row 1) or the lines of a jsonl file."""
    cut = ", …" if len(rows) > most else ""
    listed = ", ".join(str(row) for row in rows[:most]) + cut
    if kind in DELIMITED_FORMATS:
        at = f"; rows {', '.join(str(row + 2) for row in rows[:most])}{cut} in a spreadsheet, whose header is row 1"
    elif kind == "jsonl":
        at = f"; lines {', '.join(str(row + 1) for row in rows[:most])}{cut} of the file"
    else:
        at = ""
    return f"data rows {listed} (0-based, the header not counted{at})"


def image_folder(path: str) -> tuple[list[Path], list[str]]:
    """(image files, their class folders' names) of the image folder ``path`` (``<path>/<class>/<image>``, an
    image being a file with a suffix of :data:`IMAGE_SUFFIXES`, hidden files skipped), each image's header
    read (streamed: one file open at a time): :class:`WorkloadError` naming a file that is no image."""
    classes = sorted(entry.name for entry in os.scandir(path) if entry.is_dir() and not entry.name.startswith("."))
    if not classes:
        raise WorkloadError(
            f"task.dataset {path}: no class folders; an image folder is <path>/<class>/<image> (torchvision's layout)"
        )
    files, labels = [], []
    for name in classes:
        for relative, _, _ in _listing(os.path.join(path, name)):
            if relative.lower().endswith(IMAGE_SUFFIXES) and not os.path.basename(relative).startswith("."):
                files.append(Path(path, name, relative))
                labels.append(name)
    if not files:
        raise WorkloadError(f"task.dataset {path}: no images (files ending in {', '.join(IMAGE_SUFFIXES)})")
    _check_images(path, files)
    return files, labels


def _check_images(path: str, files: list[Path]) -> None:
    """Open each image of ``files`` in turn (its header only): :class:`WorkloadError` naming the first
    that is missing or no image."""
    from PIL import Image, UnidentifiedImageError

    for file in files:
        try:
            with Image.open(file) as image:
                image.size  # noqa: B018 (the header is parsed on open)
        except FileNotFoundError:
            raise WorkloadError(f"task.dataset {path}: image {file} does not exist") from None
        except (UnidentifiedImageError, OSError) as error:
            raise WorkloadError(f"task.dataset {path}: {file} is not a readable image ({error})") from None
