"""The searcher of a search's Ray Tune run: one Tune ``Searcher`` over every cell (:class:`CellMultiplexer`),
and the unit it hands out (:class:`Unit`). Ray appears here, in :mod:`dptune.search.scheduling.tune_adapters` and in
:mod:`dptune.search.driver` only.

A Tune trial is a *unit*: one cell's batch of sampled configurations (C, B, η₀). Its Tune config carries
the cell and the unit's id only; the configurations are in the unit's file (:meth:`Unit.save`, read back
by :meth:`Unit.of` in the trial process and the driver), so Tune's saved state holds a few hundred bytes a
unit whatever the number of configurations it runs. Each cell keeps its own
:class:`~dptune.search.planning.sampler.CellSampler` and budget; the searcher's checkpoint is plain JSON
(``save``/``restore``) and it pickles as plain data (``__getstate__``), so a resumed search never unpickles
code. What Tune's saved state lags behind the results folder is learnt from the folder when a driver first
asks for a unit (:mod:`dptune.search.scheduling.reconcile`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ray.tune.search import Searcher

from dptune.paths import read_file, write_file_atomic
from dptune.records import read_table
from dptune.records.ledger import started_runs
from dptune.search.planning.sampler import CellSampler
from dptune.search.runs.execution import FailedUnits, RunSpec, TrialContext, record_pruned, unit_runs
from dptune.search.scheduling.progress import say
from dptune.search.scheduling.racing import next_round
from dptune.search.scheduling.reconcile import unknown_configurations
from dptune.space.spec import RacingSpec

#: The metric every sampler and scheduler optimises: accuracy on the validation split.
METRIC = "val_accuracy"
#: Keys of a unit's Tune config: its cell (the value is the cell's ``cell_key``), and its id, which names
#: the file of the configurations it runs (:class:`Unit`).
CELL_KEY = "cell"
UNIT_ID_KEY = "unit_id"
#: Key of a unit's last report: per configuration, the mean selection value over its replicates.
SCORES_KEY = "scores"


@dataclass(frozen=True)
class Unit:
    """One Tune trial's work: ``configurations`` (each a dict of the sampled C, B and η₀) of the
    cell ``cell_key``, each run the cell's R times, or, in a racing round, ``replicates[i]`` of the i-th
    (replicate indices: :mod:`dptune.search.scheduling.racing`). ``unit_id`` is the id of the Tune trial
    it was suggested for (unique in the search, also across resumes). Tune holds it as a config of its
    cell and id (:meth:`config`); the configurations are in its file (:meth:`save`), which :meth:`of`
    reads back."""

    cell_key: str
    unit_id: str
    configurations: list[dict[str, Any]]
    replicates: list[list[int]] | None = None

    def runs(self, context: TrialContext) -> list[RunSpec]:
        """Every run of the unit (``execution.unit_runs``)."""
        return unit_runs(context, self.configurations, self.replicates)

    def config(self) -> dict[str, Any]:
        """The unit as a Tune trial's config: its cell and id (tens of bytes, whatever its size)."""
        return {CELL_KEY: self.cell_key, UNIT_ID_KEY: self.unit_id}

    def save(self, context: TrialContext) -> None:
        """Write the unit's configurations (JSON) where :meth:`of` reads them: durable before Tune, which
        may save the unit's config in its state at once, hears of the unit."""
        kept = self.configurations if self.replicates is None else [self.configurations, self.replicates]
        data = json.dumps(kept).encode()
        write_file_atomic(units_folder(context), f"{self.unit_id}.json", data, durable=True)

    @classmethod
    def of(cls, config: Mapping[str, Any], contexts: Mapping[str, TrialContext]) -> Unit:
        """The unit a Tune trial's config names, its configurations read from its file (:meth:`save`)."""
        cell_key, unit_id = config[CELL_KEY], config[UNIT_ID_KEY]
        data = read_file(units_folder(contexts[cell_key]), f"{unit_id}.json")
        if data is None:
            raise FileNotFoundError(
                f"unit {unit_id}: no file of its configurations in {units_folder(contexts[cell_key])}"
            )
        kept = json.loads(data)
        if kept and isinstance(kept[0], list):  # a racing round's: [configurations, replicates]
            return cls(cell_key, unit_id, kept[0], kept[1])
        return cls(cell_key, unit_id, kept)


