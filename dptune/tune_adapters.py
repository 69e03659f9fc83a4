"""The Ray Tune layer of a search: one searcher over every cell, per-cell ASHA, the trainable, and
the driver's callback. Ray appears here and in ``dptune.search``'s driver only.

A Tune trial is a *unit*: one cell's batch of configurations (``CELL_KEY`` names the cell,
``CONFIGURATIONS_KEY`` lists the sampled (C, B, η₀)), run by :func:`dptune.execution.run_configurations`
(fused where it applies, R replicates each). Its last report carries one score per
configuration (``SCORES_KEY``, the mean selection value over replicates), which the
:class:`CellMultiplexer` tells that cell's :class:`~dptune.cell_sampler.CellSampler`.

Every class here is top-level and receives what it wraps (like Ray's ``ConcurrencyLimiter``);
the searcher's checkpoint is plain JSON (``save``/``restore``) and it pickles as plain data
(``__getstate__``), so a resumed search never unpickles code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune import Callback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search import Searcher

from dptune.cell_sampler import CellSampler
from dptune.contract import EpochMetrics, TrialResult, TrialStatus
from dptune.errors import storage_error
from dptune.execution import (
    TrialContext,
    configuration_id,
    record_pruned,
    run_configurations,
    trial_config,
    write_result,
)
from dptune.plan import sample_rate, total_steps
from dptune.privacy import epsilon_spent
from dptune.records import ResultsStore, replicate_trial_id

#: The metric every sampler and scheduler optimises: accuracy on the validation split.
METRIC = "val_accuracy"
#: Keys of a unit's Tune config: its cell, and the configurations it carries.
CELL_KEY = "cell"
CONFIGURATIONS_KEY = "configurations"
#: Key of a unit's last report: per configuration, the mean selection value over its replicates.
SCORES_KEY = "scores"
#: Key of a unit's last report: its runs' statuses, counted (JSON), for the cell's progress line.
RUN_STATUSES_KEY = "run_statuses"
#: Key of the report of a unit that could not write to the results folder (a full or read-only disk):
#: the error, in one line. The driver then ends the search (:func:`stop_search`).
STORAGE_ERROR_KEY = "storage_error"

#: What went wrong in this driver process that must end the search: one line each (a results write
#: that failed in a callback, or a unit's ``STORAGE_ERROR_KEY``). Read by ``dptune.search`` after
#: Tune returns; module-level because a resumed Tuner unpickles its own callback objects.
DRIVER_FAILURES: list[str] = []


def tune_trainable(params: dict[str, Any], contexts: dict[str, TrialContext]) -> None:
    """Ray Tune function trainable: run one unit, report its scores after every run is recorded.

    A unit of one configuration and one replicate on the ``trial`` runner reports every epoch
    but the last (ASHA decides on them); the last is reported once, after the result is written,
    so a trial that trained every epoch keeps its full record whatever the scheduler does.
    """
    context = contexts[params[CELL_KEY]]
    epochs = context.base.epochs

    def report(metrics: EpochMetrics) -> None:
        if metrics.epoch < epochs:
            tune.report({**asdict(metrics), "done_recording": False})

    try:
        outcome = run_configurations(context, params[CONFIGURATIONS_KEY], report)
    except OSError as error:  # the results folder is full or read-only: the driver ends the search
        if storage_error(error) is not None:  # and the unit stays unfinished, so --resume runs it again
            tune.report({STORAGE_ERROR_KEY: storage_error(error), METRIC: float("nan"), "done_recording": False})
        raise
    tune.report({SCORES_KEY: outcome.scores, RUN_STATUSES_KEY: json.dumps(Counter(outcome.run_statuses)),
                 METRIC: max(outcome.scores),
                 "epoch": epochs, "ran": outcome.ran, "done_recording": True})


class CellMultiplexer(Searcher):
    """One Tune searcher over every cell run: each cell keeps its own sampler and budget.

    Cells take turns (round-robin over those with budget left), so they run side by side. A
    unit asks its cell's sampler for up to ``unit_sizes[cell]`` configurations; a proposal with
    T < T_min is recorded by :func:`~dptune.execution.record_pruned` (no compute) and does not
    count against the cell's ``budgets`` (configurations per cell).
    """

    def __init__(self, samplers: dict[str, CellSampler], budgets: dict[str, int], unit_sizes: dict[str, int],
                 contexts: dict[str, TrialContext], num_train: int, min_steps: int, metric: str = METRIC) -> None:
        super().__init__(metric=metric, mode="max")
        self.samplers = samplers
        self.budgets = dict(budgets)
        self.unit_sizes = dict(unit_sizes)
        self.contexts = contexts
        self.num_train = num_train
        self.min_steps = min_steps
        self.suggested = dict.fromkeys(samplers, 0)
        self.owner: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        self.turn = 0

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict[str, Any], **spec: Any) -> bool:
        return True

    # Ray annotates Searcher.suggest as returning Optional[Dict] but documents (and handles) the
    # string Searcher.FINISHED as its end-of-search answer.
    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:  # type: ignore[override]
        while open_cells := [k for k in self.samplers if self.suggested[k] < self.budgets[k]]:
            key = open_cells[self.turn % len(open_cells)]
            self.turn += 1
            context = self.contexts[key]
            count = min(self.unit_sizes[key], self.budgets[key] - self.suggested[key])
            configurations = self.samplers[key].ask(
                count, partial(record_pruned, context, num_train=self.num_train, min_steps=self.min_steps))
            if not configurations:  # a grid ran out early: close the cell
                self.budgets[key] = self.suggested[key]
                continue
            self.suggested[key] += len(configurations)
            self.owner[trial_id] = (key, configurations)
            return {CELL_KEY: key, CONFIGURATIONS_KEY: configurations}
        return Searcher.FINISHED

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        owned = self.owner.pop(trial_id, None)
        if owned is None:  # a unit restarted on --resume after it errored: its sampler was told then
            return
        key, configurations = owned
        sampler = self.samplers[key]
        if error or not result:
            values: list[float | None] = [None] * len(configurations)
        elif SCORES_KEY in result:
            values = list(result[SCORES_KEY])
        else:  # stopped early by ASHA (one configuration): its last intermediate accuracy
            values = [result.get(self.metric)]
        for params, value in zip(configurations, values, strict=True):
            sampler.tell(params, None if value is None or not math.isfinite(value) else float(value))

    def _dynamic_state(self) -> dict[str, Any]:
        return {"samplers": {key: sampler.state() for key, sampler in self.samplers.items()},
                "budgets": self.budgets, "suggested": self.suggested,
                "owner": {trial_id: list(owned) for trial_id, owned in self.owner.items()}, "turn": self.turn}

    def _load_dynamic_state(self, state: dict[str, Any]) -> None:
        self.samplers = {key: CellSampler.from_state(value) for key, value in state["samplers"].items()}
        self.budgets, self.suggested, self.turn = state["budgets"], state["suggested"], state["turn"]
        self.owner = {trial_id: (key, configurations) for trial_id, (key, configurations) in state["owner"].items()}

    def save(self, checkpoint_path: str) -> None:
        """One JSON file (Tune renames it into place): plain data only."""
        Path(checkpoint_path).write_text(json.dumps(self._dynamic_state()))

    def restore(self, checkpoint_path: str) -> None:
        self._load_dynamic_state(json.loads(Path(checkpoint_path).read_text()))

    def __getstate__(self) -> dict[str, Any]:
        state = {name: value for name, value in self.__dict__.items() if name != "samplers"}
        state["samplers"] = {key: sampler.state() for key, sampler in self.samplers.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        samplers = state.pop("samplers")
        self.__dict__.update(state)
        self.samplers = {key: CellSampler.from_state(value) for key, value in samplers.items()}


class PerCellASHA(FIFOScheduler):
    """Routes each unit to its own cell's ASHA, so accuracies at ε = 1 and ε = 8 never compete.

    ``schedulers`` maps a cell's key to its ``ASHAScheduler`` (time attribute ``epoch``). Units
    under a scheduler carry one configuration and one replicate (the space refuses more).
    """

    def __init__(self, schedulers: dict[str, ASHAScheduler]) -> None:
        super().__init__()
        self.cells = schedulers

    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        return all(s.set_search_properties(metric, mode, **spec) for s in self.cells.values())

    def _of(self, trial: Any) -> ASHAScheduler:
        return self.cells[trial.config[CELL_KEY]]

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        return self._of(trial).on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> None:
        self._of(trial).on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_remove(tune_controller, trial)


def stop_search(reason: str) -> None:
    """End the Tune run as Ctrl+C would (from the driver, e.g. a callback): Tune stops its loop and
    saves its state with the running units still unfinished, so ``--resume`` runs them again.
    ``reason`` goes to ``DRIVER_FAILURES``; Tune's own logging is silenced from here on (its last
    state save may fail on the same full disk, which is no news to the user)."""
    first = not DRIVER_FAILURES
    DRIVER_FAILURES.append(reason)
    for name in ("ray.tune", "ray.train", "ray.air"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if first and callable(signal.getsignal(signal.SIGUSR1)):  # Tune's interrupt handler is installed
        os.kill(os.getpid(), signal.SIGUSR1)


class RecordAndReport(Callback):
    """Driver-side: a progress line per unit, and the records of runs a unit could not write itself.

    ``cells`` maps a cell's key to (its context, a label, its configuration budget, the σ per
    feasible B, N). A unit stopped by ASHA records the steps of its last report (rows and a ledger
    end entry). A unit whose process was lost is retried by Tune (``FailureConfig``); its
    unrecorded runs stay charged their planned steps in the ledger, get no row, and run again on
    a retry or on ``--resume``. ``quiet``: no progress line (an end-to-end private search, whose
    number of runs and running best must not be shown); the records are written all the same.
    No hook raises: a failure (a full disk) ends the search through :func:`stop_search`.
    """

    def __init__(self, cells: dict[str, tuple[TrialContext, str, int, dict[int, float], int]],
                 quiet: bool = False) -> None:
        self.cells = cells
        self.quiet = quiet
        self.finished = dict.fromkeys(cells, 0)
        self.runs: dict[str, Counter[str]] = {key: Counter() for key in cells}  # runs per status, so far
        self.best: dict[str, tuple[float, dict[str, Any]]] = {}

    def _progress(self, trial: Any, what: str = "", runs: Mapping[str, int] | None = None) -> None:
        """One line for a cell: configurations done of its budget, its runs so far by status (the
        counts the summary table shows at the end), the best so far, and ``what`` happened now.
        ``runs``: the statuses of the unit's runs that ended, added to the cell's counts."""
        key = trial.config[CELL_KEY]
        if runs is not None:
            self.finished[key] += len(trial.config[CONFIGURATIONS_KEY])
            self.runs[key].update(runs)
        if self.quiet:
            return
        context, label, budget, _, _ = self.cells[key]
        replicates = f" × {context.replicates} replicates" if context.replicates > 1 else ""
        counts = ", ".join(f"{count} {status}" for status, count in sorted(self.runs[key].items())) or "no run ended"
        best = ""
        if key in self.best:
            score, params = self.best[key]
            clip = f"C={params['clip_bound']:.3g} " if "clip_bound" in params else ""
            best = f"; best so far {score:.4f} ({clip}B={params['batch_size']} η₀={params['base_learning_rate']:.3g})"
        now = f" ({what})" if what else ""
        print(f"[{label}] {self.finished[key]}/{budget} configurations{replicates}: runs {counts}{now}{best}",
              flush=True)

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        try:
            self._complete(trial)
        except Exception as error:  # never raise inside Tune's loop
            stop_search(_failure_line(error, "recording a finished unit"))

    def _complete(self, trial: Any) -> None:
        last = trial.last_result or {}
        configurations = trial.config[CONFIGURATIONS_KEY]
        if not last.get("done_recording"):
            if DRIVER_FAILURES or "epoch" not in last:  # stopped with the search: unrecorded, run on --resume
                return
            self._record_unfinished(trial, "stopped_early", "stopped by the ASHA scheduler")
            context = self.cells[trial.config[CELL_KEY]][0]
            self._progress(trial, f"stopped early at epoch {last.get('epoch')}",
                           {"stopped_early": len(configurations) * context.replicates})
            return
        scores = last.get(SCORES_KEY, [])
        for params, score in zip(configurations, scores, strict=False):
            if trial.config[CELL_KEY] not in self.best or score > self.best[trial.config[CELL_KEY]][0]:
                self.best[trial.config[CELL_KEY]] = (score, params)
        self._progress(trial, runs=json.loads(last.get(RUN_STATUSES_KEY, "{}")))

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any],
                        **info: Any) -> None:
        if result.get(STORAGE_ERROR_KEY):
            stop_search(f"a trial process could not write its records: {result[STORAGE_ERROR_KEY]}")

    def on_trial_recover(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        with contextlib.suppress(Exception):
            self._progress(trial, f"trial process lost ({_error_line(trial)}); its unrecorded runs are charged their "
                                  "planned steps and run again")

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        with contextlib.suppress(Exception):
            self._progress(trial, f"error: {_error_line(trial)}; its unrecorded runs are charged their planned steps "
                                  "and run again on --resume")

    def _record_unfinished(self, trial: Any, status: TrialStatus, reason: str) -> None:
        context, _, _, sigmas, num_train = self.cells[trial.config[CELL_KEY]]
        store = ResultsStore(context.results_root)
        last = trial.last_result or {}
        for params in trial.config[CONFIGURATIONS_KEY]:
            for replicate in range(context.replicates):
                if store.has_trial(replicate_trial_id(configuration_id(context.cell_key, params), replicate)):
                    continue  # the run wrote its full record before the unit ended
                write_result(context, params, replicate,
                             _unfinished_result(context, params, replicate, status, reason, last, sigmas, num_train),
                             ledger=True)


def _error_line(trial: Any) -> str:
    """The last line of a failed unit's error file (Tune writes the traceback there)."""
    try:
        return Path(trial.error_file).read_text().strip().splitlines()[-1]
    except (OSError, TypeError, IndexError):
        return "unknown error"


