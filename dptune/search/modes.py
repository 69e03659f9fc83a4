"""The three shapes of a search, each one :class:`SearchMode`: what differs between them, so the driver
(:mod:`dptune.search.driver`) asks its mode and never branches on the shape.

- :class:`CellSearch`: a per-cell search (random, grid or TPE, with ASHA optionally); its per-run records,
  progress and timings are the user's to see.
- :class:`PrivateSelection`: end-to-end private selection (Papernot–Steinke, ``privacy.private_selection``):
  a secret random number of runs K per cell, every per-run record inside ``<results>/inside_trust_boundary/``,
  Tune's units carrying public numbers only (:mod:`dptune.search.runs.private_units`).
- :class:`SubsampleTuning`: private selection tuned on a secret subsample (Koskela–Kulkarni,
  ``private_selection.tuning_subsample``), then a release trained on every row with the tuned configuration.

Ray-free at import: Ray Tune is imported inside the methods that build a Tune run.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from dptune._thirdparty import without_raylet_messages
from dptune.errors import SearchError, SearchIncomplete
from dptune.paths import write_file_atomic
from dptune.records import TRUST_BOUNDARY_README, owner_only, read_table, runs_root
from dptune.records.lease import hold_lease
from dptune.search.planning.cells import CellPlan, cell_spec, kept_trial_counts, private_chunk_size
from dptune.search.planning.sampler import CellSampler
from dptune.search.planning.subsample import RELEASE_PARAMETERS, draw_tuning_rows, kept_release_choice, release_context
from dptune.search.runs.execution import TrialContext, record_pruned
from dptune.search.runs.private_units import kept_proposals, unrecorded_runs
from dptune.search.scheduling.embedded_ray import private_ray_folder
from dptune.search.scheduling.tune_run import TunedShape
from dptune.search.scheduling.tuners import cell_trainable, private_trainable, private_tuner, search_tuner

if TYPE_CHECKING:
    from dptune.space import SearchSpace

#: Each cell's proposals, drawn once before any run (a private search's; a search draws as it goes: None).
Proposals = Mapping[str, list[dict[str, Any]]] | None

#: What a private search on a cluster prints: what of K the cluster's own views still show.
CLUSTER_TIMING_NOTE = (
    "note: every unit loads the workload and starts the same Ray actors and tasks whatever the secret number "
    "of runs K, but the units' durations (the dashboard, `ray list tasks --detail`), their memory beyond the "
    "workload and the job's wall time grow with K: the cluster's dashboard, state API and nodes are inside "
    "your trust boundary, or K's order of magnitude is public (docs/PRIVACY.md)"
)


class SearchMode(TunedShape, Protocol):
    """What differs between the shapes of a search, asked by the driver at each phase.

    ``private``: the per-run records, K and the runs' progress stay inside the trust boundary (and Ray
    logs critical errors only: ``ray_session.init_ray(private=...)``); ``shuts_down_ray``: an embedded Ray is
    shut down before composing; ``composing_message``: the line before the search's outcome is composed.

    User-level privacy (issue 52) is an axis across these modes, not a fourth mode: the privacy unit (an
    example, or a user's examples) is a property of the plan's mechanism (``cells.CellPlan``), which every
    mode runs and accounts alike.
    """

    private: bool
    shuts_down_ray: bool
    composing_message: str

    def runs_root(self, results_root: str) -> str:
        """Where the per-run records and Tune's state go (``records.runs_root``)."""
        ...

    def guards(self, runs: str, where: str) -> AbstractContextManager[str]:
        """Around the whole search (not ``--dry-run``): the lease on ``runs`` (yields its token) and what
        the shape keeps around it."""
        ...

    def repeatable(self, space: SearchSpace) -> bool:
        """Whether a Tune state cut short may be set aside on ``--resume`` (the proposals repeat)."""
        ...

    def prepare(self, runs: str, plans: list[CellPlan]) -> list[CellPlan]:
        """Before anything trains (not ``--dry-run``): the plans to run (a private search's kept K)."""
        ...

    def check_runner(self, fused: bool) -> None:
        """Refuse a runner the shape cannot use (``fused``: the fused runner runs the search)."""
        ...

    def tuning_rows(self, runs: str, plans: list[CellPlan], num_train: int, num_val: int) -> str | None:
        """The secret tuning rows, drawn once per search (None: the runs train on every row)."""
        ...

    def announce(self, space: SearchSpace, plans: list[CellPlan], runs: str, runner: str, cluster: bool) -> None:
        """The line(s) printed before the runs start."""
        ...

    def propose(self, space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext]) -> Proposals:
        """Each cell's proposals drawn before any run, or None (the searcher asks as the search goes)."""
        ...

    def check_complete(self, contexts: list[TrialContext], proposals: Proposals) -> None:
        """After the Tune run: raise ``SearchIncomplete`` when a planned run has no record yet."""
        ...

    def after_units(self, space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext]) -> None:
        """What runs once every unit is recorded (a subsample tuning's releases)."""
        ...

    def finished_line(self, seconds: float) -> str:
        """The line that says the runs are over (``seconds``: their wall time)."""
        ...


