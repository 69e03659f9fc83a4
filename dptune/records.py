"""Result records: the versioned Parquet dataset a search writes and the reports read.

Layout (one directory per search, any filesystem pyarrow understands: a local path or a URI
such as ``s3://bucket/prefix``)::

    <root>/trials/part-<trial_id>.parquet       one row per trial
    <root>/epochs/part-<trial_id>.parquet       one row per trial and epoch
    <root>/classes/part-<trial_id>.parquet      one row per trial and class
    <root>/diagnostics/part-<trial_id>.parquet  one row per trial and diagnostic epoch
    <root>/search/part-<search_id>.parquet      one row per (ε, epochs) cell of the search
    <root>/release/part-<search_id>.parquet     end-to-end private searches only: the release

An end-to-end private search (``privacy.private_selection``) keeps its per-run tables (trials,
epochs, classes, diagnostics) and Ray Tune's state in ``<root>/inside_trust_boundary/`` (a dataset
of its own, ``runs_root``), beside a README saying why: they reveal the secret number of runs and
hold exact validation accuracies, so publishing them voids the guarantee. ``<root>`` itself then
holds only what may leave: the ``search`` rows (no count of runs, no composition over them, no
timestamp) and the ``release``.

Invariants:
- Every part is written whole or not at all: local parts go to a temporary name in the same
  folder and are renamed (atomic on POSIX); object stores publish a single PUT atomically.
- A trial's ``trials`` part is written last, so its presence means every other table of that
  trial is complete; readers keep only rows whose trial has a ``trials`` row.
- Parts are keyed by trial id, so writing the same trial twice replaces it: a resumed search
  never shows a trial twice.

The dataset loads with pandas (``read_table``), polars (``pl.read_parquet(root/"trials")``)
and duckdb (``read_parquet('root/trials/*.parquet')``). Schema changes bump ``SCHEMA_VERSION``,
stored in every ``search`` row.

Replicates (schema 3): a *configuration* is one sampled (C, B, η₀) of one cell; it may run R
times with fresh coins. Every replicate is a trial with its own row: ``configuration_id`` (the
cell key and a digest of (C, B, η₀), equal for every replicate of the configuration) and
``replicate`` (0-based); its ``trial_id`` is ``replicate_trial_id(configuration_id, replicate)``
= ``f"{configuration_id}-r{replicate}"``. Older datasets (schema ≤ 2) have neither column:
``read_table`` reads each of their trials as replicate 0 of its own configuration
(``configuration_id = trial_id``, ``replicate = 0``), so analyses rank them as before.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from dptune.contract import TrialResult
from dptune.errors import DptuneError
from dptune.paths import filesystem

#: 2: trials gain steps_taken, split_seed, score_noise_multiplier, noisy_val_accuracy and released
#: (seed is null for secret coins); search gains the whole-search cost and the guarantee; release.
#: 3: trials gain configuration_id and replicate (R fresh-coin runs of one configuration).
#: 4: release loses trial_id and created_at (they could reveal the released run's position among
#: the runs) and gains test_split_public; trials.released is false on every run record.
#: 5: search gains runs_charged and runs_unrecorded: the whole-search cost composes the privacy ledger
#: (``dptune.ledger``), every run that was charged before its first step, recorded or not.
SCHEMA_VERSION = 5

#: The folder under a private search's results that holds what its guarantee needs hidden.
TRUST_BOUNDARY = "inside_trust_boundary"

#: The README written into ``TRUST_BOUNDARY``.
TRUST_BOUNDARY_README = """These are the per-run records of an end-to-end private search (dptune's
privacy.private_selection).

