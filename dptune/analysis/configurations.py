"""Configurations, replicates and uncertainty: the ranking every view that picks a best setting uses."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import optimize, special, stats

from dptune.analysis.intervals import accuracy_intervals
from dptune.analysis.results import CELL, CONFIDENCE, AnalysisError


def normal_quantile(confidence: float) -> float:
    """The two-sided standard normal quantile of ``confidence`` (1.96 at 0.95)."""
    return float(stats.norm.ppf(0.5 + confidence / 2))


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise AnalysisError(f"confidence must lie strictly between 0 and 1 (e.g. 0.95), got {confidence}")


def best_set_constant(
    configurations: int, confidence: float = CONFIDENCE, degrees_of_freedom: float = math.inf
) -> float:
    """Gupta's constant d of the confidence set of the best of K configurations (Gupta 1965).

    K scores x_k ~ N(μ_k, se²) (a common standard error, known or estimated with ν degrees of
    freedom): the set {k : x_k ≥ max_j x_j − d·√2·se} holds the configuration of the largest μ with
    probability ≥ ``confidence`` whatever the μ. The least favourable case is all μ equal, where

        P(d) = E_S ∫ φ(z) Φ(z + d·√2·S)^(K−1) dz = confidence,   S² ~ χ²_ν/ν (S = 1 at ν = ∞),

    solved for d here (quadrature over z, quantile nodes over S). d = 0 at K = 1; at K = 2 it is the
    one-sided normal (ν = ∞: 1.645 at 0.95) or Student t quantile; it grows slowly with K (2.82 at
    K = 40, 3.39 at K = 500, ν = ∞): the price of asking which of K is best, not whether one pair
    differs. ``math.inf`` where no finite d reaches ``confidence``.
    """
    _check_confidence(confidence)
    if configurations < 2:
        return 0.0
    nu = math.inf if not np.isfinite(degrees_of_freedom) else round(float(degrees_of_freedom), 1)
    return _best_set_constant(int(configurations), float(confidence), nu)


_Z_NODES = np.linspace(-8.5, 8.5, 1201)
_Z_WEIGHTS = stats.norm.pdf(_Z_NODES) * (_Z_NODES[1] - _Z_NODES[0])


@functools.lru_cache(maxsize=256)
def _best_set_constant(configurations: int, confidence: float, nu: float) -> float:
    nodes = 64
    scale = (
        np.ones(1)
        if math.isinf(nu)
        else np.sqrt(stats.chi2.ppf((np.arange(nodes) + 0.5) / nodes, max(nu, 1e-3)) / max(nu, 1e-3))
    )

    def shortfall(d: float) -> float:
        shifted = _Z_NODES[None, :] + d * math.sqrt(2) * scale[:, None]
        return float(np.mean(np.exp((configurations - 1) * special.log_ndtr(shifted)) @ _Z_WEIGHTS)) - confidence

    high = 1.0
    while shortfall(high) < 0:
        high *= 2
        if high > 1e4:
            return math.inf
    return float(optimize.brentq(shortfall, 0.0, high, xtol=1e-6))


def _pooled_variance(table: pd.DataFrame, by: list[str], std: str) -> tuple[pd.Series, pd.Series]:
    """Per configuration: s², the run-to-run variance of one run's score pooled over its group of ``by``
    (the median of the replicated configurations' variances ``std``², each scaled by the median of
    χ²_{R−1}/(R−1) so that it estimates σ², s² ~ σ²χ²_{R−1}/(R−1): robust to diverged configurations
    whose scores scatter widely), and its degrees of freedom, half of Σ(R_k − 1) (the median keeps
    about half the information); NaN and 0 where no configuration of the group is replicated."""
    r = table["replicates"].astype(float)
    replicated = r >= 2
    scaled = (table[std] ** 2) / (stats.chi2.median(np.maximum(r - 1, 1)) / np.maximum(r - 1, 1))
    groups = [table[c] for c in by]
    pooled = scaled.where(replicated).groupby(groups, sort=False, dropna=False).transform("median")
    df = (r - 1).where(replicated, 0.0).groupby(groups, sort=False, dropna=False).transform("sum") / 2
    return pooled, df.where(df >= 1, np.where(df > 0, 1.0, 0.0))


def _run_spread(table: pd.DataFrame, by: list[str], std: str) -> tuple[pd.Series, pd.Series]:
    """Per configuration: the variance of one run's score over fresh coins, the group's pooled s²
    (``_pooled_variance``) or the configuration's own where that is larger (a configuration noisier
    than the rest keeps its spread), and the pooled variance's degrees of freedom. The pooled ones
    also for the larger own variance: its R − 1 (1 at R = 2) would make the t factor 12.7 where the
    pool's is about 2 (measured in ``bench/bench_intervals.py``: 98 % coverage and intervals twice
    as wide at R = 2 with R − 1, 97.1–97.7 % with the pool's)."""
    pooled, df = _pooled_variance(table, by, std)
    own = table[std] ** 2
    return pooled.where(~(own > pooled), own), df


