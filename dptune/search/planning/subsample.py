"""The plan of tuning on a private subsample (``privacy.private_selection.tuning_subsample``).

Koskela & Kulkarni (NeurIPS 2023), variant 1: the Papernot–Steinke tuning runs on X₁, a Poisson
subsample of rate q₁ of the training and validation rows; the best run's configuration, transferred
by a public rule, trains the release on every training row. A tuning run's Poisson rate and step
count are fixed from public numbers (N and q₁), never from |X₁|, so that the accountant's curve is
the run's (``dptune.privacy.subsampled_tuning``, assumption 2). ``tuning_schedule`` is the
transfer rule read backwards: the (q, T) a tuning run uses to stand for a full-data (B, E).

What a run of the mode needs besides the plan, also here and Ray-free: the tuning runs' public
schedules (``public_schedules``), the secret draw of X₁ kept inside the trust boundary
(``draw_tuning_rows``), and the release's run (``release_context``, ``kept_release_choice``). The
driver trains the tuning as a private search's cell and the release as one more run.

Ray-free and torch-free: the planner and ``--dry-run`` use it before any compute.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from dptune.contract import Mechanism, PublicSchedule, TrialConfig
from dptune.errors import SearchError
from dptune.paths import read_file, write_file_atomic
from dptune.plan import epoch_steps, sample_rate, total_steps
from dptune.plan.mechanism import mechanism_of, wrapped
from dptune.privacy import PrivacyParameterError
from dptune.privacy.subsampled_tuning import plan_subsampled_tuning
from dptune.runners.checkpoint import CHECKPOINTS
from dptune.space import SearchSpace
from dptune.space.privacy import TuningSubsampleSpec

if TYPE_CHECKING:
    from dptune.data.spec import Workload
    from dptune.search.runs.execution import TrialContext

#: The files inside a private search's trust boundary that keep X₁ (the tuning subsample, drawn once)
#: and, per cell, the configuration the tuning chose for the release (fixed before the release trains).
TUNING_ROWS_FILE = "tuning_subsample.npz"
RELEASE_CHOICE_FILE = "release_choice.json"
#: The suffix of a release run's cell id and cell key: its records sit beside the tuning runs'.
RELEASE_SUFFIX = "|release"
#: What the tuning hands the release: the chosen run's sampled configuration (the rule keeps all three).
RELEASE_PARAMETERS = ("clip_bound", "batch_size", "base_learning_rate")


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

    ``schedules[B]`` is a tuning run's (q, T) and ``mechanisms[B]`` its mechanism (σ on its public
    schedule, :func:`public_schedules`), ``release_mechanisms[B]`` the release's (σ on the full data's
    q = B/N, T = round(E·N/B)), for each tunable B; every tuning run and the release are calibrated to
    ``epsilon_per_run`` at δ (by ``privacy.plan_subsampled_tuning``, wrapped here, never calibrated
    again). ``epsilon_tuning`` (the amplified tuning alone) and ``epsilon_release`` (the release's
    training alone) are at δ; their RDP composition ``epsilon_total`` ≤ the space's
    ``private_selection.epsilon``.
    """

    fraction: float
    transfer: str
    epsilon_per_run: float
    schedules: dict[int, tuple[float, int]]
    mechanisms: dict[int, Mechanism]
    release_mechanisms: dict[int, Mechanism]
    epsilon_tuning: float
    epsilon_release: float
    epsilon_total: float
    untunable: tuple[int, ...] = ()  # B the min-step rule keeps but no tuning run can stand for

    @property
    def noise_multipliers(self) -> dict[int, float]:
        """σ of each tunable B's tuning runs."""
        return {b: m.noise_multiplier for b, m in self.mechanisms.items()}

    @property
    def release_noise_multipliers(self) -> dict[int, float]:
        """σ of the release of each tunable B."""
        return {b: m.noise_multiplier for b, m in self.release_mechanisms.items()}


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


