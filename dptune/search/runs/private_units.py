"""The runs of an end-to-end private search, laid out so that nothing scheduled depends on them. Ray-free.

A private search's K (secret, ``cells.kept_trial_counts``) and its proposals (secret, from fresh OS
entropy) must not reach anything outside the trust boundary: not Ray Tune's results, searcher state
or trial names, not Ray's GCS, dashboard, state API or session folders, not the console. So:

- the driver draws every proposal of a cell once, before any run, with the cell's secret sampler and
  keeps them inside the boundary (:func:`kept_proposals`, ``proposals.json``, written atomically and
  durably; a resume reads them back: every planned run is then run exactly once, and no more than K);
- Ray Tune schedules a *public* number of units per cell (:func:`unit_count`: the trial slots, as
  the cluster's resources give them), named only by (cell, unit index, unit count);
- unit u of U runs the proposals n ≡ u (mod U) (:func:`unit_proposals`), in chunks of a public
  size, each through :func:`dptune.search.runs.execution.run_configurations` (charged in the privacy
  ledger before its first step, recorded inside the boundary, skipped when recorded), and reports a
  constant to Tune (:data:`UNIT_DONE`).

What remains visible outside is timing and a unit's memory beyond its workload: a unit's duration,
and the search's, grow with the runs it holds (docs/PRIVACY.md says so). Every proposal carries its
index (``PROPOSAL_KEY``) so that two equal draws (categorical ranges) stay two runs with their own
records and coins.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from dptune.paths import read_file, write_file_atomic
from dptune.records import ResultsStore, owner_only
from dptune.search.runs.execution import TrialContext, run_checkpoint, run_configurations, run_spec, unit_runs

#: The file inside a private search's trust boundary that keeps every cell's proposals.
PROPOSALS_FILE = "proposals.json"
#: Each proposal's index in its cell (a float, as every sampled value): part of its configuration id.
PROPOSAL_KEY = "proposal"
#: Keys of a private unit's Tune config: its cell's ``cell_key``, its index and the cell's unit count.
CELL_KEY, UNIT_KEY, UNITS_KEY = "cell", "unit", "units"
#: The one report of a private unit, the same whatever its runs did (Tune needs a metric).
UNIT_DONE: Mapping[str, float | bool] = MappingProxyType({"val_accuracy": 0.0, "done_recording": True})


@dataclass(frozen=True)
class PrivateUnit:
    """Unit ``unit`` of the ``units`` Tune trials of cell ``cell_key``: all that Tune holds of it (public)."""

    cell_key: str
    unit: int
    units: int

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> PrivateUnit:
        """The unit a Tune trial's config holds."""
        return cls(str(config[CELL_KEY]), int(config[UNIT_KEY]), int(config[UNITS_KEY]))


def unit_count(slots: int) -> int:
    """Units per cell: the trial slots (CPUs over a trial's, within ``max_concurrent_trials``), a public
    number, so the count of Tune trials and of Ray actors is the same for K = 1 and K = 1000."""
    return max(1, slots)


def kept_proposals(
    runs: str, cell_keys: Sequence[str], draw: Callable[[str], list[dict[str, Any]]]
) -> dict[str, list[dict[str, Any]]]:
    """Every cell's proposals, kept in ``<runs>/proposals.json`` inside the trust boundary: the first
    start draws them (``draw(cell_key)``: the cell's K proposals from its secret sampler), numbers
    them (``PROPOSAL_KEY``) and writes them, durably, before any run; a resume reads them back."""
    kept = read_file(runs, PROPOSALS_FILE)
    if kept is not None:
        proposals: dict[str, list[dict[str, Any]]] = json.loads(kept)
        if set(cell_keys) <= set(proposals):
            return proposals
    else:
        proposals = {}
    for key in cell_keys:
        if key not in proposals:
            proposals[key] = [{**params, PROPOSAL_KEY: float(n)} for n, params in enumerate(draw(key))]
    write_file_atomic(runs, PROPOSALS_FILE, json.dumps(proposals).encode(), durable=True)
    return proposals


def read_proposals(runs: str, cell_key: str) -> list[dict[str, Any]]:
    """The kept proposals of cell ``cell_key`` (:func:`kept_proposals` wrote them before any unit ran)."""
    kept = read_file(runs, PROPOSALS_FILE)
    if kept is None:
        raise FileNotFoundError(f"{runs}/{PROPOSALS_FILE} is missing: the driver writes it before any unit runs")
    return list(json.loads(kept)[cell_key])


def unit_proposals(proposals: Sequence[dict[str, Any]], unit: PrivateUnit) -> list[dict[str, Any]]:
    """The proposals unit ``unit`` runs: those whose index n ≡ unit (mod units)."""
    return list(proposals[unit.unit :: unit.units])


def run_private_unit(context: TrialContext, unit: PrivateUnit, chunk: int) -> None:
    """Run unit ``unit``'s proposals of its cell (read from the trust boundary), ``chunk`` at a time;
    returns nothing, so nothing of the runs can reach the caller's report. Inside :func:`hidden_work`,
    whether or not the secret draw gave this unit any run."""
    with hidden_work(context):
        mine = unit_proposals(read_proposals(context.results_root, unit.cell_key), unit)
        for start in range(0, len(mine), chunk):
            run_configurations(context, mine[start : start + chunk])


def run_release(context: TrialContext, params: dict[str, Any]) -> None:
    """Train the release of a cell tuned on a subsample (``subsample.release_context``) with the chosen
    ``params``, once (skipped when recorded; continued from its checkpoint when a process running it
    was lost), then delete the checkpoint; returns nothing, as a private unit does. Inside
    :func:`hidden_work`."""
    with hidden_work(context):
        run_configurations(context, [params])
        checkpoint = run_checkpoint(context, run_spec(context, params).trial_id)
        assert checkpoint is not None, "a release context keeps checkpoints"
        checkpoint.remove()


@contextlib.contextmanager
def hidden_work(context: TrialContext) -> Iterator[None]:
    """What a process (a Ray worker, on any node) does around a private search's runs: it creates
    everything owner-only (``records.owner_only``), keeps the ε it computes at the runs' mechanisms
    inside the trust boundary (``privacy.cache.kept_inside``), and first loads the workload the runs
    train on, so that a unit's imports and resident workload are the same whether its share of the K
    runs is empty or not (its runs' own tensors still add to its peak memory: docs/PRIVACY.md)."""
    from dptune.privacy.cache import kept_inside
    from dptune.runners.common import cached_workload

    with owner_only(), kept_inside(context.results_root):
        cached_workload(context.base.workload)
        yield


def unrecorded_runs(context: TrialContext, proposals: Sequence[dict[str, Any]]) -> int:
    """How many (proposal, replicate) runs of ``proposals`` have no record yet (inside the boundary;
    the driver only tests it against zero, so the count is never shown)."""
    recorded = ResultsStore(context.results_root).completed_trial_ids()
    return sum(run.trial_id not in recorded for run in unit_runs(context, proposals))