def _noise_scale(table: pd.DataFrame, by: list[str]) -> tuple[pd.Series, pd.Series]:
    """Per configuration: its score's standard error ``noise_se`` and the degrees of freedom of the
    variance behind it (``rank_configurations`` says how)."""
    r = table["replicates"].astype(float)
    variance, df = _run_spread(table, by, "val_std")
    binomial = np.sqrt(table["val_accuracy"] * (1 - table["val_accuracy"]) / table["num_val"]).fillna(0.0)
    se = np.where(r >= 2, np.sqrt(variance / r), np.fmax(np.sqrt(variance), binomial))
    nu = np.where(df > 0, df, np.inf)
    return pd.Series(se, index=table.index), pd.Series(nu, index=table.index)


def rank_configurations(
    trials: pd.DataFrame, by: Sequence[str] = tuple(CELL), confidence: float = CONFIDENCE, means: Sequence[str] = ()
) -> pd.DataFrame:
    """One row per configuration of finished ``trials``, ranked within each group of ``by``.

    A configuration is ``[*by, "configuration_id"]``: the replicates (fresh-coin runs) of one
    sampled (C, B, η₀) of a cell. ``configuration_id`` is content-based (cell key and a digest of
    the parameters), so replicates recorded by a resumed or repeated search pool into one
    configuration; trials of datasets before schema 3 are each their own configuration (R = 1).

    Columns: ``by``, ``configuration_id``, the parameters of its first replicate (``clip_bound``,
    ``batch_size``, ``learning_rate``, ``base_learning_rate``, ``clipping``, ``optimizer``,
    ``clip_bin``/``batch_bin`` where present, ``search_id``/``trial_id`` of replicate 0 or the
    lowest recorded), ``replicates`` R; ``val_accuracy``, ``test_accuracy``, ``train_loss``: means
    over the replicates; ``val_std``/``test_std``: sample standard deviations (ddof 1, NaN at
    R = 1); ``val_se``/``test_se`` = std/√R; ``num_val``/``num_test``: split sizes (rows); each
    column of ``means`` (e.g. the ``easy``/``hard`` class accuracies): its mean over the replicates.

    Ranking (``rank``, 1 = best in its group): mean validation accuracy, ties to the lower mean
    train loss, then the smaller ``configuration_id``. Never test accuracy.

    Within noise of the best (``within_noise``) is the ``confidence`` set of the best configuration
    (Gupta's subset selection, ``best_set_constant``): configuration k is in it when
    val_b − val_k ≤ d·√(se_b² + se_k²), b the group's best and d Gupta's constant for the group's
    K configurations (``set_constant``; ``gap`` and ``noise_threshold`` hold both sides). The set
    holds the configuration that is truly best (in expected validation accuracy over the coins)
    with probability ≥ ``confidence`` however the K compare, so the range of C and B over it is an
    interval of the optimal C and B that accounts for *which* configuration is best, not only for
    one configuration's replicate noise. ``noise_se`` is
    - with R ≥ 2 replicates: √(max(s², s_k²)/R_k), s² the group's pooled replicate variance (the
      median of the configurations' variances, each scaled by the median of χ²_{R−1}/(R−1): robust
      to diverged configurations whose scores scatter widely) and s_k² the configuration's own
      (never below it: a configuration noisier than the rest keeps its own spread). d is solved
      for the pooled variance's degrees of freedom, taken as half of Σ(R_k − 1) (the median's
      efficiency). The validation split's own sampling noise is left out: every configuration is
      scored on the same rows, so it moves all of them together and mostly cancels in a comparison;
    - with R = 1 (no replicate spread of its own): the pooled s where other configurations have
      replicates, and never below the binomial standard error of one score on the validation
      split, √(p(1 − p)/n_val) — the only noise scale a lone run has, the selection noise of a
      finite split (1.2 points at n_val = 1,129 and p = 0.8); 0 when n_val is not recorded (then
      only exact ties are within noise).
    The best is within noise of itself.
    """
    _check_confidence(confidence)
    by = list(by)
    key = [*by, "configuration_id"]
    params = [
        c
        for c in (
            "clip_bound",
            "batch_size",
            "learning_rate",
            "base_learning_rate",
            "clipping",
            "optimizer",
            "clip_bin",
            "batch_bin",
            "epsilon",
            "epochs",
            "task",
            "cell_id",
            "search_id",
            "trial_id",
        )
        if c in trials and c not in key
    ]
    columns = [
        *key,
        *params,
        "replicates",
        "val_accuracy",
        "val_std",
        "val_se",
        "test_accuracy",
        "test_std",
        "test_se",
        "train_loss",
        "num_val",
        "num_test",
        *means,
        "noise_se",
        "rank",
        "gap",
        "set_constant",
        "noise_threshold",
        "within_noise",
    ]
    if trials.empty:
        return _empty_with(trials[[*key, *params]], columns)
    ordered = trials.sort_values(["replicate", "search_id", "trial_id"], kind="mergesort")
    groups = ordered.groupby(key, sort=False, dropna=False)
    table = groups[params].first()
    table["replicates"] = groups.size()
    for measure in ("val_accuracy", "test_accuracy"):
        prefix = measure.split("_")[0]
        table[measure] = groups[measure].mean()
        table[f"{prefix}_std"] = groups[measure].std(ddof=1)
        table[f"{prefix}_se"] = table[f"{prefix}_std"] / np.sqrt(table["replicates"])
    for column in ("train_loss", *means):
        table[column] = groups[column].mean()
    table["num_val"] = groups["num_val"].median()
    table["num_test"] = groups["num_test"].median()
    table = table.reset_index()
    table["noise_se"], nu = _noise_scale(table, by)
    table = table.sort_values(
        [*by, "val_accuracy", "train_loss", "configuration_id"],
        ascending=[True] * len(by) + [False, True, True],
        na_position="last",
        kind="mergesort",
    )
    grouped = table.groupby(by, sort=False)
    table["rank"] = grouped.cumcount() + 1
    sizes = grouped["configuration_id"].transform("size")
    table["set_constant"] = [
        best_set_constant(int(k), confidence, float(v)) for k, v in zip(sizes, nu.loc[table.index], strict=True)
    ]
    best = grouped[["val_accuracy", "noise_se"]].transform("first")
    table["gap"] = best["val_accuracy"] - table["val_accuracy"]
    table["noise_threshold"] = table["set_constant"] * np.sqrt(best["noise_se"] ** 2 + table["noise_se"] ** 2)
    table["within_noise"] = table["gap"] <= table["noise_threshold"] + 1e-12
    return table.reset_index(drop=True)[columns]


