"""Expected values computed straight from the Parquet files with pandas, independently of dptune.analysis.

The tests compare what ``dptune.analysis`` and the report show with these. The rules are the
documented ones (selection on validation accuracy, ties to the lower train loss then the smaller
trial id; hard classes = the ⌈f·K⌉ least accurate classes of the best trial at the largest ε;
the fixed setting = the (C, B) with the best mean validation accuracy over all cells), written
again here with plain pandas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import brentq

TASK = ["dataset", "backbone"]
CELL = [*TASK, "epsilon", "epochs"]


def read(paths: Sequence[str], table: str) -> pd.DataFrame:
    """One table of every dataset, read with pandas (trials without a trials row dropped)."""
    frames = [pd.read_parquet(Path(p) / table) for p in paths if (Path(p) / table).is_dir()]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if table not in ("trials", "search") and len(frame):
        trials = read(paths, "trials")
        frame = frame.merge(trials[["search_id", "trial_id", *CELL]], on=["search_id", "trial_id"])
    return frame


def tuned(paths: Sequence[str]) -> pd.DataFrame:
    trials = read(paths, "trials")
    return trials[(trials["status"] == "ok") & (trials["clipping"] != "auto_s")]


def best(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    ordered = frame.sort_values(["val_accuracy", "train_loss", "trial_id"], ascending=[False, True, True])
    return ordered.groupby(keys, as_index=False).head(1).reset_index(drop=True)


def hard_labels(paths: Sequence[str], hard_fraction: float = 0.5) -> dict[tuple[str, str], set[int]]:
    """Hard class labels per (dataset, backbone)."""
    trials = read(paths, "trials")
    classes = read(paths, "classes")
    ok = trials[(trials["status"] == "ok")]
    ok = ok[ok["trial_id"].isin(classes.loc[classes["val_accuracy"].notna(), "trial_id"])]
    hard = {}
    for key, task in ok.groupby(TASK):
        reference = best(task[task["epsilon"] == task["epsilon"].max()], TASK).iloc[0]
        own = classes[(classes["trial_id"] == reference["trial_id"]) & (classes["search_id"] == reference["search_id"])]
        own = own.sort_values(["val_accuracy", "label"])  # strata come from validation, never test
        count = min(max(math.ceil(hard_fraction * len(own)), 1), len(own) - 1)
        hard[key] = set(own["label"].iloc[:count])
    return hard


def hard_accuracy(paths: Sequence[str], trials: pd.DataFrame, hard: dict[tuple[str, str], set[int]]) -> pd.Series:
    """Mean test accuracy over the hard classes of each trial in ``trials`` (aligned with it)."""
    classes = read(paths, "classes")
    is_hard = [
        label in hard[(dataset, backbone)]
        for dataset, backbone, label in classes[["dataset", "backbone", "label"]].itertuples(index=False)
    ]
    means = classes[is_hard].groupby(["search_id", "trial_id"])["test_accuracy"].mean()
    return pd.Series(
        [means.get((s, t), np.nan) for s, t in zip(trials["search_id"], trials["trial_id"], strict=True)],
        index=trials.index,
        dtype=float,
    )


def heatmap(paths: Sequence[str]) -> pd.DataFrame:
    """Per cell and exact (C, B): the test accuracy of the best trial on validation."""
    return best(tuned(paths), [*CELL, "clip_bound", "batch_size"])


def guideline(paths: Sequence[str], hard_fraction: float = 0.5) -> tuple[pd.DataFrame, tuple[float, int]]:
    """Per cell: best (C, B, η) with test and hard-class accuracy, the fixed (C, B) and the losses."""
    hard = hard_labels(paths, hard_fraction)
    cells = best(tuned(paths), CELL)
    cells["hard"] = hard_accuracy(paths, cells, hard)
    grid = heatmap(paths)
    count = len(cells)
    means = grid.groupby(["clip_bound", "batch_size"])["val_accuracy"].agg(["mean", "size"]).reset_index()
    means = means[means["size"] == count].sort_values(
        ["mean", "clip_bound", "batch_size"], ascending=[False, True, True]
    )
    clip, batch = means.iloc[0]["clip_bound"], int(means.iloc[0]["batch_size"])
    fixed = grid[(grid["clip_bound"] == clip) & (grid["batch_size"] == batch)].copy()
    fixed["hard"] = hard_accuracy(paths, fixed, hard)
    merged = cells.merge(fixed[[*CELL, "test_accuracy", "hard"]], on=CELL, suffixes=("", "_fixed"))
    merged["loss"] = merged["test_accuracy"] - merged["test_accuracy_fixed"]
    merged["hard_loss"] = merged["hard"] - merged["hard_fixed"]
    return merged, (float(clip), batch)


def cumulative_noise(paths: Sequence[str]) -> pd.DataFrame:
    """σ√T per (cell, B) from the trials that ran (σ recorded), with T."""
    trials = read(paths, "trials")
    ran = trials[np.isfinite(trials["noise_multiplier"]) & (trials["clipping"] != "auto_s")]
    table = (
        ran.groupby([*CELL, "batch_size"])
        .agg(sigma=("noise_multiplier", "first"), steps=("steps", "first"))
        .reset_index()
    )
    table["sigma_sqrt_t"] = table["sigma"] * np.sqrt(table["steps"])
    return table


def opacus_rdp(orders: np.ndarray, sigma: float, q: float, steps: int) -> np.ndarray:
    """RDP of T Poisson-subsampled Gaussian steps by Opacus' code (independent of dp_accounting)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    return np.array(compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders))


