"""Fused trials: K configurations of one cell trained side by side as batched tensor operations.

``run_fused(configs)`` trains every configuration of a list that differ only in clip bound C,
batch size B, learning rate η (and η₀) and seed, on a linear head over cached backbone features
(peft ``head``), and returns one :class:`~dptune.contract.TrialResult` per configuration, each the
mechanism :func:`~dptune.runners.trial.run_trial` runs and accounts (``engine="fused"``). Ray-free.

Per configuration k, exactly as a trial (:mod:`dptune.runners.trainer`):

- coins: its own ``np.random.SeedSequence(seed_k)`` (``None``: 128 bits of fresh OS entropy)
  spawned into the trial's four child streams (:func:`~dptune.dp.coins.trial_coins`): the head is
  built under ``torch.manual_seed`` of 64 bits of the init stream (zero-initialised, as the
  trial's), the Poisson masks come from a CPU generator with its whole MT19937 state (624 32-bit
  words) set from its stream (:func:`~dptune.dp.coins.cpu_generator`), the DP score's exact
  discrete Gaussian noise from a numpy PCG64 of its stream (:func:`~dptune.dp.coins.score_generator`),
  and the Gaussian noise from the noise stream's
  :class:`~dptune.dp.coins.DeviceCoins` (CPU: the same full MT19937 state; CUDA: Philox with a
  fresh 64-bit key and 62-bit offset, 126 bits, from a PCG64 stream before every draw of up to
  :data:`MAX_CHUNK_STEPS` steps). Every stream is a function of the seed sequence's whole entropy,
  not of the 32 bits ``manual_seed`` keeps on the CPU. No draw is shared between configurations,
  so each one is an independent (ε, δ)-DP mechanism and composition across them holds as across
  trials;
- T = ``plan.total_steps(N, B, E)`` Poisson steps at q = B/N cut into epochs by
  ``plan.epoch_steps``, σ from the config's mechanism, calibrated once by the planner for (ε, δ, q, T)
  (``config.mechanism``, :mod:`dptune.plan.mechanism`; checked against N by
  ``common.planned_mechanism``) (a tuning run on a secret subsample takes q, T, the epochs and the
  expected batch from its public schedule instead: ``plan.run_schedule``);
- each step: per-example gradients g_i of the summed cross-entropy of the head y = W x + b,
  factors f_i = ``clip_factors(‖g_i‖, C_k, rule)``, released gradient
  ``update_scale(C_k, rule, q·N) · (Σ_i f_i g_i + N(0, s_k² I))`` with s_k = ``noise_std(σ, C_k,
  rule)`` (:mod:`dptune.dp.clipping`), then Adam or SGD with η_k (torch's defaults);
- evaluation on the validation split after every epoch, the test split after the last,
  per-class accuracies, diagnostics at epochs 0, ⌈E/2⌉ and E on the trial's probe, the noisy
  selection score, the trial's divergence rules, ``steps_taken`` and ``epsilon_spent`` (a
  diverged configuration, as a diverged trial, is charged ε of its planned T steps).

Where the workload's privacy unit is a person (``WorkloadSpec.person_unit``; user-level DP-SGD,
McMahan et al. 2018, Levy et al. 2021), N is the training split's people (``Workload.num_units``) in
every check, the planner's mechanism, q = B/N_people, the expected batch q·N_people and ε; a step
samples people, trains on each sampled person's rows (all, or ``max_rows`` of them drawn afresh) and
clips each person's mean gradient to C (:mod:`dptune.runners.fused_group`); the padded batches and
the feature index stay rows.

Configurations with the same B share q, T, σ and the epoch split, so they step in lock-step: a
*group*. A group's heads are stacked as one (K, classes, dim + 1) tensor [W | b] acting on
features augmented by a constant 1, x̃ = (x, 1) (:func:`stack_heads`). A step gathers every
configuration's own Poisson batch into a padded (K, n, dim + 1) tensor with a mask; the
per-example gradient of a linear head is closed form: with δ_i = softmax(W x_i + b) − onehot(y_i),
g_i = δ_i x̃_iᵀ (∇_W ℓ_i = δ_i x_iᵀ, ∇_b ℓ_i = δ_i), so ‖g_i‖ = ‖δ_i‖·√(‖x_i‖² + 1), and the
clipped sum Σ_i f_i g_i = (f ⊙ δ)ᵀ X̃ is one batched matrix product (the FiLM engine's head path,
:mod:`dptune.dp.film`, for K heads at once). A configuration that diverges stops updating (its
row is frozen) while the others continue.

Differences from a trial that change no distribution: the Poisson masks are drawn as geometric
gaps (:class:`PoissonSteps`) rather than as N uniforms per step, and noise is drawn for several
steps at once, so the same explicit seed gives other draws than ``run_trial`` (same law); the
forward pass runs in float32 on every device (a trial on CUDA autocasts it to bf16);
``max_physical_batch_size`` is not used (:func:`max_fused_configurations` bounds memory);
``wall_time_s`` and ``examples_per_s`` are each configuration's share of its group's time.

Where the parts live: this module checks the configurations, plans the groups (the planner's
mechanism per batch size, chunks that fit memory) and runs them; :mod:`dptune.runners.fused_group` is one group
(its schedule, coins, lock-step heads and records); :mod:`dptune.runners.heads` the stacked
heads' tensor math; :mod:`dptune.runners.common` what the one-trial runner shares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dptune.contract import Mechanism, PublicSchedule, TrialConfig, TrialResult
from dptune.data import Workload
from dptune.errors import DptuneError, TrialConfigError
from dptune.plan import run_schedule
from dptune.runners.batches import DeviceWorkload, chunk_steps, person_index
from dptune.runners.common import cached_workload, check_config, check_fits_workload, planned_mechanism, torch_threads
from dptune.runners.fused_group import FUSED_ENGINE, FusedGroup, ObserverFactory
from dptune.runners.heads import EVALUATION_ROWS, FUSABLE_OPTIMIZERS

#: Working-set budget of one fused group on its device (bytes): :func:`max_fused_configurations`.
FUSED_MEMORY_BYTES: int = 2 << 30
#: The fields in which the configurations of one ``run_fused`` call may differ.
FUSABLE_FIELDS: tuple[str, ...] = (
    "clip_bound",
    "batch_size",
    "learning_rate",
    "base_learning_rate",
    "seed",
    "schedule",
)
#: Engines a fused configuration may ask for: the fused runner computes the head's per-example
#: gradients in closed form, as the FiLM engine does.
FUSABLE_ENGINES: tuple[str, ...] = ("auto", "film")


class FusedTrialsFailed(DptuneError, RuntimeError):
    """A fused group failed after training began. ``results`` holds one :class:`TrialResult` per
    configuration given to :func:`run_fused`, in order: groups that finished keep their results,
    the failed group's configurations have status ``error`` with the steps they took and the ε
    those spent, and configurations of groups not yet started have status ``error`` with 0 steps."""

    def __init__(self, message: str, results: list[TrialResult]) -> None:
        super().__init__(message)
        self.results = results


# --------------------------------------------------------------------------- checks before compute


def fused_refusal(config: TrialConfig) -> str | None:
    """Why the fused runner cannot run this config (None: it can).

    It runs peft ``head`` (a linear head on cached backbone features, the ``features`` workload),
    any clipping rule, optimizer adam or sgd, engine ``auto`` or ``film``. A config with unknown
    names or bad values is for :func:`~dptune.runners.common.check_config` to refuse.
    """
    if config.workload.peft != "head":
        return (
            f"peft {config.workload.peft!r} trains backbone parameters; the fused runner trains a linear head "
            f"on cached features (peft 'head')"
        )
    if config.engine not in FUSABLE_ENGINES:
        allowed = " or ".join(map(repr, FUSABLE_ENGINES))
        return (
            f"engine {config.engine!r} asks for another per-example gradient engine; the fused runner "
            f"computes the head's per-example gradients in closed form (engine {allowed})"
        )
    if config.optimizer not in FUSABLE_OPTIMIZERS:
        return (
            f"optimizer {config.optimizer!r} has no stacked form here; the fused runner steps "
            f"{' or '.join(map(repr, FUSABLE_OPTIMIZERS))}"
        )
    return None


def check_fusable(configs: Sequence[TrialConfig]) -> torch.device:
    """Raise :class:`TrialConfigError` unless ``configs`` can run as fused trials; return their device.

    Every config must pass the trial's own checks (:func:`~dptune.runners.common.check_config`) and
    :func:`fused_refusal`, and all must agree on every field but :data:`FUSABLE_FIELDS`.
    """
    if not configs:
        raise TrialConfigError("run_fused got no configurations; give one or more TrialConfigs of one cell")
    for index, config in enumerate(configs):
        if not isinstance(config, TrialConfig):
            raise TrialConfigError(f"configuration {index} is a {type(config).__name__}, not a TrialConfig")
    device = check_config(configs[0])
    neutral = dict.fromkeys(FUSABLE_FIELDS)
    first = configs[0].row()  # flat: a workload field is named as in a result row
    for index, config in enumerate(configs):
        check_config(config)
        refusal = fused_refusal(config)
        if refusal is not None:
            raise TrialConfigError(f"configuration {index} cannot be fused: {refusal}")
        row = config.row()
        field = next((name for name in first if name not in neutral and row[name] != first[name]), None)
        if field is not None:
            raise TrialConfigError(
                f"configuration {index} differs from configuration 0 in {field} ({row[field]!r} vs "
                f"{first[field]!r}); fused configurations may differ only in {', '.join(FUSABLE_FIELDS)}"
            )
    return device


def _padded_batch_size(batch_size: int) -> int:
    """A bound on the largest Poisson batch of a group chunk: B + 6√B + 16 (memory planning only)."""
    return int(batch_size + 6 * math.sqrt(batch_size) + 16)


def max_fused_configurations(
    config: TrialConfig,
    num_train: int,
    feature_dim: int,
    num_classes: int,
    memory_bytes: int = FUSED_MEMORY_BYTES,
    *,
    person_rows: int | None = None,
) -> int:
    """How many configurations at ``config.batch_size`` fit one fused group in ``memory_bytes`` (≥ 0).

    The model (bytes, float32 unless said): shared by the group, the augmented training features
    with their squared norms and labels, 4·(N + 1)·(dim + 4), an evaluation block of augmented
    features, 4·``EVALUATION_ROWS``·(dim + 1), and the probe's per-example gradients with their
    running sums, 16·n_probe·d (d = (dim + 1)·classes); per configuration, with n = B + 6√B + 16
    and S = :func:`chunk_steps` steps per draw: the gathered batch, its logits, δ, factors and
    norms, 4·n·(dim + 2 + 6·classes), the drawn batch indices, 16·S·n, the head, its optimizer
    state, gradient and S steps of noise, 4·d·(5 + S), and its share of the evaluation block's
    logits, 12·``EVALUATION_ROWS``·classes. Person-level (B counts people): n is ``person_rows``, a
    bound on a step's rows (:func:`person_load`), and every sampled person's G_u formed outright,
    4·(B + 6√B + 16)·d, bounds the norms' work (:func:`~dptune.runners.person_heads.person_norms`).
    """
    parameters = (feature_dim + 1) * num_classes
    steps = chunk_steps(parameters)
    people = _padded_batch_size(config.batch_size)
    padded = people if person_rows is None else person_rows
    probe = min(config.diagnostic_examples, num_train) if config.diagnostics else 0
    shared = 4 * (num_train + 1) * (feature_dim + 4) + 4 * EVALUATION_ROWS * (feature_dim + 1) + 16 * probe * parameters
    per_config = (
        4 * padded * (feature_dim + 2 + 6 * num_classes)
        + 16 * steps * padded
        + 4 * parameters * (5 + steps)
        + 12 * EVALUATION_ROWS * num_classes
        + (0 if person_rows is None else 4 * people * parameters)
    )
    return max(0, (memory_bytes - shared) // per_config)


def person_load(workload: Workload, config: TrialConfig) -> int | None:
    """A bound on the rows of one configuration's person-level batch at one step, at B = ``config.batch_size``
    people sampled at q = B/N_people: each person brings m_u = min(k_u, ``max_rows``) rows, so the rows
    have mean B·E[m] and variance ≤ B·E[m²]; the bound is B·E[m] + 6·√(B·E[m²]) + max m (None where
    the unit is a row)."""
    people = person_index(workload, config)
    if people is None:
        return None
    used = people.used_sizes().double()
    if not len(used):
        return 1
    batch = config.batch_size
    return math.ceil(
        batch * float(used.mean()) + 6 * math.sqrt(batch * float(used.square().mean())) + float(used.max())
    )


# --------------------------------------------------------------------------- the runner


@dataclass(frozen=True)
class GroupPlan:
    """One :class:`~dptune.runners.fused_group.FusedGroup` to run: the positions (in the list given
    to :func:`run_fused`) of configurations sharing ``batch_size`` and their ``mechanism`` (σ, q, T as
    the planner calibrated them), at most as many as fit the memory budget."""

    members: list[int]
    batch_size: int
    mechanism: Mechanism

    @property
    def noise_multiplier(self) -> float:
        """σ of the group's mechanism."""
        return self.mechanism.noise_multiplier


