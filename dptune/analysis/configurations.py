"""Configurations, replicates and uncertainty: the ranking every view that picks a best setting uses."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats

from dptune.analysis.results import CELL, CONFIDENCE, AnalysisError


def normal_quantile(confidence: float) -> float:
    """The two-sided standard normal quantile of ``confidence`` (1.96 at 0.95)."""
    return float(stats.norm.ppf(0.5 + confidence / 2))


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise AnalysisError(f"confidence must lie strictly between 0 and 1 (e.g. 0.95), got {confidence}")


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

    Within noise of the best (``within_noise``): configuration k is indistinguishable from the
    group's best b when val_b − val_k ≤ z·√(se_b² + se_k²) (z = 1.96 at ``confidence`` 0.95;
    ``gap`` and ``noise_threshold`` hold both sides), where ``noise_se`` is
    - with R ≥ 2 replicates: the replicate standard error val_std/√R — the spread of the
      training coins, the noise that selection can average away. The validation split's own
      sampling noise is left out: every configuration is scored on the same rows, so it moves
      all of them together and mostly cancels in a comparison;
    - with R = 1 (no replicate spread exists): the binomial standard error of one score on the
      validation split, √(p(1 − p)/n_val), as a floor — the only noise scale a single run has, the
      selection noise of a finite split (1.2 points at n_val = 1,129 and p = 0.8); 0 when n_val is
      not recorded (then only exact ties are within noise).
    The best is within noise of itself.
    """
    _check_confidence(confidence)
    by = list(by)
    key = [*by, "configuration_id"]
    if "configuration_id" not in trials:  # a frame built without the schema-3 keys: trials are configurations
        trials = trials.assign(configuration_id=trials["trial_id"], replicate=0)
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
    binomial = np.sqrt(table["val_accuracy"] * (1 - table["val_accuracy"]) / table["num_val"]).fillna(0.0)
    table["noise_se"] = np.where(table["replicates"] >= 2, table["val_se"], binomial)
    table = table.sort_values(
        [*by, "val_accuracy", "train_loss", "configuration_id"],
        ascending=[True] * len(by) + [False, True, True],
        na_position="last",
        kind="mergesort",
    )
    table["rank"] = table.groupby(by, sort=False).cumcount() + 1
    best = table.groupby(by, sort=False)[["val_accuracy", "noise_se"]].transform("first")
    table["gap"] = best["val_accuracy"] - table["val_accuracy"]
    table["noise_threshold"] = normal_quantile(confidence) * np.sqrt(best["noise_se"] ** 2 + table["noise_se"] ** 2)
    table["within_noise"] = table["gap"] <= table["noise_threshold"] + 1e-12
    return table.reset_index(drop=True)[columns]


