"""Older results read as the current schema: every migration, keyed by the schema version it applies from.

A results folder may hold parts written by any dptune since schema 1 (a search resumed by a newer
dptune mixes them in one table). A part carries no version of its own (only ``search`` rows record
``schema_version``), and a column that a later schema added reads as null from an older part; so each
migration fills one column of one table in the rows written before the version that added it (the
version it applies from: ``MIGRATIONS[version]``), recognising them by that null (and, where a null is
also a current value, by what else they lack), and leaves the rows of the current schema as they are.

:func:`migrate` applies them in version order (a later one may read what an earlier one filled);
:func:`columns_to_read` names the columns a read needs for them. The store's reader
(``ResultsStore.read``, behind ``read_table``) is their one caller: every other reader sees the
current schema only. A schema change that gives old rows a meaning adds its migration here, under the
new ``SCHEMA_VERSION``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class Migration:
    """Fill ``column`` of ``table`` in the rows written before the version it is keyed by: ``fill`` takes
    the frame (holding ``column`` and ``needs``) and returns the column as the current schema means it."""

    table: str
    column: str
    needs: tuple[str, ...]
    fill: Callable[[pd.DataFrame], pd.Series]


#: What an end-to-end private search's release said of a withheld test accuracy before it recorded why.
GENERAL_WITHHELD_REASON = "the test split is private data"

#: The guarantee of a search written before schema 2 (which recorded none).
BEFORE_SCHEMA_2_GUARANTEE = (
    "written by dptune before schema 2, whose trials all drew their noise and batches from the "
    "search's one seed: no DP guarantee and no composition bound holds for them."
)


def _filled(column: pd.Series, rows: pd.Series, value: object) -> pd.Series:
    """``column`` with ``value`` in ``rows`` (a mask) and every other value as it was (None stays None)."""
    column = column.copy()
    column[rows] = value
    return column


def _guarantee(search: pd.DataFrame) -> pd.Series:
    """Schema 2 recorded the guarantee; a search written before it holds none (its coins were public)."""
    before = search["guarantee"].isna() & (search["schema_version"] < 2)
    return _filled(search["guarantee"], before, BEFORE_SCHEMA_2_GUARANTEE)


def _configuration_id(trials: pd.DataFrame) -> pd.Series:
    """Schema 3 added replicates: a trial written before is its own configuration."""
    return trials["configuration_id"].fillna(trials["trial_id"])


def _replicate(trials: pd.DataFrame) -> pd.Series:
    """Schema 3 added replicates: a trial written before is replicate 0 of its configuration."""
    return trials["replicate"].fillna(0).astype("int64")


def _test_split_public(release: pd.DataFrame) -> pd.Series:
    """Schema 4 recorded whether the test split is public; a release written before released its test
    accuracy (it is read as public, as the summary always showed it)."""
    return release["test_split_public"].astype("boolean").fillna(True).astype(bool)


def _test_withheld(release: pd.DataFrame) -> pd.Series:
    """Schema 7 recorded why a test accuracy is withheld; a release written before gave the general reason."""
    before = release["test_withheld"].isna() & ~release["test_split_public"].astype(bool)
    return _filled(release["test_withheld"], before, GENERAL_WITHHELD_REASON)


def _accountant(column: str) -> Callable[[pd.DataFrame], pd.Series]:
    """Schema 8 recorded which accountant gave a composed ε; before it, a per-cell search's was the PLD's,
    or a single trial's own ε spent (PRV) where that was the smaller."""

    def fill(search: pd.DataFrame) -> pd.Series:
        before = search[column].isna() & (search["schema_version"] < 8) & search["epsilon_search"].notna()
        return _filled(search[column], before, "PLD (or PRV for a single trial)")

    return fill


#: The migrations, keyed by the schema version each applies from (rows written before it are filled).
MIGRATIONS: dict[int, tuple[Migration, ...]] = {
    2: (Migration("search", "guarantee", ("schema_version",), _guarantee),),
    3: (
        Migration("trials", "configuration_id", ("trial_id",), _configuration_id),
        Migration("trials", "replicate", (), _replicate),
    ),
    4: (Migration("release", "test_split_public", (), _test_split_public),),
    7: (Migration("release", "test_withheld", ("test_split_public",), _test_withheld),),
    8: tuple(
        Migration("search", column, ("schema_version", "epsilon_search"), _accountant(column))
        for column in ("accountant_cell", "accountant_search")
    ),
}


def _of(table: str) -> list[Migration]:
    """The migrations of ``table``, in the order they apply (by version)."""
    return [m for version in sorted(MIGRATIONS) for m in MIGRATIONS[version] if m.table == table]


def columns_to_read(table: str, columns: list[str]) -> list[str]:
    """``columns`` of ``table`` and, after them, those their migrations read (and theirs, in turn)."""
    wanted = list(columns)
    for migration in reversed(_of(table)):  # a later migration may need a column an earlier one fills
        if migration.column in wanted:
            wanted += [name for name in migration.needs if name not in wanted]
    return wanted


def migrate(table: str, frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (rows of ``table`` as read, every column of :func:`columns_to_read`) as the current schema:
    each migration of ``table`` applied, in version order, to the columns the frame holds."""
    for migration in _of(table):
        if migration.column in frame and all(name in frame for name in migration.needs):
            frame[migration.column] = migration.fill(frame)
    return frame
