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

import hashlib
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from dptune import __version__, preflight
from dptune.errors import ArgumentParser, DptuneError, report_and_exit, shown
from dptune.paths import check_name, filesystem, probe_writable
from dptune.plan import coupled_learning_rate, sample_rate, total_steps
from dptune.privacy import (PrivacyParameterError, TrialMechanism, calibrate_noise_multiplier, draw_trial_count,
                            epsilon_spent, plan_private_selection, selection_epsilon)
from dptune.search_privacy import composition_cost, guarantee, select_release
from dptune.records import SCHEMA_VERSION, ResultsStore, read_table, trial_rows
from dptune.space import Cell, LoadedSpace, SearchSpace, SpaceError, load_space, parse_override
from dptune.trial import EpochMetrics, TrialConfig, TrialFailed, TrialResult, check_trial_can_run, run_trial

#: The metric every sampler and scheduler optimises: accuracy on the validation split.
METRIC = "val_accuracy"
_VERSIONED_PACKAGES = ("dptune", "torch", "opacus", "prv-accountant", "ray", "optuna", "timm", "transformers")


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
    trials: int  # trials the sampler will schedule

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
            plans.append(replace(plan, trials=_trial_count(space, plan)))
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
    return replace(plan, trials=_trial_count(space, plan))


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
                     f"{space.sampler.trials_per_cell}), noisy validation score σ_s = {selection.score_noise_multiplier:g}")
    for plan in plans:
        lines.append(f"cell {plan.cell.cell_id} [{plan.clipping}]: {plan.trials} trials")
        lines.append("      B      T   σ        σ√T")
        for b in plan.feasible_batch_sizes:
            steps = total_steps(plan.num_train, b, plan.cell.epochs)
            sigma = plan.noise_multipliers[b]
            lines.append(f"  {b:>5} {steps:>6}   {sigma:<8.4f} {sigma * math.sqrt(steps):.2f}")
        if plan.pruned_batch_sizes:
            lines.append(f"  pruned by min-step rule (T < {space.min_steps}): B = {list(plan.pruned_batch_sizes)}")
        if oversized := space.batch_size.oversized(plan.num_train):
            lines.append(f"  dropped, larger than N = {plan.num_train}: B = {oversized}")
    lines.append(f"total: {sum(p.trials for p in plans)} trials in {len(plans)} cell runs")
    return "\n".join(lines)


# --------------------------------------------------------------------------- one trial under Tune


@dataclass(frozen=True)
class TrialContext:
    """What every trial of one cell shares (passed to the trainable with ``tune.with_parameters``)."""

    base: TrialConfig  # dataset, budgets, rule...; C, B, η filled per trial
    results_root: str
    search_id: str
    cell_id: str
    cell_key: str
    coupling: str
    reference_batch_size: int
    reproducible_seed: int | None = None  # the space's seed when it opts into reproducible coins


def package_versions() -> dict[str, str]:
    """Versions of the packages a result depends on (recorded with every trial)."""
    versions = {}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def trial_config(context: TrialContext, params: dict[str, Any]) -> TrialConfig:
    """The trial's full config from the sampled (C, B, η₀), with √B coupling applied.

    Its coins: ``seed=None`` (fresh OS entropy in the trial) unless the space is reproducible; then
    a seed from the space's seed and the trial's id, so that trials still never share coins.
    """
    batch_size = int(params["batch_size"])
    base_lr = float(params["base_learning_rate"])
    lr = coupled_learning_rate(base_lr, batch_size, context.reference_batch_size) if context.coupling == "sqrt" else base_lr
    clip_bound = float(params.get("clip_bound", context.base.clip_bound))
    seed = None
    if context.reproducible_seed is not None:
        trial_id = configuration_id(context.cell_key, params)
        digest = hashlib.sha256(f"{context.reproducible_seed}:{trial_id}".encode()).digest()
        seed = int.from_bytes(digest[:8], "big") >> 11  # 53 bits: exact in the float64 a pandas null column uses
    return replace(context.base, clip_bound=clip_bound, batch_size=batch_size, base_learning_rate=base_lr,
                   learning_rate=lr, seed=seed)


def write_result(context: TrialContext, trial_id: str, result: TrialResult) -> None:
    """Append one finished trial to the results dataset (atomic, idempotent per trial id)."""
    rows = trial_rows(result, search_id=context.search_id, trial_id=trial_id, cell_id=context.cell_id,
                      reference_batch_size=context.reference_batch_size, versions=package_versions(),
                      finished_at=pd.Timestamp.now(tz="UTC"))
    ResultsStore(context.results_root).write_trial(rows, trial_id)


