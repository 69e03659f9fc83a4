"""The tables of a results dataset: their Parquet schemas and the schema version.

A search writes six tables (see ``dptune.records`` for the layout): ``trials`` (one row per
trial), ``epochs`` (per trial and epoch), ``classes`` (per trial and class), ``diagnostics`` (per
trial and diagnostic epoch), ``search`` (per (ε, epochs) cell and clipping rule) and ``release``
(end-to-end private searches only). Schema changes bump ``SCHEMA_VERSION``, stored in every
``search`` row; what rows of an older schema mean in the current one comes with the change, as a
migration (``dptune.records.migrations``) that ``read_table`` applies.

Replicates (schema 3): a *configuration* is one sampled (C, B, η₀) of one cell; it may run R
times with fresh coins. Every replicate is a trial with its own row: ``configuration_id`` (the
cell key and a digest of (C, B, η₀), equal for every replicate of the configuration) and
``replicate`` (0-based); its ``trial_id`` is ``replicate_trial_id(configuration_id, replicate)``
= ``f"{configuration_id}-r{replicate}"``. Older datasets (schema ≤ 2) have neither column:
their migration reads each of their trials as replicate 0 of its own configuration
(``configuration_id = trial_id``, ``replicate = 0``), so analyses rank them as before.
"""

from __future__ import annotations

import pyarrow as pa

from dptune.errors import DptuneError

#: 2: trials gain steps_taken, split_seed, score_noise_multiplier, noisy_val_accuracy and released
#: (seed is null for secret coins); search gains the whole-search cost and the guarantee; release.
#: 3: trials gain configuration_id and replicate (R fresh-coin runs of one configuration).
#: 4: release loses trial_id and created_at (they could reveal the released run's position among
#: the runs) and gains test_split_public; trials.released is false on every run record.
#: 5: search gains runs_charged and runs_unrecorded: the whole-search cost composes the privacy ledger
#: (``dptune.records.ledger``), every run that was charged before its first step, recorded or not.
#: 6: release gains tuning_fraction and transfer (tuning on a private subsample; null otherwise).
#: 7: release gains test_withheld (the test rows' source and how the owner scores the model themselves).
#: What rows written before each version mean now: ``dptune.records.migrations.MIGRATIONS``.
SCHEMA_VERSION = 8

#: The quantiles of per-class gradient norms the ``classes`` table keeps, as column suffixes.
QUANTILES = ("q05", "q25", "q50", "q75", "q95")

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
            ("num_train", pa.int64()),  # each split's privacy units: rows, or people under a person unit
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
            *[(f"grad_norm_{q}", pa.float64()) for q in QUANTILES],
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
            ("num_train", pa.int64()),  # N: the training privacy units (rows, or people)
            ("trials_planned", pa.int64()),
            ("configurations_pruned", pa.int64()),
            ("epsilon_per_trial", pa.float64()),
            ("trials_with_steps", pa.int64()),  # trials of this cell that took ≥ 1 step
            ("epsilon_cell", pa.float64()),  # composition of this cell's trials, at delta, by accountant_cell
            ("accountant_cell", pa.string()),  # PLD, RDP, or PRV (one trial: its own ε spent)
            ("epsilon_composition", pa.float64()),  # basic composition of this cell's trials: Σ ε spent
            ("delta_composition", pa.float64()),  # and Σ δ
            ("epsilon_search", pa.float64()),  # composition of every trial of the search, at delta
            ("accountant_search", pa.string()),  # its accountant: PLD, RDP, or PRV (one trial)
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
            ("test_withheld", pa.string()),  # why the test accuracy is withheld, and how to score it; null: public
            ("epsilon_total", pa.float64()),
            ("delta_total", pa.float64()),
            ("epsilon_per_trial", pa.float64()),
            ("score_noise_multiplier", pa.float64()),
            ("mean_trials", pa.float64()),
            ("trial_count_shape", pa.float64()),
            ("tuning_fraction", pa.float64()),  # q₁ of the tuning's secret subsample; null: tuned on every row
            ("transfer", pa.string()),  # the rule that took the tuned configuration to the full data; null as above
            ("guarantee", pa.string()),
        ]
    ),
}

TABLES: tuple[str, ...] = tuple(SCHEMAS)


class RecordsError(DptuneError, ValueError):
    """A results path or table that cannot be read or written."""