def plan_groups(configs: Sequence[TrialConfig], workload: Workload, memory_bytes: int) -> list[GroupPlan]:
    """Group ``configs`` by batch size (and public schedule), read each group's mechanism
    (:func:`~dptune.runners.common.planned_mechanism`: the planner's σ, q, T, checked against the
    workload's N, its privacy units ``Workload.num_units``; one per group) and cut each group into chunks of at most
    :func:`max_fused_configurations`, all before the first step.

    Raises :class:`TrialConfigError` for a batch size of which not one configuration fits
    ``memory_bytes``, and for a config without its planned mechanism (or with another run's).
    """
    num_train, num_units, feature_dim = len(workload.train), workload.num_units, workload.feature_dim
    if feature_dim is None:
        raise TrialConfigError(
            "the fused runner trains heads on cached features; this workload has none (peft must be 'head')"
        )
    by_batch_size: dict[tuple[int, PublicSchedule | None], list[int]] = {}  # a tuning run's schedule goes with its B
    for index, config in enumerate(configs):
        by_batch_size.setdefault((config.batch_size, config.schedule), []).append(index)
    plans: list[GroupPlan] = []
    for (batch_size, _), members in by_batch_size.items():
        first = configs[members[0]]
        person_rows = person_load(workload, first)
        fits = max_fused_configurations(
            first,
            num_train,
            feature_dim,
            workload.num_classes,
            memory_bytes,
            person_rows=person_rows,
        )
        if fits < 1:
            raise TrialConfigError(
                f"not one configuration at batch_size {batch_size} fits the fused memory budget of {memory_bytes} "
                f"bytes (N = {num_train}, {workload.feature_dim} features, {workload.num_classes} classes); choose a "
                f"smaller batch_size or a larger memory budget"
            )
        mechanism = planned_mechanism(first, num_units)
        if any(planned_mechanism(configs[i], num_units) != mechanism for i in members):
            raise TrialConfigError(
                f"the configurations at batch_size {batch_size} carry different mechanisms (σ); a group steps in "
                "lock-step with the one σ the planner calibrated for its (ε, δ, q, T)"
            )
        plans += [GroupPlan(members[i : i + fits], batch_size, mechanism) for i in range(0, len(members), fits)]
    return plans