def _selection_value(config: TrialConfig, status: str, val_accuracy: float, noisy_val_accuracy: float) -> float:
    """What the sampler is told: validation accuracy (the noisy one when the trial has a DP score),
    0 for a trial that diverged or failed."""
    value = noisy_val_accuracy if config.score_noise_multiplier is not None else val_accuracy
    return value if status == "ok" and math.isfinite(value) else 0.0


#: The key of a trial's Tune config that names its cell run; the other keys are the sampled (C, B, η₀).
CELL_KEY = "cell"


def sampled(params: dict[str, Any]) -> dict[str, Any]:
    """The sampled hyperparameters of a Tune config (without the cell key)."""
    return {name: value for name, value in params.items() if name != CELL_KEY}


def tune_trainable(params: dict[str, Any], contexts: dict[str, TrialContext]) -> None:
    """Ray Tune function trainable: run one DP trial, report each epoch, record the result.

    ``params`` holds the sampled (C, B, η₀) and, under ``CELL_KEY``, the cell run it belongs to.
    """
    from ray import tune

    context = contexts[params[CELL_KEY]]
    params = sampled(params)
    config = trial_config(context, params)
    trial_id = configuration_id(context.cell_key, params)
    store = ResultsStore(context.results_root)
    if store.has_trial(trial_id):  # finished before a crash: report the recorded result, spend nothing
        row = read_table(context.results_root, "trials").set_index("trial_id").loc[trial_id]
        score = _selection_value(config, row["status"], row[METRIC], row["noisy_val_accuracy"])
        tune.report({METRIC: score, "test_accuracy": row["test_accuracy"],
                     "status": row["status"], "epoch": config.epochs, "done_recording": True})
        return

    def report(metrics: EpochMetrics) -> None:
        # The last epoch is reported once, after the result is written: a scheduler may stop a
        # trial at any report, and a trial that trained every epoch must keep its full record.
        if metrics.epoch < config.epochs:
            tune.report({**asdict(metrics), "done_recording": False})

    try:
        result = run_trial(config, report)
    except TrialFailed as failure:  # training had begun: record what it spent, then fail the Tune trial
        write_result(context, trial_id, _failed_result(config, failure.steps, str(failure), steps_taken=failure.steps_taken,
                                                       epsilon_spent=failure.epsilon_spent,
                                                       noise_multiplier=failure.noise_multiplier,
                                                       sample_rate=failure.sample_rate))
        raise
    except Exception as error:  # raised before the first step: nothing spent
        write_result(context, trial_id, _failed_result(config, 0, f"{type(error).__name__}: {error}", steps_taken=0,
                                                       epsilon_spent=0.0))
        raise
    write_result(context, trial_id, result)
    score = _selection_value(config, result.status, result.val_accuracy, result.noisy_val_accuracy)
    tune.report({METRIC: score, "test_accuracy": result.test_accuracy, "status": result.status,
                 "epoch": config.epochs, "done_recording": True})


def _failed_result(config: TrialConfig, steps: int, reason: str, *, steps_taken: int, epsilon_spent: float,
                   noise_multiplier: float = float("nan"), sample_rate: float = float("nan")) -> TrialResult:
    """The record of a trial that raised: status ``error`` with what it spent."""
    return TrialResult(config=config, status="error", reason=reason[:2000], noise_multiplier=noise_multiplier,
                       sample_rate=sample_rate, steps=steps, steps_taken=steps_taken, epsilon_spent=epsilon_spent)


# --------------------------------------------------------------------------- driver-side pieces


def configuration_id(cell_key: str, params: dict[str, Any]) -> str:
    """A trial's id: its cell and a digest of its sampled (C, B, η₀).

    Content-based, so a configuration that runs again after a crash or a resume (Tune's own
    state may lag the results by a few seconds) maps onto the same row instead of a second one.
    """
    canonical = {name: float(params[name]) for name in sorted(params)}
    return f"{cell_key}-{hashlib.sha1(json.dumps(canonical).encode()).hexdigest()[:12]}"