def papernot_steinke_geometric_rdp(rdp: np.ndarray, orders: np.ndarray, trials: float) -> np.ndarray:
    """Theorem 2 of Papernot & Steinke (ICLR 2022) with η = 1 (geometric, γ = 1/k), written out by hand
    over a trial's RDP curve: the selection's RDP curve at ``orders``."""
    gamma = 1 / trials
    constant = 2 * np.min((1 - 1 / orders) * rdp - math.log(gamma) / orders)
    selected = rdp + math.log(trials) / (orders - 1) + constant
    return np.array([selected[orders >= order].min() for order in orders])  # RDP is monotone in the order


def papernot_steinke_geometric(rdp: np.ndarray, orders: np.ndarray, trials: float, delta: float) -> float:
    """:func:`papernot_steinke_geometric_rdp` converted to (ε, δ) with Opacus' formula."""
    import warnings

    from opacus.accountants.analysis.rdp import get_privacy_spent

    selected = papernot_steinke_geometric_rdp(rdp, orders, trials)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        epsilon, _ = get_privacy_spent(orders=orders, rdp=selected, delta=delta)
    return float(epsilon)


def pld_epsilon(trials: Sequence[tuple[float, float, int]], delta: float) -> float:
    """ε at ``delta`` of composing ``trials`` (σ, q, steps), each T Poisson-subsampled Gaussian steps, by
    dp_accounting's public ``PLDAccountant`` (pessimistic discretisation of 1e-3): what dptune's composition,
    built from the same library's PLD parts, must reproduce."""
    from dp_accounting.dp_event import ComposedDpEvent, GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
    from dp_accounting.pld import PLDAccountant

    event = ComposedDpEvent(
        [SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(s)), t) for s, q, t in trials]
    )
    return PLDAccountant(value_discretization_interval=1e-3).compose(event).get_epsilon(delta)


def pld_root_epsilon(trials: Sequence[tuple[float, float, int]], delta: float) -> float:
    """ε at ``delta`` of composing ``trials`` (σ, q, total steps) with dp_accounting's pessimistic PLD on a 1e-3
    grid, read independently of dptune's reader: the root of δ(ε) = m_∞ + Σ_{ℓ>ε} p_ℓ(1 − e^{ε−ℓ})
    = δ by Brent's method, the sum taken in log space (the larger direction of add/remove)."""
    from dp_accounting.pld import privacy_loss_distribution

    composed = None
    for sigma, q, steps in trials:
        pld = privacy_loss_distribution.from_gaussian_mechanism(
            sigma, value_discretization_interval=1e-3, sampling_prob=q
        ).self_compose(steps)
        composed = pld if composed is None else composed.compose(pld)
    epsilons = []
    for pmf in (composed._pmf_remove.to_dense_pmf(), composed._pmf_add.to_dense_pmf()):
        losses = (pmf._lower_loss + np.arange(len(pmf._probs))) * pmf._discretization
        probs = np.maximum(pmf._probs, 0.0)

        def excess(epsilon: float, losses: np.ndarray = losses, probs: np.ndarray = probs, pmf: Any = pmf) -> float:
            above = losses > epsilon
            with np.errstate(divide="ignore"):
                log_terms = np.log(probs[above]) + np.log(-np.expm1(epsilon - losses[above]))
            return pmf._infinity_mass + float(np.exp(np.logaddexp.reduce(log_terms))) - delta

        epsilons.append(brentq(excess, 0.0, float(losses[-1]), xtol=1e-9))
    return max(epsilons)


def subsampled_tuning_epsilon(
    tuning: Sequence[tuple[float, float, int]],
    release: Sequence[tuple[float, float, int]],
    fraction: float,
    trials: float,
    score_noise_multiplier: float,
    delta: float,
) -> float:
    """Koskela & Kulkarni (NeurIPS 2023) variant 1 by hand, for the geometric trial count: each tuning
    candidate (σ, q, T) by Opacus' RDP plus the score's Gaussian, the worst of them through
    :func:`papernot_steinke_geometric_rdp`, amplified by a Poisson subsample of rate ``fraction`` with
    Zhu & Wang's Thm 6 in exact integer binomials, plus the worst release candidate's RDP, converted
    with Canonne, Kamath & Steinke's formula ε = min_α ε(α) + log((α−1)/α) − (log δ + log α)/(α−1)."""
    orders = np.arange(2, 129, dtype=float)
    score = orders / (2 * score_noise_multiplier**2)
    run = np.max([opacus_rdp(orders, s, q, t) for s, q, t in tuning], axis=0) + score
    selected = papernot_steinke_geometric_rdp(run, orders, trials)
    amplified = []
    for alpha in range(2, 129):
        logs = [(alpha - 1) * math.log1p(-fraction) + math.log1p((alpha - 1) * fraction)]
        for ell in range(2, alpha + 1):
            logs.append(
                math.log(math.comb(alpha, ell))
                + ell * math.log(fraction)
                + (alpha - ell) * math.log1p(-fraction)
                + (ell - 1) * selected[ell - 2]
                + (math.log(3) if ell >= 3 else 0.0)
            )
        top = max(logs)
        moment = top + math.log(math.fsum(math.exp(v - top) for v in logs))
        amplified.append(min(moment / (alpha - 1), selected[alpha - 2]))
    total = np.array(amplified) + np.max([opacus_rdp(orders, s, q, t) for s, q, t in release], axis=0)
    candidates = total + np.log((orders - 1) / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)
    return float(max(0.0, candidates.min()))
