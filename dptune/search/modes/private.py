"""End-to-end private selection (:class:`PrivateSelection`, Papernot–Steinke, ``privacy.private_selection``):
a secret random number of runs K per cell, every per-run record inside ``<results>/inside_trust_boundary/``,
Tune's units carrying public numbers only (:mod:`dptune.search.runs.private_units`); only the run with the
best noisy validation score is released. Ray-free at import."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from dptune._thirdparty import without_raylet_messages
from dptune.errors import SearchIncomplete
from dptune.paths import write_file_atomic
from dptune.records import TRUST_BOUNDARY_README, owner_only, runs_root
from dptune.records.lease import hold_lease
from dptune.search.finish.outcome import (
    release_choices,
    release_rows,
    selected_run,
    selection_search_row,
)
from dptune.search.finish.publish import publish_release_models, show_models
from dptune.search.finish.statement import statement_of_private_selection
from dptune.search.modes.common import Proposals, ReleaseChoice
from dptune.search.planning.cells import (
    CellPlan,
    cell_spec,
    format_private_plan,
    kept_trial_counts,
    plan_private_cell,
    private_chunk_size,
)
from dptune.search.planning.cells import cell_context as plain_cell_context
from dptune.search.planning.sampler import CellSampler
from dptune.search.runs.execution import TrialContext, record_pruned
from dptune.search.runs.private_units import kept_proposals, unrecorded_runs
from dptune.search.scheduling.embedded_ray import private_ray_folder
from dptune.search.scheduling.tuners import private_trainable, private_tuner

if TYPE_CHECKING:
    import pandas as pd

    from dptune.data.spec import Workload
    from dptune.privacy.search import CompositionCost
    from dptune.space import LoadedSpace, SearchSpace

#: What a private search on a cluster prints: what of K the cluster's own views still show.
CLUSTER_TIMING_NOTE = (
    "note: every unit loads the workload and starts the same Ray actors and tasks whatever the secret number "
    "of runs K, but the units' durations (the dashboard, `ray list tasks --detail`), their memory beyond the "
    "workload and the job's wall time grow with K: the cluster's dashboard, state API and nodes are inside "
    "your trust boundary, or K's order of magnitude is public (docs/PRIVACY.md)"
)


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

    def plan(self, space: SearchSpace, num_train: int, progress: bool = True) -> list[CellPlan]:
        """The one cell, its per-trial ε from the total budget (``cells.plan_private_cell``)."""
        return [plan_private_cell(space, num_train)]

    #: The plan as the command prints it (``cells.format_private_plan``).
    format_plan = staticmethod(format_private_plan)

    def prepare(self, runs: str, plans: list[CellPlan]) -> list[CellPlan]:
        """K once per search, inside the trust boundary (its README written, the folder owner-only)."""
        write_file_atomic(runs, "README.txt", TRUST_BOUNDARY_README.encode())
        if "://" not in runs:  # made before this search was private-only, or by an older dptune
            os.chmod(runs, 0o700)
        return kept_trial_counts(runs, plans)

    def check_runner(self, fused: bool) -> None:
        return None

    def tuning_rows(self, runs: str, plans: list[CellPlan], workload: Workload) -> str | None:
        return None

    cell_context = staticmethod(plain_cell_context)

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
        """Per cell run, the bound it meets and the guarantee; nothing that counts its runs."""
        rows = []
        for plan in plans:
            epsilon_selection = plan.epsilon_selection
            assert epsilon_selection is not None, "a private cell's plan carries its total ε"
            statement = self.guarantee(loaded.space, official_test_split, None, epsilon_selection, plan.num_train)
            rows.append(selection_search_row(loaded, plan, search_id, epsilon_selection, statement))
        return rows

    def guarantee(
        self,
        space: SearchSpace,
        official_test_split: bool,
        cost: CompositionCost | None = None,
        epsilon_selection: float | None = None,
        num_units: int | None = None,
    ) -> str:
        return statement_of_private_selection(space, official_test_split, epsilon_selection, num_units)

    #: The run a cell releases: the best noisy validation score (``outcome.selected_run``).
    choose = staticmethod(selected_run)

    def release_choices(
        self, plans: list[CellPlan], search_rows: list[dict[str, Any]], trials: pd.DataFrame
    ) -> list[ReleaseChoice]:
        return release_choices(plans, search_rows, trials, self.choose)

    def release_rows(
        self, space: SearchSpace, choices: list[ReleaseChoice], *, official_test_split: bool
    ) -> list[dict[str, Any]]:
        return release_rows(space, choices, official_test_split=official_test_split)

    def publish(
        self,
        space: SearchSpace,
        results_root: str,
        runs: str,
        search_rows: list[dict[str, Any]],
        releases: list[tuple[dict[str, Any], pd.Series]],
    ) -> list[str]:
        """The released model of each cell (``publish.publish_release_models``)."""
        return show_models(results_root, publish_release_models(results_root, runs, releases))


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
