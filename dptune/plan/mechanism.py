"""σ, calibrated once: the one module outside :mod:`dptune.privacy` that calls ``calibrate_noise_multiplier``.

The planner (``dptune.search.planning.cells``: ``plan_cells_per_cell``, ``plan_private_cell``,
``plan_subsample_cell``; the ``python -m dptune.plan`` table) calibrates the σ of every run here and hands it
on as a :class:`~dptune.contract.Mechanism` (σ, q, T, the epoch split, the expected batch, the (ε, δ) target);
every consumer reads that object: the runners step with it, the privacy ledger charges it, an unfinished run's
ε is accounted at it. Nothing downstream calibrates again, so a planner/runner disagreement cannot hide behind
a cached calibrator that happens to get the same inputs.

σ that :mod:`dptune.privacy` computes as part of a larger plan (private selection's per-trial ε, a
subsample tuning's per-run ε) is wrapped, not recomputed (:func:`mechanism_of`, :func:`wrapped`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace

from tqdm import tqdm

from dptune.contract import Mechanism, PublicSchedule, TrialConfig
from dptune.plan.schedule import full_schedule
from dptune.privacy import calibrate_noise_multiplier

#: A point to calibrate: (ε, E, B), at the plan's δ and N (q = B/N, T = round(E·N/B)).
Point = tuple[float, int, int]


def mechanism_of(schedule: PublicSchedule, noise_multiplier: float, epsilon: float, delta: float) -> Mechanism:
    """The mechanism of ``schedule`` at a σ already certified for (``epsilon``, ``delta``) at its (q, T)
    (by :func:`mechanism`, or by :mod:`dptune.privacy`'s plans): no accounting."""
    return Mechanism(
        noise_multiplier=float(noise_multiplier),
        sample_rate=schedule.sample_rate,
        steps=schedule.steps,
        epoch_steps=tuple(schedule.epoch_steps),
        expected_batch_size=schedule.expected_batch_size,
        epsilon=epsilon,
        delta=delta,
    )


def mechanism(
    epsilon: float,
    delta: float,
    num_train: int,
    batch_size: int,
    epochs: int,
    schedule: PublicSchedule | None = None,
) -> Mechanism:
    """The mechanism of one run: ``schedule`` (a tuning run's public one) or the full data's
    (q = B/N, T = round(E·N/B), ``dptune.plan.full_schedule``), with σ calibrated for (ε, δ) at its (q, T)."""
    public = full_schedule(num_train, batch_size, epochs) if schedule is None else schedule
    sigma = calibrate_noise_multiplier(epsilon, delta, public.sample_rate, public.steps)
    return mechanism_of(public, sigma, epsilon, delta)


def with_mechanism(config: TrialConfig, num_train: int) -> TrialConfig:
    """``config`` with its :func:`mechanism` on ``num_train`` training rows (its ε, δ, B, E and public
    schedule): what a caller that runs a trial outside a search (a test, a benchmark) hands the runner."""
    found = mechanism(config.epsilon, config.delta, num_train, config.batch_size, config.epochs, config.schedule)
    return replace(config, mechanism=found)


def mechanisms(points: Iterable[Point], delta: float, num_train: int, progress: bool = False) -> dict[Point, Mechanism]:
    """The :func:`mechanism` of every (ε, E, B) point at δ on ``num_train`` rows, in one thread per core:
    the PRV accountant's numpy work releases the GIL, so on 2 cores the default space's 28 points took
    4.4–4.8 s instead of 8.6–8.7 s one after another (from an empty cache, hand-timed). ``progress``
    shows a tqdm bar on stderr (calibrations are cached, so a repeated plan is fast)."""
    order = sorted(set(points))
    if not order:
        return {}
    with (
        ThreadPoolExecutor(max_workers=max(1, min(len(order), os.cpu_count() or 1))) as pool,
        tqdm(
            total=len(order), desc="calibrating σ", unit="B", file=sys.stderr, disable=not progress, leave=False
        ) as bar,
    ):
        futures = {point: pool.submit(mechanism, point[0], delta, num_train, point[2], point[1]) for point in order}
        for _ in as_completed(futures.values()):
            bar.update()
        return {point: future.result() for point, future in futures.items()}


def wrapped(
    noise_multipliers: Mapping[int, float], epsilon: float, delta: float, num_train: int, epochs: int
) -> dict[int, Mechanism]:
    """Per B, the full-data mechanism (:func:`dptune.plan.full_schedule`) at the σ ``noise_multipliers``
    gives it, already certified for (``epsilon``, ``delta``) (private selection's and a subsample
    tuning release's σ, from :mod:`dptune.privacy`): no accounting."""
    return {
        b: mechanism_of(full_schedule(num_train, b, epochs), sigma, epsilon, delta)
        for b, sigma in noise_multipliers.items()
    }
