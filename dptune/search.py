"""The search service: joint (C, B, η₀) search per (ε, epochs) cell on Ray Tune + Optuna.

``python -m dptune.search --space search_spaces/default.yaml`` on a laptop (embedded local Ray),
``ray job submit -- python -m dptune.search ...`` on a cluster (joins it through RAY_ADDRESS).

Flow: validate the space and the flags (no compute) → load the workload once in the driver
(fills the feature cache) → plan each cell (steps, σ, min-step pruning) → one Ray Tune run for
all cells, each cell with its own Optuna sampler, budget and (optionally) ASHA scheduler, cells
side by side → each trial writes its own Parquet rows when it ends → the search table (with the
privacy cost of tuning) → summary table → report.

Ray appears only here: a trial (``dptune.trial.run_trial``) is a plain function.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from dptune import __version__, preflight
from dptune.cell_sampler import CellSampler, CellSpec
from dptune.contract import TrialConfig
from dptune.errors import ArgumentParser, DptuneError, SearchIncomplete, report_and_exit, shown, storage_error
from dptune.execution import TrialContext, record_pruned
from dptune.lease import hold_lease
from dptune.ledger import charged_runs
from dptune.paths import check_name, filesystem, probe_writable, read_file, write_file_atomic
from dptune.plan import sample_rate, total_steps
from dptune.privacy import (
    PrivacyParameterError,
    TrialMechanism,
    calibrate_noise_multiplier,
    draw_trial_count,
    plan_private_selection,
    selection_epsilon,
)
from dptune.records import SCHEMA_VERSION, TRUST_BOUNDARY_README, ResultsStore, read_table, runs_root
from dptune.search_privacy import composition_cost, guarantee, select_release
from dptune.space import Cell, LoadedSpace, SearchSpace, SpaceError, load_space, parse_override
from dptune.trial import check_trial_can_run

#: Most configurations one Tune trial carries under ``configurations_per_trial: auto``.
MAX_UNIT_CONFIGURATIONS = 256


class SearchError(DptuneError):
    """Bad flags or an unusable results location, reported before any compute."""


# --------------------------------------------------------------------------- the plan of a cell


@dataclass(frozen=True)
class CellPlan:
    """What a cell will run: the B values that pass the min-step rule and σ for each."""

    cell: Cell
    clipping: str
    num_train: int
    feasible_batch_sizes: tuple[int, ...]
    pruned_batch_sizes: tuple[int, ...]
    noise_multipliers: dict[int, float]  # σ per feasible B
    configurations: int  # configurations the sampler will propose (each runs `replicates` times)

    @property
    def key(self) -> str:
        """A file-name-safe id of the cell and its clipping variant, e.g. ``eps1-E5``."""
        base = f"eps{self.cell.epsilon:g}-E{self.cell.epochs}".replace(".", "p")
        return base if self.clipping != "auto_s" else f"{base}-auto_s"


def _feasible(space: SearchSpace, candidates: list[int], num_train: int, epochs: int,
              cell_name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(feasible, pruned) batch sizes of a cell with ``epochs``: the min-step rule T ≥ T_min."""
    feasible = tuple(b for b in candidates if total_steps(num_train, b, epochs) >= space.min_steps)
    if not feasible:
        raise SearchError(
            f"cell {cell_name}: no batch size gives T ≥ min_steps = {space.min_steps} "
            f"with N = {num_train} (largest T is {total_steps(num_train, min(candidates), epochs)}); "
            "lower min_steps, add smaller batch sizes or more epochs"
        )
    return feasible, tuple(b for b in candidates if b not in feasible)


def plan_cells(space: SearchSpace, num_train: int, progress: bool = True) -> list[CellPlan]:
    """Plan every (ε, E) cell (and its AUTO-S variant when asked): pruning and σ per B.

    With ``privacy.private_selection`` the one cell's per-trial ε is the largest that meets the
    total budget by the private-selection bound (``privacy.plan_private_selection``).
    Raises ``SearchError`` when a cell has no batch size with T ≥ T_min.
    """
    candidates = space.batch_size.candidates(num_train)
    if not candidates:
        raise SearchError(f"every batch size in the space exceeds the training set (N = {num_train})")
    if space.privacy.private_selection is not None:
        return [_plan_private_cell(space, candidates, num_train)]
    variants = [space.training.clipping] + (["auto_s"] if space.training.compare_auto_s else [])
    plans = []
    for cell in space.cells():
        feasible, pruned = _feasible(space, candidates, num_train, cell.epochs, cell.cell_id)
        sigmas = {}
        for batch_size in tqdm(feasible, desc=f"calibrating σ for {cell.cell_id}", unit="B", file=sys.stderr,
                               disable=not progress, leave=False):
            sigmas[batch_size] = calibrate_noise_multiplier(
                cell.epsilon, space.privacy.delta, sample_rate(num_train, batch_size),
                total_steps(num_train, batch_size, cell.epochs))
        for clipping in variants:
            plan = CellPlan(cell, clipping, num_train, feasible, pruned, sigmas, 0)
            plans.append(replace(plan, configurations=_trial_count(space, plan)))
    return plans


def _plan_private_cell(space: SearchSpace, candidates: list[int], num_train: int) -> CellPlan:
    """The one cell of an end-to-end private search: per-trial ε and σ per B from the total budget."""
    selection = space.privacy.private_selection
    assert selection is not None and space.sampler.trials_per_cell is not None
    epochs = space.epochs[0]
    feasible, pruned = _feasible(space, candidates, num_train, epochs, f"epochs={epochs}")
    print(f"finding the per-trial ε for a total of ε = {selection.epsilon:g} (private selection)...", flush=True)
    try:
        found = plan_private_selection(
            selection.epsilon, space.privacy.delta, space.sampler.trials_per_cell,
            [sample_rate(num_train, b) for b in feasible], [total_steps(num_train, b, epochs) for b in feasible],
            shape=selection.trial_count_shape, score_noise_multiplier=selection.score_noise_multiplier)
    except PrivacyParameterError as error:
        raise SearchError(f"privacy.private_selection: {error}") from None
    plan = CellPlan(Cell(epsilon=found.epsilon_per_trial, epochs=epochs), space.training.clipping, num_train,
                    feasible, pruned, dict(zip(feasible, found.noise_multipliers, strict=True)), 0)
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
    drew (atomically, before any run), a resume reads them back, so K is drawn once per search."""
    kept = read_file(runs, TRIAL_COUNT_FILE)
    if kept is None:
        counts = {plan.key: plan.configurations for plan in plans}
        write_file_atomic(runs, TRIAL_COUNT_FILE, json.dumps(counts).encode())
        return plans
    counts = json.loads(kept)
    return [replace(plan, configurations=int(counts[plan.key])) if plan.key in counts else plan for plan in plans]


def _cell_seed(space: SearchSpace, plan: CellPlan) -> int:
    """A public seed per cell, from the space's seed and the cell's key: it drives the sampler's
    proposals (data-independent for random and grid search), never a trial's noise or batches."""
    return space.seed + int(hashlib.sha1(plan.key.encode()).hexdigest()[:6], 16)


