"""Report sections 5 and 7: AUTO-S against tuned C, and the clipping diagnostics (bias and variance)."""

from __future__ import annotations

import pandas as pd

from dptune.analysis.configurations import best_configurations
from dptune.analysis.gradients import last_diagnostics
from dptune.analysis.results import CELL, STRATA, Results, select_best
from dptune.analysis.strata import stratum_accuracy, with_strata


def auto_s_comparison(results: Results, strata: pd.DataFrame) -> pd.DataFrame:
    """Paper Fig. 5: per cell with AUTO-S trials, the best tuned-C and the best AUTO-S configuration.

    Columns ``tuned_*`` and ``auto_s_*`` for test accuracy, easy and hard class accuracy (means
    over the configuration's replicates) and ``trial_id`` (its first replicate);
    ``gap`` = tuned − AUTO-S test accuracy (positive: tuning C helps).
    """
    accuracy = stratum_accuracy(results, strata)
    measures = ["test_accuracy", *STRATA, "trial_id"]
    parts = []
    for name, trials in (("tuned", results.tuned), ("auto_s", results.auto_s)):
        best = best_configurations(with_strata(trials, accuracy), CELL, means=STRATA)
        parts.append(best[[*CELL, *measures]].rename(columns={m: f"{name}_{m}" for m in measures}))
    table = parts[0].merge(parts[1], on=CELL, how="inner")
    table["gap"] = table["tuned_test_accuracy"] - table["auto_s_test_accuracy"]
    return table


def clipping_diagnostics(results: Results) -> pd.DataFrame:
    """Per cell: the diagnosed run's C against C* of Theorem 5.2, and the MSE split at its C.

    C* = N_{C*}ᵀ G_{C*} / (N_{C*}ᵀ N_{C*} + σ² d) is recorded per trial at its last diagnostic
    epoch (it depends on that trial's model and σ). Columns: ``diagnosed_clip_bound`` (the C of
    the cell's best trial among those that recorded diagnostics), ``optimal_clip_bound`` (C* of that
    trial), ``optimal_clip_low/median/high`` (C* over all diagnosed tuned trials of the cell),
    ``mse_bias``/``mse_variance`` of that trial (squared gradient units) and ``bias_share`` = bias / (bias + variance).
    """
    diagnosed = last_diagnostics(results)
    columns = [
        *CELL,
        "trial_id",
        "diagnosed_clip_bound",
        "optimal_clip_bound",
        "optimal_clip_low",
        "optimal_clip_median",
        "optimal_clip_high",
        "mse_bias",
        "mse_variance",
        "bias_share",
        "diagnosed_trials",
    ]
    if diagnosed.empty:
        return pd.DataFrame(columns=columns)
    best = select_best(diagnosed, CELL).rename(columns={"clip_bound": "diagnosed_clip_bound"})
    spread = (
        diagnosed.groupby(CELL)["optimal_clip_bound"]
        .agg(optimal_clip_low="min", optimal_clip_median="median", optimal_clip_high="max", diagnosed_trials="size")
        .reset_index()
    )
    table = best.merge(spread, on=CELL)
    table["bias_share"] = table["mse_bias"] / (table["mse_bias"] + table["mse_variance"])
    return table[columns]


def mse_split(results: Results) -> pd.DataFrame:
    """Per diagnosed tuned trial: C, C*, clipping bias, noise variance and their sum (the MSE).

    The paper's MSE(C) = bias²(C) + variance(C) trade-off, one point per trial at its own C.
    """
    diagnosed = last_diagnostics(results)
    table = diagnosed[
        [
            *CELL,
            "trial_id",
            "clip_bound",
            "batch_size",
            "optimal_clip_bound",
            "mse_bias",
            "mse_variance",
            "val_accuracy",
        ]
    ].copy()
    table["mse_total"] = table["mse_bias"] + table["mse_variance"]
    return table.reset_index(drop=True)
