"""The one-run audit's theorem: an empirical ε lower bound from guesses of canaries' inclusion.

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023): m canaries,
each included in the training independently with probability ½; the auditor guesses "in" for some and
"out" for others (r guesses, abstaining on the rest) and v of the guesses are right. If the training
is (ε, δ)-DP, then (their Theorem 3.3, Proposition 5.7 and Algorithm in §5)

    P[V ≥ v] ≤ β(ε, v) + 2·m·δ·α(ε, v),      p = e^ε / (1 + e^ε)
    β(ε, v) = P[Binomial(r, p) ≥ v],        α(ε, v) = max_{1 ≤ i ≤ v} P[v − i ≤ Binomial(r, p) < v] / i

so a training whose guesses reach v refutes (ε, δ)-DP at level ``p_value(m, r, v, ε, δ)``, and the
largest ε it refutes at level 1 − confidence is the empirical lower bound
(:func:`epsilon_lower_bound`). The bound is valid for guesses made from any score that does not
look at the inclusion coins; an audit that tries several (score, sides, r) guessings is valid for the
best of them when each is held to level (1 − confidence)/guessings (Bonferroni: :func:`best_bound`).

The bound can never exceed what m and δ allow: with every guess right, ε is capped near
ln(r/3) by β and, for δ > 0, by the 2mδ·α term (:func:`ceiling`). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

#: How the r guesses are made: ``in and out``, "in" for the ⌊r/2⌋ highest scores and "out" for the
#: ⌈r/2⌉ lowest (Steinke et al.'s k₊ = k₋), or ``in``, "in" for the r highest (k₋ = 0): a canary that
#: was in but never sampled scores as one that was out, so guessing "out" can cost right guesses that
#: guessing "in" alone does not.
SIDES: tuple[str, ...] = ("in and out", "in")
#: The guessings of an audit's family, with every score: (sides, share of the m canaries guessed on).
#: Few, because each is held to (1 − confidence)/family and at large m the theorem's 2mδ term makes
#: that costly (m = 20,000, δ = 1e-5, 9,000 right of 9,000: ε ≥ 7.4 alone, 5.6 as one of six).
GUESSINGS: tuple[tuple[str, float], ...] = (("in and out", 0.1), ("in and out", 0.5), ("in", 0.45))
#: Bisection steps of :func:`epsilon_lower_bound` (ε to about 2⁻⁴⁰ of its bracket).
_BISECTIONS = 40


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P[V ≥ ``correct``] under (ε, δ)-DP with m = ``canaries`` and r = ``guesses`` (module equation)."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ canaries, got {correct}, {guesses}, {canaries}")
    if correct == 0:
        return 1.0
    p = 1.0 / (1.0 + math.exp(-epsilon))
    beta = float(stats.binom.sf(correct - 1, guesses, p))
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, p)  # P[B = v − i], i = 1..v
    alpha = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return min(1.0, beta + 2.0 * canaries * delta * alpha)


def epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95) -> float:
    """The largest ε with ``p_value`` < 1 − ``confidence``: (ε, δ)-DP is refuted for every ε below it
    (0.0 when not even ε = 0 is refuted)."""
    level = 1.0 - confidence
    if p_value(canaries, guesses, correct, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(canaries, guesses, correct, high, delta) < level:
        low, high = high, 2.0 * high
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if p_value(canaries, guesses, correct, middle, delta) < level else (low, middle)
    return low


def ceiling(canaries: int, delta: float, confidence: float = 0.95) -> float:
    """The most any audit with m = ``canaries`` and one guessing can show: every one of m guesses right."""
    return epsilon_lower_bound(canaries, canaries, canaries, delta, confidence)


def correct_guesses(
    scores: np.ndarray, included: np.ndarray, guesses: int, rng: np.random.Generator, sides: str = SIDES[0]
) -> int:
    """Right guesses among r = ``guesses`` made on ``sides`` (:data:`SIDES`) from ``scores`` (ties in
    random order from ``rng``, which never sees the inclusion coins)."""
    order = np.lexsort((rng.random(len(scores)), scores))  # ascending score, ties shuffled
    high = guesses if sides == "in" else guesses // 2
    low = guesses - high
    return int(included[order[len(order) - high :]].sum() + (~included[order[:low]]).sum())


@dataclass(frozen=True)
class Guessing:
    """One (score, sides, r) member of an audit's family: its right guesses v and what they show."""

    score: str
    sides: str
    guesses: int
    correct: int
    epsilon_lower_bound: float
    p_value: float


@dataclass(frozen=True)
class AuditBound:
    """An audit's verdict on one training under one threat model: the best of its family of
    :class:`Guessing` s (each held to level (1 − ``confidence``)/family), the claim it is compared
    with, and its ``ceiling``: the most its family could show, every guess right."""

    canaries: int
    claimed_epsilon: float
    delta: float
    confidence: float
    best: Guessing
    family: tuple[Guessing, ...]
    ceiling: float

    @property
    def epsilon_lower_bound(self) -> float:
        """The empirical ε lower bound (at :attr:`confidence`, over the whole family)."""
        return self.best.epsilon_lower_bound

    @property
    def claim_refuted(self) -> bool:
        """Whether the lower bound exceeds the claimed ε: a broken mechanism (or an unlucky 1 − confidence)."""
        return self.epsilon_lower_bound > self.claimed_epsilon

    @property
    def claim_p_value(self) -> float:
        """The family's smallest p-value of the claimed (ε, δ), Bonferroni-corrected."""
        return min(1.0, min(g.p_value for g in self.family) * len(self.family))


def best_bound(
    scores: Mapping[str, np.ndarray],
    included: np.ndarray,
    claimed_epsilon: float,
    delta: float,
    rng: np.random.Generator,
    confidence: float = 0.95,
    guessings: Sequence[tuple[str, float]] = GUESSINGS,
    bounds: int = 1,
) -> AuditBound:
    """The :class:`AuditBound` of a family: every score of ``scores`` (name → one value per canary,
    higher meaning "more likely in") with every (sides, share) of ``guessings``, r = max(2, round(share·m)),
    each held to (1 − ``confidence``)/(family · ``bounds``), so that this bound and the ``bounds`` − 1
    others it is reported with (other threat models, other configurations) hold together at ``confidence``."""
    m = len(included)
    members = [(name, sides, min(m, max(2, round(share * m)))) for name in scores for sides, share in guessings]
    level = 1.0 - (1.0 - confidence) / (len(members) * bounds)
    family = []
    for name, sides, r in members:
        v = correct_guesses(np.asarray(scores[name], dtype=float), included, r, rng, sides)
        family.append(
            Guessing(
                score=name,
                sides=sides,
                guesses=r,
                correct=v,
                epsilon_lower_bound=epsilon_lower_bound(m, r, v, delta, level),
                p_value=p_value(m, r, v, claimed_epsilon, delta),
            )
        )
    best = max(family, key=lambda g: (g.epsilon_lower_bound, -g.p_value))
    return AuditBound(
        canaries=m,
        claimed_epsilon=claimed_epsilon,
        delta=delta,
        confidence=confidence,
        best=best,
        family=tuple(family),
        ceiling=max(epsilon_lower_bound(m, r, r, delta, level) for _, _, r in set(members)),
    )