def _grid_size(space: SearchSpace, feasible: tuple[int, ...], clipping: str) -> int:
    clip_values = 1 if clipping == "auto_s" else len(space.clip_bound.grid() or [])
    return clip_values * len(feasible) * len(space.base_learning_rate.grid() or [])


def format_plan(loaded: LoadedSpace, plans: list[CellPlan]) -> str:
    """A readable description of what the search will run (``--dry-run`` prints it)."""
    space = loaded.space
    lines = [
        f"search '{space.name}' from {loaded.path} (spec {loaded.spec_hash})",
        f"task: {space.task.dataset} / {space.task.backbone} / {space.task.peft}, "
        f"N_train = {plans[0].num_train}, δ = {space.privacy.delta:g}, sampler = {space.sampler.name}, "
        f"min_steps = {space.min_steps}, coupling = {space.coupling.rule}"
        + (f" (B_ref = {space.coupling.reference_batch_size})" if space.coupling.rule == "sqrt" else ""),
        "coins: " + (f"REPRODUCIBLE from seed {space.seed} (no DP guarantee for released results)" if space.reproducible
                     else "fresh OS entropy per trial (noise, Poisson batches, initialisation), never stored"),
    ]
    selection = space.privacy.private_selection
    if selection is not None:
        lines.append(f"private selection: total ε = {selection.epsilon:g} at δ = {space.privacy.delta:g} → "
                     f"ε per trial = {plans[0].cell.epsilon:.4g}; a random number of trials (mean "
                     f"{space.sampler.trials_per_cell}), noisy validation score "
                     f"σ_s = {selection.score_noise_multiplier:g}")
    runs = f" × {space.replicates} replicates" if space.replicates > 1 else ""
    for plan in plans:
        count = (f"a secret random number of configurations (mean {space.sampler.trials_per_cell})"
                 if selection is not None else f"{plan.configurations} configurations{runs}")
        lines.append(f"cell {plan.cell.cell_id} [{plan.clipping}]: {count}")
        lines.append("      B      T   σ        σ√T")
        for b in plan.feasible_batch_sizes:
            steps = total_steps(plan.num_train, b, plan.cell.epochs)
            sigma = plan.noise_multipliers[b]
            lines.append(f"  {b:>5} {steps:>6}   {sigma:<8.4f} {sigma * math.sqrt(steps):.2f}")
        if plan.pruned_batch_sizes:
            lines.append(f"  pruned by min-step rule (T < {space.min_steps}): B = {list(plan.pruned_batch_sizes)}")
        if oversized := space.batch_size.oversized(plan.num_train):
            lines.append(f"  dropped, larger than N = {plan.num_train}: B = {oversized}")
    if selection is None:
        configurations = sum(p.configurations for p in plans)
        lines.append(f"total: {configurations} configurations{runs} = {configurations * space.replicates} trials in "
                     f"{len(plans)} cell runs")
    return "\n".join(lines)


# --------------------------------------------------------------------------- what each cell's sampler searches


