"""The per-cell search (:class:`CellSearch`): random, grid or TPE proposals per (ε, E) cell, with ASHA
optionally; its per-run records, progress and timings are the user's to see, and its ``search`` rows
compose the privacy cost of every run. Ray-free at import."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from dptune.records import runs_root
from dptune.records.lease import hold_lease
from dptune.search.finish import outcome
from dptune.search.finish.publish import publish_search_models, show_models
from dptune.search.finish.statement import statement_of_cells
from dptune.search.modes.common import Proposals, ReleaseChoice
from dptune.search.planning.cells import CellPlan, format_cell_plans, plan_cells_per_cell
from dptune.search.planning.cells import cell_context as plain_cell_context
from dptune.search.runs.execution import TrialContext
from dptune.search.scheduling.tuners import cell_trainable, search_tuner

if TYPE_CHECKING:
    import pandas as pd

    from dptune.data.spec import Workload
    from dptune.privacy.search import CompositionCost
    from dptune.space import LoadedSpace, SearchSpace


class CellSearch:
    """A per-cell search: its records, progress and timings are the user's to see."""

    private = False
    shuts_down_ray = True
    tune_log_level = logging.WARNING
    composing_message = "composing the privacy cost of every trial..."

    def runs_root(self, results_root: str) -> str:
        return runs_root(results_root, self.private)

    def guards(self, runs: str, where: str) -> AbstractContextManager[str]:
        return hold_lease(runs, where)

    def repeatable(self, space: SearchSpace) -> bool:
        return space.sampler.name in ("grid", "random")

    def plan(self, space: SearchSpace, num_train: int, progress: bool = True) -> list[CellPlan]:
        """Every (ε, E) cell and clipping variant, σ calibrated once (``cells.plan_cells_per_cell``)."""
        return plan_cells_per_cell(space, num_train, progress)

    #: The plan as the command prints it (``cells.format_cell_plans``).
    format_plan = staticmethod(format_cell_plans)

    def prepare(self, runs: str, plans: list[CellPlan]) -> list[CellPlan]:
        return plans

    def check_runner(self, fused: bool) -> None:
        return None

    def tuning_rows(self, runs: str, plans: list[CellPlan], workload: Workload) -> str | None:
        return None

    cell_context = staticmethod(plain_cell_context)

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

    def search_rows(
        self,
        loaded: LoadedSpace,
        plans: list[CellPlan],
        search_id: str,
        trials: pd.DataFrame,
        *,
        official_test_split: bool,
        charged: pd.DataFrame | None = None,
    ) -> list[dict[str, Any]]:
        """The composition of the runs, per cell and for the whole search (``outcome.cell_search_rows``)."""
        return outcome.cell_search_rows(
            loaded, plans, search_id, trials, official_test_split=official_test_split, charged=charged
        )

    def guarantee(
        self,
        space: SearchSpace,
        official_test_split: bool,
        cost: CompositionCost | None = None,
        epsilon_selection: float | None = None,
        num_units: int | None = None,
    ) -> str:
        return statement_of_cells(space, official_test_split, cost, num_units)

    def release_choices(
        self, plans: list[CellPlan], search_rows: list[dict[str, Any]], trials: pd.DataFrame
    ) -> list[ReleaseChoice]:
        return []  # each cell's best model is published (``publish``); nothing is released

    def release_rows(
        self, space: SearchSpace, choices: list[ReleaseChoice], *, official_test_split: bool
    ) -> list[dict[str, Any]]:
        return []

    def publish(
        self,
        space: SearchSpace,
        results_root: str,
        runs: str,
        search_rows: list[dict[str, Any]],
        releases: list[tuple[dict[str, Any], pd.Series]],
    ) -> list[str]:
        """The best model of each cell and clipping rule (``publish.publish_search_models``)."""
        adaptive = space.sampler.name == "tpe" or space.scheduler is not None or space.racing is not None
        return show_models(results_root, publish_search_models(results_root, runs, search_rows, adaptive=adaptive))
