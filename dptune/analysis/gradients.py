"""Report sections 3 and 4: per-example gradient norms and retention weights, by class stratum."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from dptune.analysis.configurations import best_configurations
from dptune.analysis.results import CELL, STRATA, AnalysisError, Results, select_best
from dptune.analysis.strata import stratum_accuracy, with_strata


def diagnosed_best(results: Results) -> pd.DataFrame:
    """Per cell, the best tuned trial that recorded diagnostics, with its last diagnostic row.

    Columns of the trial plus ``diagnostic_epoch``, ``grad_norms``, ``labels``,
    ``optimal_clip_bound``, ``mse_bias``, ``mse_variance``, ``noise_multiplier``, ``dimension``. The
    probes (``grad_norms``, ``labels``) are read for these rows only (:meth:`Results.probes`).
    """
    best = select_best(last_diagnostics(results), CELL)
    probed = results.probes(best.rename(columns={"diagnostic_epoch": "epoch"}))
    return probed.rename(columns={"epoch": "diagnostic_epoch"})


def last_diagnostics(results: Results) -> pd.DataFrame:
    """Tuned finished trials joined with their last diagnostic row (latest probe epoch), without its probe
    (:func:`diagnosed_best` adds it)."""
    diagnostics = results.diagnostics.sort_values("epoch").drop_duplicates(["search_id", "trial_id"], keep="last")
    columns = ["search_id", "trial_id", "epoch", "optimal_clip_bound", "mse_bias", "mse_variance", "dimension"]
    last = diagnostics[columns].rename(columns={"epoch": "diagnostic_epoch"})
    return results.tuned.merge(last, on=["search_id", "trial_id"])


def grad_norm_samples(results: Results, strata: pd.DataFrame | None = None) -> pd.DataFrame:
    """Paper Fig. 3: per-example gradient norms ‖g_i‖ of each cell's best diagnosed trial.

    Long frame: one row per probe example with ``task``, ``epsilon``, ``epochs``, ``trial_id``,
    ``diagnostic_epoch``, ``label``, ``grad_norm`` and (with ``strata``) ``stratum``.
    """
    best = diagnosed_best(results)
    columns = [*CELL, "search_id", "trial_id", "diagnostic_epoch", "label", "grad_norm"]
    if best.empty:
        return pd.DataFrame(columns=[*columns, "stratum"] if strata is not None else columns)
    long = best[[*CELL, "search_id", "trial_id", "diagnostic_epoch", "grad_norms", "labels"]]
    long = long.explode(["grad_norms", "labels"]).dropna(subset=["grad_norms"])
    long = (
        long.rename(columns={"grad_norms": "grad_norm", "labels": "label"})
        .astype({"grad_norm": float, "label": "int64"})[columns]
        .reset_index(drop=True)
    )
    if strata is not None:
        long = long.merge(strata[["task", "label", "stratum"]], on=["task", "label"], how="left")
    return long


def retention_weights(
    grad_norms: Sequence[float] | np.ndarray,
    labels: Sequence[int] | np.ndarray,
    clip_bounds: Sequence[float] | np.ndarray,
) -> pd.DataFrame:
    """Per-class retention weights of clipping (paper Eq. 3) at each clip bound.

    w_y(C) = (1/n_y) Σ_{i: y_i = y} min(1, C/‖g_i‖), with min(1, C/0) = 1. Returns one row per
    (label, clip_bound) with ``retention_weight`` in (0, 1] and ``examples`` = n_y.
    """
    norms = np.asarray(grad_norms, dtype=float)
    bounds = np.asarray(clip_bounds, dtype=float)
    if norms.shape != np.shape(labels):
        raise AnalysisError(f"grad_norms and labels differ in length ({norms.size} and {np.size(labels)})")
    if np.any(bounds <= 0):
        raise AnalysisError(f"clip bounds must be positive, got {bounds[bounds <= 0].tolist()}")
    with np.errstate(divide="ignore"):
        factors = np.minimum(1.0, bounds[None, :] / norms[:, None])
    frame = pd.DataFrame(factors, columns=bounds)
    frame["label"] = np.asarray(labels)
    weights = frame.groupby("label").mean().rename_axis(columns="clip_bound").stack()
    table = weights.rename("retention_weight").reset_index()
    table["examples"] = table["label"].map(frame["label"].value_counts())
    return table


def retention_curves(
    results: Results, strata: pd.DataFrame, clip_bounds: Sequence[float] | None = None
) -> pd.DataFrame:
    """Paper Fig. 4: mean w_y(C) over the easy and the hard classes of each cell's best diagnosed trial.

    ``clip_bounds`` default to the task's C grid (the ``clip_bin`` values of its tuned trials).
    One row per (task, ε, E, clip_bound, stratum) with ``retention_weight`` (unweighted mean of
    w_y over the stratum's classes).
    """
    columns = [*CELL, "clip_bound", "stratum", "retention_weight"]
    best = diagnosed_best(results)
    if best.empty or strata.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for trial in best.itertuples(index=False):
        grid = (
            clip_bounds
            if clip_bounds is not None
            else sorted(results.tuned.loc[results.tuned["task"] == trial.task, "clip_bin"].unique())
        )
        weights = retention_weights(trial.grad_norms, trial.labels, grid)
        weights = weights.merge(strata[strata["task"] == trial.task][["label", "stratum"]], on="label")
        means = weights.groupby(["clip_bound", "stratum"])["retention_weight"].mean().reset_index()
        rows.append(means.assign(task=trial.task, epsilon=trial.epsilon, epochs=trial.epochs))
    return pd.concat(rows, ignore_index=True)[columns]


def stratum_accuracy_by_clip(results: Results, strata: pd.DataFrame) -> pd.DataFrame:
    """Class accuracy per stratum against C: per (cell, clip_bin) the best configuration over B and η.

    Columns: task, ε, E, clip_bin, trial_id (its first replicate), test_accuracy, easy, hard
    (means over its replicates).
    """
    trials = with_strata(results.tuned, stratum_accuracy(results, strata))
    table = best_configurations(trials, [*CELL, "clip_bin"], means=STRATA)
    return table[[*CELL, "clip_bin", "trial_id", "test_accuracy", *STRATA]]