def _unstarted(config: TrialConfig, reason: str, num_units: int, noise_multiplier: float) -> TrialResult:
    """The ``error`` record of a configuration whose group never took a step: nothing spent
    (``num_units``: N of q = B/N, the training split's privacy units)."""
    schedule = run_schedule(config, num_units)
    return TrialResult(
        config=config,
        status="error",
        reason=reason[:2000],
        noise_multiplier=noise_multiplier,
        sample_rate=schedule.sample_rate,
        num_train=num_units,
        steps=schedule.steps,
        steps_taken=0,
        epsilon_spent=0.0,
        engine=FUSED_ENGINE,
    )


def _group_failure(
    configs: Sequence[TrialConfig],
    results: list[TrialResult | None],
    plan: GroupPlan,
    group: FusedGroup | None,
    error: Exception,
    num_units: int,
) -> FusedTrialsFailed:
    """The :class:`FusedTrialsFailed` of ``plan``'s group failing with ``error`` (``group`` None: before
    its first step): the failed group's results (what each configuration spent), the ``results`` of the
    groups that finished, and an unstarted record of every other configuration (``num_units``: N)."""
    failure = f"{type(error).__name__}: {error}"
    failed = (
        group.failed(error)
        if group is not None
        else [_unstarted(configs[i], failure, num_units, plan.noise_multiplier) for i in plan.members]
    )
    for i, result in zip(plan.members, failed, strict=True):
        results[i] = result
    final = [
        r
        if r is not None
        else _unstarted(
            c,
            f"not run: an earlier fused group failed ({failure})",
            num_units,
            planned_mechanism(c, num_units).noise_multiplier,
        )
        for r, c in zip(results, configs, strict=True)
    ]
    return FusedTrialsFailed(f"fused group of batch_size {plan.batch_size} failed: {failure}", final)


