"""One trial's result flattened into the rows of each per-trial table."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import pandas as pd

from dptune.contract import TrialResult
from dptune.records.schemas import QUANTILES, RecordsError


def trial_rows(
    result: TrialResult,
    *,
    search_id: str,
    trial_id: str,
    cell_id: str,
    reference_batch_size: int,
    versions: Mapping[str, str],
    finished_at: pd.Timestamp,
    configuration_id: str | None = None,
    replicate: int = 0,
) -> dict[str, list[dict[str, Any]]]:
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
        **{
            name: config[name]
            for name in (
                "dataset",
                "backbone",
                "peft",
                "fraction",
                "epsilon",
                "delta",
                "epochs",
                "clip_bound",
                "batch_size",
                "base_learning_rate",
                "learning_rate",
                "optimizer",
                "clipping",
                "seed",
                "split_seed",
                "score_noise_multiplier",
            )
        },
        "released": False,
        "reference_batch_size": reference_batch_size,
        **{
            name: getattr(result, name)
            for name in (
                "noise_multiplier",
                "sample_rate",
                "steps",
                "steps_taken",
                "epsilon_spent",
                "noisy_val_accuracy",
                "status",
                "reason",
                "val_accuracy",
                "test_accuracy",
                "train_loss",
                "num_train",
                "num_val",
                "num_test",
                "num_classes",
                "trainable_parameters",
                "wall_time_s",
                "diagnostics_wall_time_s",
                "examples_per_s",
                "device",
                "engine",
            )
        },
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
        classes.append(
            {
                **keys,
                "label": label,
                "class_name": result.class_names.get(label, str(label)),
                "val_accuracy": result.class_val_accuracy.get(label),
                "test_accuracy": result.class_accuracy.get(label),
                "diagnostic_epoch": last.epoch if last is not None and diag else None,
                "probe_examples": diag.examples if diag else None,
                **{f"grad_norm_{q}": diag.grad_norm_quantiles.get(q) if diag else None for q in QUANTILES},
                "clipped_fraction": diag.clipped_fraction if diag else None,
                "retention_weight": diag.retention_weight if diag else None,
            }
        )
    diagnostics = [{**keys, **{k: v for k, v in asdict(d).items() if k != "classes"}} for d in result.diagnostics]
    return {"trials": [trial], "epochs": epochs, "classes": classes, "diagnostics": diagnostics}
