"""Choosing the precision features are encoded in (:func:`dptune.data.features.choose_precision`
records the choice per machine): each candidate is timed on a few probe rows of the data to
encode, and the fastest that its downstream evidence (:mod:`dptune.data.downstream`) allows is
chosen; where a backbone or precision has no evidence, its features' cosine to the reference's
decides. Torch-free: candidates come in as an ``encode(precision)`` callable.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from dptune.data.downstream import DownstreamAgreement

#: The precision every other is compared with: torch in full fp32.
REFERENCE_PRECISION = "fp32"
#: Without downstream evidence, a precision is chosen only if its features agree with the
#: reference's to this cosine on every probe row.
MIN_COSINE = 0.9999
#: Interleaved rounds of the measurement (median; the order reverses every round, so two rounds
#: time each candidate once early and once late).
PROBE_ROUNDS = 2


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision features are encoded in, and why.

    ``rows_per_s`` holds the measured speed of each candidate (rows per second of wall time,
    median of interleaved rounds); ``min_cosine`` each candidate's least cosine of a probe row's
    features to its torch fp32 ones; both empty when the precision was forced.
    """

    precision: str
    reason: str
    rows_per_s: dict[str, float]
    min_cosine: dict[str, float]


def ineligibility(
    precision: str, min_cosine: float, agreement: DownstreamAgreement | None, reference: str = REFERENCE_PRECISION
) -> str | None:
    """Why ``precision`` may not be chosen (None: it may). The reference always may. With downstream
    evidence (:mod:`dptune.data.downstream`) the rule is that evidence: inside the runs' noise, and
    features not so far from the reference's (below the evidence's ``sane_cosine``) that the runtime
    on this machine cannot be the one measured. Without it, the features' cosine to the
    reference's must reach ``MIN_COSINE`` on every probe row."""
    if precision == reference:
        return None
    if agreement is None:
        return None if min_cosine >= MIN_COSINE else f"cosine {min_cosine:.5f} < {MIN_COSINE}: not eligible"
    if min_cosine < agreement.sane_cosine:
        return f"cosine {min_cosine:.5f} < {agreement.sane_cosine:.5f}: not the runtime measured, not eligible"
    return None if agreement.inside_noise else f"{agreement.describe()}: not eligible"


def measure_precision(
    encode: Callable[[str], np.ndarray],
    rows: int,
    candidates: tuple[str, ...],
    clock: Callable[[], float] = time.perf_counter,
    rounds: int = PROBE_ROUNDS,
    agreement: Mapping[str, DownstreamAgreement] | None = None,
) -> PrecisionChoice:
    """Time ``encode(precision)`` (the same ``rows`` probe rows, features returned) in each of
    ``candidates`` (the first is the fp32 reference) and choose the fastest that
    :func:`ineligibility` allows: by the downstream ``agreement`` measured for it
    (:func:`dptune.data.downstream.downstream_agreement` of the backbone), else by its features'
    cosine to the reference's.

    One warm-up call each (its features give the cosine), then ``rounds`` interleaved rounds,
    the order reversing between rounds so that a drift of the machine's speed favours none; each
    candidate's speed is ``rows`` over its median time.
    """
    agreement = agreement or {}
    reference = encode(candidates[0])
    min_cosine = {candidates[0]: 1.0}
    for precision in candidates[1:]:
        found = encode(precision)
        similarity = (found * reference).sum(1) / (np.linalg.norm(found, axis=1) * np.linalg.norm(reference, axis=1))
        min_cosine[precision] = float(similarity.min())
    seconds: dict[str, list[float]] = {precision: [] for precision in candidates}
    for round_ in range(rounds):
        for precision in candidates if round_ % 2 == 0 else candidates[::-1]:
            start = clock()
            encode(precision)
            seconds[precision].append(clock() - start)
    rates = {precision: rows / max(statistics.median(times), 1e-9) for precision, times in seconds.items()}
    why_not = {p: ineligibility(p, min_cosine[p], agreement.get(p), candidates[0]) for p in candidates}
    chosen = max((p for p in candidates if why_not[p] is None), key=lambda p: rates[p])
    others = ", ".join(
        f"{p} {rates[p]:.0f}" + ("" if why_not[p] is None else f" ({why_not[p]})")
        for p in sorted(candidates, key=lambda p: -rates[p])
        if p != chosen
    )
    evidence = agreement.get(chosen)
    basis = (
        f"cosine to {candidates[0]} ≥ {min_cosine[chosen]:.5f}"
        if evidence is None
        else f"{evidence.summary()}; cosine to {candidates[0]} ≥ {min_cosine[chosen]:.5f}"
    )
    speed = f"{rates[chosen] / rates[candidates[0]]:.2f}x {candidates[0]}, {rates[chosen]:.0f} rows/s"
    reason = f"measured: {speed} ({basis}); {others}"
    return PrecisionChoice(chosen, reason, rates, min_cosine)
