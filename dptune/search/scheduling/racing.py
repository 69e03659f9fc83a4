"""Adaptive replication (racing): which configurations of a cell get more replicates, round by round.
Ray-free.

F-Race (Birattari et al. 2002) and irace (López-Ibáñez et al. 2016) spend evaluations only on the
candidates still in the race. Here a cell's first pass runs every sampled configuration ``replicates``
times; then each round (:func:`next_round`, decided from the results folder once no unit of the cell
is running) adds ``racing.step`` replicates to each configuration in the confidence set of the best
(the within-noise set of :func:`dptune.analysis.rank_configurations`: Gupta's subset selection over
the cell's configurations, whose noise is their pooled run-to-run spread), best first, until

- the set holds one configuration, or
- the set and the optimal C and B intervals over it (its extreme C and B) came out the same
  ``racing.patience`` rounds in a row, and no comparison of the report that the cell is an end of is
  still open (:func:`open_comparison`: the optimal C or B against the cell of the other ε or E that
  ``dptune.analysis.paper_trend_checks`` compares it with, not established yet), or
- the cell's ``racing.budget`` of extra runs is spent, or every configuration in the set has
  ``racing.max_replicates``.

A round is a list of (configuration, replicate indices): the runs' ids follow from them
(``records.replicate_trial_id``), so a round handed out again after a resume runs only its runs
without a row. Before deciding a round, runs the privacy ledger charged without a row (a unit lost
before Tune saved its state) are handed out again as they were charged; those of a unit that failed
(``excluded``) are not: Tune runs that unit again on ``--resume``, and until then the search cannot
finish. What a round reads are exact validation accuracies, so a
racing search adapts to private rows as TPE does (``search.finish.statement`` says what its
composition then covers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dptune.analysis import AUTO_S, finished_trials, paper_trend_checks, rank_configurations
from dptune.records.ledger import RunStart
from dptune.search.runs.execution import TrialContext
from dptune.search.scheduling.reconcile import sampled_params
from dptune.space.spec import RacingSpec


@dataclass(frozen=True)
class RacingRound:
    """One round of a cell's race: ``configurations`` (sampled params) and, per configuration, the
    ``replicates`` (0-based indices) to run; ``signature``: the confidence set of the best and the
    optimal C and B intervals it was decided on (plain JSON data); ``ended``: why the race is over
    (None while it goes on: then the round holds runs); ``lost``: the round runs again the runs charged
    without a row (:func:`lost_runs`), not new ones."""

    configurations: list[dict[str, Any]] = field(default_factory=list)
    replicates: list[list[int]] = field(default_factory=list)
    signature: list[Any] | None = None
    ended: str | None = None
    lost: bool = False


def cell_rows(context: TrialContext, trials: pd.DataFrame) -> pd.DataFrame:
    """The rows of cell ``context`` in ``trials`` (its clipping rule's only, not an ``-auto_s`` twin's)."""
    own = re.compile(rf"{re.escape(context.cell_key)}-[0-9a-f]{{12}}")
    ids = trials["configuration_id"].astype(str)
    return trials[ids.map(lambda value: own.fullmatch(value) is not None).astype(bool)]


def open_comparison(context: TrialContext, trials: pd.DataFrame) -> bool:
    """Whether cell ``context`` is an end of a comparison of the report (``analysis.paper_trend_checks``
    over the finished runs of ``trials``, the search's, under the cell's clipping rule) that is not
    established yet: its race then goes on while its budget lasts, though its own set holds still."""
    clipping = context.base.clipping
    finished = finished_trials(trials[trials["clipping"] == clipping])
    if clipping == AUTO_S or finished.empty:  # the report compares the optima of tuned C only
        return False
    checks = paper_trend_checks(rank_configurations(finished.assign(task=""), by=["task", "epsilon", "epochs"]))
    open_ = checks[checks["verdict"] == "not established"]
    ends = {
        (float(e), int(n))
        for side in ("harder", "easier")
        for e, n in zip(open_[f"{side}_epsilon"], open_[f"{side}_epochs"], strict=True)
    }
    return (float(context.base.epsilon), int(context.base.epochs)) in ends


def lost_runs(
    context: TrialContext, started: list[RunStart], rows: pd.DataFrame, names: list[str], excluded: set[str]
) -> RacingRound:
    """The runs of cell ``context`` that ``started`` (the search's start entries) charged and ``rows``
    (the cell's) do not hold, but those ``excluded`` (trial ids), grouped by configuration, as a round."""
    recorded = set(rows["trial_id"].astype(str)) | excluded
    own = re.compile(rf"{re.escape(context.cell_key)}-[0-9a-f]{{12}}")
    found: dict[str, tuple[dict[str, Any], list[int]]] = {}
    for start in started:
        if own.fullmatch(start.configuration_id) and start.trial_id not in recorded:
            params, replicates = found.setdefault(start.configuration_id, (sampled_params(start.params, names), []))
            if start.replicate not in replicates:
                replicates.append(start.replicate)
    return RacingRound([params for params, _ in found.values()], [sorted(r) for _, r in found.values()])


def next_round(
    context: TrialContext,
    racing: RacingSpec,
    names: list[str],
    trials: pd.DataFrame,
    started: list[RunStart],
    previous: list[Any] | None,
    unchanged: int = 0,
    excluded: frozenset[str] = frozenset(),
) -> RacingRound:
    """The next round of cell ``context``'s race (module docstring), from the search's ``trials`` rows
    and ``started`` entries; ``names``: the sampled hyperparameters; ``previous``: the signature of the
    last round (None before the first) and ``unchanged``: how many rounds in a row had it; ``excluded``:
    the runs of units that failed (their trial ids), which are not handed out again here."""
    rows = cell_rows(context, trials)
    lost = lost_runs(context, started, rows, names, set(excluded))
    if lost.configurations:
        return RacingRound(lost.configurations, lost.replicates, previous, lost=True)
    ranked = rank_configurations(finished_trials(rows), by=["cell_id", "clipping"])
    if ranked.empty:
        return RacingRound(ended="no run of the cell finished")
    near = ranked[ranked["within_noise"]]
    signature = [
        sorted(near["configuration_id"].astype(str)),
        float(near["clip_bound"].min()),
        float(near["clip_bound"].max()),
        int(near["batch_size"].min()),
        int(near["batch_size"].max()),
    ]
    if len(near) == 1:
        return RacingRound(signature=signature, ended="the confidence set of the best holds one configuration")
    settled = previous is not None and signature == previous and unchanged + 1 >= racing.patience
    if settled and not open_comparison(context, trials):
        return RacingRound(
            signature=signature,
            ended=f"the confidence set and the optimal C and B intervals did not change in {unchanged + 1} round(s)",
        )
    left = racing.budget - int((rows["replicate"] >= context.replicates).sum())
    counts = rows.groupby("configuration_id")["replicate"].max() + 1
    chosen = RacingRound(signature=signature)
    for configuration in near.sort_values("rank")["configuration_id"].astype(str):
        have = int(counts[configuration])
        add = min(racing.step, racing.max_replicates - have, left)
        if add <= 0:
            continue
        left -= add
        chosen.configurations.append(sampled_params(rows[rows["configuration_id"] == configuration].iloc[0], names))
        chosen.replicates.append(list(range(have, have + add)))
    if not chosen.configurations:
        why = "the cell's racing budget is spent" if left <= 0 else "every configuration raced has max_replicates"
        return RacingRound(signature=signature, ended=why)
    return chosen
