"""One cell's sampler: an Optuna study driven through its public ask/tell, with min-step pruning.

Ray-free (Optuna only): :mod:`dptune.search.scheduling.tune_adapters` wraps one :class:`CellSampler` per cell for
Ray Tune, and benchmarks drive it directly. A proposal whose batch size B gives fewer than T_min
steps is never returned: it is handed to ``on_pruned`` (the search records it, no compute) and
told to Optuna as pruned, which TPE ranks below every completed trial, so it stops proposing it.

Its state is plain data (:meth:`CellSampler.state`, JSON): the specification and every
configuration told so far with its value. :meth:`CellSampler.from_state` rebuilds the study from
it (``study.add_trial``), so a resumed search continues every cell without unpickling code.
Configurations asked but not told at a checkpoint stay pending: Ray Tune re-runs their unit on
resume and the result is told then. A restored study holds them as running trials, its generator
is re-seeded past every ask (told and pending), and no configuration is proposed twice (pending,
told or pruned before): every configuration is asked once, across any number of resumes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

from dptune.contract import SamplerName
from dptune.errors import DptuneError
from dptune.records.ids import params_key

#: Proposals in a row that may all be pruned before the sampler gives up (a space whose feasible
#: batch sizes the sampler never proposes).
MAX_PRUNED_PROPOSALS = 1000
#: Proposals in a row that may all repeat a configuration asked before until the cell is taken to be
#: exhausted (a categorical space smaller than its budget): :meth:`CellSampler.ask` then returns fewer.
MAX_REPEATED_PROPOSALS = 200


class SamplerExhausted(DptuneError, RuntimeError):
    """The sampler proposed only pruned batch sizes ``MAX_PRUNED_PROPOSALS`` times in a row."""


@dataclass(frozen=True)
class CellSpec:
    """What a cell's sampler searches, as plain data.

    ``ranges`` maps a hyperparameter to ``{"values": [...]}`` (categorical) or ``{"low", "high",
    "log"}`` (continuous); ``batch_sizes`` are the B values offered (feasible and, except for a
    grid, pruned ones, so the pruning is learned), ``feasible_batch_sizes`` those with T ≥ T_min.
    ``seed`` is public (from the space's seed and the ``cell_key``): it drives proposals, never noise.
    ``None``: proposals come from fresh OS entropy, drawn anew by every sampler built (also on a
    resume) and stored nowhere; an end-to-end private search needs that, since a public sequence
    of proposals would let its released configuration reveal its position among the secret
    number of runs. A grid's order is then secret too.
    """

    sampler: SamplerName
    seed: int | None
    batch_sizes: tuple[int, ...]
    feasible_batch_sizes: tuple[int, ...]
    ranges: dict[str, dict[str, Any]]
    startup_trials: int = 8

    def distributions(self) -> dict[str, BaseDistribution]:
        """Optuna's distributions of the cell's hyperparameters."""
        distributions: dict[str, BaseDistribution] = {"batch_size": CategoricalDistribution(list(self.batch_sizes))}
        for name, spec in self.ranges.items():
            if "values" in spec:
                distributions[name] = CategoricalDistribution(list(spec["values"]))
            else:
                distributions[name] = FloatDistribution(spec["low"], spec["high"], log=spec["log"])
        return distributions

    def grid(self) -> dict[str, list[float]]:
        """The grid of a ``grid`` sampler (every hyperparameter categorical)."""
        listed = {name: list(spec["values"]) for name, spec in self.ranges.items()}
        return {"batch_size": list(self.batch_sizes), **listed}


#: How a told configuration ended, as stored in the sampler's state.
_STATES = MappingProxyType({"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED, "fail": TrialState.FAIL})


class Told(NamedTuple):
    """A configuration the study was told: its ``value`` (None when it failed or was pruned) and
    how it ended, ``state``: ``complete``, ``pruned`` or ``fail`` (a JSON list in the state)."""

    params: dict[str, Any]
    value: float | None
    state: str


@dataclass
class CellSampler:
    """Asks a cell's Optuna study for configurations, in batches, and tells it their values.

    ``told`` holds a :class:`Told` for every configuration finished so far; ``pending`` the
    configurations asked and not told.
    A grid is enqueued point by point (``study.enqueue_trial``) in an order drawn from the seed,
    skipping points told or pending, so it runs every point exactly once, also across a resume.
    """

    spec: CellSpec
    told: list[Told] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    study: optuna.Study = field(init=False, repr=False)
    _numbers: dict[str, list[int]] = field(init=False, repr=False)
    _grid_left: int = field(init=False, repr=False, default=0)  # grid points enqueued and not yet asked

    def __post_init__(self) -> None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        asks = len(self.told) + len(self.pending)
        self.study = optuna.create_study(direction="maximize", sampler=self._sampler(asks))
        self._numbers = {}
        distributions = self.spec.distributions()
        for params, value, state in self.told:
            self.study.add_trial(
                optuna.trial.create_trial(params=params, distributions=distributions, value=value, state=_STATES[state])
            )
        for params in self.pending:  # asked before a resume, their unit runs again: running trials
            self._running(params)
        if self.spec.sampler == "grid":
            done = self.asked()
            points = [
                dict(zip(self.spec.grid(), values, strict=True))
                for values in itertools.product(*self.spec.grid().values())
            ]
            for index in np.random.default_rng(self.spec.seed).permutation(len(points)):
                if params_key(points[index]) not in done:
                    self.study.enqueue_trial(points[index])
            self._grid_left = len(self.study.get_trials(states=(TrialState.WAITING,)))

    def _running(self, params: dict[str, Any]) -> None:
        """Add ``params`` to the study as a running trial, told later by :meth:`tell`."""
        self.study.add_trial(
            optuna.trial.create_trial(params=params, distributions=self.spec.distributions(), state=TrialState.RUNNING)
        )
        self._numbers.setdefault(params_key(params), []).append(len(self.study.trials) - 1)

    def asked(self) -> set[str]:
        """The :func:`params_key` of every configuration asked so far (told, pruned or pending)."""
        return {params_key(params) for params, _, _ in self.told} | {params_key(params) for params in self.pending}

    def hold(self, params: dict[str, Any]) -> None:
        """Take ``params``, asked by an earlier sampler of this cell that this one does not know (its runs
        were charged), as pending: it is told like a configuration this sampler asked, and never asked again."""
        self._running(params)
        self.pending.append(params)

    def with_told(self, told: list[Told]) -> CellSampler:
        """This sampler rebuilt as if it had also been told ``told`` (configurations an earlier sampler of
        this cell asked and whose runs are recorded): never asked again, and its model learns from them."""
        state = self.state()
        return CellSampler.from_state({**state, "told": [*state["told"], *(list(entry) for entry in told)]})

    def _sampler(self, asks: int) -> optuna.samplers.BaseSampler:
        # Re-seeded from the public seed and the number of configurations asked (told or pending), so
        # a restored sampler continues deterministically without pickling its generator and never
        # replays the proposals of the asks before it (those stay pending); a secret one (seed
        # None) draws its whole state from OS entropy (numpy's RandomState from a fresh
        # SeedSequence). A grid is enqueued, so its sampler never proposes.
        seed = None if self.spec.seed is None else self.spec.seed + asks
        if self.spec.sampler == "tpe":
            # constant_liar: configurations asked together in one batch are spread out, not repeated
            return optuna.samplers.TPESampler(seed=seed, n_startup_trials=self.spec.startup_trials, constant_liar=True)
        return optuna.samplers.RandomSampler(seed=seed)

    def ask(self, count: int, on_pruned: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
        """Up to ``count`` configurations with a feasible B, none asked before (fewer when a grid, or a
        categorical space, runs out).

        Each infeasible proposal is passed to ``on_pruned`` and told to the study as pruned; one that
        repeats a configuration asked before (told, pending or pruned) is told as failed, which TPE
        ignores, and proposed again.
        """
        distributions = self.spec.distributions()
        asked: list[dict[str, Any]] = []
        seen = self.asked()
        pruned_in_a_row = repeated_in_a_row = 0
        while len(asked) < count and repeated_in_a_row < MAX_REPEATED_PROPOSALS:
            if self.spec.sampler == "grid":
                if not self._grid_left:
                    break
                self._grid_left -= 1
            trial = self.study.ask(distributions)
            params = dict(trial.params)
            if params_key(params) in seen:
                self.study.tell(trial, state=TrialState.FAIL)
                repeated_in_a_row += 1
                continue
            repeated_in_a_row = 0
            seen.add(params_key(params))
            if int(params["batch_size"]) not in self.spec.feasible_batch_sizes:
                self.study.tell(trial, state=TrialState.PRUNED)
                self.told.append(Told(params, None, "pruned"))
                on_pruned(params)
                pruned_in_a_row += 1
                if pruned_in_a_row >= MAX_PRUNED_PROPOSALS:
                    raise SamplerExhausted(f"the sampler proposed only pruned batch sizes {pruned_in_a_row} times")
                continue
            pruned_in_a_row = 0
            self._numbers.setdefault(params_key(params), []).append(trial.number)
            self.pending.append(params)
            asked.append(params)
        return asked

    def tell(self, params: dict[str, Any], value: float | None) -> None:
        """Tell the study a configuration's value (``None``: it failed) — also one asked before a
        resume, which the live study does not know."""
        key = params_key(params)
        state = "complete" if value is not None else "fail"
        numbers = self._numbers.get(key)
        if numbers:
            self.study.tell(numbers.pop(0), value, state=_STATES[state])
        else:
            self.study.add_trial(
                optuna.trial.create_trial(
                    params=params, distributions=self.spec.distributions(), value=value, state=_STATES[state]
                )
            )
        waiting = [params_key(p) for p in self.pending]
        if key in waiting:
            del self.pending[waiting.index(key)]
        self.told.append(Told(params, value, state))

    def state(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable) from which :meth:`from_state` rebuilds this sampler."""
        return {
            "spec": {
                **asdict(self.spec),
                "batch_sizes": list(self.spec.batch_sizes),
                "feasible_batch_sizes": list(self.spec.feasible_batch_sizes),
            },
            "told": [list(entry) for entry in self.told],
            "pending": list(self.pending),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> CellSampler:
        spec = dict(state["spec"])
        spec["batch_sizes"] = tuple(spec["batch_sizes"])
        spec["feasible_batch_sizes"] = tuple(spec["feasible_batch_sizes"])
        return cls(CellSpec(**spec), [Told(*entry) for entry in state["told"]], list(state["pending"]))