def cell_spec(space: SearchSpace, plan: CellPlan) -> CellSpec:
    """The plain-data search space of one cell's sampler (``dptune.cell_sampler``).

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
        ranges[name] = ({"values": sorted(spec.values)} if spec.values is not None
                        else {"low": spec.low, "high": spec.high, "log": spec.log})
    secret = space.privacy.private_selection is not None and not space.reproducible
    return CellSpec(sampler=space.sampler.name, seed=None if secret else _cell_seed(space, plan), batch_sizes=offered,
                    feasible_batch_sizes=plan.feasible_batch_sizes, ranges=ranges,
                    startup_trials=min(8, max(2, plan.configurations // 3)))


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
            record_pruned(context, {"batch_size": batch_size, **dict(zip(ranges, point, strict=True))},
                          plan.num_train, space.min_steps)


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


# --------------------------------------------------------------------------- the whole search


#: Seconds to wait before the one retry of an embedded Ray start that timed out (an overloaded machine).
RAY_START_RETRY_PAUSE_S = 15.0


def init_ray(address: str | None, num_cpus: int | None = None) -> str:
    """Join a cluster (``--address`` or RAY_ADDRESS) or start an embedded local Ray.

    A plain ``ray.init()`` would silently join whatever cluster a leftover file points to, so
    the embedded case asks for ``address="local"`` explicitly. A cluster that cannot be joined
    raises ``PreflightError`` naming the address and, when no token is set, token authentication
    (``preflight.cluster_join_error``). An embedded start that times out (Ray waits 30 s for its
    processes to register: an overloaded machine) is retried once after ``RAY_START_RETRY_PAUSE_S``,
    then raises ``SearchIncomplete`` saying the machine is overloaded and what to do.
    """
    import ray

    target = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return "already initialised"
    # Every worker process first leaves a deleted working directory (inherited from the
    # `ray start` of its node), which would otherwise kill trials at `import torch`.
    runtime_env = {"worker_process_setup_hook": "dptune.trial.leave_deleted_working_directory"}
    if target:
        try:
            ray.init(address=target, log_to_driver=False, runtime_env=runtime_env)
        except (ConnectionError, RuntimeError) as error:
            raise preflight.cluster_join_error(target, "--address" if address else "RAY_ADDRESS", error) from None
        return f"joined Ray cluster at {target}"
    cpus = num_cpus or os.cpu_count()
    for attempt in (1, 2):
        try:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                     runtime_env=runtime_env)
            break
        except Exception as error:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(error):
                raise
            with contextlib.suppress(Exception):
                ray.shutdown()
            load = os.getloadavg()[0]
            if attempt == 2:
                raise SearchIncomplete(
                    f"the embedded Ray did not start: its processes did not register within Ray's startup wait, "
                    f"twice (load average {load:.1f} on {os.cpu_count()} cores: this machine is overloaded). Run "
                    "again when the load is lower (with --resume), or start Ray once yourself (`ray start --head "
                    "--num-cpus N`) and pass its address with --address; nothing was trained") from None
            print(f"warning: the embedded Ray timed out during startup (load average {load:.1f} on "
                  f"{os.cpu_count()} cores); retrying once in {RAY_START_RETRY_PAUSE_S:g} s", file=sys.stderr,
                  flush=True)
            time.sleep(RAY_START_RETRY_PAUSE_S)
    return f"started embedded local Ray ({cpus} CPUs)"


def _tune_storage(results_root: str) -> str:
    return f"{results_root}/_tune" if "://" in results_root else str(Path(results_root, "_tune").resolve())


def trial_slots(space: SearchSpace) -> int:
    """Tune trials that can run at once: the cluster's CPUs over a trial's, within ``max_concurrent_trials``."""
    import ray

    slots = int(ray.cluster_resources().get("CPU", 1) // space.resources.cpus) or 1
    if space.resources.gpu:
        slots = min(slots, int(ray.cluster_resources().get("GPU", 0) // space.resources.gpu) or 1)
    return min(slots, space.resources.max_concurrent_trials or slots)


def run_cells(space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext], resume: bool) -> list[str]:
    """One Ray Tune run for every cell of the search (resumed from its experiment state when asked);
    returns what ended it early (``tune_adapters.DRIVER_FAILURES``: a results write that failed), empty
    when it ran to its end.

    The cells share the trial processes (one set-up, not one per cell) and run side by side; each
    keeps its own sampler, budget and, with ASHA, its own scheduler. A Tune trial carries a unit
    of configurations of one cell (:func:`unit_size`). A unit whose process is lost runs again up to
    ``resources.max_retries`` times (Tune's ``FailureConfig``); ``resume`` restarts units that
    still errored, and those a stopped search left unfinished.
    """
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from dptune.tune_adapters import (
        DRIVER_FAILURES,
        METRIC,
        CellMultiplexer,
        PerCellASHA,
        RecordAndReport,
        tune_trainable,
    )

    DRIVER_FAILURES.clear()

    # The longest units first (most epochs), so the last ones to finish are short: cells take turns
    # in this order.
    by_key = {plan.key: (context, plan) for plan, context in sorted(
        zip(plans, contexts, strict=True), key=lambda pair: -pair[0].cell.epochs)}
    trainable = tune.with_resources(
        tune.with_parameters(tune_trainable, contexts={key: context for key, (context, _) in by_key.items()}),
        {"cpu": space.resources.cpus, "gpu": space.resources.gpu},
    )
    storage = _tune_storage(contexts[0].results_root)
    experiment = f"{storage}/search"
    # Save Tune's experiment state (searcher included) at most every 5 s instead of Tune's
    # adaptive period, so a resume repeats little; repeats are caught by configuration_id.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "5")
    if space.privacy.private_selection is not None:  # Tune's default output prints a trial count; verbose=0 of
        os.environ["RAY_AIR_NEW_OUTPUT"] = "0"  # the older one prints nothing
    if resume and tune.Tuner.can_restore(experiment):
        tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_unfinished=True,
                                   resume_errored=False, restart_errored=True)
        tuner.fit()
        return list(DRIVER_FAILURES)
    if resume:
        print(f"--resume: no search to resume at {contexts[0].results_root}; starting it", flush=True)
    slots = trial_slots(space)
    units = {key: unit_size(space, plan, slots, context.fused) for key, (context, plan) in by_key.items()}
    if space.sampler.name == "grid":
        for context, plan in by_key.values():
            record_pruned_grid(space, plan, context)
    searcher = CellMultiplexer(
        samplers={key: CellSampler(cell_spec(space, plan)) for key, (_, plan) in by_key.items()},
        budgets={key: plan.configurations for key, (_, plan) in by_key.items()}, unit_sizes=units,
        contexts={key: context for key, (context, _) in by_key.items()}, num_train=plans[0].num_train,
        min_steps=space.min_steps)
    scheduler = None
    if space.scheduler is not None:
        spec = space.scheduler
        scheduler = PerCellASHA({key: ASHAScheduler(time_attr="epoch", max_t=plan.cell.epochs,
                                                    grace_period=min(spec.grace_period, plan.cell.epochs),
                                                    reduction_factor=spec.reduction_factor)
                                 for key, (_, plan) in by_key.items()})
    callback = RecordAndReport({
        key: (context, f"{plan.cell.cell_id} {plan.clipping}", plan.configurations, plan.noise_multipliers,
              plan.num_train) for key, (context, plan) in by_key.items()},
        quiet=space.privacy.private_selection is not None)
    tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=searcher, scheduler=scheduler, metric=METRIC, mode="max",
            # a private search's unit count would reveal K: run until the searcher finishes
            num_samples=-1 if space.privacy.private_selection is not None else
            sum(math.ceil(plan.configurations / units[plan.key]) for plan in plans),
            max_concurrent_trials=space.resources.max_concurrent_trials,
            reuse_actors=True,  # a trial process keeps torch, the model code and the data loaded
        ),
        run_config=tune.RunConfig(
            name="search", storage_path=storage, callbacks=[callback], verbose=0,
            failure_config=tune.FailureConfig(max_failures=space.resources.max_retries, fail_fast=False),
        ),
    )
    tuner.fit()
    return list(DRIVER_FAILURES)


def base_trial_config(space: SearchSpace, plan: CellPlan, max_train_examples: int | None,
                      max_eval_examples: int | None) -> TrialConfig:
    """The part of a trial's config every trial of a cell shares."""
    task, training = space.task, space.training
    return TrialConfig(
        dataset=task.dataset, backbone=task.backbone, peft=task.peft,
        epsilon=plan.cell.epsilon, delta=space.privacy.delta, epochs=plan.cell.epochs,
        clip_bound=1.0, batch_size=plan.feasible_batch_sizes[0], learning_rate=1e-3, base_learning_rate=1e-3,
        optimizer=training.optimizer, clipping=plan.clipping, engine=training.engine, seed=None,
        split_seed=space.seed,
        score_noise_multiplier=(space.privacy.private_selection.score_noise_multiplier
                                if space.privacy.private_selection else None),
        fraction=task.fraction, examples_per_class=task.examples_per_class, classes=task.classes,
        max_tokens=task.max_tokens, validation_fraction=task.validation_fraction,
        max_physical_batch_size=space.resources.max_physical_batch_size,
        threads=max(1, int(space.resources.cpus)), diagnostics=training.diagnostics,
        diagnostic_examples=training.diagnostic_examples,
        max_train_examples=max_train_examples, max_eval_examples=max_eval_examples,
    )


def check_runner(space: SearchSpace, plans: list[CellPlan], base: TrialConfig, workload: Any) -> bool:
    """Whether the fused runner trains the search's runs (``training.runner``), checked before compute.

    ``auto``: fused where it applies (``dptune.fused.fused_refusal``) and no scheduler needs
    per-epoch reports; ``fused``: fused or a ``SearchError`` saying why not; ``trial``: never. A fused
    search's base configuration must pass the trial's value checks, and every feasible B must fit at
    least one configuration in the fused runner's memory budget.
    """
    runner = space.training.runner
    if runner == "trial" or space.scheduler is not None:
        return False
    from dptune import fused

    refusal = fused.fused_refusal(base)
    if refusal is not None:
        if runner == "fused":
            raise SearchError(f"training.runner 'fused' cannot run this search: {refusal}; "
                              "use runner 'auto' or 'trial'")
        return False
    fused.check_fusable([base])  # the trial's own value checks (TrialConfigError), as every fused group runs them
    feature_dim = int(workload.train[0][0].shape[-1])
    budget = fused.FUSED_MEMORY_BYTES
    for batch_size in sorted({b for plan in plans for b in plan.feasible_batch_sizes}):
        if fused.max_fused_configurations(replace(base, batch_size=batch_size), len(workload.train), feature_dim,
                                          workload.num_classes, memory_bytes=budget) < 1:
            raise SearchError(f"batch size {batch_size}: one configuration does not fit the fused runner's memory "
                              f"budget of {budget / 2**30:.3g} GiB; use training.runner 'trial' or smaller batch "
                              "sizes")
    return True


#: ``search`` columns that count or compose the runs of a search: null for an end-to-end private
#: search, whose number of runs K must stay secret (as must its end time, ``created_at``).
RUN_COUNT_COLUMNS = ("trials_planned", "trials_with_steps", "epsilon_cell", "epsilon_composition",
                     "delta_composition", "epsilon_search", "epsilon_search_basic", "delta_search_basic",
                     "runs_charged", "runs_unrecorded", "created_at")


def search_rows(loaded: LoadedSpace, plans: list[CellPlan], search_id: str, trials: pd.DataFrame, *,
                official_test_split: bool, charged: pd.DataFrame | None = None) -> list[dict[str, Any]]:
    """One ``search`` row per cell run, with the privacy cost of the tuning itself.

    ``trials`` is the search's ``trials`` table; ``charged`` what the privacy ledger charges
    (``ledger.charged_runs``: every run started, recorded or not; None: the ``trials`` rows, as
    for results from before the ledger). Per cell: the composition of its charged runs; for the
    whole search (every row alike): the composition of every charged run of every cell and
    variant, which all train on the same data, and how many of them left no row
    (``runs_unrecorded``); with private selection, the bound it meets and none of
    ``RUN_COUNT_COLUMNS``. ``official_test_split``: whether the dataset ships its test split
    (``DatasetInfo.official_test_split``), which the guarantee's text states.
    """
    space = loaded.space
    delta = space.privacy.delta
    trials = trials[trials["search_id"] == search_id]
    charged = trials if charged is None else charged[charged["search_id"] == search_id]
    selection = space.privacy.private_selection
    whole = composition_cost(charged, delta) if selection is None else None
    unrecorded = max(0, len(charged[charged["steps_taken"].fillna(0) > 0])
                     - len(trials[trials["steps_taken"].fillna(0) > 0]))
    rows = []
    for plan in plans:
        row: dict[str, Any] = {
            "search_id": search_id, "name": space.name, "cell_id": plan.cell.cell_id, "clipping": plan.clipping,
            "epsilon": plan.cell.epsilon, "epochs": plan.cell.epochs, "delta": delta,
            "dataset": space.task.dataset, "backbone": space.task.backbone, "peft": space.task.peft,
            "num_train": plan.num_train, "configurations_pruned": len(plan.pruned_batch_sizes),
            "epsilon_per_trial": plan.cell.epsilon,
            "selection_bound_holds": selection is not None and not space.reproducible,
            "reproducible": space.reproducible, "spec_yaml": loaded.text, "spec_hash": loaded.spec_hash,
            "schema_version": SCHEMA_VERSION, "dptune_version": __version__,
        }
        if selection is None:
            assert whole is not None
            cell_runs = charged[(charged["cell_id"] == plan.cell.cell_id) & (charged["clipping"] == plan.clipping)]
            cell = composition_cost(cell_runs, delta)
            row.update({
                "trials_planned": plan.configurations * space.replicates, "trials_with_steps": cell.trials_with_steps,
                "epsilon_cell": cell.epsilon, "epsilon_composition": cell.epsilon_basic,
                "delta_composition": cell.delta_basic, "epsilon_search": whole.epsilon,
                "epsilon_search_basic": whole.epsilon_basic, "delta_search_basic": whole.delta_basic,
                "runs_charged": whole.trials_with_steps, "runs_unrecorded": unrecorded,
                "epsilon_selection": math.nan, "delta_selection": math.nan,
                "guarantee": guarantee(space, official_test_split, whole),
                "created_at": pd.Timestamp.now(tz="UTC"),
            })
        else:
            candidates = [TrialMechanism(plan.noise_multipliers[b], sample_rate(plan.num_train, b),
                                         total_steps(plan.num_train, b, plan.cell.epochs))
                          for b in plan.feasible_batch_sizes]
            epsilon_selection = selection_epsilon(candidates, space.sampler.trials_per_cell or 0, delta,
                                                  shape=selection.trial_count_shape,
                                                  score_noise_multiplier=selection.score_noise_multiplier)
            row.update({name: None for name in RUN_COUNT_COLUMNS})
            row.update({"epsilon_selection": epsilon_selection, "delta_selection": delta,
                        "guarantee": guarantee(space, official_test_split, None, epsilon_selection)})
        rows.append(row)
    return rows


def release_rows(space: SearchSpace, plans: list[CellPlan], search_rows_: list[dict[str, Any]],
                 trials: pd.DataFrame, *, official_test_split: bool) -> list[dict[str, Any]]:
    """An end-to-end private search's release: per cell, the configuration of the run with the best
    noisy validation score (``search_privacy.select_release``), that score (the maximum of the K
    noisy scores: biased upward), its test accuracy where the test split is public, and the budget;
    nothing that orders it among the runs (no trial id, no time). Empty for other searches."""
    selection = space.privacy.private_selection
    if selection is None:
        return []
    rows = []
    for plan, row in zip(plans, search_rows_, strict=True):
        chosen = select_release(trials[(trials["search_id"] == row["search_id"]) &
                                       (trials["cell_id"] == plan.cell.cell_id)], runs=plan.configurations)
        if chosen is None:
            continue
        rows.append({
            "search_id": row["search_id"], "cell_id": plan.cell.cell_id,
            **{name: chosen[name] for name in ("clip_bound", "batch_size", "base_learning_rate", "learning_rate",
                                               "epochs", "noisy_val_accuracy")},
            "test_accuracy": chosen["test_accuracy"] if official_test_split else None,
            "test_split_public": official_test_split,
            "epsilon_total": selection.epsilon, "delta_total": space.privacy.delta,
            "epsilon_per_trial": plan.cell.epsilon, "score_noise_multiplier": selection.score_noise_multiplier,
            "mean_trials": float(space.sampler.trials_per_cell or 0),
            "trial_count_shape": selection.trial_count_shape, "guarantee": row["guarantee"],
        })
    return rows


def summary_table(results_root: str) -> pd.DataFrame:
    """Best configuration per cell (and clipping variant), by the report's rule
    (``analysis.best_configurations`` over ``analysis.finished_trials``): configurations ranked by
    mean validation accuracy over their replicates, with intervals and the set within noise of the
    best; only runs that trained to the end are ranked."""
    from dptune.analysis import best_configurations, finished_trials

    trials = read_table(results_root, "trials")
    best = best_configurations(finished_trials(trials), by=["cell_id", "clipping"])
    if best.empty:
        return best
    counts = trials.groupby(["cell_id", "clipping"])["status"].value_counts().unstack(fill_value=0)
    best = best.set_index(["cell_id", "clipping"]).join(counts).reset_index()
    return best.sort_values(["epsilon", "epochs", "clipping"])


def format_summary(best: pd.DataFrame) -> str:
    """The summary table: per cell the best configuration, its mean accuracies over R replicates
    with the test accuracy's interval, and how many configurations are within noise of it."""
    if best.empty:
        return "no finished trials yet"
    columns = {"cell_id": "cell", "clipping": "clipping", "clip_bound": "C", "batch_size": "B",
               "base_learning_rate": "η₀", "learning_rate": "η", "replicates": "R", "val_accuracy": "val acc",
               "test_accuracy": "test acc"}
    table = best[list(columns)].rename(columns=columns)
    table["test interval"] = [f"[{low:.3f}, {high:.3f}]" for low, high in zip(best["test_low"], best["test_high"],
                                                                             strict=True)]
    table["within noise"] = [f"{k}/{n}" for k, n in zip(best["within_noise"], best["configurations"], strict=True)]
    extra = [c for c in ("ok", "pruned_min_steps", "diverged", "error", "stopped_early") if c in best]
    table = pd.concat([table, best[extra]], axis=1)
    return table.to_string(index=False, float_format=lambda v: f"{v:.4g}")


#: The line above the summary table.
SUMMARY_HEADER = ("best configuration per cell (mean over its replicates, selected on exact validation accuracy: not "
                  "a DP release; test interval: t over replicates, or binomial with one; within noise: configurations "
                  "not distinguishable from the best):")

#: Trial statuses that mean a trial ran (or tried to) and produced no usable model.
FAILED_STATUSES = ("error", "diverged")


def format_failed_cells(trials: pd.DataFrame) -> list[str]:
    """One line per cell run with no finished trial and at least one failed one: how many failed,
    and the most common reason with its count."""
    lines = []
    for (cell_id, clipping), cell in trials.groupby(["cell_id", "clipping"], sort=True):
        failed = cell[cell["status"].isin(FAILED_STATUSES)]
        if failed.empty or cell["status"].isin(["ok", "stopped_early"]).any():
            continue
        reasons = failed["reason"].fillna("").replace("", "no reason recorded").value_counts()
        statuses = ", ".join(f"{count} {status}" for status, count in failed["status"].value_counts().items())
        lines.append(f"cell {cell_id} [{clipping}]: every trial that ran failed ({statuses}); most common "
                     f"reason ({reasons.iloc[0]} of {len(failed)}): {reasons.index[0]}")
    return lines


def format_outcome(results_root: str) -> str:
    """The search's printed summary: the best trial of each cell that has one, then a line for
    each cell whose trials all failed, saying why."""
    best = summary_table(results_root)
    trials = read_table(results_root, "trials")
    failed = format_failed_cells(trials) if not trials.empty else []
    return "\n".join(([] if best.empty and failed else [format_summary(best)]) + failed)


@dataclass(frozen=True)
class SearchOptions:
    """Command-line options after validation."""

    space_path: Path
    storage: str
    name: str | None
    address: str | None
    resume: bool
    dry_run: bool
    report: bool
    overrides: dict[str, Any]
    max_train_examples: int | None
    max_eval_examples: int | None
    quarantine_corrupt: bool = False
    report_dir: str | None = None  # None: <storage>/<name>/report


def _results_root(storage: str, name: str) -> str:
    return f"{storage.rstrip('/')}/{name}" if "://" in storage else str(Path(storage, name).resolve())


def check_storage(storage: str, results_root: str) -> None:
    """``--storage`` must be a usable location and the results folder under it must take a file
    (a probe is written and removed there)."""
    filesystem(storage, "--storage")
    probe_writable(results_root, "--storage")


def check_location_and_cluster(options: SearchOptions, loaded: LoadedSpace, name: str, results_root: str) -> None:
    """The checks that write nothing (before the search takes its results folder's lease), run in
    ``--dry-run`` too: the name stays one folder under ``--storage``; the results location and the
    report's take a file (a probe, removed); the Ray address answers (or, for an embedded Ray, this
    machine has the resources a trial asks for)."""
    check_name(name, "--name" if options.name else f"{loaded.path}: name")
    check_storage(options.storage, results_root)
    if options.report:
        probe_writable(report_location(results_root, options.report_dir),
                       "--report-dir" if options.report_dir else "the report location (--report-dir)")
    target = options.address or os.environ.get("RAY_ADDRESS")
    if target:
        preflight.check_address(target, "--address" if options.address else "RAY_ADDRESS")
    else:
        preflight.check_local_resources(loaded.space.resources)


def check_results(options: SearchOptions, loaded: LoadedSpace, results_root: str, runs: str) -> list[str]:
    """The checks of an existing results folder (under the lease; ``--dry-run`` only says what it would
    move); returns warnings. Every part of the results folder (and of ``runs``, where a private search
    keeps its per-run records) is readable (or quarantined); on ``--resume`` Tune's state loads (or,
    cut short, is set aside: ``preflight.check_tune_state``) and the space is the one the search
    started with.
    """
    space = loaded.space
    notes = [note for root in dict.fromkeys((results_root, runs))
             for note in preflight.check_results_folder(root, options.quarantine_corrupt, move=not options.dry_run)]
    if options.resume:
        repeatable = space.sampler.name in ("grid", "random") and space.privacy.private_selection is None
        notes += preflight.check_tune_state(runs, set_aside=repeatable and not options.dry_run)
        preflight.check_same_space(runs, loaded)
    return notes


def _warn(notes: list[str]) -> None:
    for note in notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)


