"""Split arithmetic on label arrays and per-row content digests (no data read here).

The train/validation membership of a row, and the test membership of a row of a dataset without
an official test split, is a *per-row* decision (:func:`held_out`): a keyed hash of the row's
content digest against the fraction, so that adding or removing one row of the pool moves no
other row. The difficulty knobs and caps are seeded stratified samples (:func:`stratified_sample`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

TEST_FRACTION = 0.2
"""Share of a dataset without an official test split that is held out as its test split."""
TEST_SPLIT_SEED = 20_251_020
"""Fixed seed of that test split: every trial of every seed is tested on the same examples."""

DIGEST_SIZE = 16
"""Bytes of a row's content digest (:func:`content_digests`)."""
VALIDATION, TEST = "validation", "test"
"""Purposes of :func:`held_out`: each has its own key, so the two decisions are independent."""

# Independent random streams per use, so that changing one knob does not reshuffle another
# (1 was the validation split's stream before it became a per-row hash).
_FRACTION, _EXAMPLES_PER_CLASS, _CAP = 2, 3, 4


def content_digests(contents: Iterable[bytes | memoryview], labels: np.ndarray) -> np.ndarray:
    """``(n, DIGEST_SIZE)`` uint8: blake2b of each row's label (int64) and content bytes.

    ``contents[i]`` is what identifies row ``i`` in the raw dataset (see
    ``dptune.data.workload.row_digests``); identical label and content give identical digests.
    """
    digests = bytearray()
    for label, content in zip(labels.tolist(), contents, strict=True):
        digest = hashlib.blake2b(int(label).to_bytes(8, "little", signed=True), digest_size=DIGEST_SIZE)
        digest.update(content)
        digests += digest.digest()
    return np.frombuffer(bytes(digests), dtype=np.uint8).reshape(len(labels), DIGEST_SIZE)


def split_key(seed: int, purpose: str) -> bytes:
    """The blake2b key of the per-row decision for ``purpose`` under the public split ``seed``."""
    return hashlib.blake2b(f"{purpose}:{seed}".encode(), digest_size=32, person=b"dptune-split").digest()


def uniform_draws(digests: np.ndarray, seed: int, purpose: str) -> np.ndarray:
    """uint64 ``u`` per row of ``digests`` (``(n, DIGEST_SIZE)``, :func:`content_digests`): the
    keyed blake2b (8 bytes, big-endian) of its digest, uniform in ``[0, 2**64)`` over rows and a
    function of that row's digest, ``seed`` and ``purpose`` alone."""
    key, data = split_key(seed, purpose), memoryview(np.ascontiguousarray(digests, dtype=np.uint8).tobytes())
    draws = b"".join(
        hashlib.blake2b(data[start : start + DIGEST_SIZE], key=key, digest_size=8).digest()
        for start in range(0, len(data), DIGEST_SIZE)
    )
    return np.frombuffer(draws, dtype=">u8").astype(np.uint64)


def held_out(digests: np.ndarray, fraction: float, seed: int, purpose: str) -> np.ndarray:
    """Boolean mask: row ``i`` is held out iff ``uniform_draws(...)[i] < fraction·2**64``.

    Each row is held out with probability ``fraction``, independently of every other row: adding
    or removing a row changes no other row's side; rows with identical digests (identical label
    and content) land on the same side. The number held out is binomial, ≈ ``fraction·n``.
    """
    threshold = np.uint64(min(int(fraction * 2**64), 2**64 - 1))
    return uniform_draws(digests, seed, purpose) < threshold


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
