"""The interval of an accuracy: one function for every place that prints one (console, report, card,
MLflow, ``dptune.predict``).

An accuracy is measured on an evaluation split of n rows. What its interval covers depends on what
the number estimates, and the caller says which by what it passes:

- **a model's accuracy** (one trained model, e.g. a model card's): the split's own sampling noise only.
  The interval is Wilson's score interval of k = round(p·n) correct of n (Wilson 1927), exact enough
  at p near 0 or 1 and never of zero width;
- **a configuration's accuracy** (the mean p over R runs of one (C, B, η₀) with fresh coins, what a
  rerun of it scores on data like the split's): the coins' run-to-run variance s² (``run_variance``,
  pooled over the configurations of a cell so that it has ``run_df`` degrees of freedom even at R = 1
  or 2) over R, and the split's sampling noise, which every replicate shares and so does not shrink
  with R. The two are independent, and their intervals are combined by MOVER (Zou & Donner 2008,
  the method of variance estimates recovery), each side keeping its own shape::

      h = t_{run_df} · √(s² / R)                 (the coins' half-width),
      (l, u) = Wilson's interval of round(p·n) of n,
      [p − √(h² + (p − l)²),  p + √(h² + (u − p)²)].

  It contains the split's Wilson interval (h = 0: exactly it, so tied replicates give a
  Wilson-wide interval, never a point) and tends to p ± t·√(s²/R) where the coins dominate.
  Without a measured spread (``run_df`` = 0: no configuration of the cell was replicated) the
  coins' part cannot be estimated and the interval is the split's alone, i.e. the model's; its
  ``source`` says so.

Both are clipped to [0, 1]. The coverage of the nominal level is measured in
``bench/bench_intervals.py`` (``bench/RESULTS.md``), not assumed: 94.5–95.1 % for a model, 97.0–97.8 %
for a configuration at R = 2 and 5 (conservative: the split's term also counts the per-row part of
the coins' noise that s² holds, which only per-row scores could separate).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from dptune.analysis.results import CONFIDENCE

#: What an interval's width is made of: the split's binomial noise alone (a model's accuracy, or a
#: configuration whose coins' spread is unmeasured) or the coins' spread and the split's.
IntervalSource = Literal["split", "coins and split"]


def accuracy_intervals(
    accuracy: ArrayLike,
    rows: ArrayLike,
    replicates: ArrayLike = 1,
    run_variance: ArrayLike = np.nan,
    run_df: ArrayLike = 0.0,
    confidence: float = CONFIDENCE,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(low, high, source) of the ``confidence`` interval of each accuracy (the module's definition).

    ``accuracy``: a fraction in [0, 1], the mean over ``replicates`` runs; ``rows``: n, the split's
    rows (NaN or ≤ 0: unknown, the interval is NaN); ``run_variance``: s², the variance of one run's
    accuracy over fresh coins (NaN: unmeasured), with ``run_df`` degrees of freedom (0: unmeasured).
    Arrays broadcast. ``source`` holds an :data:`IntervalSource` per accuracy.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")
    p, n, r, s2, df = np.broadcast_arrays(
        *(np.asarray(value, dtype=float) for value in (accuracy, rows, replicates, run_variance, run_df))
    )
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        n = np.where(n > 0, n, np.nan)
        k = np.round(np.clip(p, 0, 1) * n)
        centre = (k + z * z / 2) / (n + z * z)
        wilson = z * np.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
        measured = (df > 0) & np.isfinite(s2) & (s2 >= 0)
        coins = np.where(
            measured, stats.t.ppf(0.5 + confidence / 2, np.where(measured, df, 1.0)) * np.sqrt(s2 / np.maximum(r, 1)), 0
        )
        low = p - np.sqrt(coins**2 + (p - (centre - wilson)) ** 2)
        high = p + np.sqrt(coins**2 + (centre + wilson - p) ** 2)
    unknown = np.isnan(n) | np.isnan(p)
    low = np.where(unknown, np.nan, np.clip(low, 0.0, 1.0))
    high = np.where(unknown, np.nan, np.clip(high, 0.0, 1.0))
    source = np.where(measured, "coins and split", "split")
    return low, high, source


def accuracy_interval(
    accuracy: float,
    rows: int,
    replicates: int = 1,
    run_variance: float = float("nan"),
    run_df: float = 0.0,
    confidence: float = CONFIDENCE,
) -> tuple[float, float] | None:
    """One accuracy's interval (:func:`accuracy_intervals`), or None where it has none (NaN accuracy,
    no rows). Without ``run_variance``, a model's accuracy: Wilson's interval of the split."""
    low, high, _ = accuracy_intervals(accuracy, rows, replicates, run_variance, run_df, confidence)
    if np.isnan(low) or np.isnan(high):
        return None
    return float(low), float(high)
