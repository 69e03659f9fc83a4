"""The people of a data owner's file when the privacy unit is a person (:class:`dptune.contract.PersonUnit`).

``privacy.unit: {column: customer_id}`` names a column of the dataset file (and of its test file): rows
with the same value belong to one person. Here the column is read and checked (:func:`read_people`:
missing column, a row without an id, NaN or an empty id, an id that is neither int nor string, a class
with fewer than :data:`MIN_PEOPLE_PER_CLASS` people), each person gets a content digest of their id
(:func:`person_digests`, what the splits hash: every row of a person carries it, so a person lands
wholly in one split, :func:`dptune.data.splits.held_out`), and a split's rows are numbered by person
(:func:`split_people`). The ids themselves and the rows per person stay inside the trust boundary.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass

import numpy as np

from dptune.contract import DatasetFile
from dptune.data.remote import local_copy
from dptune.data.spec import People, WorkloadError
from dptune.data.splits import DIGEST_SIZE

#: Fewest people of a class: one to train on and one that the validation or test split may take.
MIN_PEOPLE_PER_CLASS = 2


@dataclass(frozen=True)
class RawPeople:
    """Each row's person in a dataset file: ``index[i]`` (int64, dense ``0..count-1``) of row ``i`` in the
    :class:`~dptune.data.sources.RawDataset`'s row order (training file first, then the test file);
    ``digests`` ``(count, DIGEST_SIZE)`` uint8, one per person (:func:`person_digests`)."""

    column: str
    index: np.ndarray
    digests: np.ndarray

    def row_digests(self) -> np.ndarray:
        """``(rows, DIGEST_SIZE)``: every row carries its person's digest, so the splits keep people whole."""
        return self.digests[self.index]


def person_digests(ids: list[int | str]) -> np.ndarray:
    """``(len(ids), DIGEST_SIZE)`` uint8: blake2b of each id's type and value (``7`` and ``"7"`` differ)."""
    out = bytearray()
    for value in ids:
        tag = b"i" if isinstance(value, int) else b"s"
        out += hashlib.blake2b(
            tag + str(value).encode("utf-8"), digest_size=DIGEST_SIZE, person=b"dptune-user"
        ).digest()
    return np.frombuffer(bytes(out), dtype=np.uint8).reshape(len(ids), DIGEST_SIZE)


def read_people(source: DatasetFile, column: str, labels: np.ndarray) -> RawPeople:
    """The people of ``source`` by ``column`` (read from the training file and, if any, the test file),
    checked against the raw class ids ``labels`` of the same rows. Raises :class:`WorkloadError` naming
    the file, the row and what is allowed."""
    keys = ("path", "test_path") if source.test_path is not None else ("path",)
    files: list[list[int | str]] = []
    for key in keys:
        location = getattr(source, key)
        path = local_copy(location, f"task.dataset.{key}")
        files.append(_ids(source.format, source.sep, path, location, column, _stamp(path)))
    ids = [value for file in files for value in file]
    if len(ids) != len(labels):
        raise WorkloadError(f"privacy.unit.column {column!r}: {len(ids)} ids for {len(labels)} rows")
    values, index = np.unique(np.array([f"{type(v).__name__}:{v}" for v in ids], dtype=object), return_inverse=True)
    first = np.zeros(len(values), dtype=np.int64)
    first[index[::-1]] = np.arange(len(index))[::-1]
    people = RawPeople(column, index.astype(np.int64), person_digests([ids[int(row)] for row in first]))
    if len(files) == 2:
        _check_disjoint(people.index[: len(files[0])], people.index[len(files[0]) :], source.test_path or "", column)
    _check_classes(people, labels, source.path)
    return people


def _check_disjoint(train: np.ndarray, test: np.ndarray, shown: str, column: str) -> None:
    """A person is in the training file or in the test file, never both (a person's rows are one split's)."""
    shared = np.isin(test, train)
    if shared.any():
        raise WorkloadError(
            f"task.dataset.test_path {shown}: {len(np.unique(test[shared]))} people of privacy.unit.column "
            f"{column!r} also have rows in the training file (first at test row {int(np.flatnonzero(shared)[0])}); "
            "a person's rows belong to one split: move them to one file"
        )


def _stamp(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return (stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _ids(declared: str, sep: str | None, path: str, shown: str, column: str, stamp: tuple[int, int]) -> list[int | str]:
    """The ids of ``column`` in the file ``path`` (``shown`` in messages; a csv or tsv file split at ``sep``),
    checked (read once per version)."""
    import pyarrow as pa

    from dptune.data.files import read_columns

    try:
        table = read_columns(path, declared, [column], every_column=False, sep=sep)
    except WorkloadError as error:  # a missing column is named by its key in the space
        message = str(error)
        raise WorkloadError("privacy.unit." + message if message.startswith("column ") else message) from None
    ids = table.column(column)
    kind = ids.type
    if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise WorkloadError(
            f"privacy.unit.column {column!r} of {shown} holds {kind}; a person's id is an int or a string"
        )
    values = ids.to_pylist()
    for row, value in enumerate(values):
        if value is None or (isinstance(value, str) and not value.strip()):
            raise WorkloadError(
                f"task.dataset {shown}: row {row} has no {column!r} (an empty or missing id); every row "
                "names its person (privacy.unit.column)"
            )
    return values


def _check_classes(people: RawPeople, labels: np.ndarray, shown: str) -> None:
    """A class held by fewer than :data:`MIN_PEOPLE_PER_CLASS` people cannot be split by person."""
    pairs = np.unique(np.stack([labels, people.index]), axis=1)
    counts = np.bincount(pairs[0], minlength=int(labels.max()) + 1)
    small = [int(c) for c in np.flatnonzero((counts > 0) & (counts < MIN_PEOPLE_PER_CLASS))]
    if small:
        raise WorkloadError(
            f"task.dataset {shown}: class id(s) {small[:5]} are held by fewer than {MIN_PEOPLE_PER_CLASS} people "
            f"(privacy.unit.column {people.column!r}); a class needs one person to train on and one for "
            "validation or test"
        )


def split_people(people: RawPeople, train: np.ndarray, val: np.ndarray, test: np.ndarray) -> People:
    """:class:`~dptune.data.spec.People` of the splits' raw rows ``train``, ``val`` and ``test``: each
    split's people numbered densely in order of their first row (a person without rows in a split, all
    of them filtered out, is not one of its people)."""

    def dense(rows: np.ndarray) -> np.ndarray:
        _, first, inverse = np.unique(people.index[rows], return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        return rank[inverse].astype(np.int64)

    return People(column=people.column, train=dense(train), val=dense(val), test=dense(test))