def _make_searcher(space: SearchSpace, plan: CellPlan, context: TrialContext) -> Any:
    """Optuna sampler for one cell, wrapped with min-step pruning (imports Ray lazily)."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from ray.tune.search import Searcher
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributions: dict[str, Any] = {}
    grid: dict[str, list] = {}
    # A grid is known in advance: its pruned points are recorded now and never offered to the
    # sampler. Model-based and random samplers may propose a pruned B; MinStepPruning handles it.
    is_grid = space.sampler.name == "grid"
    offered = plan.feasible_batch_sizes if is_grid else tuple(sorted(plan.feasible_batch_sizes + plan.pruned_batch_sizes))
    distributions["batch_size"] = CategoricalDistribution(list(offered))
    grid["batch_size"] = list(offered)
    ranges = {"base_learning_rate": space.base_learning_rate}
    if plan.clipping != "auto_s":
        ranges["clip_bound"] = space.clip_bound
    for name, spec in ranges.items():
        if spec.values is not None:
            distributions[name] = CategoricalDistribution(sorted(spec.values))
            grid[name] = sorted(spec.values)
        else:
            distributions[name] = FloatDistribution(spec.low, spec.high, log=spec.log)
    if is_grid:
        for batch_size in plan.pruned_batch_sizes:
            for point in itertools.product(*(grid[name] for name in ranges)):
                record_pruned(context, plan, {"batch_size": batch_size, **dict(zip(ranges, point))}, space.min_steps)
    seed = _cell_seed(space, plan)
    if is_grid:
        sampler = optuna.samplers.GridSampler(grid, seed=seed)
    elif space.sampler.name == "random":
        sampler = optuna.samplers.RandomSampler(seed=seed)
    else:
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(8, max(2, plan.trials // 3)))

    class MinStepPruning(Searcher):
        """Wraps the Optuna searcher: a proposal with T < T_min is never scheduled.

        It is recorded (status ``pruned_min_steps``, no compute) and told to Optuna as a pruned
        trial, which TPE ranks below every completed one, so it stops proposing it.
        """

        def __init__(self, inner: OptunaSearch) -> None:
            super().__init__(metric=METRIC, mode="max")
            self.inner = inner

        def set_search_properties(self, metric, mode, config, **spec) -> bool:  # noqa: ANN001
            return self.inner.set_search_properties(metric, mode, config, **spec)

        def suggest(self, trial_id: str) -> dict | None:
            for attempt in range(1000):
                params = self.inner.suggest(f"{trial_id}~{attempt}")
                if params is None or params == Searcher.FINISHED:
                    return params
                if int(params["batch_size"]) in plan.feasible_batch_sizes:
                    # re-key the Optuna trial under the id Tune will report results for
                    self.inner._ot_trials[trial_id] = self.inner._ot_trials.pop(f"{trial_id}~{attempt}")
                    return params
                self.inner.on_trial_complete(f"{trial_id}~{attempt}", result=None)
                record_pruned(context, plan, params, space.min_steps)
            raise SearchError(f"cell {plan.cell.cell_id}: the sampler proposed only pruned batch sizes 1000 times")

        def on_trial_result(self, trial_id: str, result: dict) -> None:
            self.inner.on_trial_result(trial_id, result)

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            self.inner.on_trial_complete(trial_id, result=result, error=error)

    return MinStepPruning(OptunaSearch(space=distributions, metric=METRIC, mode="max", sampler=sampler))


def record_pruned(context: TrialContext, plan: CellPlan, params: dict[str, Any], min_steps: int) -> None:
    """Record a configuration removed by the min-step rule: a row, no compute."""
    config = trial_config(context, params)
    steps = total_steps(plan.num_train, config.batch_size, config.epochs)
    result = TrialResult(config=config, status="pruned_min_steps",
                         reason=f"T = {steps} steps < min_steps = {min_steps}",
                         sample_rate=sample_rate(plan.num_train, config.batch_size), steps=steps, steps_taken=0,
                         num_train=plan.num_train, epsilon_spent=0.0)
    write_result(context, configuration_id(context.cell_key, params), result)


def _make_callback(cells: dict[str, tuple[TrialContext, CellPlan]]) -> Any:
    """Driver-side callback: progress lines, and rows for trials that ended without recording."""
    from ray.tune import Callback

    class RecordAndReport(Callback):
        def __init__(self) -> None:
            self.finished = dict.fromkeys(cells, 0)

        def _progress(self, trial: Any, what: str) -> None:
            key = trial.config[CELL_KEY]
            plan = cells[key][1]
            self.finished[key] += 1
            cfg = trial.config
            clip = f"C={cfg['clip_bound']:.3g} " if "clip_bound" in cfg else ""
            print(f"[{plan.cell.cell_id} {plan.clipping}] {self.finished[key]}/{plan.trials} {what}: "
                  f"{clip}B={cfg['batch_size']} η₀={cfg['base_learning_rate']:.3g}", flush=True)

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            last = trial.last_result or {}
            if not last.get("done_recording"):
                self._record_unfinished(trial, "stopped_early", "stopped by the ASHA scheduler")
                self._progress(trial, f"stopped early at epoch {last.get('epoch')}")
            else:
                self._progress(trial, f"{last.get('status')}, val acc {last.get(METRIC, float('nan')):.4f}")

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            reason = str(trial.error_file and Path(trial.error_file).read_text().strip().splitlines()[-1])
            self._record_unfinished(trial, "error", reason)
            self._progress(trial, f"error: {reason}")

        def _record_unfinished(self, trial: Any, status: str, reason: str) -> None:
            context, plan = cells[trial.config[CELL_KEY]]
            params = sampled(trial.config)
            trial_id = configuration_id(context.cell_key, params)
            if ResultsStore(context.results_root).has_trial(trial_id):
                return  # the trial wrote its full record before it was stopped
            config = trial_config(context, params)
            last = trial.last_result or {}
            epochs = [] if "epoch" not in last or status == "error" else [EpochMetrics(
                **{f: last[f] for f in EpochMetrics.__dataclass_fields__ if f in last})]
            sigma = plan.noise_multipliers[config.batch_size]
            rate = sample_rate(plan.num_train, config.batch_size)
            steps = total_steps(plan.num_train, config.batch_size, config.epochs)
            if status == "stopped_early":  # Tune's function trainables block in report(): no step after it
                steps_taken = int(last.get("steps", 0))
            else:  # the trial's process was lost before it could record itself: count every planned step
                steps_taken = steps
                reason += " (trial process lost: its privacy cost is counted as if every planned step ran)"
            spent = epsilon_spent(sigma, rate, steps_taken, config.delta) if steps_taken else 0.0
            result = TrialResult(config=config, status=status, reason=reason, noise_multiplier=sigma,
                                 sample_rate=rate, steps=steps, steps_taken=steps_taken, epsilon_spent=spent,
                                 num_train=plan.num_train, epochs=epochs,
                                 val_accuracy=last.get(METRIC, float("nan")))
            write_result(context, trial_id, result)

    return RecordAndReport()


def _make_multiplexer(searchers: dict[str, Any], budgets: dict[str, int]) -> Any:
    """One Tune searcher over every cell run: each cell keeps its own sampler and budget."""
    from ray import cloudpickle
    from ray.tune.search import Searcher

    class CellMultiplexer(Searcher):
        """Round-robin over the cells that still have budget, so cells run side by side.

        Each suggestion carries its cell under ``CELL_KEY``; results go back to that cell's
        sampler only. State (per-cell counts, trial owners, each sampler's state) is saved and
        restored with Tune's experiment checkpoints, so ``--resume`` continues every cell.
        """

        def __init__(self) -> None:
            super().__init__(metric=METRIC, mode="max")
            self.searchers = searchers
            self.budgets = dict(budgets)
            self.suggested = dict.fromkeys(searchers, 0)
            self.owner: dict[str, str] = {}
            self.turn = 0

        def set_search_properties(self, metric, mode, config, **spec) -> bool:  # noqa: ANN001
            return all(s.set_search_properties(metric, mode, config, **spec) for s in self.searchers.values())

        def suggest(self, trial_id: str) -> dict | None:
            while open_cells := [k for k in self.searchers if self.suggested[k] < self.budgets[k]]:
                key = open_cells[self.turn % len(open_cells)]
                self.turn += 1
                params = self.searchers[key].suggest(trial_id)
                if params == Searcher.FINISHED:  # a grid ran out early: close the cell
                    self.budgets[key] = self.suggested[key]
                    continue
                if params is None:
                    return None
                self.suggested[key] += 1
                self.owner[trial_id] = key
                return {**params, CELL_KEY: key}
            return Searcher.FINISHED

        def on_trial_result(self, trial_id: str, result: dict) -> None:
            self.searchers[self.owner[trial_id]].on_trial_result(trial_id, result)

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            self.searchers[self.owner[trial_id]].on_trial_complete(trial_id, result=result, error=error)

        def save(self, checkpoint_path: str) -> None:
            # One file (Tune renames it into place): the per-cell samplers are local classes
            # holding Optuna studies, which cloudpickle stores by value.
            with open(checkpoint_path, "wb") as file:
                cloudpickle.dump(self.__dict__, file)

        def restore(self, checkpoint_path: str) -> None:
            with open(checkpoint_path, "rb") as file:
                self.__dict__.update(cloudpickle.load(file))

    return CellMultiplexer()


def _make_scheduler(space: SearchSpace, plans: dict[str, CellPlan]) -> Any:
    """ASHA per cell (trials are compared only within their cell), or none."""
    if space.scheduler is None:
        return None
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    spec = space.scheduler

    class PerCellASHA(FIFOScheduler):
        """Routes each trial to its own cell's ASHA: accuracies at ε = 1 and ε = 8 never compete."""

        def __init__(self) -> None:
            super().__init__()
            self.cells = {key: ASHAScheduler(time_attr="epoch", max_t=plan.cell.epochs,
                                             grace_period=min(spec.grace_period, plan.cell.epochs),
                                             reduction_factor=spec.reduction_factor)
                          for key, plan in plans.items()}

        def set_search_properties(self, metric, mode, **spec) -> bool:  # noqa: ANN001
            return all(s.set_search_properties(metric, mode, **spec) for s in self.cells.values())

        def _of(self, trial: Any) -> Any:
            return self.cells[trial.config[CELL_KEY]]

        def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
            self._of(trial).on_trial_add(tune_controller, trial)

        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
            return self._of(trial).on_trial_result(tune_controller, trial, result)

        def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
            self._of(trial).on_trial_complete(tune_controller, trial, result)

        def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
            self._of(trial).on_trial_remove(tune_controller, trial)

    return PerCellASHA()


# --------------------------------------------------------------------------- the whole search


def init_ray(address: str | None, num_cpus: int | None = None) -> str:
    """Join a cluster (``--address`` or RAY_ADDRESS) or start an embedded local Ray.

    A plain ``ray.init()`` would silently join whatever cluster a leftover file points to, so
    the embedded case asks for ``address="local"`` explicitly.
    """
    import ray

    target = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return "already initialised"
    # Every worker process first leaves a deleted working directory (inherited from the
    # `ray start` of its node), which would otherwise kill trials at `import torch`.
    runtime_env = {"worker_process_setup_hook": "dptune.trial.leave_deleted_working_directory"}
    if target:
        ray.init(address=target, log_to_driver=False, runtime_env=runtime_env)
        return f"joined Ray cluster at {target}"
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env=runtime_env)
    return f"started embedded local Ray ({num_cpus or os.cpu_count()} CPUs)"


