"""One Ray Tune run for every cell of a search (:func:`run_cells`): its trainable and Tuner are its
shape's (a :class:`TunedShape`: each mode of :mod:`dptune.search.modes` is one), fresh or restored
from Tune's state (``tuners.restore_tuner``), and what ends
it early is recorded in a :class:`~dptune.search.scheduling.tune_adapters.TuneRunState` this run owns."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dptune.records.ledger import started_runs
from dptune.search import preflight
from dptune.search.planning.cells import CellPlan
from dptune.search.runs.execution import FailedUnits, TrialContext
from dptune.search.scheduling.tuners import restore_tuner
from dptune.space import SearchSpace

if TYPE_CHECKING:
    from dptune.search.scheduling.tune_adapters import TuneRunState


class TunedShape(Protocol):
    """What a Tune run asks of a search's shape (:class:`dptune.search.modes.SearchMode` extends it): the
    level of Tune's logger during the run, the trainable, and a fresh Tuner."""

    tune_log_level: int

    def trainable(self, space: SearchSpace, contexts: dict[str, TrialContext], fused: bool) -> Any:
        """The Tune function trainable, with its parameters (``tune.with_parameters``)."""
        ...

    def tuner(
        self,
        space: SearchSpace,
        plans: list[CellPlan],
        contexts: dict[str, TrialContext],
        trainable: Any,
        run_config: Any,
        state: TuneRunState,
    ) -> Any:
        """A fresh Tuner of the search (``tuners``)."""
        ...


def tune_storage(results_root: str) -> str:
    """Where Ray Tune keeps the state of the search whose per-run records are at ``results_root``."""
    return f"{results_root}/_tune" if "://" in results_root else str(Path(results_root, "_tune").resolve())


def run_cells(
    space: SearchSpace,
    plans: list[CellPlan],
    contexts: list[TrialContext],
    resume: bool,
    mode: TunedShape,
) -> tuple[list[str], list[str], dict[str, FailedUnits]]:
    """One Ray Tune run for every cell of the search (resumed from its experiment state when asked);
    returns what ended it early, from the run's :class:`~dptune.search.scheduling.tune_adapters.TuneRunState`: the
    results writes that failed and the stop signals received (Ctrl+C, SIGTERM), both empty when it ran
    to its end; and the runs of the units that failed for good, by cell (``searcher.failed_units``).

    The cells share the trial processes (one set-up, not one per cell) and run side by side. A unit
    whose process is lost runs again up to ``resources.max_retries`` times (Tune's ``FailureConfig``);
    ``resume`` restarts units that still errored, and those a stopped search left unfinished. The
    trainable and the Tuner are the ``mode``'s (``modes.mode_of``): a search's
    units carry sampled configurations; an end-to-end private search's carry public unit numbers only.
    """
    from ray import tune

    from dptune.search.scheduling.searcher import failed_units
    from dptune.search.scheduling.tune_adapters import TuneRunState, stop_on_signals

    # The longest units first (most epochs), so the last ones to finish are short: cells take turns
    # in this order (dicts keep it).
    cells = sorted(zip(plans, contexts, strict=True), key=lambda pair: -pair[0].cell.epochs)
    by_key = {plan.cell_key: context for plan, context in cells}
    trainable = tune.with_resources(
        mode.trainable(space, by_key, contexts[0].fused), {"cpu": space.resources.cpus, "gpu": space.resources.gpu}
    )
    storage = tune_storage(contexts[0].results_root)
    preflight.record_tune_location(contexts[0].results_root, storage)
    _quiet_tune(mode)
    state = TuneRunState()
    tuner = _tuner(space, mode, [plan for plan, _ in cells], by_key, (trainable, storage), resume, state)
    with stop_on_signals(state):
        results = tuner.fit()
    return list(state.failures), list(state.signals), failed_units(results, by_key)


def _quiet_tune(mode: TunedShape) -> None:
    """What Tune saves and prints while it runs."""
    # Save Tune's experiment state (searcher included) at most every 5 s instead of Tune's
    # adaptive period, so a resume repeats little; repeats are caught by configuration_id.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "5")
    # Tune's default output counts its own units (one Tune trial carries many runs), prints times and a
    # TensorBoard hint to a folder of nothing a user wants; verbose=0 of the older one prints nothing,
    # and dptune's progress lines count runs
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    # Tune's "Wrote the latest version..." lines; a private search shows none of its warnings either: they
    # carry a time ("The `process_trial_result` operation took 2.1 s" on a busy machine)
    logging.getLogger("ray.tune").setLevel(mode.tune_log_level)


def _tuner(
    space: SearchSpace,
    mode: TunedShape,
    plans: list[CellPlan],
    by_key: dict[str, TrialContext],
    where: tuple[Any, str],
    resume: bool,
    state: TuneRunState,
) -> Any:
    """The search's Tuner: restored from Tune's state under ``where``'s storage (its trainable, storage)
    on ``resume``, else a fresh one (the ``mode``'s); its searcher and callbacks record into ``state``."""
    from ray import tune

    trainable, storage = where
    experiment = f"{storage}/search"
    if resume and tune.Tuner.can_restore(experiment):
        return restore_tuner(experiment, trainable, by_key, state)
    first = next(iter(by_key.values()))
    if resume and not started_runs(first.results_root, first.search_id):  # else: Tune's state set aside
        print(f"--resume: no search to resume at {first.results_root}; starting it", flush=True)
    run_config = tune.RunConfig(
        name="search",
        storage_path=storage,
        verbose=0,
        failure_config=tune.FailureConfig(max_failures=space.resources.max_retries, fail_fast=False),
    )
    return mode.tuner(space, plans, by_key, trainable, run_config, state)