def plans_that_ran(runs: str, search_id: str, plans: list[CellPlan]) -> list[CellPlan]:
    """The cell runs with at least one recorded trial of this search (only those get a ``search`` row);
    ``runs`` is where the search's per-run records are (``records.runs_root``)."""
    trials = read_table(runs, "trials", columns=["search_id", "cell_id", "clipping"])
    mine = trials[trials["search_id"] == search_id]
    recorded = set(zip(mine["cell_id"], mine["clipping"], strict=True))
    return [plan for plan in plans if (plan.cell.cell_id, plan.clipping) in recorded]


def report_location(results_root: str, report_dir: str | None) -> str:
    """Where the report goes: ``report_dir`` (absolute, or a URI) or ``<results_root>/report``."""
    if report_dir is None:
        return f"{results_root}/report"
    return report_dir.rstrip("/") if "://" in report_dir else str(Path(report_dir).expanduser().resolve())


def search_finished(results_root: str, search_id: str) -> bool:
    """Whether the search ``search_id`` ran to its end at ``results_root`` (its ``search`` rows exist)."""
    return search_id in set(read_table(results_root, "search", columns=["search_id"])["search_id"])


def run_search(options: SearchOptions) -> str:
    """Validate, plan and run a whole search; return the results dataset's location.

    Except for ``--dry-run``, the search holds the exclusive lease on its results folder
    (``dptune.lease``) from before it loads data until it returns or raises: a second search on
    the same folder is refused at once.
    """
    loaded = load_space(options.space_path, options.overrides)
    name = options.name or loaded.space.name
    results_root = _results_root(options.storage, name)
    _warn(preflight.flag_warnings(loaded.space, trials_per_cell_flag="sampler.trials_per_cell" in options.overrides))
    check_location_and_cluster(options, loaded, name, results_root)
    if options.dry_run:
        return _run_search(options, loaded, name, results_root)
    with hold_lease(results_root, f"--storage {options.storage!r} --name {name!r}:"):
        return _run_search(options, loaded, name, results_root)