def units_folder(context: TrialContext) -> str:
    """Where a search's units keep their configurations (:meth:`Unit.save`): in the folder of Tune's state
    (``tune_run.tune_storage``), under the results root that every trial process writes to."""
    return f"{context.results_root.rstrip('/')}/_tune/units"


class CellMultiplexer(Searcher):
    """One Tune searcher over every cell run: each cell keeps its own sampler and budget.

    Cells take turns (round-robin over those with budget left), so they run side by side. A
    unit asks its cell's sampler for up to ``unit_sizes[cell]`` configurations; a proposal with
    T < T_min is recorded by :func:`~dptune.search.runs.execution.record_pruned` (no compute) and does not
    count against the cell's ``budgets`` (configurations per cell).

    The first time a driver asks it for a unit, it learns from the results folder what Tune's saved state
    missed (:mod:`dptune.search.scheduling.reconcile`): recorded configurations are told and counted, charged ones
    without their rows are handed out again, as they were charged, before anything new is asked. So a
    cell asks at most its budget across any number of kills and resumes, and no charged run is dropped.

    It pickles without its contexts. A restored Tuner unpickles its searcher from the experiment state the
    search's first driver wrote (another process, another lease, perhaps another folder: a copy); the
    driver gives it its own contexts (:meth:`bind`, ``tuners.restore_tuner``), never those of that pickle,
    so a resume writes only to its own folder under its own lease.
    """

    def __init__(
        self,
        samplers: dict[str, CellSampler],
        budgets: dict[str, int],
        unit_sizes: dict[str, int],
        contexts: dict[str, TrialContext],
        num_train: int,
        min_steps: int,
        metric: str = METRIC,
        racing: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(metric=metric, mode="max")
        self.samplers = samplers
        self.budgets = dict(budgets)
        self.unit_sizes = dict(unit_sizes)
        self._contexts: Mapping[str, TrialContext] | None = contexts  # None once unpickled, until bound
        self.num_train = num_train
        self.min_steps = min_steps
        self.suggested = dict.fromkeys(samplers, 0)
        self.owner: dict[str, Unit] = {}  # by Tune trial id: the units suggested and not yet complete
        self.errored: dict[str, Unit] = {}  # by Tune trial id: a racing search's units that failed
        self.turn = 0
        self.racing = racing  # the space's racing (``RacingSpec`` as plain data), None: no racing
        self.races: dict[str, dict[str, Any]] = (
            {key: {"signature": None, "ended": None, "rounds": 0, "queued": [[], []]} for key in samplers}
            if racing is not None
            else {}
        )
        self._unrecorded: dict[str, list[dict[str, Any]]] | None = None  # per cell, once this process reads it

    @property
    def contexts(self) -> dict[str, TrialContext]:
        """Each cell's context: the one given, or once unpickled (a restored Tuner's) the one :meth:`bind` gave."""
        if self._contexts is None:
            raise RuntimeError("a restored Tuner's searcher was not bound to this driver (tuners.restore_tuner)")
        return {cell_key: self._contexts[cell_key] for cell_key in self.unit_sizes}

    def bind(self, contexts: Mapping[str, TrialContext]) -> None:
        """Give a restored (unpickled) searcher this driver's context of each cell."""
        self._contexts = contexts

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict[str, Any], **spec: Any) -> bool:
        return True

    # Ray annotates Searcher.suggest as returning Optional[Dict] but documents (and handles) the
    # string Searcher.FINISHED as its end-of-search answer.
    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:  # type: ignore[override]
        if self._unrecorded is None:
            self._unrecorded = self._reconcile()
        unrecorded = self._unrecorded
        while open_cells := [
            key for key in self.samplers if unrecorded[key] or self.suggested[key] < self.budgets[key]
        ]:
            cell_key = open_cells[self.turn % len(open_cells)]
            self.turn += 1
            context = self.contexts[cell_key]
            if unrecorded[cell_key]:  # charged before Tune saved its state: run again before anything new
                configurations = unrecorded[cell_key][: self.unit_sizes[cell_key]]
                del unrecorded[cell_key][: len(configurations)]
                for params in configurations:
                    self.samplers[cell_key].hold(params)
            else:
                count = min(self.unit_sizes[cell_key], self.budgets[cell_key] - self.suggested[cell_key])
                configurations = self.samplers[cell_key].ask(
                    count, partial(record_pruned, context, num_train=self.num_train, min_steps=self.min_steps)
                )
            if not configurations:  # a grid ran out early: close the cell
                self.budgets[cell_key] = self.suggested[cell_key]
                continue
            self.suggested[cell_key] += len(configurations)
            return self._hand_out(Unit(cell_key, trial_id, configurations))
        return self._race(trial_id)

    def _hand_out(self, unit: Unit) -> dict[str, Any]:
        """Keep ``unit`` as the trial's, write its file, and return its Tune config."""
        self.owner[unit.unit_id] = unit
        unit.save(self.contexts[unit.cell_key])
        return unit.config()

    def _race(self, trial_id: str) -> dict[str, Any] | str | None:
        """Once every cell's first pass is handed out: a unit of a racing round (``racing``), None while a
        cell waits for its running units before its next round is decided, or ``FINISHED``."""
        waiting = False
        for cell_key in self.samplers:
            race = self.races.get(cell_key)
            if race is None or race["ended"] is not None:
                continue
            if not race["queued"][0]:
                if any(unit.cell_key == cell_key for unit in self.owner.values()):
                    waiting = True
                    continue
                self._decide_round(cell_key, race)
                if race["ended"] is not None:
                    continue
            size = self.unit_sizes[cell_key]
            configurations, replicates = (part[:size] for part in race["queued"])
            race["queued"] = [part[size:] for part in race["queued"]]
            return self._hand_out(Unit(cell_key, trial_id, configurations, replicates))
        return None if waiting else Searcher.FINISHED

    def _decide_round(self, cell_key: str, race: dict[str, Any]) -> None:
        """Decide cell ``cell_key``'s next racing round from the results folder (``racing.next_round``)
        into ``race``: its runs queued, or why the race ended."""
        assert self.racing is not None
        context = self.contexts[cell_key]
        trials = read_table(context.results_root, "trials")
        trials = trials[trials["search_id"] == context.search_id]
        started = started_runs(context.results_root, context.search_id)
        names = list(self.samplers[cell_key].spec.distributions())
        failed = frozenset(
            run.trial_id for unit in self.errored.values() if unit.cell_key == cell_key for run in unit.runs(context)
        )
        previous, unchanged = race["signature"], race.get("unchanged", 0)
        chosen = next_round(context, RacingSpec(**self.racing), names, trials, started, previous, unchanged, failed)
        if not chosen.lost:
            race["unchanged"] = unchanged + 1 if previous is not None and chosen.signature == previous else 0
        race["signature"], race["ended"] = chosen.signature, chosen.ended
        race["queued"] = [chosen.configurations, chosen.replicates]
        label = f"{context.cell_id} {context.base.clipping}"  # as the cell's progress names it
        runs = sum(map(len, chosen.replicates))
        if chosen.lost:
            say(f"[{label}] {runs} racing run(s) charged in the privacy ledger without a record run again")
        elif chosen.ended is None:
            race["rounds"] += 1
            say(
                f"[{label}] racing round {race['rounds']}: {runs} more run(s) of "
                f"{len(chosen.configurations)} configuration(s)"
            )
        else:
            say(f"[{label}] racing ended after {race['rounds']} round(s): {chosen.ended}")

    def _reconcile(self) -> dict[str, list[dict[str, Any]]]:
        """Teach each cell's sampler what the results folder holds and it does not know (Tune's saved state
        lags the folder: :mod:`dptune.search.scheduling.reconcile`); returns, per cell, the charged configurations
        with a replicate unrecorded, which this searcher hands out before asking for anything new."""
        context = next(iter(self.contexts.values()))
        started = started_runs(context.results_root, context.search_id)
        trials = read_table(context.results_root, "trials")
        trials = trials[trials["search_id"] == context.search_id]
        unrecorded = {}
        for cell_key, sampler in self.samplers.items():
            found = unknown_configurations(self.contexts[cell_key], sampler, started, trials)
            if found.told:
                self.samplers[cell_key] = sampler.with_told(found.told)
                self.suggested[cell_key] += sum(told.state != "pruned" for told in found.told)
            unrecorded[cell_key] = found.unrecorded
        if count := sum(map(len, unrecorded.values())):
            say(
                f"{count} configuration(s) charged in the privacy ledger after Tune last saved its state run "
                "again, as they were charged"
            )
        return unrecorded

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        unit = self.owner.pop(trial_id, None)
        restarted = self.errored.pop(trial_id, None) is not None  # on --resume, after it errored: told then
        if unit is not None and error and self.racing is not None:
            self.errored[trial_id] = unit  # Tune runs it again on --resume (``restart_errored``)
        if unit is None or restarted or unit.replicates is not None:  # a racing round's tells nothing
            return
        sampler = self.samplers[unit.cell_key]
        if error or not result:
            values: list[float | None] = [None] * len(unit.configurations)
        elif SCORES_KEY in result:
            values = list(result[SCORES_KEY])
        else:  # stopped early by ASHA (one configuration): its last intermediate accuracy
            values = [result.get(self.metric)]
        for params, value in zip(unit.configurations, values, strict=True):
            sampler.tell(params, None if value is None or not math.isfinite(value) else float(value))

    def _dynamic_state(self) -> dict[str, Any]:
        return {
            "samplers": {key: sampler.state() for key, sampler in self.samplers.items()},
            "budgets": self.budgets,
            "suggested": self.suggested,
            "owner": {
                trial_id: [unit.cell_key, unit.configurations, unit.replicates] for trial_id, unit in self.owner.items()
            },
            "turn": self.turn,
            "races": self.races,
            "errored": {
                trial_id: [unit.cell_key, unit.configurations, unit.replicates]
                for trial_id, unit in self.errored.items()
            },
        }

    def _load_dynamic_state(self, state: dict[str, Any]) -> None:
        self.samplers = {key: CellSampler.from_state(value) for key, value in state["samplers"].items()}
        self.budgets, self.suggested, self.turn = state["budgets"], state["suggested"], state["turn"]
        self.races = state.get("races", {})
        self.owner, self.errored = (
            {trial_id: Unit(cell_key, trial_id, *kept) for trial_id, (cell_key, *kept) in units.items()}
            for units in (state["owner"], state.get("errored", {}))
        )
        self.owner.update(self.errored)  # a restored Tuner restarts every unit that errored: its cell waits for it
        self._unrecorded = None

    def save(self, checkpoint_path: str) -> None:
        """One JSON file (Tune renames it into place): plain data only."""
        Path(checkpoint_path).write_text(json.dumps(self._dynamic_state()))

    def restore(self, checkpoint_path: str) -> None:
        self._load_dynamic_state(json.loads(Path(checkpoint_path).read_text()))

    def __getstate__(self) -> dict[str, Any]:
        fixed = {name: value for name, value in self.__dict__.items() if name not in _DYNAMIC_STATE}
        return {**fixed, **self._dynamic_state(), "_contexts": None, "_unrecorded": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        dynamic = {name: state.pop(name) for name in _DYNAMIC_STATE}
        self.__dict__.update(state)
        self._load_dynamic_state(dynamic)


#: The attributes of a :class:`CellMultiplexer` that change as it runs (its JSON checkpoint).
_DYNAMIC_STATE = ("samplers", "budgets", "suggested", "owner", "turn", "races", "errored")


def failed_units(results: Any, contexts: Mapping[str, TrialContext]) -> dict[str, FailedUnits]:
    """The runs of the units of a finished Tune run (its ``ResultGrid``) that ended in error, by cell key,
    with the last line of one of their errors: :func:`dptune.search.finish.outcome.check_every_run_recorded`
    requires their rows."""
    failed: dict[str, tuple[list[str], str]] = {}
    for result in results:
        if result.error is None or UNIT_ID_KEY not in (result.config or {}):  # not a private unit
            continue
        unit = Unit.of(result.config, contexts)
        trials, _ = failed.setdefault(unit.cell_key, ([], ""))
        trials += [spec.trial_id for spec in unit.runs(contexts[unit.cell_key])]
        lines = str(result.error).strip().splitlines()
        failed[unit.cell_key] = (trials, lines[-1] if lines else type(result.error).__name__)
    return {key: FailedUnits(tuple(trials), error) for key, (trials, error) in failed.items()}
