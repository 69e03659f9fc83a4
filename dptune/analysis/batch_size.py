"""Report section 6: cumulative noise σ√T against B, and the min-step rule of the search."""

from __future__ import annotations

import numpy as np
import pandas as pd
import yaml

from dptune.analysis.configurations import best_configurations
from dptune.analysis.results import AUTO_S, CELL, PLATEAU_TOLERANCE, Results
from dptune.plan import DEFAULT_MIN_STEPS, recommended_batch_size


def batch_size_noise(results: Results) -> pd.DataFrame:
    """Paper Figs. 6–7: per (task, ε, E, B) the recorded noise and the measured best accuracy.

    ``noise_multiplier`` σ and ``steps`` T are those the trials trained with (every trial of a
    (cell, B) shares them; configurations pruned by the min-step rule carry T but no σ);
    ``cumulative_noise`` = σ√T (the paper's quantity), ``per_step_noise`` = σ/B (the old per-step
    rule's noise std of the mean gradient, in units of C). ``test_accuracy``/``val_accuracy``
    are the means of the best tuned configuration at that B (over C and η, selected on mean
    validation accuracy); ``measured_best`` marks the B of the cell's best configuration.
    ``largest_feasible_batch_size`` is the largest B of the cell with T ≥ T_min (``min_steps``), and
    ``recommended_batch_size`` the B that ``dptune.plan.recommended_batch_size`` picks from these
    σ√T with ``PLATEAU_TOLERANCE``: among the B the search evaluated, with recorded σ (NaN where
    T_min is unknown). ``per_step_rule_batch_size`` is what the old per-step rule picks with the
    same function applied to σ/B and no step bound: the smallest B within the tolerance of the
    least per-step noise.
    """
    columns = [
        *CELL,
        "batch_size",
        "num_train",
        "noise_multiplier",
        "steps",
        "cumulative_noise",
        "per_step_noise",
        "pruned",
        "val_accuracy",
        "test_accuracy",
        "trial_id",
        "measured_best",
        "largest_feasible_batch_size",
        "recommended_batch_size",
        "per_step_rule_batch_size",
    ]
    trials = results.trials[results.trials["clipping"] != AUTO_S]
    if trials.empty:
        return pd.DataFrame(columns=columns)
    keys = [*CELL, "batch_size"]
    table = (
        trials.groupby(keys)
        .agg(num_train=("num_train", "max"), noise_multiplier=("noise_multiplier", "median"), steps=("steps", "max"))
        .reset_index()
    )
    pruned = trials[trials["status"] == "pruned_min_steps"].groupby(keys).size().rename("pruned_trials")
    table = table.merge(pruned.reset_index(), on=keys, how="left")
    table["pruned"] = table.pop("pruned_trials").fillna(0) > 0
    table["cumulative_noise"] = table["noise_multiplier"] * np.sqrt(table["steps"])
    table["per_step_noise"] = table["noise_multiplier"] / table["batch_size"]
    best = best_configurations(results.tuned, keys)[[*keys, "val_accuracy", "test_accuracy", "trial_id"]]
    table = table.merge(best, on=keys, how="left")
    winner = best_configurations(results.tuned)[[*CELL, "batch_size"]].rename(columns={"batch_size": "best_b"})
    table = table.merge(winner, on=CELL, how="left")
    table["measured_best"] = table.pop("best_b") == table["batch_size"]
    bounds = min_steps(results)
    table["min_steps"] = table["task"].map(bounds)
    feasible = table[table["steps"] >= table["min_steps"]]
    table = table.merge(
        feasible.groupby(CELL)["batch_size"].max().rename("largest_feasible_batch_size").reset_index(),
        on=CELL,
        how="left",
    )
    table["recommended_batch_size"] = table["per_step_rule_batch_size"] = np.nan
    for _, cell in table.groupby(CELL):
        rows = cell[np.isfinite(cell["cumulative_noise"])]
        if rows.empty:
            continue
        sizes, steps = rows["batch_size"].tolist(), rows["steps"].tolist()
        table.loc[cell.index, "per_step_rule_batch_size"] = recommended_batch_size(
            sizes, rows["per_step_noise"].tolist(), steps, 1, PLATEAU_TOLERANCE
        )
        if np.isfinite(cell["min_steps"].iloc[0]):
            choice = recommended_batch_size(
                sizes, rows["cumulative_noise"].tolist(), steps, int(cell["min_steps"].iloc[0]), PLATEAU_TOLERANCE
            )
            table.loc[cell.index, "recommended_batch_size"] = np.nan if choice is None else choice
    return table.sort_values(keys).reset_index(drop=True)[columns]


def batch_size_rule_check(noise: pd.DataFrame) -> pd.DataFrame:
    """Per cell of ``batch_size_noise``: the rule's recommended B against the measured best B.

    ``accuracy_gap`` = best − recommended test accuracy (points lost by following the rule; NaN
    when the recommended B was not evaluated); ``match`` says whether the two B agree;
    ``per_step_rule_batch_size`` is the old per-step rule's pick, for comparison.
    """
    rows = []
    for key, cell in noise.groupby(CELL):
        old = cell["per_step_rule_batch_size"].dropna()
        best = cell[cell["measured_best"]]
        recommended = cell["recommended_batch_size"].dropna()
        chosen = cell[cell["batch_size"] == recommended.iloc[0]] if len(recommended) else cell.iloc[0:0]
        best_b = int(best["batch_size"].iloc[0]) if len(best) else None
        rec_b = int(recommended.iloc[0]) if len(recommended) else None
        best_acc = float(best["test_accuracy"].iloc[0]) if len(best) else np.nan
        rec_acc = float(chosen["test_accuracy"].iloc[0]) if len(chosen) else np.nan
        rows.append(
            {
                **dict(zip(CELL, key, strict=True)),
                "recommended_batch_size": rec_b,
                "best_batch_size": best_b,
                "match": None if rec_b is None or best_b is None else rec_b == best_b,
                "recommended_accuracy": rec_acc,
                "best_accuracy": best_acc,
                "accuracy_gap": best_acc - rec_acc,
                "per_step_rule_batch_size": int(old.iloc[0]) if len(old) else None,
            }
        )
    return pd.DataFrame(
        rows,
        columns=[
            *CELL,
            "recommended_batch_size",
            "best_batch_size",
            "match",
            "recommended_accuracy",
            "best_accuracy",
            "accuracy_gap",
            "per_step_rule_batch_size",
        ],
    )


def min_steps(results: Results) -> dict[str, int]:
    """T_min of the min-step rule per task, read from the search specs.

    A spec without a ``min_steps`` key ran with the default, ``dptune.plan.DEFAULT_MIN_STEPS``.
    Tasks without a recorded spec (a search still running) are absent: their bound is unknown.
    With several searches of one task the smallest bound applies (every B one of them ran is
    feasible).
    """
    bounds: dict[str, int] = {}
    specs = results.search.drop_duplicates("search_id")[["search_id", "spec_yaml"]]
    for search_id, spec_yaml in specs.itertuples(index=False):
        spec = yaml.safe_load(spec_yaml) if spec_yaml else None
        if not isinstance(spec, dict):
            continue
        bound = int(spec.get("min_steps", DEFAULT_MIN_STEPS))
        for task in results.trials.loc[results.trials["search_id"] == search_id, "task"].unique():
            bounds[task] = min(bounds.get(task, bound), bound)
    return bounds
