"""The plan of tuning on a private subsample (``privacy.private_selection.tuning_subsample``).

Koskela & Kulkarni (NeurIPS 2023), variant 1: the Papernot–Steinke tuning runs on X₁, a Poisson
subsample of rate q₁ of the training and validation rows; the best run's configuration, transferred
by a public rule, trains the release on every training row. A tuning run's Poisson rate and step
count are fixed from public numbers (N and q₁), never from |X₁|, so that the accountant's curve is
the run's (``dptune.privacy.subsampled_tuning``, assumption 2). ``tuning_schedule`` is the
transfer rule read backwards: the (q, T) a tuning run uses to stand for a full-data (B, E).

Ray-free and torch-free: the planner and ``--dry-run`` use it before any compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from dptune.errors import SearchError
from dptune.plan import sample_rate, total_steps
from dptune.privacy import PrivacyParameterError
from dptune.privacy.subsampled_tuning import plan_subsampled_tuning
from dptune.space import SearchSpace
from dptune.space.spec import TuningSubsampleSpec


def tuning_schedule(num_train: int, batch_size: int, epochs: int, fraction: float, transfer: str) -> tuple[float, int]:
    """(q, T) of a tuning run on X₁ that stands for the full-data configuration with expected batch
    ``batch_size`` over ``epochs`` epochs of ``num_train`` rows, for q₁ = ``fraction``.

    ``sample_rate``: the release's own q = B/N and T = round(E·N/B) (an expected batch of q₁·B on X₁).
    ``batch_size``: an expected batch of B on X₁'s public nominal size q₁·N, so q = B/(q₁·N) and
    T = max(1, round(E·q₁·N/B)); raises ``ValueError`` when B > q₁·N (q would exceed 1).
    """
    if transfer == "sample_rate":
        return sample_rate(num_train, batch_size), total_steps(num_train, batch_size, epochs)
    if transfer != "batch_size":
        raise ValueError(f"transfer must be 'sample_rate' or 'batch_size', got {transfer!r}")
    nominal = fraction * num_train
    if batch_size > nominal:
        raise ValueError(f"batch_size {batch_size} exceeds the tuning set's nominal size q₁·N = {nominal:g}")
    return batch_size / nominal, max(1, round(epochs * nominal / batch_size))


@dataclass(frozen=True)
class TuningPlan:
    """What tuning on a subsample runs, and what the whole costs.

    ``schedules[B]`` is a tuning run's (q, T) and ``noise_multipliers[B]`` its σ, for each tunable B;
    every tuning run and the release are calibrated to ``epsilon_per_run`` at δ. ``epsilon_tuning``
    (the amplified tuning alone) and ``epsilon_release`` (the release's training alone) are at δ;
    their RDP composition ``epsilon_total`` ≤ the space's ``private_selection.epsilon``.
    """

    fraction: float
    transfer: str
    epsilon_per_run: float
    schedules: dict[int, tuple[float, int]]
    noise_multipliers: dict[int, float]
    release_noise_multipliers: dict[int, float]
    epsilon_tuning: float
    epsilon_release: float
    epsilon_total: float
    untunable: tuple[int, ...] = ()  # B the min-step rule keeps but no tuning run can stand for


def tunable_batch_sizes(space: SearchSpace, feasible: tuple[int, ...], num_train: int) -> tuple[int, ...]:
    """The B of ``feasible`` a tuning run can stand for (all but, under ``batch_size``, B > q₁·N);
    raises ``SearchError`` when none is left."""
    subsample = _subsample(space)
    tunable = tuple(b for b in feasible if subsample.transfer != "batch_size" or b <= subsample.fraction * num_train)
    if not tunable:
        raise SearchError(
            f"privacy.private_selection.tuning_subsample: no batch size fits the tuning set's nominal size "
            f"q₁·N = {subsample.fraction * num_train:g} (transfer 'batch_size'); add smaller batch sizes, raise "
            "fraction or use transfer 'sample_rate'"
        )
    return tunable


def plan_tuning(
    space: SearchSpace, batch_sizes: tuple[int, ...], num_train: int, epochs: int, untunable: tuple[int, ...] = ()
) -> TuningPlan:
    """The per-run ε whose tuning on the subsample plus the release meets the space's total budget
    (``privacy.plan_subsampled_tuning``), for the tunable ``batch_sizes`` (``untunable``: those left
    out, for the record); raises ``SearchError`` when the budget is unreachable."""
    selection = space.privacy.private_selection
    subsample = _subsample(space)
    assert selection is not None and space.sampler.trials_per_cell is not None
    schedules = {b: tuning_schedule(num_train, b, epochs, subsample.fraction, subsample.transfer) for b in batch_sizes}
    releases = [(sample_rate(num_train, b), total_steps(num_train, b, epochs)) for b in batch_sizes]
    try:
        found = plan_subsampled_tuning(
            selection.epsilon,
            space.privacy.delta,
            subsample.fraction,
            space.sampler.trials_per_cell,
            list(schedules.values()),
            releases,
            shape=selection.trial_count_shape,
            score_noise_multiplier=selection.score_noise_multiplier,
        )
    except PrivacyParameterError as error:
        raise SearchError(f"privacy.private_selection.tuning_subsample: {error}") from None
    return TuningPlan(
        fraction=subsample.fraction,
        transfer=subsample.transfer,
        epsilon_per_run=found.epsilon_per_run,
        schedules=schedules,
        noise_multipliers=dict(zip(batch_sizes, found.tuning_noise_multipliers, strict=True)),
        release_noise_multipliers=dict(zip(batch_sizes, found.release_noise_multipliers, strict=True)),
        epsilon_tuning=found.cost.epsilon_tuning,
        epsilon_release=found.cost.epsilon_release,
        epsilon_total=found.cost.epsilon,
        untunable=untunable,
    )


def _subsample(space: SearchSpace) -> TuningSubsampleSpec:
    selection = space.privacy.private_selection
    if selection is None or selection.tuning_subsample is None:
        raise ValueError("the space has no privacy.private_selection.tuning_subsample")
    return selection.tuning_subsample