def _tune_storage(results_root: str) -> str:
    return f"{results_root}/_tune" if "://" in results_root else str(Path(results_root, "_tune").resolve())


def run_cells(space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext], resume: bool) -> None:
    """One Ray Tune run for every cell of the search (resumed from its experiment state when asked).

    The cells share the trial processes (one set-up, not one per cell) and run side by side; each
    keeps its own sampler, budget and, with ASHA, its own scheduler.
    """
    from ray import tune

    by_key = {plan.key: (context, plan) for plan, context in zip(plans, contexts, strict=True)}
    trainable = tune.with_resources(
        tune.with_parameters(tune_trainable, contexts={key: context for key, (context, _) in by_key.items()}),
        {"cpu": space.resources.cpus, "gpu": space.resources.gpu},
    )
    storage = _tune_storage(contexts[0].results_root)
    experiment = f"{storage}/search"
    # Save Tune's experiment state (searcher included) at most every 5 s instead of Tune's
    # adaptive period, so a resume repeats little; repeats are caught by configuration_id.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "5")
    if resume and tune.Tuner.can_restore(experiment):
        tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_unfinished=True,
                                   resume_errored=False, restart_errored=False)
    else:
        if resume:
            print(f"--resume: no search to resume at {contexts[0].results_root}; starting it", flush=True)
        searchers = {key: _make_searcher(space, plan, context) for key, (context, plan) in by_key.items()}
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(
                search_alg=_make_multiplexer(searchers, {plan.key: plan.trials for plan in plans}),
                scheduler=_make_scheduler(space, {plan.key: plan for plan in plans}), metric=METRIC, mode="max",
                num_samples=sum(plan.trials for plan in plans),
                max_concurrent_trials=space.resources.max_concurrent_trials,
                reuse_actors=True,  # a trial process keeps torch, the model code and the data loaded
            ),
            run_config=tune.RunConfig(
                name="search", storage_path=storage, callbacks=[_make_callback(by_key)], verbose=0,
                failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
            ),
        )
    tuner.fit()


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


