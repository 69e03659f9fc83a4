"""Coverage: what the results hold and what is missing; task difficulty and the order of tasks; the
public plan of an end-to-end private search."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import yaml

from dptune import plan
from dptune.analysis.configurations import best_configurations
from dptune.analysis.gradients import grad_norm_samples
from dptune.analysis.results import Results
from dptune.space.spec import BatchSizeSpec


def coverage(results: Results) -> pd.DataFrame:
    """Trials per search cell: planned (``search`` table), recorded, and counts by status.

    One row per (search, cell) whose runs are counted (not an end-to-end private search's: its
    number of runs is secret and its records are elsewhere). ``trials_planned`` sums the cell's
    runs (tuned C and AUTO-S);
    ``recorded`` counts trial records except configurations pruned by the min-step rule (the
    search records those besides the planned trials); ``remaining`` = planned − recorded (a
    running search) when the plan is known, else NaN.
    """
    keys = ["search_id", "cell_id"]
    trials = results.trials
    counts = pd.crosstab([trials["search_id"], trials["cell_id"]], trials["status"]) if len(trials) else None
    counts = counts.reset_index() if counts is not None else pd.DataFrame(columns=keys)
    counts.columns.name = None
    counted = results.search[results.search["trials_planned"].notna()]  # a private search counts no run
    planned = counted.groupby(keys).agg(name=("name", "first"), trials_planned=("trials_planned", "sum"))
    table = planned.reset_index().merge(counts, on=keys, how="outer")
    statuses = [c for c in table.columns if c not in {*keys, "name", "trials_planned"}]
    table[statuses] = table[statuses].fillna(0).astype(int)
    table["recorded"] = table[[c for c in statuses if c != "pruned_min_steps"]].sum(axis=1).astype(int)
    table["remaining"] = (table["trials_planned"] - table["recorded"]).clip(lower=0)
    return table.sort_values(keys).reset_index(drop=True)


def missing_data(results: Results) -> list[str]:
    """Plain-language notes on what the results lack (empty when nothing is missing). The runs of an
    end-to-end private search lack by design what its bound refuses (diagnostics, AUTO-S, a second ε
    or E): no note says so, nor suggests what private mode refuses."""
    notes: list[str] = []
    trials = results.trials
    if trials.empty and not results.release.empty:
        return [
            "per-run records: an end-to-end private search keeps them inside the data owner's trust boundary, "
            "so only its release is shown"
        ]
    if trials.empty:
        return ["no trial has finished yet: the datasets hold no trials rows"]
    if results.finished.empty:
        notes.append("no trial finished with status ok: nothing can be ranked")
    if results.search.empty:
        notes.append("no search table: the number of planned trials is unknown")
    else:
        remaining = int(coverage(results)["remaining"].sum())
        if remaining:
            notes.append(f"{remaining} planned trial(s) have no record yet (a search still running, or stopped)")
    if results.classes["test_accuracy"].notna().sum() == 0:
        notes.append("no per-class accuracies recorded: classes cannot be split into easy and hard")
    if set(trials["search_id"]) <= set(results.release["search_id"]):  # the runs of private searches only
        return notes
    if results.diagnostics.empty:
        notes.append("no diagnostics recorded (trials ran with diagnostics off): sections 3, 4 and 7 are empty")
    if results.auto_s.empty:
        notes.append("no AUTO-S trials (training.compare_auto_s was off): section 5 is empty")
    if results.finished["epsilon"].nunique() < 2:
        notes.append("only one privacy budget ε: trends against ε cannot be shown")
    if results.finished["epochs"].nunique() < 2:
        notes.append("only one epoch budget E: trends against E cannot be shown")
    return notes


def privacy_statements(results: Results) -> list[str]:
    """What each search's (ε, δ) covers, as recorded with it (``search.guarantee``; for results written
    before it was recorded, what the reader fills in: ``records.migrations``), one per search."""
    search = results.search
    if search.empty:
        return []
    statements = []
    for search_id, rows in search.groupby("search_id", sort=True):
        if rows["guarantee"].notna().any():
            text = rows["guarantee"].dropna().iloc[0]
        else:
            text = "no statement of what (ε, δ) covers was recorded with this search."
        statements.append(f"{search_id}: {text}")
    return statements


#: The columns of :func:`selection_plans`.
PLAN_COLUMNS = ["search_id", "batch_size", "sample_rate", "steps", "noise_multiplier", "cumulative_noise", "planned"]


def selection_plans(results: Results) -> pd.DataFrame:
    """The public plan of each end-to-end private search in ``results`` (a search with a release): one row
    per batch size B its space names, from its ``search`` row's public numbers alone (N, E, δ, the
    per-run ε its planner found, the recorded space) — never from its runs.

    ``planned`` says what became of B: ``"planned"`` (a run may draw it), ``"pruned: T < T_min"`` (the
    min-step rule), ``"dropped: B > N"``, or, tuning on a subsample with the transfer rule ``batch_size``,
    ``"not tuned: B > q₁·N"``. A planned B has q = B/N, T = round(E·N/B) and σ, the noise multiplier of
    a full-data run at the per-run ε and δ (the planner's, ``dptune.plan``), and σ√T; the others NaN.
    Under ``tuning_subsample`` these are the release's mechanisms (its one training on every row); the
    tuning runs on the subsample have their own q and T, by the transfer rule.
    """
    releases = results.release.drop_duplicates("search_id").set_index("search_id")
    frames = [
        _selection_plan(row, releases.loc[row["search_id"]])
        for _, row in results.search.drop_duplicates("search_id").iterrows()
        if row["search_id"] in releases.index
    ]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=PLAN_COLUMNS)


def _selection_plan(search: pd.Series, release: pd.Series) -> pd.DataFrame:
    """:func:`selection_plans` of one search: its ``search`` row and its ``release`` row."""
    spec = yaml.safe_load(str(search["spec_yaml"]))
    num_train, epochs = int(search["num_train"]), int(search["epochs"])
    min_steps = int(spec.get("min_steps", plan.DEFAULT_MIN_STEPS))
    sizes = BatchSizeSpec.model_validate(spec["batch_size"])
    fraction, transfer = release.get("tuning_fraction"), release.get("transfer")
    status = dict.fromkeys(sizes.oversized(num_train), "dropped: B > N")
    for b in sizes.candidates(num_train):
        if plan.total_steps(num_train, b, epochs) < min_steps:
            status[b] = f"pruned: T < {min_steps}"
        elif transfer == "batch_size" and pd.notna(fraction) and b > fraction * num_train:
            status[b] = "not tuned: B > q₁·N"
        else:
            status[b] = "planned"
    planned = [b for b, what in status.items() if what == "planned"]
    with warnings.catch_warnings():  # δ > 1/N was the search's to warn about, when it planned
        warnings.simplefilter("ignore", UserWarning)
        rows = plan.plan(
            num_train, [float(search["epsilon_per_trial"])], float(search["delta"]), epochs, planned, min_steps
        )
    by_size = {row.batch_size: row for row in rows}
    return pd.DataFrame(
        [
            {
                "search_id": search["search_id"],
                "batch_size": b,
                "sample_rate": by_size[b].sample_rate if b in by_size else np.nan,
                "steps": by_size[b].steps if b in by_size else np.nan,
                "noise_multiplier": by_size[b].noise_multiplier if b in by_size else np.nan,
                "cumulative_noise": by_size[b].cumulative_noise if b in by_size else np.nan,
                "planned": what,
            }
            for b, what in status.items()
        ],
        columns=PLAN_COLUMNS,
    )


def task_difficulty(results: Results) -> pd.DataFrame:
    """Tasks ranked from easiest (rank 1) to hardest by best validation accuracy.

    Difficulty is measured by the mean over cells of the best (tuned-C) mean validation accuracy
    of a configuration over its replicates,
    over the (ε, E) pairs every task has when there are such shared pairs, else over each
    task's own cells. ``median_grad_norm`` is the median probe ‖g_i‖ of the best diagnosed
    trials (last diagnostic epoch), the quantity difficulty moves (paper §4).
    """
    best = best_configurations(results.tuned)
    if best.empty:
        return pd.DataFrame(columns=["rank", "task", "cells", "mean_best_val_accuracy", "median_grad_norm"])
    budgets = best.groupby("task")[["epsilon", "epochs"]].apply(lambda f: set(map(tuple, f.to_numpy())))
    shared = set.intersection(*budgets) if len(budgets) else set()
    in_shared = [(e, n) in shared for e, n in zip(best["epsilon"], best["epochs"], strict=True)]
    used = best[in_shared] if shared else best
    table = (
        used.groupby("task")
        .agg(cells=("val_accuracy", "size"), mean_best_val_accuracy=("val_accuracy", "mean"))
        .reset_index()
    )
    norms = grad_norm_samples(results)
    medians = norms.groupby("task")["grad_norm"].median() if not norms.empty else pd.Series(dtype=float)
    table["median_grad_norm"] = table["task"].map(medians)
    table = table.sort_values(["mean_best_val_accuracy", "task"], ascending=[False, True]).reset_index(drop=True)
    table.insert(0, "rank", np.arange(1, len(table) + 1))
    return table


def task_order(results: Results) -> list[str]:
    """Tasks from easiest to hardest (``task_difficulty``), then tasks without finished trials."""
    ranked = list(task_difficulty(results)["task"])
    return ranked + sorted(set(results.trials["task"]) - set(ranked))