def _run_search(options: SearchOptions, loaded: LoadedSpace, name: str, results_root: str) -> str:
    from dptune.data import DATASETS, WorkloadSpec, load_workload

    space = loaded.space
    private = space.privacy.private_selection is not None
    runs = runs_root(results_root, private)
    notes = preflight.flag_warnings(space, trials_per_cell_flag="sampler.trials_per_cell" in options.overrides)
    _warn(checked := check_results(options, loaded, results_root, runs))
    notes += checked
    report = report_location(results_root, options.report_dir) if options.report else None
    store = ResultsStore(results_root)
    if not options.dry_run and not options.resume and ResultsStore(runs).completed_trial_ids():
        raise SearchError(f"results already exist at {results_root}; pass --resume to continue that search "
                          "or choose another --name/--storage")

    search_id = f"{name}-{loaded.spec_hash}"
    if options.resume and not options.dry_run and search_finished(results_root, search_id):
        print(f"--resume: search {search_id} at {results_root} is finished; nothing to run")
        conclude(results_root, report, private=private)
        return results_root

    cluster = options.address or os.environ.get("RAY_ADDRESS")
    if cluster and not options.dry_run:  # a cluster that refuses this driver (its token) fails before data loads
        print(init_ray(options.address), flush=True)
        preflight.check_cluster_resources(space.resources)
    print(f"dptune {__version__}: loading {space.task.dataset} for {space.task.backbone}/{space.task.peft}", flush=True)
    workload = load_workload(WorkloadSpec(
        dataset=space.task.dataset, backbone=space.task.backbone, peft=space.task.peft, seed=space.seed,
        fraction=space.task.fraction, examples_per_class=space.task.examples_per_class, classes=space.task.classes,
        max_tokens=space.task.max_tokens, validation_fraction=space.task.validation_fraction,
        max_train_examples=options.max_train_examples, max_eval_examples=options.max_eval_examples))
    preflight.check_steps(space, len(workload.train))
    plans = plan_cells(space, len(workload.train))
    if private and not options.dry_run:  # K once per search, inside the trust boundary
        write_file_atomic(runs, "README.txt", TRUST_BOUNDARY_README.encode())
        plans = kept_trial_counts(runs, plans)
    _warn(data_notes := preflight.data_warnings(space, len(workload.train)))
    notes += data_notes
    base = base_trial_config(space, plans[0], options.max_train_examples, options.max_eval_examples)
    fused = check_runner(space, plans, base, workload)
    if not fused:  # the model and its engine (Opacus or FiLM): what run_trial trains; the fused runner uses neither
        check_trial_can_run(base)
    print(format_plan(loaded, plans), flush=True)
    if options.dry_run:
        return results_root

    preflight.write_manifest(runs, loaded, name)  # a private search's start time stays inside its boundary
    if not cluster:
        print(init_ray(options.address), flush=True)
    started = time.monotonic()
    contexts = [TrialContext(
        base=base_trial_config(space, plan, options.max_train_examples, options.max_eval_examples),
        results_root=runs, search_id=search_id, cell_id=plan.cell.cell_id, cell_key=plan.key,
        coupling=space.coupling.rule, reference_batch_size=space.coupling.reference_batch_size,
        reproducible_seed=space.seed if space.reproducible else None, replicates=space.replicates, fused=fused,
        num_train=plan.num_train, noise_multipliers=dict(plan.noise_multipliers))
        for plan in plans]
    runner = "fused runner" if fused else "one trial per run"
    if private:  # K, its progress and the search's duration stay inside the trust boundary
        print(f"running the private search ({runner}); no per-run progress is shown: it would reveal the "
              f"secret number of runs (per-run records: {runs})", flush=True)
    else:
        replicates = f" × {space.replicates} replicates" if space.replicates > 1 else ""
        print(f"running {sum(plan.configurations for plan in plans)} configurations{replicates} in {len(plans)} "
              f"cell runs side by side ({runner})", flush=True)
    failures = run_cells(space, plans, contexts, options.resume)
    if failures:
        raise SearchIncomplete(
            f"--storage {options.storage}: the results folder {results_root} took no more writes ({failures[0]}); "
            "the search stopped. Free space (or make the folder writable), then run the same command with "
            "--resume: what finished is kept, and every training that took a step stays charged in the "
            "privacy ledger")
    check_every_run_recorded(runs, search_id, space.resources.max_retries, private)
    print("\nsearch finished" + ("" if private else f" in {time.monotonic() - started:.0f} s"), flush=True)
    ran = plans_that_ran(runs, search_id, plans)
    _warn(idle := [f"cell {p.cell.cell_id} [{p.clipping}] recorded no trial; no search row is written for it"
                   for p in plans if p not in ran])
    if ran:
        print("selecting the release by its noisy validation score..." if private else
              "composing the privacy cost of every trial (PLD accountant)...", flush=True)
        trials = read_table(runs, "trials")
        public_test = DATASETS[space.task.dataset].official_test_split
        rows = [{**row, "warnings": json.dumps(notes + idle, ensure_ascii=False)}
                for row in search_rows(loaded, ran, search_id, trials, official_test_split=public_test,
                                       charged=charged_runs(runs, search_id, trials))]
        released = release_rows(space, ran, rows, trials, official_test_split=public_test)
        if released:  # before the search rows: a search row marks a finished search
            store.write_part("release", search_id, released)
        store.write_part("search", search_id, rows)
    conclude(results_root, report, private=private)
    return results_root


