"""The Ray Tune layer of a search: per-cell ASHA, the trainables, and the driver's callbacks. Ray appears
here, in :mod:`dptune.search.scheduling.searcher` (the searcher over every cell and its :class:`Unit`) and in
:mod:`dptune.search.driver` only.

A Tune trial is a *unit* (:class:`~dptune.search.scheduling.searcher.Unit`): one cell's batch of sampled
configurations (C, B, η₀), run by :func:`dptune.search.runs.execution.run_configurations` (fused where it
applies, R replicates each). A cell here is a cell under one clipping rule, named by its ``cell_key``
(:attr:`dptune.search.planning.cells.CellPlan.cell_key`). Its last report carries one score per configuration
(``SCORES_KEY``, the mean selection value over replicates), which the searcher tells that cell's
:class:`~dptune.search.planning.sampler.CellSampler`.

Every class here is top-level and receives what it wraps (like Ray's ``ConcurrencyLimiter``); the
callbacks pickle without their contexts and their :class:`TuneRunState`, which the driver binds anew
on a restored Tuner's (:func:`dptune.search.scheduling.tuners.restore_tuner`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune import Callback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from dptune._thirdparty import interrupt_tune_run
from dptune.contract import EpochMetrics, TrialStatus
from dptune.errors import DptuneError, storage_error
from dptune.paths import write_file_atomic
from dptune.records import ResultsStore
from dptune.search.runs.execution import (
    FinishedRun,
    TrialContext,
    run_configurations,
    unfinished_result,
    write_result,
)
from dptune.search.runs.private_units import UNIT_DONE, PrivateUnit, run_private_unit
from dptune.search.scheduling.progress import CellTally, SearchProgress, recorded_statuses
from dptune.search.scheduling.searcher import CELL_KEY, METRIC, SCORES_KEY, Unit

#: Key of a unit's last report: the status of each of its runs, in ``unit_runs`` order (a JSON list), for
#: its cell's progress.
RUN_STATUSES_KEY = "run_statuses"
#: Key of a unit's intermediate report: how many of its runs not recorded when it began are trained so far
#: (fractional inside a fused group), for its cell's progress (``execution.UnitProgress``).
RUNS_TRAINED_KEY = "runs_trained"
#: A unit reports its runs trained at most this often (s) between epochs, and each time it records runs.
PROGRESS_INTERVAL_S = 2.0
#: Key of the report of a unit that could not write to the results folder (a full or read-only disk):
#: the error, in one line. The driver then ends the search (:meth:`TuneRunState.stop_search`).
STORAGE_ERROR_KEY = "storage_error"


@dataclass
class TuneRunState:
    """What ended one Tune run early, owned by the driver (:func:`dptune.search.scheduling.tune_run.run_cells` makes one
    per run and reads it after Tune returns) and given to the driver's callbacks and signal handler.

    ``failures``: what went wrong in this driver process that must end the search, one line each (a
    results write that failed in a callback, or a unit's ``STORAGE_ERROR_KEY``). ``signals``: the stop
    signals (``SIGINT``: Ctrl+C; ``SIGTERM``: ``ray job stop``, ``kill``) received while the run ran
    (:func:`stop_on_signals`): the search then ends unfinished. Both empty: it ran to its end."""

    failures: list[str] = field(default_factory=list)
    signals: list[str] = field(default_factory=list)

    @property
    def stopping(self) -> bool:
        """Whether the run is being ended early (a failure, or a stop signal)."""
        return bool(self.failures or self.signals)

    def stop_search(self, reason: str) -> None:
        """End the Tune run as Ctrl+C would (from the driver, e.g. a callback): Tune stops its loop and
        saves its state with the running units still unfinished, so ``--resume`` runs them again.
        ``reason`` goes to ``failures``; Tune's own logging is silenced from here on (its last state
        save may fail on the same full disk, which is no news to the user)."""
        first = not self.failures
        self.failures.append(reason)
        if first:
            _end_tune_run()


@dataclass(frozen=True)
class CellRun:
    """What the driver's callback (:class:`RecordAndReport`) knows of one cell: the ``context``
    every run of it shares (with N and σ per feasible B, as a search always gives them), the
    ``label`` its progress lines show, and its ``budget`` of configurations."""

    context: TrialContext
    label: str
    budget: int


def tune_trainable(params: dict[str, Any], contexts: dict[str, TrialContext]) -> None:
    """Ray Tune function trainable: run one unit, report its scores after every run is recorded.

    A unit of one configuration and one replicate on the ``trial`` runner reports every epoch
    but the last (ASHA decides on them); the last is reported once, after the result is written,
    so a trial that trained every epoch keeps its full record whatever the scheduler does. A unit of
    more runs (fused, or several on the ``trial`` runner: never under a scheduler) reports its runs
    trained so far (``RUNS_TRAINED_KEY``) each time it records runs, and between epochs at most every
    ``PROGRESS_INTERVAL_S``, so its cell's progress moves before it ends.
    """
    unit = Unit.of(params, contexts)
    context = contexts[unit.cell_key]
    epochs = context.base.epochs
    last_report = time.monotonic()

    def report(metrics: EpochMetrics) -> None:
        if metrics.epoch < epochs:
            tune.report({**asdict(metrics), "done_recording": False})

    def progress(trained: float, recorded: bool) -> None:
        nonlocal last_report
        if recorded or time.monotonic() - last_report >= PROGRESS_INTERVAL_S:
            last_report = time.monotonic()
            tune.report({RUNS_TRAINED_KEY: trained, METRIC: float("nan"), "done_recording": False})

    try:
        outcome = run_configurations(context, unit.configurations, report, progress, unit.replicates)
    except OSError as error:  # the results folder is full or read-only: the driver ends the search
        if storage_error(error) is not None:  # and the unit stays unfinished, so --resume runs it again
            tune.report({STORAGE_ERROR_KEY: storage_error(error), METRIC: float("nan"), "done_recording": False})
        raise
    tune.report(
        {
            SCORES_KEY: outcome.scores,
            RUN_STATUSES_KEY: json.dumps(outcome.run_statuses),
            METRIC: max(outcome.scores),
            "epoch": epochs,
            "ran": outcome.ran,
            "done_recording": True,
        }
    )


#: The file (inside the trust boundary) where a private unit that failed keeps its traceback.
PRIVATE_UNIT_ERRORS = "unit_errors"


class PrivateUnitFailed(DptuneError, RuntimeError):
    """A private search's unit failed; what failed is kept inside the trust boundary, not in this message
    (Tune and Ray keep a unit's error in their own state, which is outside the boundary)."""


def private_unit_trainable(params: dict[str, Any], contexts: dict[str, TrialContext], chunk: int) -> None:
    """Ray Tune function trainable of an end-to-end private search: one :class:`PrivateUnit`
    (``dptune.search.runs.private_units``), whose runs are read and recorded inside the trust boundary.

    What reaches Tune, and so Ray's state, logs and session folders, is the same whatever the runs
    did: one constant report (``UNIT_DONE``) and, on a failure, a storage error's one line
    (``STORAGE_ERROR_KEY``: the OS's words, no path) or :class:`PrivateUnitFailed` naming the file
    inside the boundary that holds the traceback.
    """
    unit = PrivateUnit.of(params)
    context = contexts[unit.cell_key]
    try:
        run_private_unit(context, unit, chunk)
    except Exception as error:
        if (line := storage_error(error)) is not None:  # the driver ends the search; --resume runs the rest
            tune.report({STORAGE_ERROR_KEY: line, METRIC: float("nan"), "done_recording": False})
            raise PrivateUnitFailed(f"a private unit could not write its records: {line}") from None
        name = f"{unit.cell_key}-unit{unit.unit}.txt"
        with contextlib.suppress(Exception):
            write_file_atomic(
                f"{context.results_root.rstrip('/')}/{PRIVATE_UNIT_ERRORS}",
                name,
                "".join(traceback.format_exception(error)).encode(),
            )
        where = f"{context.results_root}/{PRIVATE_UNIT_ERRORS}/{name}"
        raise PrivateUnitFailed(f"a unit of the private search failed; its traceback is kept at {where}") from None
    tune.report(dict(UNIT_DONE))


class StopOnStorageFailure(Callback):
    """Driver-side: ends the search (:meth:`TuneRunState.stop_search` of ``state``, the driver's) when a
    unit reports that it could not write its records (``STORAGE_ERROR_KEY``: a full or read-only results
    folder). It pickles without ``state``; a restored Tuner's is given this driver's (:meth:`bind`)."""

    def __init__(self, state: TuneRunState) -> None:
        self._state: TuneRunState | None = state

    @property
    def state(self) -> TuneRunState:
        """This driver's run state: the one given, or once unpickled the one :meth:`bind` gave."""
        if self._state is None:
            raise RuntimeError("a restored Tuner's callback was not bound to this driver (tuners.restore_tuner)")
        return self._state

    def bind(self, contexts: Mapping[str, TrialContext], state: TuneRunState) -> None:
        """Give a restored (unpickled) callback this driver's run state (``contexts``: each cell's, unused here)."""
        self._state = state

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_state": None}

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        if result.get(STORAGE_ERROR_KEY):
            self.state.stop_search(f"a trial process could not write its records: {result[STORAGE_ERROR_KEY]}")


class UnitFailureNotice(Callback):
    """Driver-side, private search: one line, without a time or a trial name, each time a unit fails (its
    process lost, or an error raised), pointing into the trust boundary (``runs``: Tune's error files under
    ``_tune``, tracebacks under ``PRIVATE_UNIT_ERRORS``); Ray's and Tune's own lines about it are off."""

    def __init__(self, runs: str, max_retries: int) -> None:
        self.runs, self.max_retries = runs.rstrip("/"), max_retries

    def on_trial_recover(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._say("it runs again")

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._say(f"it was run {self.max_retries + 1} time(s) (resources.max_retries = {self.max_retries})")

    def _say(self, then: str) -> None:
        print(
            f"a unit of the private search failed, and {then}; what happened stays inside the trust boundary: "
            f"{self.runs}/_tune and {self.runs}/{PRIVATE_UNIT_ERRORS}",
            flush=True,
        )


class PerCellASHA(FIFOScheduler):
    """Routes each unit to its own cell's ASHA, so accuracies at ε = 1 and ε = 8 never compete.

    ``schedulers`` maps a ``cell_key`` to its ``ASHAScheduler`` (time attribute ``epoch``). Units
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


def _end_tune_run() -> None:
    """Ask Tune to stop its loop with the running units left unfinished (``_thirdparty.interrupt_tune_run``:
    a ``Stopper`` would end them as finished instead), its logging silenced."""
    for name in ("ray.tune", "ray.train", "ray.air"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    interrupt_tune_run()


@contextlib.contextmanager
def stop_on_signals(state: TuneRunState) -> Iterator[None]:
    """While the Tune run inside runs, the first SIGINT (Ctrl+C) or SIGTERM (``ray job stop``) ends it as
    a full disk does (Tune saves its state, the running units stay unrecorded and ``--resume`` runs them
    again) and is kept in ``state.signals``; a second one raises ``KeyboardInterrupt`` at once (what
    finished is on disk already). Tune's own SIGINT handler, which would end the run as if it had
    finished, is kept out (``TUNE_DISABLE_SIGINT_HANDLER``); the previous handlers come back afterwards.
    Only the main thread can take signals: elsewhere this does nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: Any) -> None:
        if state.signals:
            raise KeyboardInterrupt
        state.signals.append(signal.Signals(signum).name)
        _end_tune_run()

    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    previous = {number: signal.signal(number, on_signal) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class RecordAndReport(StopOnStorageFailure):
    """Driver-side: each cell's progress (:class:`~dptune.search.scheduling.progress.SearchProgress`: a bar
    where someone watches, plain lines elsewhere), and the records of runs a unit could not write itself.

    ``cells`` maps a ``cell_key`` to its :class:`CellRun`. A unit's intermediate reports move its cell's
    progress (``RUNS_TRAINED_KEY`` of a fused unit, the epochs of a trial unit); its last report's run
    statuses count its runs done. A unit stopped by ASHA records the steps of its last report (rows and a
    ledger end entry). A unit whose process was lost is retried by Tune (``FailureConfig``); its
    unrecorded runs stay charged their planned steps in the ledger, get no row, and run again on a retry
    or on ``--resume``. No hook raises: a failure (a full disk) ends the search through
    :meth:`TuneRunState.stop_search`. (An end-to-end private search has none of this: its units report
    nothing of their runs, :func:`private_unit_trainable`.) It pickles without its contexts, run state
    and display; a restored Tuner's gets this driver's (:meth:`bind`), and its display starts from the
    runs the results folder holds.
    """

    def __init__(self, cells: dict[str, CellRun], state: TuneRunState) -> None:
        super().__init__(state)
        self._cells: dict[str, CellRun] | None = cells  # None once unpickled, until bound
        self._contexts: Mapping[str, TrialContext] | None = None
        self._cell_labels = {cell_key: (cell.label, cell.budget) for cell_key, cell in cells.items()}
        self._progress: SearchProgress | None = None  # this driver's display, from its first event
        self.best: dict[str, tuple[float, dict[str, Any]]] = {}

    @property
    def cells(self) -> dict[str, CellRun]:
        """Each cell's run: the one given, or once unpickled (a restored Tuner's) with this driver's context."""
        if self._cells is not None:
            return self._cells
        if self._contexts is None:
            raise RuntimeError("a restored Tuner's callback was not bound to this driver (tuners.restore_tuner)")
        return {key: CellRun(self._contexts[key], label, budget) for key, (label, budget) in self._cell_labels.items()}

    @property
    def progress(self) -> SearchProgress:
        """This driver's display of the cells, started at the runs each has recorded."""
        if self._progress is None:
            tallies, recorded = {}, {}
            for key, cell in self.cells.items():
                context = cell.context
                where = (context.results_root, context.search_id)
                if where not in recorded:  # the trials table read once per results folder, not once per cell
                    recorded[where] = recorded_statuses(*where)
                statuses = recorded[where].get(key, {})
                tallies[key] = CellTally(cell.label, cell.budget, context.replicates, statuses, best=self._best(key))
            self._progress = SearchProgress(tallies)
        return self._progress

    def bind(self, contexts: Mapping[str, TrialContext], state: TuneRunState) -> None:
        """Give a restored (unpickled) callback this driver's context of each cell and its run state."""
        super().bind(contexts, state)
        self._contexts = contexts

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_cells": None, "_contexts": None, "_progress": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**state, "_progress": None})

    def setup(
        self,
        stop: Any = None,
        num_samples: int | None = None,
        total_num_samples: int | None = None,
        **info: Any,
    ) -> None:
        with contextlib.suppress(Exception):  # the display is no reason to fail a search
            _ = self.progress

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        if self._progress is not None:
            self._progress.close()

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        super().on_trial_result(iteration, trials, trial, result, **info)
        if result.get("done_recording", True):
            return
        with contextlib.suppress(Exception):
            cell_key = trial.config[CELL_KEY]
            if RUNS_TRAINED_KEY in result:
                self.progress.training(cell_key, trial.trial_id, float(result[RUNS_TRAINED_KEY]))
            elif "epoch" in result:  # a trial unit of one run, after an epoch but its last
                self.progress.training(
                    cell_key, trial.trial_id, result["epoch"] / self.cells[cell_key].context.base.epochs
                )

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        try:
            self._complete(trial)
        except Exception as error:  # never raise inside Tune's loop
            self.state.stop_search(_failure_line(error, "recording a finished unit"))

    def _complete(self, trial: Any) -> None:
        last = trial.last_result or {}
        unit = self._unit(trial)
        context = self.cells[unit.cell_key].context
        if last.get("done_recording"):
            scores = last.get(SCORES_KEY, [])
            for params, score in zip(unit.configurations, scores, strict=False):
                if unit.cell_key not in self.best or score > self.best[unit.cell_key][0]:
                    self.best[unit.cell_key] = (score, params)
            runs = [run.trial_id for run in unit.runs(context)]
            statuses = dict(zip(runs, json.loads(last.get(RUN_STATUSES_KEY, "[]")), strict=False))  # display only
            what = ""
        elif self.state.stopping or "epoch" not in last:  # stopped with the search: run on --resume
            return
        else:
            statuses = self._record_unfinished(unit, trial, "stopped_early", "stopped by the ASHA scheduler")
            what = f"stopped early at epoch {last.get('epoch')}"
        with contextlib.suppress(Exception):  # the display is no reason to stop a search
            self.progress.cells[unit.cell_key].best = self._best(unit.cell_key)
            self.progress.ended(unit.cell_key, trial.trial_id, statuses, what)

    def on_trial_recover(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        with contextlib.suppress(Exception):
            self.progress.failed(
                trial.config[CELL_KEY],
                trial.trial_id,
                f"trial process lost ({_error_line(trial)}); its unrecorded runs are charged their "
                "planned steps and run again",
            )

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        with contextlib.suppress(Exception):
            self.progress.failed(
                trial.config[CELL_KEY],
                trial.trial_id,
                f"error: {_error_line(trial)}; its unrecorded runs are charged their planned steps "
                "and run again on --resume",
            )

    def _best(self, cell_key: str) -> str:
        """The cell's best score so far and its configuration, as shown (empty: none yet)."""
        if cell_key not in self.best:
            return ""
        score, params = self.best[cell_key]
        clip = f"C={params['clip_bound']:.3g} " if "clip_bound" in params else ""
        return f"{score:.4f} ({clip}B={params['batch_size']} η₀={params['base_learning_rate']:.3g})"

    def _unit(self, trial: Any) -> Unit:
        """The unit ``trial`` runs, with its configurations (read from its file)."""
        return Unit.of(trial.config, {key: cell.context for key, cell in self.cells.items()})

    def _record_unfinished(self, unit: Unit, trial: Any, status: TrialStatus, reason: str) -> dict[str, str]:
        """Record ``unit``'s runs that wrote no record themselves, from ``trial``'s last report; the status
        of each of its runs, by trial id (those it recorded itself read back)."""
        context = self.cells[unit.cell_key].context
        store = ResultsStore(context.results_root)
        last = trial.last_result or {}
        statuses: dict[str, str] = {}
        recorded = []
        for run in unit.runs(context):
            if store.has_trial(run.trial_id):
                recorded.append(run.trial_id)  # the run wrote its full record before the unit ended
                continue
            result = unfinished_result(context, run, status, reason, last, METRIC)
            write_result(context, FinishedRun(run, result), ledger=True)
            statuses[run.trial_id] = status
        if recorded:
            rows = store.read("trials", ["trial_id", "status"], trial_ids=recorded)
            statuses.update(zip(rows["trial_id"].astype(str), rows["status"].astype(str), strict=True))
        return statuses


def _error_line(trial: Any) -> str:
    """The last line of a failed unit's error file (Tune writes the traceback there)."""
    try:
        return Path(trial.error_file).read_text().strip().splitlines()[-1]
    except (OSError, TypeError, IndexError):
        return "unknown error"


def _failure_line(error: BaseException, doing: str) -> str:
    return f"{doing}: {storage_error(error) or f'{type(error).__name__}: {error}'}"