def _empty_with(frame: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """No rows; ``frame``'s columns keep their dtypes (so merges on them work), the others are float."""
    empty = frame.iloc[0:0].copy()
    for column in columns:
        if column not in empty:
            empty[column] = pd.Series(dtype=float)
    return empty[list(columns)]


def with_intervals(ranked: pd.DataFrame, by: Sequence[str], confidence: float = CONFIDENCE) -> pd.DataFrame:
    """``ranked`` (``rank_configurations``'s table, grouped by ``by``) with the ``confidence`` interval of
    every configuration's mean validation and test accuracy: ``val_low``/``val_high``,
    ``test_low``/``test_high`` and ``interval_source`` (of the test interval), by
    :func:`dptune.analysis.intervals.accuracy_intervals`: the run-to-run spread pooled over the group's
    configurations (``_run_spread``) over R, plus the split's binomial noise, never narrower than the
    split's Wilson interval; the split's alone where no configuration of the group is replicated."""
    table = ranked.copy()
    for measure, rows in (("val", "num_val"), ("test", "num_test")):
        variance, df = _run_spread(table, list(by), f"{measure}_std")
        table[f"{measure}_low"], table[f"{measure}_high"], source = accuracy_intervals(
            table[f"{measure}_accuracy"], table[rows], table["replicates"], variance, df, confidence
        )
    table["interval_source"] = source
    return table


def best_configurations(
    trials: pd.DataFrame, by: Sequence[str] = tuple(CELL), confidence: float = CONFIDENCE, means: Sequence[str] = ()
) -> pd.DataFrame:
    """The best configuration of each group of ``by`` (``rank_configurations``'s rank 1), with intervals.

    Columns of ``rank_configurations`` for the best, plus ``val_low``/``val_high`` and
    ``test_low``/``test_high``: the ``confidence`` interval of its mean accuracy, and
    ``interval_source`` (``with_intervals``). ``configurations``: how
    many the group ranked; ``within_noise``: how many are within noise of the best (≥ 1), its
    confidence set (``rank_configurations``); ``clip_low``/``clip_high``, ``batch_low``/``batch_high``:
    the extreme C and B of that set, the ``confidence`` interval of the optimal C and B (it holds
    the truly best configuration's C and B at least as often as the set holds that configuration).
    """
    ranked = rank_configurations(trials, by, confidence, means)
    by = list(by)
    extra = [
        "val_low",
        "val_high",
        "test_low",
        "test_high",
        "interval_source",
        "configurations",
        "within_noise",
        "clip_low",
        "clip_high",
        "batch_low",
        "batch_high",
    ]
    if ranked.empty:
        return _empty_with(ranked.drop(columns="within_noise"), [*ranked.columns.drop("within_noise"), *extra])
    near = ranked[ranked["within_noise"]]
    spread = near.groupby(by).agg(
        within_noise=("configuration_id", "size"),
        clip_low=("clip_bound", "min"),
        clip_high=("clip_bound", "max"),
        batch_low=("batch_size", "min"),
        batch_high=("batch_size", "max"),
    )
    spread["configurations"] = ranked.groupby(by).size()
    ranked = with_intervals(ranked, by, confidence)
    best = ranked[ranked["rank"] == 1].drop(columns="within_noise").merge(spread.reset_index(), on=by)
    kept = [c for c in ranked.columns if c != "within_noise" and c not in extra]
    return best.sort_values(by).reset_index(drop=True)[[*kept, *extra]]