def _chunk_progress(progress: Callable[[float], None], before: int, size: int) -> Callable[[float], None]:
    """``progress`` of a chunk of ``size`` configs after ``before`` others, told its share of epochs trained."""
    return lambda share: progress(before + size * share)


def run_fused(
    configs: Sequence[TrialConfig],
    on_done: Callable[[list[int], list[TrialResult]], None] | None = None,
    *,
    memory_bytes: int | None = None,
    workload: Workload | None = None,
    progress: Callable[[float], None] | None = None,
    observers: ObserverFactory | None = None,
) -> list[TrialResult]:
    """Train every config (K of them) as fused trials; one :class:`TrialResult` per config, in order,
    each what ``run_trial(config)`` would return in distribution (``engine="fused"``).

    The configs share everything except :data:`FUSABLE_FIELDS` (a :class:`TrialConfigError`
    before compute otherwise, as for a refused or bad config, an empty list, a batch size above N,
    or a batch size of which not one configuration fits ``memory_bytes``, default
    :data:`FUSED_MEMORY_BYTES`), or a config without the mechanism the planner calibrated for it
    (``config.mechanism``, checked against N before the first step; σ is never calibrated here). N
    counts the workload's privacy units (``Workload.num_units``: its rows, or its people).
    Configs are grouped by batch size, each group runs fused in chunks of at most
    :func:`max_fused_configurations` (:func:`plan_groups`), and ``on_done(indices, results)`` is
    called after each chunk with the positions in ``configs`` and their results, so the caller can
    record them at once; ``progress(runs)`` after each epoch of a chunk but its last, with the configs
    trained so far (a chunk of k at epoch e of E counts k·e/E; ≥ 0, below K). A failure inside a chunk
    raises :class:`FusedTrialsFailed` carrying every config's result. ``workload``: the splits to train
    on (a benchmark's own), else the configs' workload spec's, loaded once per process; either way
    checked against the configs' privacy unit. ``observers``: an auditor's
    :class:`~dptune.runners.common.StepObserver` of each group's steps (:mod:`dptune.audit`), built
    from the group's positions and q; a search passes none.
    """
    configs = list(configs)
    device = check_fusable(configs)
    first = configs[0]
    with torch_threads(first.threads):
        workload = cached_workload(first.workload) if workload is None else workload
        num_units = workload.num_units
        for config in configs:
            check_fits_workload(config, workload)
        plans = plan_groups(configs, workload, FUSED_MEMORY_BYTES if memory_bytes is None else memory_bytes)
        data = DeviceWorkload.build(first, workload, device)
        results: list[TrialResult | None] = [None] * len(configs)
        trained = 0  # configurations of the chunks run so far
        for plan in plans:
            group: FusedGroup | None = None
            on_epoch = None if progress is None else _chunk_progress(progress, trained, len(plan.members))
            try:
                observer = None if observers is None else observers(plan.members, plan.mechanism.sample_rate)
                group = FusedGroup(data, [configs[i] for i in plan.members], plan.noise_multiplier, observer)
                group_results = group.run(on_epoch)
            except Exception as error:  # say what every configuration spent, finished or not
                raise _group_failure(configs, results, plan, group, error, num_units) from error
            for i, result in zip(plan.members, group_results, strict=True):
                results[i] = result
            trained += len(plan.members)
            if on_done is not None:
                on_done(plan.members, group_results)
    return [r for r in results if r is not None]