def plan_tuning(space: SearchSpace, feasible: tuple[int, ...], num_train: int, epochs: int) -> TuningPlan:
    """The per-run ε whose tuning on the subsample plus the release meets the space's total budget
    (``privacy.plan_subsampled_tuning``), over the B of ``feasible`` a tuning run can stand for
    (:func:`tunable_batch_sizes`; the others are kept as ``untunable``); raises ``SearchError`` when
    none can, or the budget is unreachable."""
    selection = space.privacy.private_selection
    subsample = _subsample(space)
    assert selection is not None and space.sampler.trials_per_cell is not None
    batch_sizes = tunable_batch_sizes(space, feasible, num_train)
    untunable = tuple(b for b in feasible if b not in batch_sizes)
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
    delta, per_run = space.privacy.delta, found.epsilon_per_run
    public = tuning_schedules(schedules, subsample.fraction, subsample.transfer, num_train, epochs)
    return TuningPlan(
        fraction=subsample.fraction,
        transfer=subsample.transfer,
        epsilon_per_run=per_run,
        schedules=schedules,
        mechanisms={
            b: mechanism_of(public[b], sigma, per_run, delta)
            for b, sigma in zip(batch_sizes, found.tuning_noise_multipliers, strict=True)
        },
        release_mechanisms=wrapped(
            dict(zip(batch_sizes, found.release_noise_multipliers, strict=True)), per_run, delta, num_train, epochs
        ),
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


def public_schedules(plan: TuningPlan, num_train: int, epochs: int) -> dict[int, PublicSchedule]:
    """Per tunable B, the :class:`~dptune.contract.PublicSchedule` of its tuning runs: the plan's (q, T),
    cut into ``epochs`` epochs (``sample_rate``: the release's own split ``epoch_steps(N, B, E)``;
    ``batch_size``: epoch e ends at step round(e·T/E)), with the expected batch q·q₁·N."""
    return tuning_schedules(plan.schedules, plan.fraction, plan.transfer, num_train, epochs)


def tuning_schedules(
    runs: dict[int, tuple[float, int]], fraction: float, transfer: str, num_train: int, epochs: int
) -> dict[int, PublicSchedule]:
    """:func:`public_schedules` of the tuning runs' (q, T) per B, ``runs``, at q₁ = ``fraction``."""
    nominal = fraction * num_train
    schedules = {}
    for batch_size, (rate, steps) in runs.items():
        if transfer == "sample_rate":
            split = tuple(epoch_steps(num_train, batch_size, epochs))
        else:
            ends = [round(Fraction(e * steps, epochs)) for e in range(epochs + 1)]
            split = tuple(b - a for a, b in zip(ends, ends[1:], strict=False))
        schedules[batch_size] = PublicSchedule(rate, steps, split, rate * nominal)
    return schedules


def draw_tuning_rows(runs: str, workload: Workload, fraction: float) -> str:
    """The location of X₁, the search's tuning subsample, inside its trust boundary ``runs``: each of the
    workload's training and validation units kept with probability ``fraction`` (q₁), from a generator
    seeded with 128 bits of fresh OS entropy that is never stored. A unit is a row, or a person with all
    their rows where the privacy unit is a person (X₁ is drawn over people, as the accounting's
    subsampling is). The first start draws and writes it (atomically, before any run); a resume reads
    it back, so X₁ is drawn once per search, as the accounting assumes. Raises ``SearchError`` when a
    kept file was drawn for other splits."""
    from dptune.data.workload import tuning_rows_bytes

    num_train, num_val = len(workload.train), len(workload.val)
    location = f"{runs.rstrip('/')}/{TUNING_ROWS_FILE}"
    kept = read_file(runs, TUNING_ROWS_FILE)
    if kept is not None:
        with np.load(io.BytesIO(kept)) as rows:
            sizes = tuple(int(n) for n in rows["sizes"])
        if sizes != (num_train, num_val):
            raise SearchError(
                f"{location} was drawn for {sizes[0]} training and {sizes[1]} validation rows, this search has "
                f"{num_train} and {num_val}: it belongs to another search; choose another --name or --storage"
            )
        return location
    coins = np.random.default_rng(np.random.SeedSequence())  # 128 bits of OS entropy, never stored
    if workload.people is None:
        train = np.flatnonzero(coins.random(num_train) < fraction)
        val = np.flatnonzero(coins.random(num_val) < fraction)
    else:
        people = workload.people
        train = np.flatnonzero((coins.random(people.count("train")) < fraction)[people.train])
        val = np.flatnonzero((coins.random(people.count("val")) < fraction)[people.val])
    write_file_atomic(runs, TUNING_ROWS_FILE, tuning_rows_bytes(train, val, (num_train, num_val)), durable=True)
    return location


def on_tuning_rows(base: TrialConfig, location: str | None) -> TrialConfig:
    """``base`` training on the tuning subsample kept at ``location`` (None: unchanged)."""
    return base if location is None else replace(base, workload=replace(base.workload, tuning_rows=location))


def kept_release_choice(
    runs: str, cell_key: str, choose: Callable[[], dict[str, float] | None]
) -> dict[str, float] | None:
    """The release configuration (C, B, η₀) of cell ``cell_key``: the one kept inside the trust boundary
    ``runs`` when a start already chose it, else ``choose()`` (None: nothing to release), kept before the
    release trains. So a resume never chooses again (``privacy.search.select_release`` may draw which K
    of more than K recorded runs compete; drawing again until a preferred one wins would not be private)."""
    kept = json.loads(read_file(runs, RELEASE_CHOICE_FILE) or b"{}")
    if cell_key not in kept:
        kept[cell_key] = choose()
        write_file_atomic(runs, RELEASE_CHOICE_FILE, json.dumps(kept).encode(), durable=True)
    return kept[cell_key]


def release_context(tuning: TrialContext, plan: TuningPlan) -> TrialContext:
    """The :class:`~dptune.search.runs.execution.TrialContext` of the release of the cell whose tuning runs
    under ``tuning`` by ``plan``: every training row (no X₁), the full data's own schedule, the
    release's σ at the plan's per-run ε, no DP score (the release's validation accuracy is never
    released), one run, trained by the one-trial runner with its state checkpointed between epochs
    inside the trust boundary (``checkpoints``: a kill mid-training is continued, not trained again);
    its cell id and key are the tuning's with ``RELEASE_SUFFIX`` and ``-release``."""
    base = tuning.base
    return replace(
        tuning,
        base=replace(
            base,
            workload=replace(base.workload, tuning_rows=None),
            score_noise_multiplier=None,
            schedule=None,
            release_run=True,
        ),
        cell_id=tuning.cell_id + RELEASE_SUFFIX,
        cell_key=tuning.cell_key + "-release",
        replicates=1,
        fused=False,
        mechanisms=dict(plan.release_mechanisms),
        schedules=None,
        checkpoints=f"{tuning.results_root.rstrip('/')}/{CHECKPOINTS}",
    )