class CellSearch:
    """A per-cell search: its records, progress and timings are the user's to see."""

    private = False
    shuts_down_ray = True
    tune_log_level = logging.WARNING
    composing_message = "composing the privacy cost of every trial (PLD accountant)..."

    def runs_root(self, results_root: str) -> str:
        return runs_root(results_root, self.private)

    def guards(self, runs: str, where: str) -> AbstractContextManager[str]:
        return hold_lease(runs, where)

    def repeatable(self, space: SearchSpace) -> bool:
        return space.sampler.name in ("grid", "random")

    def prepare(self, runs: str, plans: list[CellPlan]) -> list[CellPlan]:
        return plans

    def check_runner(self, fused: bool) -> None:
        return None

    def tuning_rows(self, runs: str, plans: list[CellPlan], num_train: int, num_val: int) -> str | None:
        return None

    def announce(self, space: SearchSpace, plans: list[CellPlan], runs: str, runner: str, cluster: bool) -> None:
        replicates = f" × {space.replicates} replicates" if space.replicates > 1 else ""
        print(
            f"running {sum(plan.configurations for plan in plans)} configurations{replicates} in {len(plans)} "
            f"cell runs side by side ({runner})",
            flush=True,
        )

    def propose(self, space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext]) -> Proposals:
        return None

    def trainable(self, space: SearchSpace, contexts: dict[str, TrialContext], fused: bool) -> Any:
        return cell_trainable(contexts)

    tuner = staticmethod(search_tuner)

    def check_complete(self, contexts: list[TrialContext], proposals: Proposals) -> None:
        return None

    def after_units(self, space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext]) -> None:
        return None

    def finished_line(self, seconds: float) -> str:
        return f"\nsearch finished in {seconds:.0f} s"


class PrivateSelection:
    """End-to-end private selection: K, the proposals, the runs' progress and the search's duration stay
    inside the trust boundary; Tune's units carry public numbers only."""

    private = True
    shuts_down_ray = False  # private_ray_folder shuts it down on the way out
    tune_log_level = logging.CRITICAL  # Tune's warnings carry a time
    composing_message = "selecting the release by its noisy validation score..."

    def runs_root(self, results_root: str) -> str:
        return runs_root(results_root, self.private)

    @contextlib.contextmanager
    def guards(self, runs: str, where: str) -> Iterator[str]:
        # everything created owner-only; its lease (whose times bracket the search), Ray's session folder
        # and Tune's lock files stay inside; a dead unit: dptune's own line, not the raylet's
        with owner_only(), hold_lease(runs, where) as token, private_ray_folder(), without_raylet_messages():
            yield token

    def repeatable(self, space: SearchSpace) -> bool:
        return False

    def prepare(self, runs: str, plans: list[CellPlan]) -> list[CellPlan]:
        """K once per search, inside the trust boundary (its README written, the folder owner-only)."""
        write_file_atomic(runs, "README.txt", TRUST_BOUNDARY_README.encode())
        if "://" not in runs:  # made before this search was private-only, or by an older dptune
            os.chmod(runs, 0o700)
        return kept_trial_counts(runs, plans)

    def check_runner(self, fused: bool) -> None:
        return None

    def tuning_rows(self, runs: str, plans: list[CellPlan], num_train: int, num_val: int) -> str | None:
        return None

    def announce(self, space: SearchSpace, plans: list[CellPlan], runs: str, runner: str, cluster: bool) -> None:
        print(
            f"running the private search ({runner}); no per-run progress is shown: it would reveal the "
            f"secret number of runs (per-run records: {runs})",
            flush=True,
        )
        if cluster:
            print(CLUSTER_TIMING_NOTE, flush=True)

    def propose(self, space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext]) -> Proposals:
        """Every proposal of every cell, drawn once from its secret sampler, kept inside the boundary."""
        runs = contexts[0].results_root
        by_key = {plan.cell_key: plan for plan in plans}
        return kept_proposals(runs, [plan.cell_key for plan in plans], partial(_propose, space, by_key, contexts))

    def trainable(self, space: SearchSpace, contexts: dict[str, TrialContext], fused: bool) -> Any:
        return private_trainable(contexts, private_chunk_size(space, fused))

    tuner = staticmethod(private_tuner)

    def check_complete(self, contexts: list[TrialContext], proposals: Proposals) -> None:
        assert proposals is not None
        if any(unrecorded_runs(context, proposals[context.cell_key]) for context in contexts):
            raise SearchIncomplete(
                "the private search stopped before every planned run was recorded; nothing is released. Run the "
                "same command with --resume to run the rest (what finished is kept, and every training that took a "
                "step stays charged in the privacy ledger)"
            )

    def after_units(self, space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext]) -> None:
        return None

    def finished_line(self, seconds: float) -> str:
        return "\nsearch finished"


