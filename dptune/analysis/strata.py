"""Strata: easy and hard classes, decided on validation accuracy, and each stratum's accuracy."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import pandas as pd

from dptune.analysis.results import EASY, HARD, STRATA, AnalysisError, Results, select_best


def class_strata(
    results: Results, hard_fraction: float = 0.5, hard_classes: Collection[str] | None = None
) -> pd.DataFrame:
    """Split each task's classes into ``easy`` and ``hard``.

    Default: the reference trial of a task is its best (validation) finished trial at the
    task's largest ε that recorded per-class accuracies; its ⌈hard_fraction·K⌉ classes of lowest
    *validation* accuracy (ties: smaller label; never test accuracy, which the strata are then
    used to report) are hard, at least one and at most K − 1 (0.5 = median
    split). With ``hard_classes`` (labels or class names, matched as text) exactly those
    classes are hard, in every task that has them.

    Returns one row per (task, label): ``class_name``, ``reference_accuracy``,
    ``reference_trial``, ``stratum``.
    """
    if not 0 < hard_fraction < 1:
        raise AnalysisError(f"hard_fraction must lie strictly between 0 and 1, got {hard_fraction}")
    columns = ["task", "label", "class_name", "reference_accuracy", "reference_trial", "stratum"]
    classes = results.classes[results.classes["val_accuracy"].notna()]
    with_classes = results.finished.merge(
        classes[["search_id", "trial_id"]].drop_duplicates(), on=["search_id", "trial_id"]
    )
    if with_classes.empty:
        if hard_classes:
            raise AnalysisError("hard classes were given but the results hold no per-class accuracies")
        return pd.DataFrame(columns=columns)
    loosest = with_classes[with_classes["epsilon"] == with_classes.groupby("task")["epsilon"].transform("max")]
    reference = select_best(loosest, ["task"])[["search_id", "trial_id", "task"]]
    table = classes.drop(columns="test_accuracy").merge(reference, on=["search_id", "trial_id", "task"])
    table = table.rename(columns={"val_accuracy": "reference_accuracy", "trial_id": "reference_trial"})
    table = table.sort_values(["task", "reference_accuracy", "label"]).reset_index(drop=True)
    if hard_classes:
        wanted = {str(c) for c in hard_classes}
        known = set(table["label"].astype(str)) | set(table["class_name"].astype(str))
        unknown = sorted(wanted - known)
        if unknown:
            raise AnalysisError(
                f"hard classes {', '.join(unknown)} are in no task; known labels and names: {', '.join(sorted(known))}"
            )
        hard = table["label"].astype(str).isin(wanted) | table["class_name"].astype(str).isin(wanted)
    else:
        rank = table.groupby("task").cumcount()
        size = table.groupby("task")["label"].transform("size")
        hard_count = np.clip(np.ceil(hard_fraction * size), 1, np.maximum(size - 1, 1))
        hard = rank < hard_count
    table["stratum"] = np.where(hard, HARD, EASY)
    return table[columns]


def stratum_accuracy(results: Results, strata: pd.DataFrame) -> pd.DataFrame:
    """Per trial: mean class test accuracy over ``easy`` and ``hard`` classes (columns of those names).

    Classes without a stratum are ignored; a trial without class rows gets NaN.
    """
    if strata.empty or results.classes.empty:
        return pd.DataFrame(columns=["search_id", "trial_id", *STRATA])
    classes = results.classes.merge(strata[["task", "label", "stratum"]], on=["task", "label"])
    if classes.empty:
        return pd.DataFrame(columns=["search_id", "trial_id", *STRATA])
    table = classes.pivot_table(
        index=["search_id", "trial_id"], columns="stratum", values="test_accuracy", aggfunc="mean"
    ).reindex(columns=list(STRATA))
    table.columns.name = None
    return table.reset_index()


def with_strata(trials: pd.DataFrame, accuracy: pd.DataFrame) -> pd.DataFrame:
    """``trials`` with the ``easy`` and ``hard`` class accuracies of ``stratum_accuracy`` joined on."""
    return trials.merge(accuracy, on=["search_id", "trial_id"], how="left")