They stay inside the data owner's trust boundary. They are NOT covered by the search's (epsilon, delta):
they reveal the secret number of runs K (which the private-selection bound needs hidden), every run's
configuration, exact validation accuracies of private rows, and Ray Tune's state. Publishing any file
under this folder voids the guarantee. What may be released is the release table (and the search table)
in the folder above, and the report built from it.
"""

_QUANTILES = ("q05", "q25", "q50", "q75", "q95")

SCHEMAS: dict[str, pa.Schema] = {
    "trials": pa.schema(
        [
            ("search_id", pa.string()),
            ("trial_id", pa.string()),
            ("configuration_id", pa.string()),  # cell key + digest of (C, B, η₀): shared by its replicates
            ("replicate", pa.int64()),  # 0-based index of the fresh-coin run of the configuration
            ("cell_id", pa.string()),
            ("dataset", pa.string()),
            ("backbone", pa.string()),
            ("peft", pa.string()),
            ("fraction", pa.float64()),
            ("epsilon", pa.float64()),
            ("delta", pa.float64()),
            ("epochs", pa.int64()),
            ("clip_bound", pa.float64()),
            ("batch_size", pa.int64()),
            ("base_learning_rate", pa.float64()),
            ("learning_rate", pa.float64()),
            ("reference_batch_size", pa.int64()),
            ("optimizer", pa.string()),
            ("clipping", pa.string()),
            ("seed", pa.int64()),  # null: fresh secret coins (the default); else the reproducible seed
            ("split_seed", pa.int64()),  # public: data split and subset caps
            ("noise_multiplier", pa.float64()),
            ("sample_rate", pa.float64()),
            ("steps", pa.int64()),  # T planned
            ("steps_taken", pa.int64()),  # steps actually run: what epsilon_spent counts
            ("epsilon_spent", pa.float64()),
            ("score_noise_multiplier", pa.float64()),  # σ_s of the DP selection score, null without one
            ("noisy_val_accuracy", pa.float64()),
            ("released", pa.bool_()),  # false: a per-run record is never itself a DP release (see ``release``)
            ("status", pa.string()),
            ("reason", pa.string()),
            ("val_accuracy", pa.float64()),
            ("test_accuracy", pa.float64()),
            ("train_loss", pa.float64()),
            ("num_train", pa.int64()),
            ("num_val", pa.int64()),
            ("num_test", pa.int64()),
            ("num_classes", pa.int64()),
            ("trainable_parameters", pa.int64()),
            ("wall_time_s", pa.float64()),
            ("diagnostics_wall_time_s", pa.float64()),
            ("examples_per_s", pa.float64()),
            ("device", pa.string()),
            ("engine", pa.string()),
            ("config", pa.string()),  # the full TrialConfig as JSON
            ("versions", pa.string()),  # package versions as JSON
            ("finished_at", pa.timestamp("ms", tz="UTC")),
        ]
    ),
    "epochs": pa.schema(
        [
            ("search_id", pa.string()),
            ("trial_id", pa.string()),
            ("epoch", pa.int64()),
            ("steps", pa.int64()),
            ("train_loss", pa.float64()),
            ("val_loss", pa.float64()),
            ("val_accuracy", pa.float64()),
            ("test_accuracy", pa.float64()),
            ("wall_time_s", pa.float64()),
            ("examples_per_s", pa.float64()),
        ]
    ),
    "classes": pa.schema(
        [
            ("search_id", pa.string()),
            ("trial_id", pa.string()),
            ("label", pa.int64()),
            ("class_name", pa.string()),
            ("val_accuracy", pa.float64()),  # per-class strata are decided on this, never on test
            ("test_accuracy", pa.float64()),
            ("diagnostic_epoch", pa.int64()),
            ("probe_examples", pa.int64()),
            *[(f"grad_norm_{q}", pa.float64()) for q in _QUANTILES],
            ("clipped_fraction", pa.float64()),
            ("retention_weight", pa.float64()),
        ]
    ),
    "diagnostics": pa.schema(
        [
            ("search_id", pa.string()),
            ("trial_id", pa.string()),
            ("epoch", pa.int64()),
            ("clip_bound", pa.float64()),
            ("noise_multiplier", pa.float64()),
            ("dimension", pa.int64()),
            ("mse_bias", pa.float64()),
            ("mse_variance", pa.float64()),
            ("optimal_clip_bound", pa.float64()),
            ("expected_batch_size", pa.float64()),
            ("wall_time_s", pa.float64()),
            ("grad_norms", pa.list_(pa.float64())),
            ("labels", pa.list_(pa.int64())),
        ]
    ),
    "search": pa.schema(
        [
            ("search_id", pa.string()),
            ("name", pa.string()),
            ("cell_id", pa.string()),
            ("clipping", pa.string()),  # the cell's clipping rule (a cell with compare_auto_s has two rows)
            ("epsilon", pa.float64()),
            ("epochs", pa.int64()),
            ("delta", pa.float64()),
            ("dataset", pa.string()),
            ("backbone", pa.string()),
            ("peft", pa.string()),
            ("num_train", pa.int64()),
            ("trials_planned", pa.int64()),
            ("configurations_pruned", pa.int64()),
            ("epsilon_per_trial", pa.float64()),
            ("trials_with_steps", pa.int64()),  # trials of this cell that took ≥ 1 step
            ("epsilon_cell", pa.float64()),  # PLD composition of this cell's trials, at delta
            ("epsilon_composition", pa.float64()),  # basic composition of this cell's trials: Σ ε spent
            ("delta_composition", pa.float64()),  # and Σ δ
            ("epsilon_search", pa.float64()),  # PLD composition of every trial of the search, at delta
            ("epsilon_search_basic", pa.float64()),  # Σ ε spent over the search
            ("delta_search_basic", pa.float64()),
            ("runs_charged", pa.int64()),  # runs of the search the privacy ledger charges (took ≥ 1 step)
            ("runs_unrecorded", pa.int64()),  # of those, runs with no trials row (lost, disk full, attempts rerun)
            ("epsilon_selection", pa.float64()),  # private selection only: the total budget's bound
            ("delta_selection", pa.float64()),
            ("selection_bound_holds", pa.bool_()),  # private selection with secret coins
            ("reproducible", pa.bool_()),
            ("guarantee", pa.string()),  # what (ε, δ) covers and what it does not, in words
            ("spec_yaml", pa.string()),
            ("spec_hash", pa.string()),
            ("schema_version", pa.int64()),
            ("dptune_version", pa.string()),
            ("created_at", pa.timestamp("ms", tz="UTC")),
            ("warnings", pa.string()),  # JSON list of the warnings the search printed before it ran
        ]
    ),
    "release": pa.schema(
        [
            ("search_id", pa.string()),
            ("cell_id", pa.string()),
            ("clip_bound", pa.float64()),
            ("batch_size", pa.int64()),
            ("base_learning_rate", pa.float64()),
            ("learning_rate", pa.float64()),
            ("epochs", pa.int64()),
            ("noisy_val_accuracy", pa.float64()),  # the maximum of the K noisy scores: biased upward
            ("test_accuracy", pa.float64()),  # null unless the test split is public (shipped with the dataset)
            ("test_split_public", pa.bool_()),
            ("epsilon_total", pa.float64()),
            ("delta_total", pa.float64()),
            ("epsilon_per_trial", pa.float64()),
            ("score_noise_multiplier", pa.float64()),
            ("mean_trials", pa.float64()),
            ("trial_count_shape", pa.float64()),
            ("guarantee", pa.string()),
        ]
    ),
}

TABLES: tuple[str, ...] = tuple(SCHEMAS)


#: Where ``quarantine_part`` moves unreadable parts: ``<root>/quarantine/<table>/part-*.parquet``
#: (outside every table folder, so readers never see them again).
QUARANTINE = "quarantine"


class RecordsError(DptuneError, ValueError):
    """A results path or table that cannot be read or written."""


def _filesystem(root: str) -> tuple[pafs.FileSystem, str]:
    """Resolve a local path or URI into a pyarrow filesystem and a path inside it."""
    return filesystem(root)


def runs_root(results_root: str, private: bool) -> str:
    """Where a search's per-run tables and Ray Tune's state go: ``results_root``, or for an
    end-to-end private search its ``TRUST_BOUNDARY`` folder."""
    return f"{results_root.rstrip('/')}/{TRUST_BOUNDARY}" if private else results_root


def replicate_trial_id(configuration_id: str, replicate: int) -> str:
    """The trial id of replicate ``replicate`` (0-based) of a configuration: ``<configuration_id>-r<replicate>``."""
    return f"{configuration_id}-r{replicate}"


def trial_rows(result: TrialResult, *, search_id: str, trial_id: str, cell_id: str,
               reference_batch_size: int, versions: Mapping[str, str], finished_at: pd.Timestamp,
               configuration_id: str | None = None, replicate: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Flatten one ``TrialResult`` into rows for each per-trial table.

    ``configuration_id`` names the configuration the trial is replicate ``replicate`` (0-based) of;
    None: the trial is its own configuration (``configuration_id = trial_id``, as in schema ≤ 2).
    """
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 0:
        raise RecordsError(f"trial {trial_id}: replicate must be an integer ≥ 0 (0-based), got {replicate!r}")
    config = result.config.row()  # flat: the workload's fields beside the trial's, as the schema has them
    keys = {"search_id": search_id, "trial_id": trial_id}
    trial = {
        **keys,
        "configuration_id": trial_id if configuration_id is None else configuration_id,
        "replicate": replicate,
        "cell_id": cell_id,
        **{name: config[name] for name in (
            "dataset", "backbone", "peft", "fraction", "epsilon", "delta", "epochs", "clip_bound",
            "batch_size", "base_learning_rate", "learning_rate", "optimizer", "clipping", "seed", "split_seed",
            "score_noise_multiplier")},
        "released": False,
        "reference_batch_size": reference_batch_size,
        **{name: getattr(result, name) for name in (
            "noise_multiplier", "sample_rate", "steps", "steps_taken", "epsilon_spent", "noisy_val_accuracy", "status",
            "reason", "val_accuracy", "test_accuracy", "train_loss", "num_train", "num_val", "num_test",
            "num_classes", "trainable_parameters", "wall_time_s", "diagnostics_wall_time_s", "examples_per_s", "device",
            "engine")},
        "config": json.dumps(config, sort_keys=True),
        "versions": json.dumps(dict(versions), sort_keys=True),
        "finished_at": finished_at,
    }
    epochs = [{**keys, **asdict(metrics)} for metrics in result.epochs]
    last = result.diagnostics[-1] if result.diagnostics else None
    per_class = {c.label: c for c in last.classes} if last else {}
    labels = sorted(set(result.class_accuracy) | set(result.class_val_accuracy) | set(per_class))
    classes = []
    for label in labels:
        diag = per_class.get(label)
        classes.append({
            **keys,
            "label": label,
            "class_name": result.class_names.get(label, str(label)),
            "val_accuracy": result.class_val_accuracy.get(label),
            "test_accuracy": result.class_accuracy.get(label),
            "diagnostic_epoch": last.epoch if diag else None,
            "probe_examples": diag.examples if diag else None,
            **{f"grad_norm_{q}": diag.grad_norm_quantiles.get(q) if diag else None for q in _QUANTILES},
            "clipped_fraction": diag.clipped_fraction if diag else None,
            "retention_weight": diag.retention_weight if diag else None,
        })
    diagnostics = [
        {**keys, **{k: v for k, v in asdict(d).items() if k != "classes"}} for d in result.diagnostics
    ]
    return {"trials": [trial], "epochs": epochs, "classes": classes, "diagnostics": diagnostics}


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


