"""What both runners share: the checks before compute, workload loading, the diagnostics probe,
evaluation records and the noisy selection score.

The one-trial runner (:mod:`dptune.runners.trainer`) and the fused runner
(:mod:`dptune.runners.fused`) run the same mechanism; what decides it in both is here, once:

- checks, in the order a runner makes them, before any compute: :func:`check_config` (names
  against the registries, values, the device), then after loading :func:`check_fits_workload`
  (B ≤ N, δ suits N) and :func:`planned_mechanism` (the planner's σ, q, T for this run and N);
- the workload: :func:`cached_workload` of a config's ``workload`` spec (loaded once per process);
- the diagnostics: :func:`probe_indices` (the probe rows, the same for every trial of a search)
  and :func:`diagnostic_epochs` (0, ⌈E/2⌉ and E);
- the outcome: :class:`Evaluation` (loss, accuracy, per-class counts of one split),
  :func:`noisy_count` and :func:`noisy_score` (the DP selection score: the validation count plus
  exact discrete Gaussian noise, over the public number of validation rows) and
  :func:`diverged_charge` (why a diverged run is charged its planned steps).

The coins of the mechanism live in :mod:`dptune.dp.coins`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import numpy as np
import torch

from dptune.contract import NO_BACKBONE, ClippingRule, Mechanism, TrialConfig, WorkloadSpec, is_own_backbone
from dptune.data import DATASETS, Workload, load_workload
from dptune.dp.clipping import check_rule
from dptune.dp.discrete_gaussian import sample_discrete_gaussian
from dptune.dp.engine import check_engine
from dptune.dp.optimizers import check_optimizer
from dptune.errors import TrialConfigError
from dptune.models import BACKBONES, PEFTS
from dptune.plan import run_schedule
from dptune.privacy import check_delta

#: Memory the diagnostics probe may hold as flattened per-example gradients (bytes, float32; the
#: summary needs about as much again): the probe shrinks below ``diagnostic_examples`` when n·d·4
#: would exceed it.
PROBE_MEMORY_BYTES = 1 << 30
#: Stream of the public split seed that picks the diagnostics probe.
_PROBE_STREAM = 7


class StepObserver(Protocol):
    """An auditor's view of a head's DP steps (:mod:`dptune.audit`): called once per step with the
    step's released gradients of K heads on features, ``released`` (K, classes, dim + 1) in the layout
    [W | b] (``dptune.runners.heads.stack_heads``), ``update_scale_k · (Σ_i f_i g_i + s_k·z_k)`` as the
    engine made them, before the optimizer steps with them, with each head's clip bound C_k and update
    scale (K,) and the clipping rule. It may add terms of the same form to ``released`` (the audit's
    gradient canaries) and read it; it draws no coin of the run. The fused runner calls it for a group
    (K configurations), the trial runner for its one head (K = 1)."""

    def __call__(
        self, released: torch.Tensor, clip_bounds: torch.Tensor, scales: torch.Tensor, rule: ClippingRule
    ) -> None: ...


def _choices(registry: Mapping[str, object]) -> str:
    return ", ".join(sorted(registry))


def check_config(config: TrialConfig) -> torch.device:
    """Raise :class:`TrialConfigError` (naming the value and the allowed ones) for a bad config.

    Cheap checks only (no data, no weights). Returns the device the trial runs on.
    """
    workload = config.workload
    for kind, value, registry in (
        ("dataset", workload.dataset, DATASETS),
        ("backbone", workload.backbone, BACKBONES),
        ("peft", workload.peft, PEFTS),
    ):
        own = (kind == "dataset" and workload.dataset_file is not None) or (
            kind == "backbone" and (value == NO_BACKBONE or is_own_backbone(value))
        )
        if value not in registry and not own:  # own data, backbones, embeddings: checked with the data (check_spec)
            raise TrialConfigError(f"{kind} {value!r} is unknown; choose one of {_choices(registry)}")
    try:
        check_rule(config.clipping)
        check_optimizer(config.optimizer)
        check_engine(config.engine)
    except ValueError as error:
        raise TrialConfigError(str(error)) from error
    positive = {
        "epsilon": config.epsilon,
        "epochs": config.epochs,
        "clip_bound": config.clip_bound,
        "batch_size": config.batch_size,
        "learning_rate": config.learning_rate,
        "max_physical_batch_size": config.max_physical_batch_size,
        "diagnostic_examples": config.diagnostic_examples,
    }
    for name, number in positive.items():
        if not number > 0:
            raise TrialConfigError(f"{name} must be > 0, got {number}")
    if not 0 < config.delta < 1:
        raise TrialConfigError(f"delta must be in (0, 1), got {config.delta}")
    if config.score_noise_multiplier is not None and not config.score_noise_multiplier > 0:
        raise TrialConfigError(f"score_noise_multiplier must be > 0 or None, got {config.score_noise_multiplier}")
    if config.seed is not None and not 0 <= config.seed < 2**128:
        raise TrialConfigError(f"seed must be None (fresh OS entropy) or an integer in [0, 2**128), got {config.seed}")
    if config.threads is not None and config.threads < 1:
        raise TrialConfigError(f"threads must be ≥ 1 or None, got {config.threads}")
    return resolve_device(config.device)


def resolve_device(name: str) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; ``"cpu"``, ``"cuda"``, ``"cuda:<i>"`` as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise TrialConfigError(f"device {name!r} is not a device; use auto, cpu, cuda or cuda:<index>") from error
    if device.type not in ("cpu", "cuda"):
        raise TrialConfigError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:<index>")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrialConfigError(f"device {name!r} requested but CUDA is not available here; use cpu or auto")
    return device


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run with ``torch.set_num_threads(threads)`` (unchanged when None), restoring it after."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def check_fits_workload(config: TrialConfig, workload: Workload) -> None:
    """Raise (``TrialConfigError``, ``PrivacyParameterError``) unless the workload's privacy unit is the
    config's (people exactly when ``person_unit`` is set), B ≤ N and δ suits N, with N the workload's
    units (a run with a public schedule samples at its own q ≤ 1, whatever its B)."""
    if (config.workload.person_unit is None) != (workload.people is None):
        raise TrialConfigError(
            f"the run's privacy unit is {'a row' if config.workload.person_unit is None else 'a person'} but its "
            f"workload {'has' if workload.people is not None else 'has no'} people: load the workload of the run's spec"
        )
    num_train = workload.num_units
    units = "training examples" if workload.people is None else "training people"
    if config.schedule is None and config.batch_size > num_train:
        raise TrialConfigError(
            f"batch_size {config.batch_size} exceeds the {num_train} {units} of "
            f"{config.workload.dataset!r} (after splits and caps); choose batch_size ≤ {num_train}"
        )
    check_delta(config.delta, num_train)


def planned_mechanism(config: TrialConfig, num_train: int) -> Mechanism:
    """The mechanism ``config`` steps with: the σ, q and T the planner calibrated for it
    (``config.mechanism``, :mod:`dptune.plan.mechanism`); a runner never calibrates σ itself.

    Raises :class:`TrialConfigError` when the run has none, or when it was planned for another run than
    this one: its (q, T, epoch split, expected batch) are not the schedule ``config`` trains by on the
    workload's ``num_train`` rows (``dptune.plan.run_schedule``), or its (ε, δ) are not the config's. So
    a planner and a runner that disagree (another N, B, E or target) fail before any compute.
    """
    mechanism = config.mechanism
    if mechanism is None:
        raise TrialConfigError(
            "the run has no mechanism: σ, q and T are calibrated once, by the planner, and every run needs "
            "its mechanism from it (dptune.plan.mechanism.with_mechanism(config, N), or a search's cell plan)"
        )
    schedule = run_schedule(config, num_train)
    if mechanism.schedule != schedule or (mechanism.epsilon, mechanism.delta) != (config.epsilon, config.delta):
        raise TrialConfigError(
            f"the run's mechanism was planned for another run: q = {mechanism.sample_rate:g}, T = {mechanism.steps} "
            f"(epochs {list(mechanism.epoch_steps)}, expected batch {mechanism.expected_batch_size:g}) at "
            f"(ε, δ) = ({mechanism.epsilon:g}, {mechanism.delta:g}), but B = {config.batch_size} over "
            f"{config.epochs} epochs of N = {num_train} units (rows or people) trains at q = {schedule.sample_rate:g}, "
            f"T = {schedule.steps} (epochs {list(schedule.epoch_steps)}, expected batch "
            f"{schedule.expected_batch_size:g}) at ({config.epsilon:g}, {config.delta:g}); plan it for this "
            "workload (dptune.plan.mechanism)"
        )
    return mechanism


@functools.lru_cache(maxsize=2)
def cached_workload(spec: WorkloadSpec) -> Workload:
    """``load_workload`` memoised per process: the trials of a search that share a process (Ray
    Tune reuses its actors) load the splits once. Trials only read the datasets."""
    return load_workload(spec)


def model_provenance(workload: Workload) -> dict[str, str]:
    """What a run's saved model records of its inputs: the workload's provenance, its class names (JSON,
    in label order), its privacy unit (``row``, or ``person:<id column>``) and, for a data owner's file,
    its ``input_column`` (the column :class:`dptune.model.Model` reads from a table)."""
    unit = "row" if workload.people is None else f"person:{workload.people.column}"
    own = workload.spec.dataset_file
    column = {} if own is None or own.input_column is None else {"input_column": own.input_column}
    return {
        **workload.provenance,
        "class_names": json.dumps(workload.class_names, ensure_ascii=False),
        "privacy_unit": unit,
        **column,
    }


@dataclass(frozen=True)
class PersonScore:
    """A split's correct predictions counted per person: ``count`` = ⌊Σ_u c_u/k_u⌋ over its ``people``
    people u, with c_u of person u's k_u rows predicted right (the sum of the people's accuracies).

    Removing one person moves Σ_u c_u/k_u by at most 1, so the floor moves by at most 1: the count has
    sensitivity 1 under add/remove of a person, as the row count has for a row, and is an integer (the
    discrete Gaussian's domain). The sum is exact: grouped by k, Σ_k (Σ_{u: k_u = k} c_u)/k in
    rational arithmetic, so no rounding can move the floor.
    """

    count: int
    people: int
    accuracy: float = math.nan  # the people's mean accuracy, (1/P) Σ_u c_u/k_u (exact, then rounded once)

    @classmethod
    def of(cls, correct: np.ndarray, people: np.ndarray) -> PersonScore:
        """The score of rows whose correctness is ``correct`` (bool, one per row) and whose people are
        ``people`` (dense int64 indices, :class:`dptune.data.People`)."""
        if len(people) == 0:
            return cls(count=0, people=0)
        rows = np.bincount(people)
        right = np.bincount(people, weights=np.asarray(correct, dtype=np.int64)).astype(np.int64)
        present = rows > 0
        total = sum(
            (Fraction(int(right[present][rows[present] == k].sum()), int(k)) for k in np.unique(rows[present])),
            Fraction(0),
        )
        count = int(present.sum())
        return cls(count=math.floor(total), people=count, accuracy=float(total / count))


@dataclass(frozen=True)
class Evaluation:
    """Mean cross-entropy and accuracy on a split; per-class counts for per-class accuracy; the count per
    person (:class:`PersonScore`) where the privacy unit is a person.

    ``accuracy`` is the share of rows predicted right, or, where the privacy unit is a person, the
    people's mean accuracy: each person weighs one, as in the selection count, and the interval over
    the split's people (``num_val``, ``num_test``) is then one of a mean of independent units in [0, 1]
    (rows of one person are not independent). Build one with :meth:`of`.
    """

    loss: float
    accuracy: float
    correct_per_class: np.ndarray
    examples_per_class: np.ndarray
    person_score: PersonScore | None = None

    @classmethod
    def of(
        cls, loss: float, correct_per_class: np.ndarray, examples_per_class: np.ndarray, score: PersonScore | None
    ) -> Evaluation:
        """The evaluation of a split of ``examples_per_class`` rows with mean loss ``loss``, its per-class
        right predictions and, where the unit is a person, its people's ``score``."""
        rows = float(correct_per_class.sum()) / max(int(examples_per_class.sum()), 1)
        accuracy = rows if score is None else score.accuracy
        return cls(loss, accuracy, correct_per_class, examples_per_class, score)

    def class_accuracy(self) -> dict[int, float]:
        """Accuracy of every class present in the split."""
        present = np.flatnonzero(self.examples_per_class)
        return {int(c): float(self.correct_per_class[c] / self.examples_per_class[c]) for c in present}


def probe_indices(config: TrialConfig, num_train: int, dimension: int) -> torch.Tensor:
    """Training rows of the diagnostics probe: ≤ ``diagnostic_examples`` of them, fewer when their
    flattened gradients (``dimension`` each, float32) would exceed ``PROBE_MEMORY_BYTES``.

    The probe is no coin of the mechanism: every trial of a search diagnoses the same examples (the
    public split seed picks them), so that their diagnostics compare.
    """
    (seed,) = np.random.SeedSequence([config.workload.seed, _PROBE_STREAM]).generate_state(1, dtype=np.uint64)
    fits = max(1, PROBE_MEMORY_BYTES // (4 * dimension))
    size = min(config.diagnostic_examples, num_train, fits)
    return torch.randperm(num_train, generator=torch.Generator().manual_seed(int(seed)))[:size]


def noisy_count(val: Evaluation, score_noise_multiplier: float, generator: np.random.Generator) -> int:
    """The DP release behind the selection score: correct validation predictions + N_Z(0, σ_s²).

    The count has sensitivity 1 under add/remove of one validation row, and the noise is the exact
    discrete Gaussian (:func:`~dptune.dp.discrete_gaussian.sample_discrete_gaussian`) with σ_s =
    ``score_noise_multiplier`` in counts: ρ = 1/(2σ_s²)-zCDP, RDP α/(2σ_s²), the Gaussian bound the
    accounting composes. An integer plus integer noise has no floating-point low bits to leak (the
    float32 Gaussian it replaces ruled out neighbouring counts: Mironov 2012). The draw comes from
    the trial's own score coins (``generator``, :func:`~dptune.dp.coins.score_generator`).
    Where the privacy unit is a person the count is the validation people's :class:`PersonScore`
    (sensitivity 1 under add/remove of a person), with the same noise.
    """
    count = int(val.correct_per_class.sum()) if val.person_score is None else val.person_score.count
    return count + sample_discrete_gaussian(score_noise_multiplier, generator)


def noisy_score(val: Evaluation, score_noise_multiplier: float, generator: np.random.Generator) -> float:
    """The DP selection score: :func:`noisy_count` / num_val, a noisy validation accuracy.

    Dividing the integer release by the number of validation rows (public, as q = B/N already
    treats N as public) is post-processing: the float64 quotient is a function of the integer alone,
    which ``round(score · num_val)`` recovers exactly.
    """
    units = int(val.examples_per_class.sum()) if val.person_score is None else val.person_score.people
    return noisy_count(val, score_noise_multiplier, generator) / units


def diverged_charge(planned_steps: int, private_score: bool) -> str:
    """What a diverged run's ``reason`` adds: it is charged ε of its ``planned_steps``, not of the
    steps it took, because when it stopped depended on the private data."""
    why = (
        "its stop is data-dependent, and charging the whole planned run covers any stopping rule"
        if private_score
        else "the stop read an exact, non-private loss"
    )
    return f"; charged its {planned_steps} planned steps because {why}"


def diagnostic_epochs(epochs: int) -> list[int]:
    """Epochs after which the probe is diagnosed: 0 (before training), ⌈E/2⌉ and E."""
    return sorted({0, math.ceil(epochs / 2), epochs})