def search_rows(loaded: LoadedSpace, plans: list[CellPlan], search_id: str,
                trials: pd.DataFrame) -> list[dict[str, Any]]:
    """One ``search`` row per cell run, with the privacy cost of the tuning itself.

    ``trials`` is the search's ``trials`` table. Per cell: the composition of its trials that took
    steps; for the whole search (every row alike): the composition of every trial of every cell and
    variant, which all train on the same data; with private selection, the bound it meets.
    """
    space = loaded.space
    delta = space.privacy.delta
    trials = trials[trials["search_id"] == search_id]
    whole = composition_cost(trials, delta)
    selection = space.privacy.private_selection
    rows = []
    for plan in plans:
        cell_trials = trials[(trials["cell_id"] == plan.cell.cell_id) & (trials["clipping"] == plan.clipping)]
        cell = composition_cost(cell_trials, delta)
        epsilon_selection = math.nan
        if selection is not None:
            candidates = [TrialMechanism(plan.noise_multipliers[b], sample_rate(plan.num_train, b),
                                         total_steps(plan.num_train, b, plan.cell.epochs))
                          for b in plan.feasible_batch_sizes]
            epsilon_selection = selection_epsilon(candidates, space.sampler.trials_per_cell or 0, delta,
                                                  shape=selection.trial_count_shape,
                                                  score_noise_multiplier=selection.score_noise_multiplier)
        rows.append({
            "search_id": search_id, "name": space.name, "cell_id": plan.cell.cell_id, "clipping": plan.clipping,
            "epsilon": plan.cell.epsilon, "epochs": plan.cell.epochs, "delta": delta,
            "dataset": space.task.dataset, "backbone": space.task.backbone, "peft": space.task.peft,
            "num_train": plan.num_train, "trials_planned": plan.trials,
            "configurations_pruned": len(plan.pruned_batch_sizes),
            "epsilon_per_trial": plan.cell.epsilon, "trials_with_steps": cell.trials_with_steps,
            "epsilon_cell": cell.epsilon, "epsilon_composition": cell.epsilon_basic,
            "delta_composition": cell.delta_basic, "epsilon_search": whole.epsilon,
            "epsilon_search_basic": whole.epsilon_basic, "delta_search_basic": whole.delta_basic,
            "epsilon_selection": epsilon_selection, "delta_selection": delta if selection else math.nan,
            "selection_bound_holds": selection is not None and not space.reproducible,
            "reproducible": space.reproducible,
            "guarantee": guarantee(space, whole, None if selection is None else epsilon_selection),
            "spec_yaml": loaded.text, "spec_hash": loaded.spec_hash, "schema_version": SCHEMA_VERSION,
            "dptune_version": __version__, "created_at": pd.Timestamp.now(tz="UTC"),
        })
    return rows


