"""Result records: the versioned Parquet dataset a search writes and the reports read.

Layout (one directory per search, any filesystem pyarrow understands: a local path or a URI
such as ``s3://bucket/prefix``)::

    <root>/trials/part-<trial_id>.parquet       one row per trial
    <root>/epochs/part-<trial_id>.parquet       one row per trial and epoch
    <root>/classes/part-<trial_id>.parquet      one row per trial and class
    <root>/diagnostics/part-<trial_id>.parquet  one row per trial and diagnostic epoch
    <root>/<table>/part-c-<seq>-<tag>.parquet   many trials' rows of a per-trial table, compacted
    <root>/search/part-<search_id>.parquet      one row per (ε, epochs) cell of the search
    <root>/release/part-<search_id>.parquet     end-to-end private searches only: the release
    <runs root>/ledger/                          the write-ahead privacy ledger (``ledger``)
    <runs root>/weights/<trial_id>.safetensors   the trained parameters of every ok run (``weights``),
    <runs root>/weights/bundle-<seq>-<tag>.safetensors  and many runs' of them, bundled

A run's rows and weights are written as it ends; ``compaction`` merges them into a few large files
(a unit's at its end, the rest at the finishing step), and every reader takes each trial's rows from
exactly one file (``store``). The dataset loads with pandas (``read_table``), polars
(``pl.read_parquet(root/"trials")``) and duckdb (``read_parquet('root/trials/*.parquet')``).

The modules: ``schemas`` (the tables, ``SCHEMA_VERSION``), ``ids`` (configuration and trial ids),
``rows`` (a trial's result as rows),
``store`` (atomic writes, consistent reads, quarantine), ``compaction`` (a few large files from many
small ones, crash-safe), ``weights`` (each run's trained parameters), ``trust`` (the trust boundary of a
private search, ``runs_root``) and ``ledger`` (every run charged before its first step).
"""

from __future__ import annotations

from dptune.records.compaction import compact_records
from dptune.records.ids import configuration_id, params_key, replicate_trial_id
from dptune.records.rows import trial_rows
from dptune.records.schemas import SCHEMA_VERSION, SCHEMAS, TABLES, RecordsError
from dptune.records.store import (
    QUARANTINE,
    ResultsStore,
    part_problem,
    quarantine_part,
    read_table,
    unreadable_parts,
)
from dptune.records.trust import (
    TRUST_BOUNDARY,
    TRUST_BOUNDARY_README,
    owner_only,
    release_label,
    runs_root,
    withheld_reason,
)

__all__ = [
    "QUARANTINE",
    "SCHEMAS",
    "SCHEMA_VERSION",
    "TABLES",
    "TRUST_BOUNDARY",
    "TRUST_BOUNDARY_README",
    "RecordsError",
    "ResultsStore",
    "compact_records",
    "configuration_id",
    "owner_only",
    "params_key",
    "part_problem",
    "quarantine_part",
    "read_table",
    "release_label",
    "replicate_trial_id",
    "runs_root",
    "trial_rows",
    "unreadable_parts",
    "withheld_reason",
]
