"""A search's cells and what each runs: feasible batch sizes (the min-step rule), the mechanism per B
(σ, q, T, calibrated once here, through :mod:`dptune.plan.mechanism`, and read by every run), the
number of configurations (a secret random K under private selection), the sampler's plain-data
space, the Tune unit size, the trial configuration every run of a cell shares and the runner
that trains them. Ray-free.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dptune.contract import ClippingRule, Mechanism, TrialConfig, WorkloadSpec
from dptune.errors import SearchError
from dptune.paths import read_file, write_file_atomic
from dptune.plan import sample_rate, total_steps
from dptune.plan.mechanism import mechanisms, wrapped
from dptune.privacy import PrivacyParameterError, draw_trial_count, plan_private_selection
from dptune.privacy.checks import bound_text
from dptune.search.planning.sampler import CellSpec
from dptune.search.planning.subsample import TuningPlan, on_tuning_rows, plan_tuning, public_schedules
from dptune.search.runs.execution import TrialContext, record_pruned
from dptune.space import Cell, LoadedSpace, SearchSpace

#: Most configurations one Tune trial carries under ``configurations_per_trial: auto``.
MAX_UNIT_CONFIGURATIONS = 256


@dataclass(frozen=True)
class CellPlan:
    """What a cell will run under one clipping rule: the B values that pass the min-step rule and the
    mechanism of each (σ calibrated once, for q = B/N and T = round(E·N/B) at the cell's ε and the δ).

    Two ids name it: ``cell.cell_id`` (``eps=1|epochs=5``) is the (ε, E) cell as the records name
    it, next to a ``clipping`` column; :attr:`cell_key` names the cell under its clipping rule for
    the search itself.
    """

    cell: Cell
    clipping: ClippingRule
    num_train: int
    feasible_batch_sizes: tuple[int, ...]
    pruned_batch_sizes: tuple[int, ...]
    mechanisms: dict[int, Mechanism]  # per feasible B: σ, q, T of its runs (a subsample tuning's release)
    configurations: int  # configurations the sampler will propose (each runs `replicates` times)
    tuning: TuningPlan | None = None  # tuning on a private subsample: its runs' schedules and mechanisms
    #: An end-to-end private cell's total ε at the space's δ, as its planner found it (None otherwise):
    #: private selection's bound of the planned σ (``PrivateSelectionPlan.epsilon_selection``), or a subsample
    #: tuning's RDP total of tuning and release (``TuningPlan.epsilon_total``). Every statement reads it.
    epsilon_selection: float | None = None

    @property
    def noise_multipliers(self) -> dict[int, float]:
        """σ per feasible B (of :attr:`mechanisms`)."""
        return {b: m.noise_multiplier for b, m in self.mechanisms.items()}

    @property
    def tuning_plan(self) -> TuningPlan:
        """:attr:`tuning` of a cell that tunes on a secret subsample (only such a cell has one)."""
        assert self.tuning is not None, "only a cell that tunes on a subsample has a tuning plan"
        return self.tuning

    @property
    def cell_key(self) -> str:
        """The file-name-safe id of the cell under its clipping rule, e.g. ``eps1-E5`` or
        ``eps1-E5-auto_s``: it keys the cell's sampler, budget and Tune units, prefixes its
        configuration ids (so its runs' part files) and a private search's kept trial counts, and
        seeds the cell's proposals: results folders hold it, so its form must not change."""
        base = f"eps{self.cell.epsilon:g}-E{self.cell.epochs}".replace(".", "p")
        return base if self.clipping != "auto_s" else f"{base}-auto_s"


def _feasible(
    space: SearchSpace, candidates: list[int], num_train: int, epochs: int, cell_name: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(feasible, pruned) batch sizes of a cell with ``epochs``: the min-step rule T ≥ T_min."""
    feasible = tuple(b for b in candidates if total_steps(num_train, b, epochs) >= space.min_steps)
    if not feasible:
        raise SearchError(
            f"cell {cell_name}: no batch size gives T ≥ min_steps = {space.min_steps} "
            f"with N = {num_train} (largest T is {total_steps(num_train, min(candidates), epochs)}); "
            "lower min_steps, add smaller batch sizes or more epochs"
        )
    return feasible, tuple(b for b in candidates if b not in feasible)


def _candidates(space: SearchSpace, num_train: int) -> list[int]:
    """The space's batch sizes that fit the training set; raises ``SearchError`` when none does."""
    candidates = space.batch_size.candidates(num_train)
    if not candidates:
        raise SearchError(f"every batch size in the space exceeds the training set (N = {num_train})")
    return candidates


def plan_cells_per_cell(space: SearchSpace, num_train: int, progress: bool = True) -> list[CellPlan]:
    """Plan every (ε, E) cell of a per-cell search (and its AUTO-S variant when asked): pruning and the
    mechanism per B (:func:`dptune.plan.mechanism.mechanisms`, every σ of the search calibrated here, once).
    Raises ``SearchError`` when a cell has no batch size with T ≥ T_min."""
    candidates = _candidates(space, num_train)
    variants: list[ClippingRule] = [space.training.clipping] + (["auto_s"] if space.training.compare_auto_s else [])
    cells = [(cell, *_feasible(space, candidates, num_train, cell.epochs, cell.cell_id)) for cell in space.cells()]
    found = mechanisms(
        {(cell.epsilon, cell.epochs, b) for cell, feasible, _ in cells for b in feasible},
        space.privacy.delta,
        num_train,
        progress,
    )
    plans = []
    for cell, feasible, pruned in cells:
        cell_mechanisms = {b: found[cell.epsilon, cell.epochs, b] for b in feasible}
        for clipping in variants:
            plan = CellPlan(cell, clipping, num_train, feasible, pruned, cell_mechanisms, 0)
            plans.append(replace(plan, configurations=_trial_count(space, plan)))
    return plans


def _private_batch_sizes(space: SearchSpace, num_train: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """The epochs E of an end-to-end private search's one cell and its (feasible, pruned) batch sizes."""
    selection = space.privacy.private_selection
    assert selection is not None and space.sampler.trials_per_cell is not None
    epochs = space.epochs[0]
    feasible, pruned = _feasible(space, _candidates(space, num_train), num_train, epochs, f"epochs={epochs}")
    print(f"finding the per-trial ε for a total of ε = {selection.epsilon:g} (private selection)...", flush=True)
    return epochs, feasible, pruned


def plan_private_cell(space: SearchSpace, num_train: int) -> CellPlan:
    """The one cell of an end-to-end private search (``privacy.private_selection``): the per-trial ε, the
    largest that meets the total budget by the private-selection bound (``privacy.plan_private_selection``),
    and the mechanism per B (σ from that plan, wrapped: ``dptune.plan.mechanism.wrapped``). Raises
    ``SearchError`` when no batch size has T ≥ T_min or the budget is unreachable."""
    selection = space.privacy.private_selection
    epochs, feasible, pruned = _private_batch_sizes(space, num_train)
    assert selection is not None and space.sampler.trials_per_cell is not None
    try:
        found = plan_private_selection(
            selection.epsilon,
            space.privacy.delta,
            space.sampler.trials_per_cell,
            [sample_rate(num_train, b) for b in feasible],
            [total_steps(num_train, b, epochs) for b in feasible],
            shape=selection.trial_count_shape,
            score_noise_multiplier=selection.score_noise_multiplier,
        )
    except PrivacyParameterError as error:
        raise SearchError(f"privacy.private_selection: {error}") from None
    sigmas = dict(zip(feasible, found.noise_multipliers, strict=True))
    planned = wrapped(sigmas, found.epsilon_per_trial, space.privacy.delta, num_train, epochs)
    cell = Cell(epsilon=found.epsilon_per_trial, epochs=epochs)
    plan = CellPlan(cell, space.training.clipping, num_train, feasible, pruned, planned, 0)
    return _private_plan(space, replace(plan, epsilon_selection=found.epsilon_selection))


def plan_subsample_cell(space: SearchSpace, num_train: int) -> CellPlan:
    """The one cell of a private search tuned on a secret subsample (``private_selection.tuning_subsample``):
    its tuning plan (``subsample.plan_tuning``: the per-run ε, the tuning runs' schedules and mechanisms)
    and, per tunable B, the release's mechanism on every training row."""
    epochs, feasible, pruned = _private_batch_sizes(space, num_train)
    tuning = plan_tuning(space, feasible, num_train, epochs)
    cell = Cell(epsilon=tuning.epsilon_per_run, epochs=epochs)
    clipping = space.training.clipping
    planned = tuning.release_mechanisms
    plan = CellPlan(cell, clipping, num_train, tuple(tuning.schedules), pruned, planned, 0, tuning)
    return _private_plan(space, replace(plan, epsilon_selection=tuning.epsilon_total))


def _private_plan(space: SearchSpace, plan: CellPlan) -> CellPlan:
    """A private search's one cell ``plan`` with its secret trial count K drawn (:func:`_trial_count`)."""
    return replace(plan, configurations=_trial_count(space, plan))


def _trial_count(space: SearchSpace, plan: CellPlan) -> int:
    """Trials a cell runs: the grid's size, ``trials_per_cell``, or, with a random trial count (and
    always under private selection), a draw K ≥ 1 from the truncated negative binomial with mean
    ``trials_per_cell`` (geometric unless ``trial_count_shape`` says otherwise). K comes from fresh
    OS entropy — the private-selection bound needs it secret — unless the space is ``reproducible``."""
    if space.sampler.name == "grid":
        return _grid_size(space, plan.feasible_batch_sizes, plan.clipping)
    mean = space.sampler.trials_per_cell
    assert mean is not None
    selection = space.privacy.private_selection
    if not space.sampler.random_trial_count and selection is None:
        return mean
    rng = np.random.default_rng(_cell_seed(space, plan) if space.reproducible else None)
    return draw_trial_count(mean, selection.trial_count_shape if selection else 1.0, rng)


#: The file inside a private search's trust boundary that keeps its secret trial count K.
TRIAL_COUNT_FILE = "trial_count.json"


def kept_trial_counts(runs: str, plans: list[CellPlan]) -> list[CellPlan]:
    """The plans with the trial counts a private search drew when it started, kept in
    ``<runs>/trial_count.json`` inside its trust boundary: the first start writes the counts it
    drew (atomically and durably, before any run), a resume reads them back (and keeps the draw of
    a cell the file lacks), so K is drawn once per search."""
    kept = read_file(runs, TRIAL_COUNT_FILE)
    counts = json.loads(kept) if kept is not None else {}
    if not {plan.cell_key for plan in plans} <= set(counts):
        counts = {plan.cell_key: plan.configurations for plan in plans} | counts
        write_file_atomic(runs, TRIAL_COUNT_FILE, json.dumps(counts).encode(), durable=True)
    return [replace(plan, configurations=int(counts[plan.cell_key])) for plan in plans]


def _cell_seed(space: SearchSpace, plan: CellPlan) -> int:
    """A public seed per cell, from the space's seed and the ``cell_key``: it drives the sampler's
    proposals (data-independent for random and grid search), never a trial's noise or batches."""
    return space.seed + int(hashlib.sha1(plan.cell_key.encode()).hexdigest()[:6], 16)


def _grid_size(space: SearchSpace, feasible: tuple[int, ...], clipping: str) -> int:
    clip_values = 1 if clipping == "auto_s" else len(space.clip_bound.grid() or [])
    return clip_values * len(feasible) * len(space.base_learning_rate.grid() or [])


def _plan_header(loaded: LoadedSpace, plans: list[CellPlan]) -> list[str]:
    """The first lines of a plan's description: the space, the task and the coins."""
    space = loaded.space
    return [
        f"search '{space.name}' from {loaded.path} (spec {loaded.spec_hash})",
        f"task: {space.task.dataset_name} / {space.task.backbone} / {space.task.peft}, "
        + (
            f"N_train = {plans[0].num_train}"
            if (unit := space.privacy.person_unit) is None
            else f"privacy unit: person ({unit.column!r}), N_people = {plans[0].num_train} (B counts people)"
        )
        + f", δ = {space.privacy.delta:g}, sampler = {space.sampler.name}, "
        f"min_steps = {space.min_steps}, coupling = {space.coupling.rule}"
        + (f" (B_ref = {space.coupling.reference_batch_size})" if space.coupling.rule == "sqrt" else ""),
        "coins: "
        + (
            f"REPRODUCIBLE from seed {space.seed} (no DP guarantee for released results)"
            if space.reproducible
            else "fresh OS entropy per trial (noise, Poisson batches, initialisation), never stored"
        ),
    ]


def _cell_lines(space: SearchSpace, plan: CellPlan, count: str) -> list[str]:
    """A cell's lines in a plan's description: its ``count`` of configurations and its mechanism per B."""
    lines = [f"cell {plan.cell.cell_id} [{plan.clipping}]: {count}", "      B      T   σ        σ√T"]
    for b in plan.feasible_batch_sizes:
        steps, sigma = plan.mechanisms[b].steps, plan.mechanisms[b].noise_multiplier
        lines.append(f"  {b:>5} {steps:>6}   {sigma:<8.4f} {sigma * math.sqrt(steps):.2f}")
    if plan.pruned_batch_sizes:
        lines.append(f"  pruned by min-step rule (T < {space.min_steps}): B = {list(plan.pruned_batch_sizes)}")
    if oversized := space.batch_size.oversized(plan.num_train):
        lines.append(f"  dropped, larger than N = {plan.num_train}: B = {oversized}")
    return lines


def format_cell_plans(loaded: LoadedSpace, plans: list[CellPlan]) -> str:
    """A readable description of what a per-cell search will run (``--dry-run`` prints it): each cell's
    configurations and mechanism per B, and the total."""
    space = loaded.space
    runs = f" × {space.replicates} replicates" if space.replicates > 1 else ""
    lines = _plan_header(loaded, plans)
    for plan in plans:
        lines += _cell_lines(space, plan, f"{plan.configurations} configurations{runs}")
    configurations = sum(p.configurations for p in plans)
    lines.append(
        f"total: {configurations} configurations{runs} = {configurations * space.replicates} trials in "
        f"{len(plans)} cell runs"
    )
    return "\n".join(lines)


def format_private_plan(loaded: LoadedSpace, plans: list[CellPlan]) -> str:
    """:func:`format_cell_plans` of an end-to-end private search: its budget's split, and no count of its runs."""
    return "\n".join(_selection_plan_lines(loaded, plans, []))


def format_subsample_plan(loaded: LoadedSpace, plans: list[CellPlan]) -> str:
    """:func:`format_private_plan` of a search tuned on a secret subsample, with its tuning runs' schedules."""
    return "\n".join(_selection_plan_lines(loaded, plans, _format_tuning(plans[0].tuning_plan)))


def _selection_plan_lines(loaded: LoadedSpace, plans: list[CellPlan], tuning: list[str]) -> list[str]:
    """A private search's plan: the split of its total budget, the ``tuning`` lines, each cell's mechanism."""
    space = loaded.space
    selection = space.privacy.private_selection
    assert selection is not None
    lines = _plan_header(loaded, plans)
    lines.append(
        f"private selection: total ε = {selection.epsilon:g} at δ = {space.privacy.delta:g} → "
        f"ε per trial = {plans[0].cell.epsilon:.4g}; a random number of trials (mean "
        f"{space.sampler.trials_per_cell}), noisy validation score "
        f"σ_s = {selection.score_noise_multiplier:g}"
    )
    lines += tuning
    count = f"a secret random number of configurations (mean {space.sampler.trials_per_cell})"
    for plan in plans:
        lines += _cell_lines(space, plan, count)
    return lines


def _format_tuning(tuning: TuningPlan) -> list[str]:
    """The dry run's lines on tuning on a subsample: the split of the total and each tuning run's schedule."""
    lines = [
        f"tuning on a secret subsample: q₁ = {tuning.fraction:g} of the training and validation rows, "
        f"transfer '{tuning.transfer}'; σ of every tuning run and of the release calibrated to ε = "
        f"{bound_text(tuning.epsilon_per_run, 4)} each; the RDP bound of the whole: ε = "
        f"{bound_text(tuning.epsilon_total, 4)} (the amplified tuning alone {bound_text(tuning.epsilon_tuning, 4)}, "
        f"the release alone {bound_text(tuning.epsilon_release, 4)})",
        "  a tuning run (on the subsample) per full-data B:",
        "      B   q        T      σ",
    ]
    for b, (rate, steps) in tuning.schedules.items():
        lines.append(f"  {b:>5}   {rate:<8.4g} {steps:>6}   {tuning.noise_multipliers[b]:.4f}")
    if tuning.untunable:
        lines.append(f"  not tuned, larger than the subsample's q₁·N rows: B = {list(tuning.untunable)}")
    lines.append("  the release, on every training row: the cell's table below")
    return lines


def cell_spec(space: SearchSpace, plan: CellPlan) -> CellSpec:
    """The plain-data search space of one cell's sampler (:mod:`dptune.search.planning.sampler`).

    A grid is known in advance: its pruned B are never offered (:func:`record_pruned_grid` records
    them). Model-based and random samplers are offered the pruned B too, so they learn to avoid
    them; the cell sampler records and skips each such proposal.
    """
    is_grid = space.sampler.name == "grid"
    offered = plan.feasible_batch_sizes
    if not is_grid:
        offered = tuple(sorted(plan.feasible_batch_sizes + plan.pruned_batch_sizes))
    ranges: dict[str, dict[str, Any]] = {}
    for name, spec in _sampled_ranges(space, plan).items():
        ranges[name] = (
            {"values": sorted(spec.values)}
            if spec.values is not None
            else {"low": spec.low, "high": spec.high, "log": spec.log}
        )
    secret = space.privacy.private_selection is not None and not space.reproducible
    return CellSpec(
        sampler=space.sampler.name,
        seed=None if secret else _cell_seed(space, plan),
        batch_sizes=offered,
        feasible_batch_sizes=plan.feasible_batch_sizes,
        ranges=ranges,
        startup_trials=min(8, max(2, plan.configurations // 3)),
    )


def _sampled_ranges(space: SearchSpace, plan: CellPlan) -> dict[str, Any]:
    """The continuous or listed hyperparameters of a cell besides B: η₀, and C unless AUTO-S."""
    ranges = {"base_learning_rate": space.base_learning_rate}
    if plan.clipping != "auto_s":
        ranges["clip_bound"] = space.clip_bound
    return ranges


def record_pruned_grid(space: SearchSpace, plan: CellPlan, context: TrialContext) -> None:
    """Record every grid point whose B the min-step rule removed: one row each, no compute."""
    ranges = _sampled_ranges(space, plan)
    for batch_size in plan.pruned_batch_sizes:
        for point in itertools.product(*(sorted(spec.values) for spec in ranges.values())):
            record_pruned(
                context,
                {"batch_size": batch_size, **dict(zip(ranges, point, strict=True))},
                plan.num_train,
                space.min_steps,
            )


def unit_size(space: SearchSpace, plan: CellPlan, slots: int, fused: bool) -> int:
    """Configurations one Tune trial carries in a cell: ``resources.configurations_per_trial``, or
    under ``auto`` with the fused runner the cell's budget spread over the trial slots (at most
    ``MAX_UNIT_CONFIGURATIONS``), else one. The fused runner splits a unit to fit memory itself."""
    asked = space.resources.configurations_per_trial
    if asked != "auto":
        return min(int(asked), max(1, plan.configurations))
    if not fused:
        return 1
    return max(1, min(MAX_UNIT_CONFIGURATIONS, math.ceil(plan.configurations / max(1, slots))))


def private_chunk_size(space: SearchSpace, fused: bool) -> int:
    """Configurations a private unit runs at once (``dptune.search.runs.private_units``): a public number,
    ``resources.configurations_per_trial``, or under ``auto`` ``MAX_UNIT_CONFIGURATIONS`` with the
    fused runner (which splits them to fit memory itself), else one."""
    asked = space.resources.configurations_per_trial
    if asked != "auto":
        return int(asked)
    return MAX_UNIT_CONFIGURATIONS if fused else 1


def task_workload(space: SearchSpace, max_train_examples: int | None, max_eval_examples: int | None) -> WorkloadSpec:
    """The workload of the search's task (the space's ``task`` and public ``seed``), with the
    command line's subset caps: what the driver loads and every trial trains on."""
    task = space.task
    return WorkloadSpec(
        dataset=task.dataset_name,
        backbone=task.backbone,
        peft=task.peft,
        seed=space.seed,
        fraction=task.fraction,
        examples_per_class=task.examples_per_class,
        classes=task.classes,
        max_tokens=task.max_tokens,
        validation_fraction=task.validation_fraction,
        max_train_examples=max_train_examples,
        max_eval_examples=max_eval_examples,
        dataset_file=task.dataset_file,
        person_unit=space.privacy.person_unit,
    )


def base_trial_config(
    space: SearchSpace, plan: CellPlan, max_train_examples: int | None, max_eval_examples: int | None
) -> TrialConfig:
    """The part of a trial's config every trial of a cell shares."""
    training = space.training
    return TrialConfig(
        workload=task_workload(space, max_train_examples, max_eval_examples),
        epsilon=plan.cell.epsilon,
        delta=space.privacy.delta,
        epochs=plan.cell.epochs,
        clip_bound=1.0,
        batch_size=plan.feasible_batch_sizes[0],
        learning_rate=1e-3,
        base_learning_rate=1e-3,
        optimizer=training.optimizer,
        clipping=plan.clipping,
        engine=training.engine,
        seed=None,
        score_noise_multiplier=(
            space.privacy.private_selection.score_noise_multiplier if space.privacy.private_selection else None
        ),
        max_physical_batch_size=space.resources.max_physical_batch_size,
        threads=max(1, int(space.resources.cpus)),
        diagnostics=training.diagnostics,
        diagnostic_examples=training.diagnostic_examples,
    )


def check_runner(space: SearchSpace, plans: list[CellPlan], base: TrialConfig, workload: Any) -> bool:
    """Whether the fused runner trains the search's runs (``training.runner``), checked before compute.

    ``auto``: fused where it applies (``dptune.runners.fused.fused_refusal``) and no scheduler needs
    per-epoch reports; ``fused``: fused or a ``SearchError`` saying why not; ``trial``: never. A fused
    search's base configuration must pass the trial's value checks, and every feasible B must fit at
    least one configuration in the fused runner's memory budget.
    """
    runner = space.training.runner
    if runner == "trial" or space.scheduler is not None:
        return False
    from dptune.runners import fused

    refusal = fused.fused_refusal(base)
    if refusal is not None:
        if runner == "fused":
            raise SearchError(
                f"training.runner 'fused' cannot run this search: {refusal}; use runner 'auto' or 'trial'"
            )
        return False
    fused.check_fusable([base])  # the trial's own value checks (TrialConfigError), as every fused group runs them
    feature_dim = int(workload.train[0][0].shape[-1])
    budget = fused.FUSED_MEMORY_BYTES
    for batch_size in sorted({b for plan in plans for b in plan.feasible_batch_sizes}):
        if (
            fused.max_fused_configurations(
                replace(base, batch_size=batch_size),
                len(workload.train),
                feature_dim,
                workload.num_classes,
                memory_bytes=budget,
                person_rows=fused.person_load(workload, replace(base, batch_size=batch_size)),
            )
            < 1
        ):
            raise SearchError(
                f"batch size {batch_size}: one configuration does not fit the fused runner's memory "
                f"budget of {budget / 2**30:.3g} GiB; use training.runner 'trial' or smaller batch "
                "sizes"
            )
    return True


def cell_context(
    space: SearchSpace,
    plan: CellPlan,
    max_train_examples: int | None,
    max_eval_examples: int | None,
    runs: str,
    search_id: str,
    fused: bool,
    tuning_rows: str | None,
    lease_token: str | None,
) -> TrialContext:
    """What every run of cell ``plan`` shares (:class:`~dptune.search.runs.execution.TrialContext`): its base
    configuration (on the secret tuning rows ``tuning_rows``, where the search drew them), ids, coupling,
    coins, runner, N with the mechanism per feasible B from the plan, and the search's lease token; its runs
    are recorded under ``runs``. A cell that tunes on a subsample: :func:`tuning_cell_context`."""
    return TrialContext(
        base=on_tuning_rows(base_trial_config(space, plan, max_train_examples, max_eval_examples), tuning_rows),
        results_root=runs,
        search_id=search_id,
        cell_id=plan.cell.cell_id,
        cell_key=plan.cell_key,
        coupling=space.coupling.rule,
        reference_batch_size=space.coupling.reference_batch_size,
        reproducible_seed=space.seed if space.reproducible else None,
        replicates=space.replicates,
        fused=fused,
        num_train=plan.num_train,
        mechanisms=dict(plan.mechanisms),
        lease_token=lease_token,
    )


def tuning_cell_context(
    space: SearchSpace,
    plan: CellPlan,
    max_train_examples: int | None,
    max_eval_examples: int | None,
    runs: str,
    search_id: str,
    fused: bool,
    tuning_rows: str | None,
    lease_token: str | None,
) -> TrialContext:
    """:func:`cell_context` of a cell that tunes on a secret subsample (``plan.tuning``): its runs train on
    ``tuning_rows`` with the tuning runs' mechanisms per B, on their public schedules."""
    tuning = plan.tuning_plan
    context = cell_context(
        space, plan, max_train_examples, max_eval_examples, runs, search_id, fused, tuning_rows, lease_token
    )
    schedules = public_schedules(tuning, plan.num_train, plan.cell.epochs)
    return replace(context, mechanisms=dict(tuning.mechanisms), schedules=schedules)
