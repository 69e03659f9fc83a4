"""The plan's arithmetic: how a run turns (N, B, E) into DP-SGD steps, and the batch-size rule.

Single source of truth for how a trial turns (N, B, E) into DP-SGD steps: with Poisson sampling at
rate q = B/N (``sample_rate``) a step visits each example with probability q, so E epochs are
E·N/B steps; a trial runs exactly T = round(E·N/B) steps (``total_steps``), rounded once over
the whole budget, and σ is calibrated for that (q, T). The expected passes over the data, T·q,
are then within q/2 of E. (Rounding per epoch instead, E·round(N/B), drifts: N = 50000, B = 32768
gives 2 steps per epoch at q = 0.655, 1.31 passes per epoch.) Epoch e ends at step round(e·N/B)
(``epoch_steps``), so every epoch boundary is within q/2 passes of e as well.

Accounting-free: σ is calibrated in :mod:`dptune.plan.mechanism` only.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from fractions import Fraction

from dptune.contract import PublicSchedule, TrialConfig
from dptune.errors import DptuneError

#: T_min of the min-step rule: the paper saw no convergence below ~20 steps on one dataset.
DEFAULT_MIN_STEPS = 20
#: Relative tolerance that defines the σ√T plateau: within 5% of the minimum.
DEFAULT_TOLERANCE = 0.05
DEFAULT_DELTA = 1e-5
#: η₀ and B_ref of the √B coupling (a common DP-Adam rate at a mid-sized batch).
DEFAULT_BASE_LEARNING_RATE = 1e-3
DEFAULT_REFERENCE_BATCH_SIZE = 256
#: Smallest batch size of the default grid (powers of two from here up to N, plus N).
SMALLEST_DEFAULT_BATCH_SIZE = 16
#: Most steps T one configuration may plan: σ calibration (PRV accountant) grows with T, from
#: about 10 s at T ≈ 2·10⁴ to 35 s at 2·10⁵ and past a minute (and gigabytes) beyond 10⁶ on
#: 2 cores, so a larger T is refused before any accounting instead of hanging.
MAX_STEPS = 1_000_000


def _is_count(value: object) -> bool:
    """An integer ≥ 1 (numpy integers included, bool excluded)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1


def _check_sizes(num_examples: int, batch_size: int) -> None:
    if not _is_count(num_examples):
        raise ValueError(f"num_examples (N) must be an integer ≥ 1, got {num_examples!r}")
    if not (_is_count(batch_size) and batch_size <= num_examples):
        raise ValueError(f"batch_size (B) must be an integer in [1, num_examples={num_examples}], got {batch_size!r}")


def sample_rate(num_examples: int, batch_size: int) -> float:
    """Poisson sampling rate q = B/N (B is the expected batch size)."""
    _check_sizes(num_examples, batch_size)
    return batch_size / num_examples


def _steps_after(num_examples: int, batch_size: int, epochs: int) -> int:
    """round(E·N/B), exactly (integer arithmetic; Python's round: halves go to the even side).
    It is ≥ E, as B ≤ N."""
    return round(Fraction(epochs * num_examples, batch_size))


def _check_epochs(epochs: int) -> None:
    if not _is_count(epochs):
        raise ValueError(f"epochs (E) must be an integer ≥ 1, got {epochs!r}")


def total_steps(num_examples: int, batch_size: int, epochs: int) -> int:
    """Steps T a trial runs: round(E·N/B) (≥ E ≥ 1 as B ≤ N), the fixed-epoch budget E·N/B rounded once.

    σ is calibrated for exactly this T at q = B/N; the expected passes over the data T·q then satisfy
    |T·q − E| ≤ q/2.
    """
    _check_sizes(num_examples, batch_size)
    _check_epochs(epochs)
    return _steps_after(num_examples, batch_size, epochs)


def epoch_steps(num_examples: int, batch_size: int, epochs: int) -> list[int]:
    """The steps of each of the E epochs: epoch e ends at step round(e·N/B) (= max(e, round(e·N/B))
    as B ≤ N).

    Invariants: E entries, each ≥ 1 (consecutive ends differ by N/B ≥ 1 before rounding), summing to
    ``total_steps(N, B, E)``; after epoch e the expected passes over the data are within q/2 of e.
    Full batch (B = N) gives [1]·E; B dividing N gives [N/B]·E; otherwise the entries are
    ⌊N/B⌋ or ⌈N/B⌉ (e.g. N = 10, B = 4, E = 4: [2, 3, 3, 2]).
    """
    _check_sizes(num_examples, batch_size)
    _check_epochs(epochs)
    ends = [_steps_after(num_examples, batch_size, epoch) for epoch in range(epochs + 1)]
    return [end - start for start, end in itertools.pairwise(ends)]


