"""Report sections 1 and 2: accuracy over (C, B), and the optimal C and B of each cell."""

from __future__ import annotations

import pandas as pd

from dptune.analysis.configurations import rank_configurations
from dptune.analysis.results import AUTO_S, CELL, NEAR_OPTIMAL, STRATA, AnalysisError, Results, select_best
from dptune.analysis.strata import with_strata


def accuracy_grid(results: Results, accuracy: pd.DataFrame | None = None) -> pd.DataFrame:
    """Paper Fig. 1: per cell and (C, B) bin, the best configuration over η (and any other option).

    One row per (task, ε, E, clip_bin, batch_bin) with the selected configuration's (best mean
    validation accuracy over its replicates, ``rank_configurations``) mean ``val_accuracy``,
    ``test_accuracy``, ``train_loss``, its ``learning_rate``, ``replicates``, ``search_id``/``trial_id``
    of its first replicate and ``trials`` (finished trials in the bin). With ``accuracy``
    (``stratum_accuracy``), also the mean ``easy``/``hard`` class accuracies over its replicates.
    """
    tuned = results.tuned
    keys = [*CELL, "clip_bin", "batch_bin"]
    means = list(STRATA) if accuracy is not None else []
    best = rank_configurations(with_strata(tuned, accuracy) if means else tuned, keys, means=means)
    best = best[best["rank"] == 1]
    counts = tuned.groupby(keys).size().rename("trials").reset_index()
    return best.merge(counts, on=keys)[
        [
            *keys,
            "val_accuracy",
            "test_accuracy",
            "train_loss",
            "learning_rate",
            "base_learning_rate",
            "replicates",
            *means,
            "search_id",
            "trial_id",
            "trials",
        ]
    ].reset_index(drop=True)


def unfinished_bins(results: Results) -> pd.DataFrame:
    """(C, B) bins of each cell that hold tuned-C trial records but no finished trial.

    ``outcome`` is ``pruned`` when the min-step rule removed the configuration, else ``failed``
    (diverged, error or stopped early).
    """
    keys = [*CELL, "clip_bin", "batch_bin"]
    trials = results.trials[results.trials["clipping"] != AUTO_S]
    finished = results.tuned[keys].drop_duplicates()
    rest = trials.merge(finished, on=keys, how="left", indicator=True)
    rest = rest[rest["_merge"] == "left_only"]
    outcome = rest.groupby(keys)["status"].agg(lambda s: "pruned" if (s == "pruned_min_steps").any() else "failed")
    return outcome.rename("outcome").reset_index()


def optimal_settings(results: Results, near_optimal: float = NEAR_OPTIMAL) -> pd.DataFrame:
    """Paper Fig. 2: per cell the best (C, B, η) and the spread of near-optimal settings.

    Near-optimal trials are the cell's tuned trials with validation accuracy within
    ``near_optimal`` of the best; ``clip_low``/``clip_high`` and ``batch_low``/``batch_high``
    are their extreme C and B, ``near_optimal_trials`` their count (≥ 1: the best is one).
    """
    if near_optimal < 0:
        raise AnalysisError(f"near_optimal must be ≥ 0 (accuracy units), got {near_optimal}")
    tuned = results.tuned
    best = select_best(tuned, CELL)
    if best.empty:
        return pd.DataFrame(
            columns=[
                *CELL,
                "clip_bound",
                "batch_size",
                "learning_rate",
                "val_accuracy",
                "test_accuracy",
                "clip_low",
                "clip_high",
                "batch_low",
                "batch_high",
                "near_optimal_trials",
            ]
        )
    threshold = best[[*CELL, "val_accuracy"]].rename(columns={"val_accuracy": "best_val"})
    near = tuned.merge(threshold, on=CELL)
    near = near[near["val_accuracy"] >= near["best_val"] - near_optimal - 1e-9]  # inclusive, float-safe
    spread = (
        near.groupby(CELL)
        .agg(
            clip_low=("clip_bound", "min"),
            clip_high=("clip_bound", "max"),
            batch_low=("batch_size", "min"),
            batch_high=("batch_size", "max"),
            near_optimal_trials=("trial_id", "size"),
        )
        .reset_index()
    )
    columns = [
        *CELL,
        "clip_bound",
        "batch_size",
        "learning_rate",
        "base_learning_rate",
        "val_accuracy",
        "test_accuracy",
        "search_id",
        "trial_id",
    ]
    return best[columns].merge(spread, on=CELL)
