"""Report sections 1 and 2: accuracy over (C, B), and the intervals of the accuracies the figures draw."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from dptune.analysis.configurations import rank_configurations, with_intervals
from dptune.analysis.results import AUTO_S, CELL, STRATA, Results
from dptune.analysis.strata import with_strata


def accuracy_grid(results: Results, accuracy: pd.DataFrame | None = None) -> pd.DataFrame:
    """Paper Fig. 1: per cell and (C, B) bin, the best configuration over η (and any other option).

    One row per (task, ε, E, clip_bin, batch_bin) with the selected configuration's (best mean
    validation accuracy over its replicates, ``rank_configurations``) mean ``val_accuracy``,
    ``test_accuracy``, ``train_loss``, its ``learning_rate``, ``replicates``, ``search_id``/``trial_id``
    of its first replicate, ``configurations`` (configurations ranked in the bin), ``trials``
    (finished trials in the bin) and ``within_noise``: whether the selected configuration is in its
    cell's confidence set of the best configuration (``rank_configurations`` over the cell: it
    cannot be told apart from the cell's best on these data). With ``accuracy``
    (``stratum_accuracy``), also the mean ``easy``/``hard`` class accuracies over its replicates.
    """
    tuned = results.tuned
    keys = [*CELL, "clip_bin", "batch_bin"]
    means = list(STRATA) if accuracy is not None else []
    ranked = rank_configurations(with_strata(tuned, accuracy) if means else tuned, keys, means=means)
    best = ranked[ranked["rank"] == 1].drop(columns="within_noise")
    counts = tuned.groupby(keys).size().rename("trials").reset_index()
    counts = counts.merge(ranked.groupby(keys).size().rename("configurations").reset_index(), on=keys)
    in_set = rank_configurations(tuned)[[*CELL, "configuration_id", "within_noise"]]
    return (
        best.merge(counts, on=keys)
        .merge(in_set, on=[*CELL, "configuration_id"])[
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
                "configurations",
                "trials",
                "within_noise",
            ]
        ]
        .reset_index(drop=True)
    )


def configuration_intervals(
    trials: pd.DataFrame, by: Sequence[str], strata: pd.DataFrame | None = None, accuracy: pd.DataFrame | None = None
) -> pd.DataFrame:
    """The intervals of every configuration's mean test accuracy, and of its mean class accuracy per stratum.

    One row per configuration of ``rank_configurations(trials, by)``: ``by``, ``configuration_id``,
    ``trial_id`` (its first replicate, the key the figures' tables carry), ``rank`` (within its group of
    ``by``, e.g. a (C, B) bin), ``test_low`` and ``test_high`` (``with_intervals`` over its cell,
    ``CELL``: the run-to-run spread is pooled over the cell's configurations whatever ``by`` groups, so
    a configuration has the interval every other output prints). With ``strata`` (``class_strata``)
    and ``accuracy`` (``stratum_accuracy``), per stratum s also ``s_low``/``s_high``: the same function
    with the stratum's mean class accuracy in place of the test accuracy (its spread pooled over the
    cell) and the stratum's share of the test rows in place of ``num_test`` (``num_test`` times the
    stratum's share of the task's classes: the records count no test rows per class, so the classes
    are taken as equally represented in the split). NaN where a configuration has no class accuracies.
    """
    by = list(by)
    key = [*by, "configuration_id", "trial_id", "rank"]
    cell = [*CELL, "configuration_id"]  # ``by`` holds the cell's columns (and may group finer)
    bounds = with_intervals(rank_configurations(trials, CELL), CELL)[[*cell, "test_low", "test_high"]]
    table = rank_configurations(trials, by)[key].merge(bounds, on=cell, how="left")
    if strata is None or accuracy is None or strata.empty:
        return table
    scored = with_strata(trials, accuracy)
    shares = (
        strata.groupby("task")["stratum"]
        .value_counts(normalize=True)
        .unstack(fill_value=0.0)
        .reindex(columns=list(STRATA), fill_value=0.0)
    )
    for stratum in STRATA:
        rows = scored["num_test"] * scored["task"].map(shares[stratum])
        as_test = scored.assign(test_accuracy=scored[stratum], num_test=rows)
        ranked = with_intervals(rank_configurations(as_test, CELL), CELL)
        bounds = ranked[[*cell, "test_low", "test_high"]].rename(
            columns={"test_low": f"{stratum}_low", "test_high": f"{stratum}_high"}
        )
        table = table.merge(bounds, on=cell, how="left")
    return table


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