def _failure_line(error: BaseException, doing: str) -> str:
    return f"{doing}: {storage_error(error) or f'{type(error).__name__}: {error}'}"


def _unfinished_result(context: TrialContext, params: dict[str, Any], replicate: int, status: TrialStatus,
                       reason: str, last: dict[str, Any], sigmas: dict[int, float], num_train: int) -> TrialResult:
    """The record of a run ASHA stopped (status ``status``) before it recorded itself: Tune's function
    trainables block in ``report()``, so it took the steps of its last report and no more."""
    config = trial_config(context, params, replicate)
    epochs = [EpochMetrics(**{f: last[f] for f in EpochMetrics.__dataclass_fields__ if f in last})]
    sigma = sigmas[config.batch_size]
    rate = sample_rate(num_train, config.batch_size)
    steps = total_steps(num_train, config.batch_size, config.epochs)
    steps_taken = int(last.get("steps", 0))
    spent = epsilon_spent(sigma, rate, steps_taken, config.delta) if steps_taken else 0.0
    return TrialResult(config=config, status=status, reason=reason, noise_multiplier=sigma, sample_rate=rate,
                       steps=steps, steps_taken=steps_taken, epsilon_spent=spent, num_train=num_train, epochs=epochs,
                       val_accuracy=last.get(METRIC, float("nan")))