def full_schedule(num_train: int, batch_size: int, epochs: int) -> PublicSchedule:
    """The Poisson schedule of B over E epochs of all ``num_train`` rows: q = B/N, T = ``total_steps``,
    ``epoch_steps`` and the expected batch q·N = B (examples)."""
    return PublicSchedule(
        sample_rate=sample_rate(num_train, batch_size),
        steps=total_steps(num_train, batch_size, epochs),
        epoch_steps=tuple(epoch_steps(num_train, batch_size, epochs)),
        expected_batch_size=float(batch_size),
    )


def run_schedule(config: TrialConfig, num_train: int) -> PublicSchedule:
    """The Poisson schedule ``config`` trains by on ``num_train`` rows: its public one where it has one
    (a tuning run on a secret subsample), else :func:`full_schedule` of its B and E."""
    if config.schedule is not None:
        return config.schedule
    return full_schedule(num_train, config.batch_size, config.epochs)


def coupled_learning_rate(base_learning_rate: float, batch_size: float, reference_batch_size: int) -> float:
    """√B coupling: η = η₀·√(B/B_ref) (B an expected batch: a tuning run's q·q₁·N may be fractional)."""
    if not base_learning_rate > 0:
        raise ValueError(f"base_learning_rate (η₀) must be > 0, got {base_learning_rate!r}")
    if not (batch_size > 0 and reference_batch_size >= 1):
        raise ValueError(f"batch sizes must be > 0 (B_ref ≥ 1), got B={batch_size!r}, B_ref={reference_batch_size!r}")
    return base_learning_rate * math.sqrt(batch_size / reference_batch_size)


def default_batch_sizes(num_examples: int) -> list[int]:
    """Powers of two from 16 up to N, plus full batch N."""
    sizes = []
    batch_size = SMALLEST_DEFAULT_BATCH_SIZE
    while batch_size < num_examples:
        sizes.append(batch_size)
        batch_size *= 2
    return sizes + [num_examples]


def recommended_batch_size(
    batch_sizes: Sequence[int],
    cumulative_noise: Sequence[float],
    steps: Sequence[int],
    min_steps: int,
    tolerance: float,
) -> int | None:
    """The smallest B with T ≥ ``min_steps`` and σ√T ≤ (1 + ``tolerance``)·min{σ√T : T ≥ min_steps}.

    None when no B meets the min-step rule.
    """
    eligible = [(b, noise) for b, noise, t in zip(batch_sizes, cumulative_noise, steps, strict=True) if t >= min_steps]
    if not eligible:
        return None
    floor = min(noise for _, noise in eligible)
    return min(b for b, noise in eligible if noise <= (1 + tolerance) * floor)


class PlanError(DptuneError, ValueError):
    """A planning input out of range; the message names the parameter, its flag and what is allowed."""


def check_min_steps_reachable(num_examples: int, smallest_batch_size: int, epochs: int, min_steps: int) -> None:
    """Refuse a plan in which no B qualifies: T = round(E·N/B) < ``min_steps`` even at the smallest B, which
    gives the most steps (``PlanError`` saying so and what would let one qualify: a lower T_min, more
    epochs, or smaller batch sizes)."""
    most = total_steps(num_examples, smallest_batch_size, epochs)
    if most >= min_steps:
        return
    more_epochs = math.ceil(Fraction(2 * min_steps - 1, 2) * smallest_batch_size / num_examples)
    while total_steps(num_examples, smallest_batch_size, more_epochs) < min_steps:
        more_epochs += 1  # round() takes halves to the even side: at most one more
    largest = math.floor(Fraction(epochs * num_examples) / Fraction(2 * min_steps - 1, 2))
    while largest >= 1 and total_steps(num_examples, largest, epochs) < min_steps:
        largest -= 1
    smaller = f", or give batch sizes B ≤ {largest} (--batch-sizes)" if largest >= 1 else ""
    raise PlanError(
        f"--min-steps {min_steps}: no batch size qualifies: T = round(E·N/B) < {min_steps} for every B (N = "
        f"{num_examples}, E = {epochs}: the most steps are T = {most}, at B = {smallest_batch_size}). Lower "
        f"--min-steps to {most} or less, raise --epochs to {more_epochs} or more{smaller}"
    )


def check_max_steps(num_examples: int, batch_size: int, epochs: int, where: str) -> None:
    """Refuse a configuration whose T = round(E·N/B) exceeds ``MAX_STEPS`` (``PlanError`` naming ``where``)."""
    steps = total_steps(num_examples, batch_size, epochs)
    if steps > MAX_STEPS:
        smallest = math.ceil(epochs * num_examples / MAX_STEPS)
        fix = f"batch sizes B ≥ {smallest} or fewer epochs" if smallest <= num_examples else "fewer epochs"
        raise PlanError(
            f"{where}: B = {batch_size} gives T = E·N/B = {steps} steps (N = {num_examples}, "
            f"E = {epochs}), more than the {MAX_STEPS} steps σ can be calibrated for in bounded time "
            f"(use {fix})"
        )