def check_every_run_recorded(runs: str, search_id: str, max_retries: int, private: bool) -> None:
    """Raise ``SearchIncomplete`` when a run the privacy ledger charged has no row (its trial process
    was lost ``max_retries`` + 1 times, or it could not write): ``--resume`` runs it again. A private
    search's message does not count the runs (that would reveal K)."""
    missing = set(charged_runs(runs, search_id)["trial_id"]) - ResultsStore(runs).completed_trial_ids()
    if not missing:
        return
    count = "some runs" if private else f"{len(missing)} run(s)"
    raise SearchIncomplete(
        f"{count} of this search did not finish: their trial process was lost {max_retries + 1} time(s) "
        f"(resources.max_retries = {max_retries}); each attempt is charged in the privacy ledger ({runs}/ledger). "
        "Run the same command with --resume to run them again; the search table and summary are written when "
        "every run has finished")


def conclude(results_root: str, report: str | None, *, private: bool) -> None:
    """Print where the results are, the best trial per cell and the search's privacy cost, or for an
    end-to-end private search only its release; build the report at ``report`` (unless ``None``)."""
    print(f"results: {results_root}")
    if not private:
        print(SUMMARY_HEADER)
        print(format_outcome(results_root))
    print(format_privacy(read_table(results_root, "search"), read_table(results_root, "release"),
                         runs=runs_root(results_root, True) if private else None))
    if report is not None:
        print(f"report: {build_report_at(results_root, report)}")