def release_rows(space: SearchSpace, plans: list[CellPlan], search_rows_: list[dict[str, Any]],
                 trials: pd.DataFrame) -> list[dict[str, Any]]:
    """An end-to-end private search's released outcome: per cell, the trial with the best noisy
    validation score (``search_privacy.select_release``); empty for other searches."""
    selection = space.privacy.private_selection
    if selection is None:
        return []
    rows = []
    for plan, row in zip(plans, search_rows_, strict=True):
        chosen = select_release(trials[(trials["search_id"] == row["search_id"]) &
                                       (trials["cell_id"] == plan.cell.cell_id)])
        if chosen is None:
            continue
        rows.append({
            "search_id": row["search_id"], "cell_id": plan.cell.cell_id, "trial_id": chosen["trial_id"],
            **{name: chosen[name] for name in ("clip_bound", "batch_size", "base_learning_rate", "learning_rate",
                                               "epochs", "noisy_val_accuracy", "test_accuracy")},
            "epsilon_total": selection.epsilon, "delta_total": space.privacy.delta,
            "epsilon_per_trial": plan.cell.epsilon, "score_noise_multiplier": selection.score_noise_multiplier,
            "mean_trials": float(space.sampler.trials_per_cell or 0),
            "trial_count_shape": selection.trial_count_shape, "guarantee": row["guarantee"],
            "created_at": pd.Timestamp.now(tz="UTC"),
        })
    return rows


def summary_table(results_root: str) -> pd.DataFrame:
    """Best trial per cell (and clipping variant), by the report's rule (``analysis.select_best``
    over ``analysis.finished_trials``): only trials that trained to the end are ranked."""
    from dptune.analysis import finished_trials, select_best

    trials = read_table(results_root, "trials")
    best = select_best(finished_trials(trials), ["cell_id", "clipping"])
    if best.empty:
        return best
    counts = trials.groupby(["cell_id", "clipping"])["status"].value_counts().unstack(fill_value=0)
    best = best.set_index(["cell_id", "clipping"]).join(counts).reset_index()
    return best.sort_values(["epsilon", "epochs", "clipping"])


