"""The three shapes of a search, each one :class:`SearchMode` in a module of its own: what differs between
them (the plan, the Tune units, the records, the release and the privacy statement), so the driver
(:mod:`dptune.search.driver`) asks its mode and never branches on the shape.

- :class:`CellSearch` (:mod:`~dptune.search.modes.cells`): a per-cell search (random, grid or TPE, with
  ASHA optionally); its per-run records, progress and timings are the user's to see.
- :class:`PrivateSelection` (:mod:`~dptune.search.modes.private`): end-to-end private selection
  (Papernot–Steinke, ``privacy.private_selection``): a secret random number of runs K per cell, every
  per-run record inside ``<results>/inside_trust_boundary/``, Tune's units carrying public numbers only
  (:mod:`dptune.search.runs.private_units`).
- :class:`SubsampleTuning` (:mod:`~dptune.search.modes.subsample`): private selection tuned on a secret
  subsample (Koskela–Kulkarni, ``private_selection.tuning_subsample``), then a release trained on every
  row with the tuned configuration.

A mode composes per-shape pieces of the parts below it, none of which asks which shape it serves: the
planners (``planning.cells.plan_cells_per_cell``, ``plan_private_cell``, ``plan_subsample_cell``), the
``search`` and ``release`` rows (``finish.outcome``), the statements (``finish.statement``) and the
publishers (``finish.publish``). :func:`mode_of` is the one place the shape is read from the space.

Ray-free at import: Ray Tune is imported inside the methods that build a Tune run.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from dptune.search.modes.cells import CellSearch
from dptune.search.modes.common import Proposals, ReleaseChoice
from dptune.search.modes.private import CLUSTER_TIMING_NOTE, PrivateSelection
from dptune.search.modes.subsample import SubsampleTuning
from dptune.search.scheduling.tune_run import TunedShape

if TYPE_CHECKING:
    import pandas as pd

    from dptune.data.spec import Workload
    from dptune.privacy.search import CompositionCost
    from dptune.search.planning.cells import CellPlan
    from dptune.search.runs.execution import TrialContext
    from dptune.space import LoadedSpace, SearchSpace

__all__ = (
    "CLUSTER_TIMING_NOTE",
    "CellSearch",
    "PrivateSelection",
    "Proposals",
    "ReleaseChoice",
    "SearchMode",
    "SubsampleTuning",
    "mode_of",
)


class SearchMode(TunedShape, Protocol):
    """What differs between the shapes of a search, asked by the driver at each phase.

    ``private``: the per-run records, K and the runs' progress stay inside the trust boundary (and Ray
    logs critical errors only: ``ray_session.init_ray(private=...)``); ``shuts_down_ray``: an embedded Ray is
    shut down before composing; ``composing_message``: the line before the search's outcome is composed.
    The plan comes from :meth:`plan` (printed by :meth:`format_plan`); a finished search's outcome from
    :meth:`search_rows` (quoting :meth:`guarantee`), then :meth:`release_choices`, :meth:`release_rows`
    and :meth:`publish`, in that order.

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

    def plan(self, space: SearchSpace, num_train: int, progress: bool = True) -> list[CellPlan]:
        """The search's cell plans for ``num_train`` training rows: every mechanism calibrated once, and
        a private search's one cell with its per-trial ε from the total budget (``progress``: show the
        calibration's progress)."""
        ...

    def format_plan(self, loaded: LoadedSpace, plans: list[CellPlan]) -> str:
        """What the search will run, readable (printed before it runs, and by ``--dry-run``)."""
        ...

    def prepare(self, runs: str, plans: list[CellPlan]) -> list[CellPlan]:
        """Before anything trains (not ``--dry-run``): the plans to run (a private search's kept K)."""
        ...

    def check_runner(self, fused: bool) -> None:
        """Refuse a runner the shape cannot use (``fused``: the fused runner runs the search)."""
        ...

    def tuning_rows(self, runs: str, plans: list[CellPlan], workload: Workload) -> str | None:
        """The secret tuning rows of ``workload``, drawn once per search (None: the runs train on every row)."""
        ...

    def cell_context(
        self,
        space: SearchSpace,
        plan: CellPlan,
        max_train_examples: int | None,
        max_eval_examples: int | None,
        runs: str,
        search_id: str,
        fused: bool,
        tuning_rows: str | None,
        lease_token: str | None,
    ) -> TrialContext:
        """What every run of cell ``plan`` shares (``planning.cells.cell_context``; a subsample tuning's
        runs on the tuning rows and their public schedules)."""
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
        """One ``search`` row per cell run of ``plans`` with the privacy cost of the search and its
        guarantee (``trials``: the ``trials`` table; ``charged``: what the privacy ledger charges;
        ``official_test_split``: whether the dataset ships its test split)."""
        ...

    def guarantee(
        self,
        space: SearchSpace,
        official_test_split: bool,
        cost: CompositionCost | None = None,
        epsilon_selection: float | None = None,
        num_units: int | None = None,
    ) -> str:
        """What the search's (ε, δ) covers, in words (``finish.statement``): ``cost``, a per-cell search's
        composition; ``epsilon_selection``, an end-to-end private search's bound; ``num_units``, N (people or rows)."""
        ...

    def release_choices(
        self, plans: list[CellPlan], search_rows: list[dict[str, Any]], trials: pd.DataFrame
    ) -> list[ReleaseChoice]:
        """Per cell run that releases a run: (its plan, its ``search`` row, the run); chosen once."""
        ...

    def release_rows(
        self, space: SearchSpace, choices: list[ReleaseChoice], *, official_test_split: bool
    ) -> list[dict[str, Any]]:
        """The ``release`` rows of ``choices`` (none for a per-cell search)."""
        ...

    def publish(
        self,
        space: SearchSpace,
        results_root: str,
        runs: str,
        search_rows: list[dict[str, Any]],
        releases: list[tuple[dict[str, Any], pd.Series]],
    ) -> list[str]:
        """Publish the search's models under ``<results>/models/`` and say where; returns their folders
        (``releases``: the ``release`` rows with the runs they release)."""
        ...


def mode_of(space: SearchSpace) -> SearchMode:
    """The shape of the search ``space`` describes."""
    selection = space.privacy.private_selection
    if selection is None:
        return CellSearch()
    return PrivateSelection() if selection.tuning_subsample is None else SubsampleTuning()