#: The release table's columns as the summary shows them.
RELEASE_COLUMNS = {"cell_id": "cell", "clip_bound": "C", "batch_size": "B", "base_learning_rate": "η₀",
                   "learning_rate": "η", "noisy_val_accuracy": "noisy val acc (max of noisy scores)",
                   "test_accuracy": "test acc", "epsilon_total": "ε total", "delta_total": "δ"}


def format_privacy(search: pd.DataFrame, release: pd.DataFrame, runs: str | None = None) -> str:
    """The privacy section of the summary and what the guarantee covers (the ``guarantee`` text
    recorded with the search). ``runs``: the trust-boundary folder of an end-to-end private search,
    whose summary shows only its release (nothing that counts or composes its runs); otherwise the
    per-cell and whole-search cost."""
    if search.empty:
        return ""
    first = search.iloc[0]
    if runs is not None:
        lines = ["", "the release of this end-to-end private search (all that may leave the trust boundary):"]
        if release.empty:
            lines.append("none: no run finished")
        else:
            table = release[list(RELEASE_COLUMNS)].rename(columns=RELEASE_COLUMNS).astype(object)
            table["test acc"] = table["test acc"].where(release["test_split_public"].fillna(True).astype(bool),
                                                        "withheld (test split carved from the private pool)")
            lines.append(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
            lines.append("the noisy validation score is the maximum over the runs' noisy scores: biased upward, "
                         "not an estimate of the model's accuracy")
        lines.append(f"per-run records, inside the data owner's trust boundary (NOT covered; publishing them "
                     f"voids the guarantee): {runs}")
        lines.append("what (ε, δ) covers: " + str(first["guarantee"]))
        return "\n".join(lines)
    lines = ["", "privacy cost of the search (trials took steps on the same data; ε at the space's δ):"]
    table = search[["cell_id", "clipping", "trials_with_steps", "epsilon_per_trial", "epsilon_cell",
                    "epsilon_composition"]]
    lines.append(table.rename(columns={
        "cell_id": "cell", "trials_with_steps": "trials with steps", "epsilon_per_trial": "ε per trial",
        "epsilon_cell": "ε cell (composed)", "epsilon_composition": "Σε (basic)"}).to_string(
        index=False, float_format=lambda v: f"{v:.3g}"))
    lines.append(f"whole search: ε = {first['epsilon_search']:.3g} at δ = {first['delta']:g} (PLD "
                 f"composition of every trial that took a step); basic composition: "
                 f"ε = {first['epsilon_search_basic']:.3g}, δ = {first['delta_search_basic']:.2g}")
    unrecorded = first.get("runs_unrecorded")
    if unrecorded is not None and not pd.isna(unrecorded) and int(unrecorded) > 0:
        lines.append(f"charged but unrecorded: {int(unrecorded)} of the {int(first['runs_charged'])} runs composed "
                     "above took steps and left no trials row (a lost trial process, a full disk, or an attempt "
                     "run again); the privacy ledger charges each its planned steps unless it reported fewer")
    lines.append("what (ε, δ) covers: " + str(first["guarantee"]))
    return "\n".join(lines)


def build_report_at(results_root: str, location: str) -> str:
    """Build the report of ``results_root`` into folder ``location`` (a local path, or a URI: built
    in a temporary folder, then copied through ``pyarrow.fs``); return its index.html's location."""
    from dptune.report import build_report

    if "://" not in location:
        return str(build_report([results_root], location))
    import tempfile

    import pyarrow.fs as pafs

    filesystem, path = pafs.FileSystem.from_uri(location)
    with tempfile.TemporaryDirectory(prefix="dptune-report-") as local:
        build_report([results_root], local)
        filesystem.create_dir(path, recursive=True)
        pafs.copy_files(local, path, destination_filesystem=filesystem)
    return f"{location}/index.html"


def parse_args(argv: list[str] | None = None) -> SearchOptions:
    parser = ArgumentParser(
        prog="python -m dptune.search",
        description="Joint DP hyperparameter search over clip bound C, batch size B and learning rate η₀ "
                    "per (ε, epochs) cell, on Ray Tune.",
    )
    parser.add_argument("--version", action="version", version=f"dptune {__version__}")
    parser.add_argument("--space", default="search_spaces/default.yaml",
                        help="search-space YAML (default: %(default)s)")
    parser.add_argument("--storage", default="results", help="results folder or URI (default: %(default)s)")
    parser.add_argument("--name", help="search name, a folder under --storage (default: the space's name)")
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted search of the same name")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan (cells, configurations, pruning, σ per B) and stop")
    parser.add_argument("--no-report", dest="report", action="store_false", help="do not build the HTML report")
    parser.add_argument("--report-dir", metavar="DIR",
                        help="folder or URI for the HTML report (default: <storage>/<name>/report, beside the results)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a space key, e.g. --set privacy.epsilons=[1] (YAML value; repeatable)")
    parser.add_argument("--trials-per-cell", type=int, help="override sampler.trials_per_cell")
    parser.add_argument("--max-train-examples", type=int, help="cap the training set (quick runs and tests)")
    parser.add_argument("--max-eval-examples", type=int, help="cap the validation and test sets (quick runs and tests)")
    parser.add_argument("--quarantine-corrupt", action="store_true",
                        help="move unreadable Parquet parts of the results folder to <results>/quarantine/ "
                             "instead of refusing to start")
    args = parser.parse_args(argv)

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--set {shown(item)}: expected KEY=VALUE, e.g. privacy.epsilons=[1,8]")
        try:
            overrides[key] = parse_override(key, value)
        except SpaceError as exc:
            parser.error(str(exc))
    if args.trials_per_cell is not None:
        if args.trials_per_cell < 1:
            parser.error(f"--trials-per-cell must be ≥ 1 (got {args.trials_per_cell})")
        overrides["sampler.trials_per_cell"] = args.trials_per_cell
    for flag in ("max_train_examples", "max_eval_examples"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be ≥ 1 (got {value})")
    try:
        if args.name is not None:
            check_name(args.name, "--name")
        if args.address is not None:
            preflight.check_address_syntax(args.address)
    except DptuneError as exc:
        parser.error(str(exc))
    return SearchOptions(space_path=Path(args.space), storage=args.storage, name=args.name, address=args.address,
                         resume=args.resume, dry_run=args.dry_run, report=args.report, overrides=overrides,
                         max_train_examples=args.max_train_examples, max_eval_examples=args.max_eval_examples,
                         quarantine_corrupt=args.quarantine_corrupt, report_dir=args.report_dir)


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    try:
        run_search(options)
    except DptuneError as exc:  # bad input, or a search that could not finish; anything else is a bug...
        report_and_exit(exc)
    except Exception as exc:  # ...and keeps its traceback, unless the results folder took no more writes
        if (what := storage_error(exc)) is None:
            raise
        report_and_exit(SearchIncomplete(
            f"--storage {options.storage}: cannot write the results: {what}. Free space (or make the folder "
            "writable), then run the same command with --resume: what finished is kept, and every training that "
            "took a step stays charged in the privacy ledger"))


if __name__ == "__main__":
    main()