class SubsampleTuning(PrivateSelection):
    """Private selection tuned on a secret subsample, then a release trained on every row."""

    def check_runner(self, fused: bool) -> None:
        if not fused:
            raise SearchError(
                "privacy.private_selection.tuning_subsample: the tuning runs take q and T from public numbers, "
                "which only the fused runner does (peft 'head', training.runner auto or fused, no scheduler)"
            )

    def tuning_rows(self, runs: str, plans: list[CellPlan], num_train: int, num_val: int) -> str | None:
        """X₁, once per search, inside the trust boundary."""
        tuning = plans[0].tuning
        assert tuning is not None
        return draw_tuning_rows(runs, num_train, num_val, tuning.fraction)

    def after_units(self, space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext]) -> None:
        train_releases(space, plans, contexts)


def mode_of(space: SearchSpace) -> SearchMode:
    """The shape of the search ``space`` describes."""
    selection = space.privacy.private_selection
    if selection is None:
        return CellSearch()
    return PrivateSelection() if selection.tuning_subsample is None else SubsampleTuning()


def _propose(
    space: SearchSpace, plans: dict[str, CellPlan], contexts: list[TrialContext], cell_key: str
) -> list[dict[str, Any]]:
    """Cell ``cell_key``'s K proposals from its secret sampler (fresh OS entropy); proposals of a B the
    min-step rule removes are recorded inside the boundary (no compute) and drawn again."""
    plan = plans[cell_key]
    (context,) = [c for c in contexts if c.cell_key == cell_key]
    sampler = CellSampler(cell_spec(space, plan))
    return sampler.ask(
        plan.configurations, partial(record_pruned, context, num_train=plan.num_train, min_steps=space.min_steps)
    )


def train_releases(space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext]) -> None:
    """Tuning on a subsample: per cell, the configuration its tuning chose (the best noisy validation
    score, ``privacy.search.select_release``, kept inside the trust boundary before anything trains:
    ``subsample.kept_release_choice``) trains once on every training row, as one Ray task through
    ``private_units.run_release`` (charged in the privacy ledger before its first step, recorded,
    skipped when a resume finds it recorded; it returns nothing). Nothing is trained for a cell none of
    whose runs finished."""
    from dptune.search.runs.private_units import run_release
    from dptune.search.scheduling.ray_session import run_as_task

    for plan, context in zip(plans, contexts, strict=True):
        assert plan.tuning is not None
        params = kept_release_choice(context.results_root, plan.cell_key, partial(_chosen, context, plan))
        if params is None:
            continue
        print("training the release on every training row with the tuned configuration...", flush=True)
        run_as_task(space, run_release, release_context(context, plan.tuning), params)


def _chosen(context: TrialContext, plan: CellPlan) -> dict[str, float] | None:
    """The sampled configuration of cell ``plan``'s run with the best noisy validation score (None: no run finished)."""
    from dptune.privacy.search import select_release

    trials = read_table(context.results_root, "trials")
    mine = trials[(trials["search_id"] == context.search_id) & (trials["cell_id"] == plan.cell.cell_id)]
    chosen = select_release(mine, runs=plan.configurations)
    return None if chosen is None else {name: float(chosen[name]) for name in RELEASE_PARAMETERS}