def _part_paths(store: ResultsStore, table: str) -> list[str]:
    infos = store._fs.get_file_info(pafs.FileSelector(store._table_dir(table), allow_not_found=True))
    return sorted(i.path for i in infos if i.base_name.startswith("part-") and i.base_name.endswith(".parquet"))


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
    wrong = [f"{field.name} is {field.type}, expected {expected.field(field.name).type}" for field in found
             if field.name in expected.names and not field.type.equals(expected.field(field.name).type)]
    return f"its schema differs from table '{table}': {'; '.join(wrong)[:200]}" if wrong else None


def unreadable_parts(root: str) -> list[tuple[str, str, str]]:
    """Every part of the dataset at ``root`` that cannot be read: ``(table, path, problem)``."""
    store = ResultsStore(root)
    return [(table, part, problem) for table in TABLES for part in _part_paths(store, table)
            if (problem := part_problem(store, table, part)) is not None]


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
    parts = _part_paths(store, table)  # checks the table's name
    schema = SCHEMAS[table]
    selected = list(columns or schema.names)
    if not parts:
        return schema.empty_table().select(selected).to_pandas()
    fill_ids = "configuration_id" in selected and "trial_id" not in selected
    try:
        frame = pq.ParquetDataset(parts, filesystem=store._fs, schema=schema).read(
            columns=[*selected, "trial_id"] if fill_ids else selected).to_pandas()
    except (pa.ArrowException, OSError) as exc:
        bad = [(part, problem) for part in parts if (problem := part_problem(store, table, part)) is not None]
        if not bad:
            raise
        part, problem = bad[0]
        raise RecordsError(f"{part}: {problem} ({len(bad)} unreadable part(s) in table '{table}'; move "
                           "them aside, or run python -m dptune.search --resume --quarantine-corrupt)") from exc
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
