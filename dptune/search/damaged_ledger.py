"""Going on past an unreadable start file of the privacy ledger, conservatively (``--charge-unreadable-ledger``).

What an unreadable start file charged is unknown, but not unbounded: it was written by one unit of
one cell of this search before the unit's first step, so it held at most ``runs_per_start`` runs
(the cell's planned configurations times R replicates: no unit, chunk or retry carries more), each
one Poisson-subsampled Gaussian mechanism the cell's plan can start: for one feasible B its planned
(σ_B, q_B, T_B) (a subsample tuning's public schedules, and its release's).
Charging ``runs_per_start`` runs of *every* such mechanism of *every* cell in its place dominates
any content the file can have had (what ran is a part of what is charged, and composing more
mechanisms never lowers ε: dropping outputs is post-processing), so the search's
printed ε stays an upper bound. It is loose by design (often far above what ran): restoring the
file from a backup instead, before passing the flag, keeps the tight ε.
"""

from __future__ import annotations

from dptune.records.ledger import UNREADABLE_TRIAL_PREFIX, RunStart, replace_unreadable_start, unreadable_starts
from dptune.search.planning.cells import CellPlan
from dptune.search.planning.subsample import release_context
from dptune.search.runs.execution import TrialContext


def conservative_starts(contexts: list[TrialContext], runs_per_start: dict[str, int], file_name: str) -> list[RunStart]:
    """The runs charged in place of the unreadable start file ``file_name``: for every context (its
    ``cell_key`` keys ``runs_per_start``) and every B it has a mechanism for, ``runs_per_start`` runs at
    the planned mechanism (σ_B, q_B, T_B at its ε and δ, as the plan calibrated it), under trial ids no
    row records."""
    starts = []
    for context in contexts:
        assert context.num_train is not None and context.mechanisms is not None
        for batch_size, mechanism in sorted(context.mechanisms.items()):
            for index in range(runs_per_start[context.cell_key]):
                trial_id = f"{UNREADABLE_TRIAL_PREFIX}{file_name}:{context.cell_key}:B{batch_size}:{index}"
                starts.append(
                    RunStart(
                        trial_id=trial_id,
                        configuration_id=trial_id,
                        replicate=0,
                        search_id=context.search_id,
                        cell_id=context.cell_id,
                        clipping=context.base.clipping,
                        params={"batch_size": float(batch_size)},
                        noise_multiplier=float(mechanism.noise_multiplier),
                        sample_rate=mechanism.sample_rate,
                        steps=mechanism.steps,
                        delta=mechanism.delta,
                        epsilon=mechanism.epsilon,
                    )
                )
    return starts


def charge_unreadable_starts(
    runs: str, plans: list[CellPlan], contexts: list[TrialContext], private: bool
) -> list[str]:
    """Replace every unreadable start file of the ledger at ``runs`` by its conservative stand-in
    (:func:`conservative_starts`, durably, before anything trains) and move the file to
    ``ledger/unreadable/``; one note per file, saying what is charged. ``contexts`` are the cells'
    (in the order of ``plans``); a subsample tuning's release (one run per start) is added. A
    ``private`` search's note leaves the count out (it would reveal the secret number of runs)."""
    contexts = contexts + [
        release_context(context, plan.tuning) for context, plan in zip(contexts, plans, strict=True) if plan.tuning
    ]
    planned = {plan.cell_key: plan.configurations for plan in plans}
    runs_per_start = {context.cell_key: planned.get(context.cell_key, 1) * context.replicates for context in contexts}
    notes = []
    for path in unreadable_starts(runs):
        file_name = path.rstrip("/").rsplit("/", 1)[-1]
        starts = conservative_starts(contexts, runs_per_start, file_name)
        replace_unreadable_start(runs, path, starts)
        count = "" if private else f" as {len(starts)} run(s)"
        notes.append(
            f"{path}: an unreadable privacy ledger entry, charged conservatively{count} (every run "
            "one start file of this search can hold, at every mechanism its plan can start; moved to "
            "ledger/unreadable/): the printed ε is an upper bound, loose by design; restoring the file from a "
            "backup and resuming again does not lower it"
        )
    return notes