def _empty_with(frame: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """No rows; ``frame``'s columns keep their dtypes (so merges on them work), the others are float."""
    empty = frame.iloc[0:0].copy()
    for column in columns:
        if column not in empty:
            empty[column] = pd.Series(dtype=float)
    return empty[list(columns)]


def _mean_interval(
    mean: pd.Series, std: pd.Series, replicates: pd.Series, rows: pd.Series, confidence: float
) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of the interval of a mean accuracy, clipped to [0, 1] (see ``best_configurations``)."""
    r = replicates.to_numpy(dtype=float)
    p = mean.to_numpy(dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        t = stats.t.ppf(0.5 + confidence / 2, np.maximum(r - 1, 1))
        replicated = t * std.to_numpy(dtype=float) / np.sqrt(r)
        binomial = normal_quantile(confidence) * np.sqrt(p * (1 - p) / rows.to_numpy(dtype=float))
    half = np.where(r >= 2, replicated, binomial)
    return np.clip(p - half, 0.0, 1.0), np.clip(p + half, 0.0, 1.0)


def best_configurations(
    trials: pd.DataFrame, by: Sequence[str] = tuple(CELL), confidence: float = CONFIDENCE, means: Sequence[str] = ()
) -> pd.DataFrame:
    """The best configuration of each group of ``by`` (``rank_configurations``'s rank 1), with intervals.

    Columns of ``rank_configurations`` for the best, plus ``val_low``/``val_high`` and
    ``test_low``/``test_high``: the ``confidence`` interval of its mean accuracy, and
    ``interval_source``:
    - ``"replicates"`` (R ≥ 2): Student t over the replicates, mean ± t_{R−1}·std/√R — what a
      rerun of the configuration with fresh coins scores on the same splits;
    - ``"binomial"`` (R = 1, no replicate spread exists): mean ± z·√(p(1 − p)/n), the sampling
      noise of one score on the n-row split; the training coins' spread is not measured.
    Both are clipped to [0, 1] (NaN where a split size is unrecorded). ``configurations``: how
    many the group ranked; ``within_noise``: how many are within noise of the best (≥ 1);
    ``clip_low``/``clip_high``, ``batch_low``/``batch_high``: the extreme C and B of that set.
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
    best = ranked[ranked["rank"] == 1].drop(columns="within_noise").merge(spread.reset_index(), on=by)
    for measure, rows in (("val", "num_val"), ("test", "num_test")):
        best[f"{measure}_low"], best[f"{measure}_high"] = _mean_interval(
            best[f"{measure}_accuracy"], best[f"{measure}_std"], best["replicates"], best[rows], confidence
        )
    best["interval_source"] = np.where(best["replicates"] >= 2, "replicates", "binomial")
    return best.sort_values(by).reset_index(drop=True)[[*[c for c in ranked.columns if c != "within_noise"], *extra]]


def _resampled_scores(
    group: pd.DataFrame, ranked: pd.DataFrame, resamples: int, rng: np.random.Generator
) -> np.ndarray:
    """(resamples, K) bootstrap mean validation accuracies of the K configurations of ``ranked``."""
    columns = []
    values = group.groupby("configuration_id")["val_accuracy"].apply(lambda s: s.to_numpy(dtype=float))
    for row in ranked.itertuples(index=False):
        own = values[row.configuration_id]
        if own.size >= 2:
            columns.append(own[rng.integers(0, own.size, size=(resamples, own.size))].mean(axis=1))
        elif np.isfinite(row.num_val) and row.num_val > 0:
            columns.append(rng.binomial(int(row.num_val), float(np.clip(own[0], 0, 1)), size=resamples) / row.num_val)
        else:
            columns.append(np.full(resamples, own[0]))
    return np.column_stack(columns)


def optimal_setting_intervals(
    trials: pd.DataFrame,
    by: Sequence[str] = tuple(CELL),
    resamples: int = 1000,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> pd.DataFrame:
    """Paper Fig. 2 with uncertainty: bootstrap intervals of the optimal C and B of each group of ``by``.

    Each of ``resamples`` rounds redraws every configuration's validation score and selects the
    best on validation again (never test): a configuration with R ≥ 2 replicates gets the mean of
    R replicates drawn with replacement; one with R = 1 a binomial draw Bin(n_val, p)/n_val of its
    validation split's sampling noise (a constant when n_val is unrecorded). Ties go to the
    better-ranked configuration (``rank_configurations``). ``clip_low``/``clip_high`` and
    ``batch_low``/``batch_high`` are the percentile interval at ``confidence`` of the selected C and
    B (inverted-CDF percentiles: the ends are values some round selected; percentiles commute with
    the logarithm, so this is also the percentile interval on a log axis);
    ``clip_bound``/``batch_size`` are the point estimate (the best configuration); ``selected_share``
    is the fraction of rounds that selected it and ``clip_share``/``batch_share`` those that selected
    its C / its B. ``source`` says which noise was resampled: ``replicates``, ``binomial`` or
    ``mixed``. ``seed`` fixes the bootstrap draws.
    With few replicates the intervals are narrow-biased: resampling R values keeps (R − 1)/R of
    their variance and never leaves their range (the within-noise set of ``rank_configurations``
    is the more cautious measure).
    """
    _check_confidence(confidence)
    if resamples < 1:
        raise AnalysisError(f"resamples must be ≥ 1, got {resamples}")
    by = list(by)
    columns = [
        *by,
        "clip_bound",
        "batch_size",
        "configurations",
        "replicates",
        "clip_low",
        "clip_high",
        "batch_low",
        "batch_high",
        "selected_share",
        "clip_share",
        "batch_share",
        "resamples",
        "source",
    ]
    ranked = rank_configurations(trials, by, confidence)
    if ranked.empty:
        return pd.DataFrame(columns=columns)
    rng = np.random.default_rng(seed)
    tail = (1 - confidence) / 2
    rows = []
    for key, cell in ranked.groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        mask = np.ones(len(trials), dtype=bool)
        for name, value in zip(by, key, strict=True):
            mask &= (trials[name] == value).to_numpy()
        chosen = _resampled_scores(trials[mask], cell, resamples, rng).argmax(axis=1)
        clips, batches = cell["clip_bound"].to_numpy(dtype=float), cell["batch_size"].to_numpy(dtype=float)
        best = cell.iloc[0]
        replicated = cell["replicates"] >= 2
        interval = {}
        for name, picked in (("clip", clips[chosen]), ("batch", batches[chosen])):
            low, high = np.quantile(picked, [tail, 1 - tail], method="inverted_cdf")
            interval[f"{name}_low"], interval[f"{name}_high"] = float(low), float(high)
        rows.append(
            {
                **dict(zip(by, key, strict=True)),
                "clip_bound": best["clip_bound"],
                "batch_size": best["batch_size"],
                "configurations": len(cell),
                "replicates": int(best["replicates"]),
                **interval,
                "selected_share": float(np.mean(chosen == 0)),
                "clip_share": float(np.mean(clips[chosen] == best["clip_bound"])),
                "batch_share": float(np.mean(batches[chosen] == best["batch_size"])),
                "resamples": resamples,
                "source": "replicates" if replicated.all() else "binomial" if not replicated.any() else "mixed",
            }
        )
    return pd.DataFrame(rows, columns=columns)
