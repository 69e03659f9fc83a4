"""What a finished search writes and prints: the ``search`` rows (the privacy cost of tuning, per
cell and for the whole search, or a private search's bound and nothing that counts its runs), the
``release`` of an end-to-end private search, the summary table of the best configuration per cell
and the privacy section of the summary. Ray-free and torch-free.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pandas as pd

from dptune import __version__
from dptune.errors import SearchIncomplete, SearchInterrupted
from dptune.privacy.checks import bound_text
from dptune.privacy.search import CompositionCost, composition_cost, select_release
from dptune.records import SCHEMA_VERSION, ResultsStore, read_table, release_label, runs_root, withheld_reason
from dptune.records.ledger import UNREADABLE_TRIAL_PREFIX, charged_runs
from dptune.search.finish.statement import statement_of_cells, test_withheld
from dptune.search.planning.subsample import RELEASE_PARAMETERS, RELEASE_SUFFIX
from dptune.search.runs.execution import FailedUnits
from dptune.space import LoadedSpace, SearchSpace

if TYPE_CHECKING:
    from dptune.search.planning.cells import CellPlan


#: ``search`` columns that count or compose the runs of a search: null for an end-to-end private
#: search, whose number of runs K must stay secret (as must its end time, ``created_at``).
RUN_COUNT_COLUMNS = (
    "trials_planned",
    "trials_with_steps",
    "epsilon_cell",
    "epsilon_composition",
    "delta_composition",
    "epsilon_search",
    "epsilon_search_basic",
    "delta_search_basic",
    "runs_charged",
    "runs_unrecorded",
    "created_at",
)


def cell_search_rows(
    loaded: LoadedSpace,
    plans: list[CellPlan],
    search_id: str,
    trials: pd.DataFrame,
    *,
    official_test_split: bool,
    charged: pd.DataFrame | None = None,
) -> list[dict[str, Any]]:
    """A per-cell search's ``search`` rows: one per cell run, with the privacy cost of the tuning itself.

    ``trials`` is the search's ``trials`` table; ``charged`` what the privacy ledger charges
    (``ledger.charged_runs``: every run started, recorded or not; None: the ``trials`` rows, as
    for results from before the ledger). Per cell: the composition of its charged runs; for the
    whole search (every row alike): the composition of every charged run of every cell and
    variant, which all train on the same data, and how many of them left no row
    (``runs_unrecorded``). ``official_test_split``: whether the dataset ships its test split
    (``DatasetInfo.official_test_split``), which the guarantee's text (``statement_of_cells``) states.
    An end-to-end private search's rows: :func:`selection_search_row`.
    """
    space = loaded.space
    trials = trials[trials["search_id"] == search_id]
    charged = trials if charged is None else charged[charged["search_id"] == search_id]
    whole = composition_cost(charged, space.privacy.delta)
    statement = statement_of_cells(space, official_test_split, whole, plans[0].num_train if plans else None)
    unrecorded = max(0, _took_steps(charged) - _took_steps(trials))
    return [
        {
            **_plan_columns(loaded, plan, search_id, selection_bound_holds=False),
            **_composition_columns(space, plan, charged, whole, unrecorded, statement),
        }
        for plan in plans
    ]


def selection_search_row(
    loaded: LoadedSpace, plan: CellPlan, search_id: str, epsilon_selection: float, statement: str
) -> dict[str, Any]:
    """An end-to-end private search's ``search`` row of cell run ``plan``: the bound its plan meets
    (``epsilon_selection``, at the space's δ), the guarantee's ``statement``, and none of
    ``RUN_COUNT_COLUMNS`` (they would count its secret number of runs)."""
    space = loaded.space
    return {
        **_plan_columns(loaded, plan, search_id, selection_bound_holds=not space.reproducible),
        **{name: None for name in RUN_COUNT_COLUMNS},
        "epsilon_selection": epsilon_selection,
        "delta_selection": space.privacy.delta,
        "guarantee": statement,
    }


def _took_steps(runs: pd.DataFrame) -> int:
    """How many of ``runs`` took a step."""
    return len(runs[runs["steps_taken"].fillna(0) > 0])


def _plan_columns(
    loaded: LoadedSpace, plan: CellPlan, search_id: str, *, selection_bound_holds: bool
) -> dict[str, Any]:
    """The ``search`` columns every search shape has: the cell run's plan, the space and the versions
    (``selection_bound_holds``: an end-to-end private search's bound, with secret coins)."""
    space = loaded.space
    return {
        "search_id": search_id,
        "name": space.name,
        "cell_id": plan.cell.cell_id,
        "clipping": plan.clipping,
        "epsilon": plan.cell.epsilon,
        "epochs": plan.cell.epochs,
        "delta": space.privacy.delta,
        "dataset": space.task.dataset_name,
        "backbone": space.task.backbone,
        "peft": space.task.peft,
        "num_train": plan.num_train,
        "configurations_pruned": len(plan.pruned_batch_sizes),
        "epsilon_per_trial": plan.cell.epsilon,
        "selection_bound_holds": selection_bound_holds,
        "reproducible": space.reproducible,
        "spec_yaml": loaded.text,
        "spec_hash": loaded.spec_hash,
        "schema_version": SCHEMA_VERSION,
        "dptune_version": __version__,
    }


def _composition_columns(
    space: SearchSpace,
    plan: CellPlan,
    charged: pd.DataFrame,
    whole: CompositionCost,
    unrecorded: int,
    statement: str,
) -> dict[str, Any]:
    """A per-cell search's cost columns: the composition of the cell run's ``charged`` runs, the
    ``whole`` search's (every row alike), the runs charged but ``unrecorded``, and its ``statement``."""
    cell_runs = charged[(charged["cell_id"] == plan.cell.cell_id) & (charged["clipping"] == plan.clipping)]
    cell = composition_cost(cell_runs, space.privacy.delta)
    replicate = cell_runs["trial_id"].drop_duplicates().astype(str).str.extract(r"-r(\d+)$")[0].astype(float)
    return {  # racing rounds add to the first pass's plan the runs they decided on (a stand-in id has none)
        "trials_planned": plan.configurations * space.replicates + int((replicate >= space.replicates).sum()),
        "trials_with_steps": cell.trials_with_steps,
        "epsilon_cell": cell.epsilon,
        "accountant_cell": cell.accountant,
        "epsilon_composition": cell.epsilon_basic,
        "delta_composition": cell.delta_basic,
        "epsilon_search": whole.epsilon,
        "accountant_search": whole.accountant,
        "epsilon_search_basic": whole.epsilon_basic,
        "delta_search_basic": whole.delta_basic,
        "runs_charged": whole.trials_with_steps,
        "runs_unrecorded": unrecorded,
        "epsilon_selection": math.nan,
        "delta_selection": math.nan,
        "guarantee": statement,
        "created_at": pd.Timestamp.now(tz="UTC"),
    }


#: How an end-to-end private search picks the run a cell releases from the search's ``trials`` rows
#: (``search_id``'s): (those rows, the cell's plan) → the released run, or None (no run finished).
Choose = Callable[[pd.DataFrame, "CellPlan"], "pd.Series | None"]


def release_choices(
    plans: list[CellPlan], search_rows_: list[dict[str, Any]], trials: pd.DataFrame, choose: Choose
) -> list[tuple[CellPlan, dict[str, Any], pd.Series]]:
    """An end-to-end private search's choice per cell: (plan, its ``search`` row, the run it releases),
    as ``choose`` picks it (:func:`selected_run`, :func:`subsample_release`; called once per cell:
    publish from what it chose). A cell none of whose runs finished has none."""
    choices = []
    for plan, row in zip(plans, search_rows_, strict=True):
        chosen = choose(trials[trials["search_id"] == row["search_id"]], plan)
        if chosen is not None:
            choices.append((plan, row, chosen))
    return choices


def selected_run(trials: pd.DataFrame, plan: CellPlan) -> pd.Series | None:
    """Private selection's release of cell ``plan``: the run with the best noisy validation score
    (``privacy.search.select_release``, randomized when more than K runs finished)."""
    return select_release(trials[trials["cell_id"] == plan.cell.cell_id], runs=plan.configurations)


def subsample_release(trials: pd.DataFrame, plan: CellPlan) -> pd.Series | None:
    """Tuning on a subsample: the release run of cell ``plan`` (:func:`_subsample_release`)."""
    return _subsample_release(trials, plan.cell.cell_id, plan.tuning_plan.fraction)


def release_rows(
    space: SearchSpace, choices: list[tuple[CellPlan, dict[str, Any], pd.Series]], *, official_test_split: bool
) -> list[dict[str, Any]]:
    """The ``release`` rows of :func:`release_choices`: per cell, the released run's configuration, its
    noisy validation score (the maximum of the K noisy scores: biased upward), its test accuracy
    where the test split is public, and the budget; nothing that orders it among the runs (no trial
    id, no time). Tuning on a subsample: :func:`subsample_release_rows`."""
    selection = space.privacy.private_selection
    rows = []
    for plan, row, chosen in choices:
        assert selection is not None
        rows.append(
            {
                "search_id": row["search_id"],
                "cell_id": plan.cell.cell_id,
                **{
                    name: chosen[name]
                    for name in (
                        "clip_bound",
                        "batch_size",
                        "base_learning_rate",
                        "learning_rate",
                        "epochs",
                        "noisy_val_accuracy",
                    )
                },
                "test_accuracy": chosen["test_accuracy"] if official_test_split else None,
                "test_split_public": official_test_split,
                "test_withheld": test_withheld(space, official_test_split),
                "epsilon_total": selection.epsilon,
                "delta_total": space.privacy.delta,
                "epsilon_per_trial": plan.cell.epsilon,
                "score_noise_multiplier": selection.score_noise_multiplier,
                "mean_trials": float(space.sampler.trials_per_cell or 0),
                "trial_count_shape": selection.trial_count_shape,
                "tuning_fraction": None,
                "transfer": None,
                "guarantee": row["guarantee"],
            }
        )
    return rows


def subsample_release_rows(
    space: SearchSpace, choices: list[tuple[CellPlan, dict[str, Any], pd.Series]], *, official_test_split: bool
) -> list[dict[str, Any]]:
    """:func:`release_rows` of a search tuned on a subsample: with its q₁ and transfer rule."""
    rows = release_rows(space, choices, official_test_split=official_test_split)
    return [
        {**row, "tuning_fraction": plan.tuning_plan.fraction, "transfer": plan.tuning_plan.transfer}
        for row, (plan, _, _) in zip(rows, choices, strict=True)
    ]


def _subsample_release(trials: pd.DataFrame, cell_id: str, fraction: float) -> pd.Series | None:
    """The release of a cell tuned on a subsample of rate ``fraction`` (q₁): its finished release run
    (cell id ``<cell>|release``) with the noisy validation count of the tuning run whose configuration it
    trained, the integer k divided once by the public nominal q₁·N_val (N_val: the release run's validation
    rows), never by X₁'s own validation size, which stays inside the trust boundary. None: no release
    finished."""
    release = trials[(trials["cell_id"] == cell_id + RELEASE_SUFFIX) & (trials["status"] == "ok")]
    if release.empty:
        return None
    chosen = release.iloc[0].copy()
    tuned = trials[(trials["cell_id"] == cell_id) & (trials["status"] == "ok")]
    same = tuned[(tuned[list(RELEASE_PARAMETERS)] == chosen[list(RELEASE_PARAMETERS)].to_numpy()).all(axis=1)]
    if same.empty:
        chosen["noisy_val_accuracy"] = math.nan
        return chosen
    # the run's noisy count k: an integer (count + discrete Gaussian), stored as k / |X₁ ∩ val|; rounded
    # back to k so that the score's bits depend on k and public numbers only, never on |X₁ ∩ val|
    count = round(float((same["noisy_val_accuracy"] * same["num_val"]).max()))
    chosen["noisy_val_accuracy"] = count / (fraction * int(chosen["num_val"]))
    return chosen


def summary_table(results_root: str, *, trials: pd.DataFrame | None = None) -> pd.DataFrame:
    """Best configuration per cell (and clipping variant), by the report's rule
    (``analysis.best_configurations`` over ``analysis.finished_trials``): configurations ranked by
    mean validation accuracy over their replicates, with intervals and the set within noise of the
    best; only runs that trained to the end are ranked. ``trials``: the ``trials`` table of
    ``results_root`` when the caller has read it (:func:`_trials_of`)."""
    from dptune.analysis import best_configurations, finished_trials

    trials = _trials_of(results_root, trials)
    best = best_configurations(finished_trials(trials), by=["cell_id", "clipping"])
    if best.empty:
        return best
    counts = trials.groupby(["cell_id", "clipping"])["status"].value_counts().unstack(fill_value=0)
    best = best.set_index(["cell_id", "clipping"]).join(counts).reset_index()
    return best.sort_values(["epsilon", "epochs", "clipping"])


def format_summary(best: pd.DataFrame) -> str:
    """The summary table: per cell the best configuration, its mean accuracies over R replicates
    with the test accuracy's interval, and how many configurations are within noise of it."""
    if best.empty:
        return "no finished trials yet"
    columns = {
        "cell_id": "cell",
        "clipping": "clipping",
        "clip_bound": "C",
        "batch_size": "B",
        "base_learning_rate": "η₀",
        "learning_rate": "η",
        "replicates": "R",
        "val_accuracy": "val acc",
        "test_accuracy": "test acc",
    }
    table = best[list(columns)].rename(columns=columns)
    table["test interval"] = [
        f"[{low:.3f}, {high:.3f}]" for low, high in zip(best["test_low"], best["test_high"], strict=True)
    ]
    table["within noise"] = [f"{k}/{n}" for k, n in zip(best["within_noise"], best["configurations"], strict=True)]
    extra = [c for c in ("ok", "pruned_min_steps", "diverged", "error", "stopped_early") if c in best]
    table = pd.concat([table, best[extra]], axis=1)
    return table.to_string(index=False, float_format=lambda v: f"{v:.4g}")


#: The line above the summary table.
SUMMARY_HEADER = (
    "best configuration per cell (mean over its replicates, selected on exact validation accuracy: not "
    "a DP release; test interval: 95 %, the coins' run-to-run spread pooled over the cell and the test split's "
    "sampling noise (the split's alone where no configuration was replicated), as the report and the model "
    "card print it; within noise: configurations "
    "not distinguishable from the best):"
)


#: Trial statuses that mean a trial ran (or tried to) and produced no usable model.
FAILED_STATUSES = ("error", "diverged")


def format_failed_cells(trials: pd.DataFrame) -> list[str]:
    """One line per cell run with no finished trial and at least one failed one: how many failed,
    and the most common reason with its count."""
    lines = []
    for (cell_id, clipping), cell in trials.groupby(["cell_id", "clipping"], sort=True):
        failed = cell[cell["status"].isin(FAILED_STATUSES)]
        if failed.empty or cell["status"].isin(["ok", "stopped_early"]).any():
            continue
        reasons = failed["reason"].fillna("").replace("", "no reason recorded").value_counts()
        statuses = ", ".join(f"{count} {status}" for status, count in failed["status"].value_counts().items())
        lines.append(
            f"cell {cell_id} [{clipping}]: every trial that ran failed ({statuses}); most common "
            f"reason ({reasons.iloc[0]} of {len(failed)}): {reasons.index[0]}"
        )
    return lines


def _trials_of(results_root: str, trials: pd.DataFrame | None) -> pd.DataFrame:
    """``trials`` when given (the whole ``trials`` table of ``results_root``, as ``read_table`` reads it
    once every run the caller waits for is recorded), else that table read now."""
    return read_table(results_root, "trials") if trials is None else trials


def format_outcome(results_root: str, *, trials: pd.DataFrame | None = None) -> str:
    """The search's printed summary: the best trial of each cell that has one, then a line for
    each cell whose trials all failed, saying why. ``trials``: as for :func:`summary_table`."""
    trials = _trials_of(results_root, trials)
    best = summary_table(results_root, trials=trials)
    failed = format_failed_cells(trials) if not trials.empty else []
    return "\n".join(([] if best.empty and failed else [format_summary(best)]) + failed)


#: The release table's columns as the summary shows them (after its name, ``records.release_label``).
RELEASE_COLUMNS = MappingProxyType(
    {
        "clip_bound": "C",
        "batch_size": "B",
        "base_learning_rate": "η₀",
        "learning_rate": "η",
        "noisy_val_accuracy": "noisy val acc (max of noisy scores)",
        "test_accuracy": "test acc",
        "tuning_fraction": "tuned on (q₁)",
        "epsilon_total": "ε total",
        "delta_total": "δ",
    }
)


def format_privacy(search: pd.DataFrame, release: pd.DataFrame, runs: str | None = None) -> str:
    """The privacy section of the summary and what the guarantee covers (the ``guarantee`` text
    recorded with the search). ``runs``: the trust-boundary folder of an end-to-end private search,
    whose summary shows only its release (nothing that counts or composes its runs); otherwise the
    per-cell and whole-search cost."""
    if search.empty:
        return ""
    first = search.iloc[0]
    lines = _release_lines(release, runs) if runs is not None else _cost_lines(search, first)
    lines.append("what (ε, δ) covers: " + str(first["guarantee"]))
    return "\n".join(lines)


def _release_lines(release: pd.DataFrame, runs: str) -> list[str]:
    """An end-to-end private search's privacy section: its release (a table, why a test accuracy is
    withheld, what its noisy score is) and where its per-run records stay (``runs``)."""
    lines = ["", "the release of this end-to-end private search (all that may leave the trust boundary):"]
    if release.empty:
        lines.append("none: no run finished")
    else:
        table = release[list(RELEASE_COLUMNS)].rename(columns=dict(RELEASE_COLUMNS)).astype(object)
        table.insert(0, "release", [release_label(row) for _, row in release.iterrows()])
        table["tuned on (q₁)"] = table["tuned on (q₁)"].where(release["tuning_fraction"].notna(), "all rows")
        public = release["test_split_public"].astype(bool)
        table["test acc"] = table["test acc"].where(public, "withheld")
        lines.append(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        lines += [
            f"test accuracy of {release_label(row)} withheld: {withheld_reason(row)}"
            for _, row in release[~public].iterrows()
        ]
        lines.append(
            "the noisy validation score is the maximum over the runs' noisy scores: biased upward, "
            "not an estimate of the model's accuracy"
        )
    lines.append(
        f"per-run records, inside the data owner's trust boundary (NOT covered; publishing them "
        f"voids the guarantee): {runs}"
    )
    return lines


def _cost_lines(search: pd.DataFrame, first: pd.Series) -> list[str]:
    """A per-cell search's privacy section: the cost of each cell run, of the whole search (``first``:
    its first ``search`` row; every row holds it) and the runs charged that left no record."""
    lines = ["", "privacy cost of the search (trials took steps on the same data; ε at the space's δ):"]
    table = search[
        ["cell_id", "clipping", "trials_with_steps", "epsilon_per_trial", "epsilon_cell", "epsilon_composition"]
    ]
    lines.append(
        table.rename(
            columns={
                "cell_id": "cell",
                "trials_with_steps": "trials with steps",
                "epsilon_per_trial": "ε per trial",
                "epsilon_cell": "ε cell (composed)",
                "epsilon_composition": "Σε (basic)",
            }
        ).to_string(index=False, float_format=bound_text)
    )
    lines.append(
        f"whole search: ε = {bound_text(first['epsilon_search'])} at δ = {first['delta']:g} "
        f"({first['accountant_search']} composition of every trial that took a step); basic composition: "
        f"ε = {bound_text(first['epsilon_search_basic'])}, δ = {bound_text(first['delta_search_basic'], 2)}"
    )
    unrecorded = first.get("runs_unrecorded")
    if unrecorded is not None and not pd.isna(unrecorded) and int(unrecorded) > 0:
        lines.append(
            f"charged but unrecorded: {int(unrecorded)} of the {int(first['runs_charged'])} runs composed "
            "above took steps and left no trials row (a lost trial process, a full disk, an attempt run "
            "again, or a run charged in place of an unreadable ledger entry: --charge-unreadable-ledger); the "
            "privacy ledger charges each its planned steps unless it reported fewer"
        )
    return lines


def summary_text(results_root: str, *, private: bool, trials: pd.DataFrame | None = None) -> str:
    """The summary of the finished search at ``results_root``: the best trial per cell and the search's
    privacy cost, or for an end-to-end private search only its release (``trials`` is not read: its
    runs are inside the trust boundary). ``trials``: as for :func:`summary_table`."""
    privacy = format_privacy(
        read_table(results_root, "search"),
        read_table(results_root, "release"),
        runs=runs_root(results_root, True) if private else None,
    )
    if private:
        return privacy
    return "\n".join([SUMMARY_HEADER, format_outcome(results_root, trials=trials), privacy])


def stopped_by_signal(
    signals: list[str],
    runs: str,
    search_id: str,
    space: SearchSpace,
    plans: list[CellPlan],
    private: bool,
    *,
    trials: pd.DataFrame | None = None,
) -> None:
    """Raise :class:`SearchInterrupted` when stop ``signals`` (their names) ended the Tune run: one line
    saying how many runs are recorded (a private search's count stays inside its boundary: it would
    reveal how far the secret number of runs got) and that ``--resume`` runs the rest. ``trials``: the
    ``trials`` table of ``runs`` when the caller has read it after the Tune run (:func:`_trials_of`)."""
    if not signals:
        return
    name = signals[0]
    how = "Ctrl+C (SIGINT)" if name == "SIGINT" else name
    if private:
        done = "nothing is released"
    else:
        trials = _trials_of(runs, trials)
        trained = (trials["search_id"] == search_id) & (trials["status"] != "pruned_min_steps")  # as planned counts
        recorded = int(trained.sum()) if len(trials) else 0
        planned = sum(plan.configurations for plan in plans) * space.replicates
        done = f"{recorded} of {planned} runs recorded"
        if space.racing is not None:  # the rounds decide their runs as they go
            done = f"{recorded} runs recorded (the first pass plans {planned}; racing rounds add more)"
    raise SearchInterrupted(
        f"stopped by {how} before the search finished: {done}. Run the same command with --resume to run the "
        "rest, each exactly once (what finished is kept, and every training that took a step stays charged in "
        "the privacy ledger)",
        int(signal.Signals[name]),
    )


def check_every_run_recorded(
    runs: str,
    search_id: str,
    max_retries: int,
    private: bool,
    failed_units: Mapping[str, FailedUnits] | None = None,
    *,
    trials: pd.DataFrame | None = None,
) -> None:
    """Raise ``SearchIncomplete`` unless every run the search planned has its row: each run the privacy ledger
    charged (a process lost ``max_retries`` + 1 times, a write that failed) and each run of a unit that
    failed (``failed_units``, by cell key: a unit that failed before it charged anything leaves no start
    entry). ``--resume`` runs them again. The message names the cells and, for a search that is not
    end-to-end private, counts the runs (a private one's count would reveal K). A subsample tuning's release
    is not among them: it trains after this check, and a resume continues it from its checkpoint; nor are
    the stand-ins of unreadable start files (:mod:`dptune.search.damaged_ledger`). ``trials``: the
    ``trials`` table of ``runs`` when the caller has read it after the Tune run (:func:`_trials_of`)."""
    charged = charged_runs(runs, search_id)
    stand_in = charged["trial_id"].astype(str).str.startswith(UNREADABLE_TRIAL_PREFIX)  # no row records them
    tuned = charged[~charged["cell_id"].astype(str).str.endswith(RELEASE_SUFFIX) & ~stand_in]
    planned = set(tuned["trial_id"])
    for failed in (failed_units or {}).values():
        planned |= set(failed.trial_ids)
    recorded = ResultsStore(runs).completed_trial_ids() if trials is None else set(trials["trial_id"])
    missing = planned - recorded
    if not missing:
        return
    cells = sorted({key for key in (failed_units or {})} | {trial.rsplit("-", 2)[0] for trial in missing})
    count = "some runs" if private else f"{len(missing)} run(s)"
    errors = [failed.error for failed in (failed_units or {}).values() if failed.error]
    why = f"a unit failed ({errors[0][:300]})" if errors else f"a trial process was lost {max_retries + 1} time(s)"
    raise SearchIncomplete(
        f"{count} of this search have no record (cell(s) {', '.join(cells)[:300]}): {why}, or the results could "
        f"not be written (resources.max_retries = {max_retries}); every attempt that took a step is charged in "
        f"the privacy ledger ({runs}/ledger). Run the same command with --resume to run them again; the search "
        "table and summary are written when every planned run is recorded"
    )