def format_summary(best: pd.DataFrame) -> str:
    if best.empty:
        return "no finished trials yet"
    columns = {"cell_id": "cell", "clipping": "clipping", "clip_bound": "C", "batch_size": "B",
               "base_learning_rate": "η₀", "learning_rate": "η", "val_accuracy": "val acc", "test_accuracy": "test acc"}
    table = best[list(columns)].rename(columns=columns)
    extra = [c for c in ("ok", "pruned_min_steps", "diverged", "error", "stopped_early") if c in best]
    table = pd.concat([table, best[extra]], axis=1)
    return table.to_string(index=False, float_format=lambda v: f"{v:.4g}")


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


def check_before_data(options: SearchOptions, loaded: LoadedSpace, name: str, results_root: str) -> list[str]:
    """Every check that needs neither the workload nor Ray, run in ``--dry-run`` too; returns warnings.

    The name stays one folder under ``--storage``; the results location takes a file; the Ray
    address answers (or, for an embedded Ray, this machine has the resources a trial asks for);
    every part of an existing results folder is readable (or quarantined); on ``--resume`` Tune's
    state loads and the space is the one the search started with.
    """
    space = loaded.space
    check_name(name, "--name" if options.name else f"{loaded.path}: name")
    check_storage(options.storage, results_root)
    target = options.address or os.environ.get("RAY_ADDRESS")
    if target:
        preflight.check_address(target, "--address" if options.address else "RAY_ADDRESS")
    else:
        preflight.check_local_resources(space.resources)
    notes = preflight.check_results_folder(results_root, options.quarantine_corrupt, move=not options.dry_run)
    if options.resume:
        preflight.check_tune_state(results_root)
        preflight.check_same_space(results_root, loaded)
    return notes


def _warn(notes: list[str]) -> None:
    for note in notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)


def plans_that_ran(results_root: str, search_id: str, plans: list[CellPlan]) -> list[CellPlan]:
    """The cell runs with at least one recorded trial of this search (only those get a ``search`` row)."""
    trials = read_table(results_root, "trials", columns=["search_id", "cell_id", "clipping"])
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
    """Validate, plan and run a whole search; return the results dataset's location."""
    from dptune.data import WorkloadSpec, load_workload

    loaded = load_space(options.space_path, options.overrides)
    space = loaded.space
    name = options.name or space.name
    results_root = _results_root(options.storage, name)
    _warn(notes := preflight.flag_warnings(space, trials_per_cell_flag="sampler.trials_per_cell" in options.overrides))
    _warn(checked := check_before_data(options, loaded, name, results_root))
    notes += checked
    report = report_location(results_root, options.report_dir) if options.report else None
    if report is not None:
        probe_writable(report, "--report-dir" if options.report_dir else "the report location (--report-dir)")
    store = ResultsStore(results_root)
    if not options.dry_run and not options.resume and store.completed_trial_ids():
        raise SearchError(f"results already exist at {results_root}; pass --resume to continue that search "
                          "or choose another --name/--storage")

    search_id = f"{name}-{loaded.spec_hash}"
    if options.resume and not options.dry_run and search_finished(results_root, search_id):
        print(f"--resume: search {search_id} at {results_root} is finished; nothing to run")
        conclude(results_root, report, private=space.privacy.private_selection is not None)
        return results_root

    print(f"dptune {__version__}: loading {space.task.dataset} for {space.task.backbone}/{space.task.peft}", flush=True)
    workload = load_workload(WorkloadSpec(
        dataset=space.task.dataset, backbone=space.task.backbone, peft=space.task.peft, seed=space.seed,
        fraction=space.task.fraction, examples_per_class=space.task.examples_per_class, classes=space.task.classes,
        max_tokens=space.task.max_tokens, validation_fraction=space.task.validation_fraction,
        max_train_examples=options.max_train_examples, max_eval_examples=options.max_eval_examples))
    preflight.check_steps(space, len(workload.train))
    plans = plan_cells(space, len(workload.train))
    _warn(data_notes := preflight.data_warnings(space, len(workload.train)))
    notes += data_notes
    check_trial_can_run(base_trial_config(space, plans[0], options.max_train_examples, options.max_eval_examples))
    print(format_plan(loaded, plans), flush=True)
    if options.dry_run:
        return results_root

    preflight.write_manifest(results_root, loaded, name)
    print(init_ray(options.address), flush=True)
    if options.address or os.environ.get("RAY_ADDRESS"):
        preflight.check_cluster_resources(space.resources)
    started = time.monotonic()
    contexts = [TrialContext(
        base=base_trial_config(space, plan, options.max_train_examples, options.max_eval_examples),
        results_root=results_root, search_id=search_id, cell_id=plan.cell.cell_id, cell_key=plan.key,
        coupling=space.coupling.rule, reference_batch_size=space.coupling.reference_batch_size,
        reproducible_seed=space.seed if space.reproducible else None) for plan in plans]
    print(f"running {sum(plan.trials for plan in plans)} trials in {len(plans)} cell runs side by side", flush=True)
    run_cells(space, plans, contexts, options.resume)
    print(f"\nsearch finished in {time.monotonic() - started:.0f} s", flush=True)
    ran = plans_that_ran(results_root, search_id, plans)
    _warn(idle := [f"cell {p.cell.cell_id} [{p.clipping}] recorded no trial; no search row is written for it"
                   for p in plans if p not in ran])
    if ran:
        print("composing the privacy cost of every trial (PRV accountant)...", flush=True)
        trials = read_table(results_root, "trials")
        rows = [{**row, "warnings": json.dumps(notes + idle, ensure_ascii=False)}
                for row in search_rows(loaded, ran, search_id, trials)]
        released = release_rows(space, ran, rows, trials)
        if released:  # before the search rows: a search row marks a finished search
            store.write_part("release", search_id, released)
        store.write_part("search", search_id, rows)
    conclude(results_root, report, private=space.privacy.private_selection is not None)
    return results_root


