"""Report sections 1 and 2: accuracy over (C, B), and the optimal C and B of each cell."""

from __future__ import annotations

import pandas as pd

from dptune.analysis.configurations import rank_configurations
from dptune.analysis.results import AUTO_S, CELL, STRATA, Results
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
