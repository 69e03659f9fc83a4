"""Seeded, stratified split arithmetic on label arrays (no data touched)."""

from __future__ import annotations

import numpy as np

TEST_FRACTION = 0.2
"""Share of a dataset without an official test split that is held out as its test split."""
TEST_SPLIT_SEED = 20_251_020
"""Fixed seed of that test split: every trial of every seed is tested on the same examples."""

# Independent random streams per use, so that changing one knob does not reshuffle another.
_VALIDATION, _FRACTION, _EXAMPLES_PER_CLASS, _CAP = 1, 2, 3, 4


def allocate(class_sizes: np.ndarray, total: int) -> np.ndarray:
    """Split ``total`` over classes in proportion to ``class_sizes`` (largest-remainder method).

    Each class gets ``floor(total·n_c/N)`` or one more; the counts sum to ``total``; leftover
    units go to the largest fractional parts, ties to the lower class id.
    """
    quotas = total * class_sizes / class_sizes.sum()
    counts = np.floor(quotas).astype(np.int64)
    leftover = total - int(counts.sum())
    order = np.lexsort((np.arange(len(quotas)), -(quotas - counts)))
    counts[order[:leftover]] += 1
    return counts


def stratified_sample(rows: np.ndarray, labels: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    """``total`` of ``rows`` drawn without replacement, stratified by ``labels[rows]``; sorted."""
    classes, inverse = np.unique(labels[rows], return_inverse=True)
    counts = allocate(np.bincount(inverse, minlength=len(classes)), total)
    chosen = [rng.permutation(rows[inverse == c])[:count] for c, count in enumerate(counts)]
    return np.sort(np.concatenate(chosen)) if chosen else rows[:0]


def stream(seed: int, purpose: int) -> np.random.Generator:
    """The random stream for one purpose under ``seed``."""
    return np.random.default_rng([seed, purpose])


def carve(
    rows: np.ndarray, labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``rows`` into (held out ≈ fraction, rest), stratified; both sorted."""
    held = stratified_sample(rows, labels, round(fraction * len(rows)), rng)
    return held, np.setdiff1d(rows, held)


def cap(rows: np.ndarray, labels: np.ndarray, limit: int | None, rng: np.random.Generator) -> np.ndarray:
    """At most ``limit`` of ``rows``, stratified (all of them when ``limit`` is None or larger)."""
    if limit is None or limit >= len(rows):
        return rows
    return stratified_sample(rows, labels, limit, rng)


def per_class(rows: np.ndarray, labels: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Exactly ``count`` random rows of each class present in ``labels[rows]``; sorted.

    The caller checks that every class has at least ``count`` rows.
    """
    chosen = [rng.permutation(rows[labels[rows] == c])[:count] for c in np.unique(labels[rows])]
    return np.sort(np.concatenate(chosen))