def conclude(results_root: str, report: str | None, *, private: bool) -> None:
    """Print where the results are, the best trial per cell (not for a private search: its per-trial
    records are not released) and the search's privacy cost; build the report at ``report``
    (unless ``None``)."""
    print(f"results: {results_root}")
    if not private:
        print("best configuration per cell (selected on exact validation accuracy: not a DP release):")
        print(format_outcome(results_root))
    print(format_privacy(read_table(results_root, "search"), read_table(results_root, "release")))
    if report is not None:
        print(f"report: {build_report_at(results_root, report)}")


def format_privacy(search: pd.DataFrame, release: pd.DataFrame) -> str:
    """The privacy section of the summary: per-cell and whole-search cost, the release of a private
    search, and what the guarantee covers (the ``guarantee`` text recorded with the search)."""
    if search.empty:
        return ""
    lines = ["", "privacy cost of the search (trials took steps on the same data; ε at the space's δ):"]
    table = search[["cell_id", "clipping", "trials_with_steps", "epsilon_per_trial", "epsilon_cell",
                    "epsilon_composition"]]
    lines.append(table.rename(columns={
        "cell_id": "cell", "trials_with_steps": "trials with steps", "epsilon_per_trial": "ε per trial",
        "epsilon_cell": "ε cell (PRV)", "epsilon_composition": "Σε (basic)"}).to_string(
        index=False, float_format=lambda v: f"{v:.3g}"))
    first = search.iloc[0]
    lines.append(f"whole search: ε = {first['epsilon_search']:.3g} at δ = {first['delta']:g} (PRV composition of "
                 f"every trial that took a step); basic composition: ε = {first['epsilon_search_basic']:.3g}, "
                 f"δ = {first['delta_search_basic']:.2g}")
    if not release.empty:
        lines.append("released outcome (end-to-end private tuning):")
        columns = {"clip_bound": "C", "batch_size": "B", "base_learning_rate": "η₀", "learning_rate": "η",
                   "noisy_val_accuracy": "noisy val acc", "test_accuracy": "test acc", "epsilon_total": "ε total",
                   "delta_total": "δ"}
        lines.append(release[list(columns)].rename(columns=columns).to_string(
            index=False, float_format=lambda v: f"{v:.4g}"))
    elif first["selection_bound_holds"]:
        lines.append("released outcome: none (no trial finished)")
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
    parser.add_argument("--space", default="search_spaces/default.yaml", help="search-space YAML (default: %(default)s)")
    parser.add_argument("--storage", default="results", help="results folder or URI (default: %(default)s)")
    parser.add_argument("--name", help="search name, a folder under --storage (default: the space's name)")
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted search of the same name")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (cells, trials, pruning, σ per B) and stop")
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
    except DptuneError as exc:  # bad input; anything else is a bug and keeps its traceback
        report_and_exit(exc)


if __name__ == "__main__":
    main()
