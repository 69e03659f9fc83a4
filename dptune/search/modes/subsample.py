"""Private selection tuned on a secret subsample (:class:`SubsampleTuning`, Koskela–Kulkarni,
``private_selection.tuning_subsample``): the runs tune on X₁, then the configuration they chose trains
once on every row, and that model is the release. Ray-free at import."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from dptune.errors import SearchError
from dptune.records import read_table
from dptune.search.finish.outcome import subsample_release, subsample_release_rows
from dptune.search.finish.statement import statement_of_subsample_tuning
from dptune.search.modes.common import ReleaseChoice
from dptune.search.modes.private import PrivateSelection
from dptune.search.planning.cells import CellPlan, format_subsample_plan, plan_subsample_cell, tuning_cell_context
from dptune.search.planning.subsample import RELEASE_PARAMETERS, draw_tuning_rows, kept_release_choice, release_context
from dptune.search.runs.execution import TrialContext

if TYPE_CHECKING:
    from dptune.data.spec import Workload
    from dptune.privacy.search import CompositionCost
    from dptune.space import SearchSpace


class SubsampleTuning(PrivateSelection):
    """Private selection tuned on a secret subsample, then a release trained on every row."""

    def plan(self, space: SearchSpace, num_train: int, progress: bool = True) -> list[CellPlan]:
        """The one cell and its tuning plan (``cells.plan_subsample_cell``)."""
        return [plan_subsample_cell(space, num_train)]

    #: The plan as the command prints it (``cells.format_subsample_plan``).
    format_plan = staticmethod(format_subsample_plan)

    def check_runner(self, fused: bool) -> None:
        if not fused:
            raise SearchError(
                "privacy.private_selection.tuning_subsample: the tuning runs take q and T from public numbers, "
                "which only the fused runner does (peft 'head', training.runner auto or fused, no scheduler)"
            )

    def tuning_rows(self, runs: str, plans: list[CellPlan], workload: Workload) -> str | None:
        """X₁, once per search, inside the trust boundary."""
        return draw_tuning_rows(runs, workload, plans[0].tuning_plan.fraction)

    #: The tuning runs train on X₁ on their public schedules (``cells.tuning_cell_context``).
    cell_context = staticmethod(tuning_cell_context)

    def after_units(self, space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext]) -> None:
        train_releases(space, plans, contexts)

    def guarantee(
        self,
        space: SearchSpace,
        official_test_split: bool,
        cost: CompositionCost | None = None,
        epsilon_selection: float | None = None,
        num_units: int | None = None,
    ) -> str:
        return statement_of_subsample_tuning(space, official_test_split, epsilon_selection, num_units)

    #: The run a cell releases: its release run (``outcome.subsample_release``).
    choose = staticmethod(subsample_release)

    def release_rows(
        self, space: SearchSpace, choices: list[ReleaseChoice], *, official_test_split: bool
    ) -> list[dict[str, Any]]:
        return subsample_release_rows(space, choices, official_test_split=official_test_split)


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
        params = kept_release_choice(context.results_root, plan.cell_key, partial(_chosen, context, plan))
        if params is None:
            continue
        print("training the release on every training row with the tuned configuration...", flush=True)
        run_as_task(space, run_release, release_context(context, plan.tuning_plan), params)


def _chosen(context: TrialContext, plan: CellPlan) -> dict[str, float] | None:
    """The sampled configuration of cell ``plan``'s run with the best noisy validation score (None: no run finished)."""
    from dptune.privacy.search import select_release

    trials = read_table(context.results_root, "trials")
    mine = trials[(trials["search_id"] == context.search_id) & (trials["cell_id"] == plan.cell.cell_id)]
    chosen = select_release(mine, runs=plan.configurations)
    return None if chosen is None else {name: float(chosen[name]) for name in RELEASE_PARAMETERS}
