"""Analysis of dptune results: load, join, stratify and summarise (torch-free, Ray-free).

Everything here works on pandas frames read from one or more result datasets written by
``dptune.records`` (a search that is still running reads consistently too), so notebooks and
``dptune.report`` share one implementation::

    results = load_results(["results/default"])
    strata = class_strata(results, hard_fraction=0.5)
    table = guideline_table(results, strata)

Conventions (the report states them too):

- A *task* is (dataset, fraction, backbone, PEFT); a *cell* is (task, ε, E). Frames carry the
  columns ``task``, ``epsilon`` (ε of (ε, δ)-DP) and ``epochs`` (E, passes over the data).
- Only trials with status ``ok`` count as finished; the others are listed, never ranked.
- *Tuned C* trials are those with a clip bound (``standard`` or ``normalized`` clipping); AUTO-S
  trials (``auto_s``) are the automatic-clipping comparison (paper Fig. 5).
- Selection is on validation accuracy, never test: the best trial of a group has the highest
  ``val_accuracy``; ties go to the lower final ``train_loss``, then to the smaller trial id.
  Reported accuracies are the selected trial's test accuracy.
- A *configuration* is one (C, B, η₀) of a cell, run R ≥ 1 times with fresh coins (replicates,
  records schema 3; older trials are each their own configuration). Views that pick a best
  setting (heatmaps, Fig. 2, AUTO-S, the batch-size rule, the guideline table, difficulty)
  rank configurations by mean validation accuracy over replicates (``rank_configurations``) and
  report their mean accuracies; with R = 1 this is the best-trial rule above. Views of one
  trial's probe (diagnostics, gradient norms, strata reference) keep the best trial.
  Uncertainty (intervals, the set within noise of the best, bootstrap intervals of the optimal
  C and B) is defined in ``rank_configurations``, ``best_configurations`` and
  ``optimal_setting_intervals``.
- Accuracies are fractions in [0, 1]; ``near_optimal`` and losses are in the same units
  (0.01 = one percentage point).
- Class accuracy of a stratum is the unweighted mean of its classes' test accuracies.
- C is continuous when the search spec samples it from a range (TPE, random): it is then binned
  on a logarithmic grid of ``BINS_PER_DECADE`` bins per decade aligned to powers of ten
  (``clip_bin`` holds the bin's geometric centre); from a list of values (the grid sampler) it is
  exact. Without a recorded spec (a running search), C is binned above ``MAX_EXACT_LEVELS``
  distinct values. B (``batch_bin``) is always a list in a spec: binned only above that count.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow.fs as pafs
import yaml
from scipy import stats

from dptune.errors import DptuneError
from dptune.plan import DEFAULT_MIN_STEPS, DEFAULT_TOLERANCE, recommended_batch_size
from dptune.records import TABLES, read_table

#: Status of a trial that trained to the end; only these are ranked.
FINISHED = "ok"
#: Clipping rule of the automatic-clipping comparison (Bu et al. 2023).
AUTO_S = "auto_s"
#: Columns that identify a task and a cell.
TASK_COLUMNS: tuple[str, ...] = ("dataset", "fraction", "backbone", "peft")
CELL: list[str] = ["task", "epsilon", "epochs"]
#: Difficulty strata of classes.
EASY, HARD = "easy", "hard"
STRATA: tuple[str, ...] = (EASY, HARD)
#: Up to this many distinct values, C and B are shown exactly; above it they are log-binned.
MAX_EXACT_LEVELS = 12
BINS_PER_DECADE = 4
#: Relative width of the σ√T plateau of the batch-size rule (``dptune.plan``'s default).
PLATEAU_TOLERANCE = DEFAULT_TOLERANCE
#: Default tolerance of "near-optimal" (accuracy units: 0.01 = one percentage point).
NEAR_OPTIMAL = 0.01
#: Two-sided confidence of the intervals and of the within-noise rule of configurations.
CONFIDENCE = 0.95

_SELECTION_ORDER = (["val_accuracy", "train_loss", "search_id", "trial_id"], [False, True, True, True])


class AnalysisError(DptuneError, ValueError):
    """Results or options that cannot be analysed; the message names the problem and the choices."""


@dataclass(frozen=True)
class Results:
    """The tables of one or more result datasets, concatenated, with derived columns.

    ``trials`` gains ``task``, ``clip_bin`` and ``batch_bin`` (see the module docstring);
    ``classes`` and ``diagnostics`` gain ``task``, ``epsilon`` and ``epochs`` of their trial.
    ``clip_binned``/``batch_binned`` say whether C/B were binned (else exact values).
    ``release`` holds the releases of end-to-end private searches, whose per-run records are not
    in their dataset (they stay inside the data owner's trust boundary).
    """

    sources: tuple[str, ...]
    trials: pd.DataFrame
    epochs: pd.DataFrame
    classes: pd.DataFrame
    diagnostics: pd.DataFrame
    search: pd.DataFrame
    clip_binned: bool
    batch_binned: bool
    release: pd.DataFrame

    @property
    def finished(self) -> pd.DataFrame:
        """Trials with status ``ok`` and a finite validation accuracy (``finished_trials``)."""
        return finished_trials(self.trials)

    @property
    def tuned(self) -> pd.DataFrame:
        """Finished trials with a tuned clip bound (any clipping rule but AUTO-S)."""
        finished = self.finished
        return finished[finished["clipping"] != AUTO_S]

    @property
    def auto_s(self) -> pd.DataFrame:
        """Finished AUTO-S trials."""
        finished = self.finished
        return finished[finished["clipping"] == AUTO_S]


def check_results_paths(paths: Sequence[str]) -> None:
    """Raise ``AnalysisError`` unless every path is a results dataset (before reading anything).

    A dataset is a folder (local path or URI) holding a ``trials/`` or ``search/`` folder, as
    ``dptune.search`` writes it.
    """
    if not paths:
        raise AnalysisError("no results given: pass one or more result dataset folders")
    for path in paths:
        if "://" in path:
            filesystem, root = pafs.FileSystem.from_uri(path)
        else:
            filesystem, root = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
        info = filesystem.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise AnalysisError(f"{path}: no such results dataset (the folder does not exist)")
        if info.type != pafs.FileType.Directory:
            raise AnalysisError(f"{path}: not a results dataset (a file, expected a folder)")
        tables = [filesystem.get_file_info(f"{root}/{name}").type for name in ("trials", "search")]
        if all(kind != pafs.FileType.Directory for kind in tables):
            raise AnalysisError(
                f"{path}: not a dptune results dataset: expected a trials/ or search/ folder "
                f"(tables {', '.join(TABLES)}, written by python -m dptune.search)"
            )


def task_label(dataset: str, fraction: float, backbone: str, peft: str) -> str:
    """Human name of a task, e.g. ``20newsgroups (10%) · minilm · head``."""
    share = "" if fraction >= 1 else f" ({fraction:.0%})"
    return f"{dataset}{share} · {backbone} · {peft}"


def log_bins(values: pd.Series, continuous: bool | None = None, max_levels: int = MAX_EXACT_LEVELS,
             bins_per_decade: int = BINS_PER_DECADE) -> tuple[pd.Series, bool]:
    """Map positive ``values`` to log-grid bins; return (representatives, whether binned).

    ``continuous`` says whether the values were sampled from a range (bin them) or a list (keep
    them); when unknown (``None``) they are binned only above ``max_levels`` distinct values.
    Value v falls in bin k = ⌊bins_per_decade·log10 v⌋ and is represented by the bin's geometric
    centre 10^((k + ½)/bins_per_decade); the grid is aligned to powers of ten, so bins agree
    across searches.
    """
    finite = values[np.isfinite(values) & (values > 0)]
    if continuous is False or (continuous is None and finite.nunique() <= max_levels):
        return values.astype(float), False
    index = np.floor(np.log10(values.astype(float)) * bins_per_decade + 1e-9)
    centres = 10.0 ** ((index + 0.5) / bins_per_decade)
    return pd.Series(np.round(centres, 12), index=values.index), True


def _with_trial_keys(frame: pd.DataFrame, trials: pd.DataFrame) -> pd.DataFrame:
    keys = trials[["search_id", "trial_id", *CELL]]
    return frame.merge(keys, on=["search_id", "trial_id"], how="inner")


def load_results(paths: Sequence[str]) -> Results:
    """Read and join every table of the datasets at ``paths`` (see ``check_results_paths``).

    A dataset given twice, or two datasets sharing a search, contribute each trial once.
    """
    check_results_paths(paths)
    tables = {name: pd.concat([read_table(path, name) for path in paths], ignore_index=True) for name in TABLES}
    trials = tables["trials"].drop_duplicates(["search_id", "trial_id"], keep="last").reset_index(drop=True)
    trials["task"] = pd.Series([task_label(*row) for row in trials[list(TASK_COLUMNS)].itertuples(index=False)],
                               index=trials.index, dtype="str")
    tuned = trials["clipping"] != AUTO_S
    trials["clip_bin"], clip_binned = log_bins(trials["clip_bound"].where(tuned, np.nan),
                                               _sampled_from_range(tables["search"], "clip_bound"))
    trials["batch_bin"], batch_binned = log_bins(trials["batch_size"].astype(float))
    dedupe = {"epochs": ["epoch"], "classes": ["label"], "diagnostics": ["epoch"]}
    joined = {
        name: _with_trial_keys(tables[name].drop_duplicates(["search_id", "trial_id", *extra], keep="last"), trials)
        for name, extra in dedupe.items()
    }
    search = tables["search"].drop_duplicates().reset_index(drop=True)
    return Results(sources=tuple(paths), trials=trials, search=search, clip_binned=clip_binned,
                   batch_binned=batch_binned, release=tables["release"].drop_duplicates().reset_index(drop=True),
                   **joined)


def _sampled_from_range(search: pd.DataFrame, key: str) -> bool | None:
    """Whether any search spec samples ``key`` from a range (``low``/``high``) rather than ``values``.

    None when no spec is recorded (a search still running writes its ``search`` rows at the end).
    """
    specs = [yaml.safe_load(text) for text in search["spec_yaml"].dropna().unique()]
    ranges = [spec[key] for spec in specs if isinstance(spec, dict) and isinstance(spec.get(key), dict)]
    return any("low" in spec for spec in ranges) if ranges else None


def finished_trials(trials: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``trials`` that may be ranked: status ``ok`` and a finite validation accuracy
    (a trial stopped early or failed is listed, never ranked)."""
    return trials[(trials["status"] == FINISHED) & np.isfinite(trials["val_accuracy"])]


def select_best(trials: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """One row per group of ``by``: the trial with the best validation accuracy (module rules)."""
    columns, ascending = _SELECTION_ORDER
    ordered = trials.sort_values(columns, ascending=ascending, na_position="last", kind="mergesort")
    return ordered.drop_duplicates(list(by), keep="first").sort_values(list(by)).reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# Coverage: what the results hold and what is missing
# ---------------------------------------------------------------------------------------------

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
    """Plain-language notes on what the results lack (empty when nothing is missing)."""
    notes: list[str] = []
    trials = results.trials
    if trials.empty and not results.release.empty:
        return ["per-run records: an end-to-end private search keeps them inside the data owner's trust boundary, "
                "so only its release is shown"]
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
    if results.diagnostics.empty:
        notes.append("no diagnostics recorded (trials ran with diagnostics off): sections 3, 4 and 7 are empty")
    if results.classes["test_accuracy"].notna().sum() == 0:
        notes.append("no per-class accuracies recorded: classes cannot be split into easy and hard")
    if results.auto_s.empty:
        notes.append("no AUTO-S trials (training.compare_auto_s was off): section 5 is empty")
    if results.finished["epsilon"].nunique() < 2:
        notes.append("only one privacy budget ε: trends against ε cannot be shown")
    if results.finished["epochs"].nunique() < 2:
        notes.append("only one epoch budget E: trends against E cannot be shown")
    return notes


def privacy_statements(results: Results) -> list[str]:
    """What each search's (ε, δ) covers, as recorded with it (``search.guarantee``), one per search;
    for results written before the guarantee was recorded, a statement of what is known."""
    search = results.search
    if search.empty:
        return []
    statements = []
    for search_id, rows in search.groupby("search_id", sort=True):
        if rows["guarantee"].notna().any():
            text = rows["guarantee"].dropna().iloc[0]
        elif (rows["schema_version"] < 2).any():
            text = ("written by dptune before schema 2, whose trials all drew their noise and batches from the "
                    "search's one seed: no DP guarantee and no composition bound holds for them.")
        else:
            text = "no statement of what (ε, δ) covers was recorded with this search."
        statements.append(f"{search_id}: {text}")
    return statements


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
    table = used.groupby("task").agg(cells=("val_accuracy", "size"),
                                     mean_best_val_accuracy=("val_accuracy", "mean")).reset_index()
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


# ---------------------------------------------------------------------------------------------
# Strata: easy and hard classes
# ---------------------------------------------------------------------------------------------

def class_strata(results: Results, hard_fraction: float = 0.5,
                 hard_classes: Collection[str] | None = None) -> pd.DataFrame:
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
    with_classes = results.finished.merge(classes[["search_id", "trial_id"]].drop_duplicates(),
                                          on=["search_id", "trial_id"])
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
            raise AnalysisError(f"hard classes {', '.join(unknown)} are in no task; known labels and names: "
                                f"{', '.join(sorted(known))}")
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
    table = classes.pivot_table(index=["search_id", "trial_id"], columns="stratum", values="test_accuracy",
                                aggfunc="mean").reindex(columns=list(STRATA))
    table.columns.name = None
    return table.reset_index()


def with_strata(trials: pd.DataFrame, accuracy: pd.DataFrame) -> pd.DataFrame:
    """``trials`` with the ``easy`` and ``hard`` class accuracies of ``stratum_accuracy`` joined on."""
    return trials.merge(accuracy, on=["search_id", "trial_id"], how="left")


# ---------------------------------------------------------------------------------------------
# Section 1 and 2: accuracy over (C, B), optimal C and B
# ---------------------------------------------------------------------------------------------

def accuracy_grid(results: Results, accuracy: pd.DataFrame | None = None) -> pd.DataFrame:
    """Paper Fig. 1: per cell and (C, B) bin, the best configuration over η (and any other option).

    One row per (task, ε, E, clip_bin, batch_bin) with the selected configuration's (best mean
    validation accuracy over its replicates, ``rank_configurations``) mean ``val_accuracy``,
    ``test_accuracy``, ``train_loss``, its ``learning_rate``, ``replicates``, ``search_id``/``trial_id``
    of its first replicate and ``trials`` (finished trials in the bin). With ``accuracy``
    (``stratum_accuracy``), also the mean ``easy``/``hard`` class accuracies over its replicates.
    """
    tuned = results.tuned
    keys = [*CELL, "clip_bin", "batch_bin"]
    means = list(STRATA) if accuracy is not None else []
    best = rank_configurations(with_strata(tuned, accuracy) if means else tuned, keys, means=means)
    best = best[best["rank"] == 1]
    counts = tuned.groupby(keys).size().rename("trials").reset_index()
    return best.merge(counts, on=keys)[[*keys, "val_accuracy", "test_accuracy", "train_loss", "learning_rate",
                                        "base_learning_rate", "replicates", *means, "search_id", "trial_id",
                                        "trials"]].reset_index(drop=True)


def unfinished_bins(results: Results) -> pd.DataFrame:
    """(C, B) bins of each cell that hold tuned-C trial records but no finished trial.

    ``outcome`` is ``pruned`` when the min-step rule removed the configuration, else ``failed``
    (diverged, error or stopped early).
    """
    keys = [*CELL, "clip_bin", "batch_bin"]
    trials = results.trials[results.trials["clipping"] != AUTO_S]
    finished = results.tuned[keys].drop_duplicates()
    rest = trials.merge(finished, on=keys, how="left", indicator=True)
    rest = rest[rest["_merge"] == "left_only"]
    outcome = rest.groupby(keys)["status"].agg(lambda s: "pruned" if (s == "pruned_min_steps").any() else "failed")
    return outcome.rename("outcome").reset_index()


def optimal_settings(results: Results, near_optimal: float = NEAR_OPTIMAL) -> pd.DataFrame:
    """Paper Fig. 2: per cell the best (C, B, η) and the spread of near-optimal settings.

    Near-optimal trials are the cell's tuned trials with validation accuracy within
    ``near_optimal`` of the best; ``clip_low``/``clip_high`` and ``batch_low``/``batch_high``
    are their extreme C and B, ``near_optimal_trials`` their count (≥ 1: the best is one).
    """
    if near_optimal < 0:
        raise AnalysisError(f"near_optimal must be ≥ 0 (accuracy units), got {near_optimal}")
    tuned = results.tuned
    best = select_best(tuned, CELL)
    if best.empty:
        return pd.DataFrame(columns=[*CELL, "clip_bound", "batch_size", "learning_rate", "val_accuracy",
                                     "test_accuracy", "clip_low", "clip_high", "batch_low", "batch_high",
                                     "near_optimal_trials"])
    threshold = best[[*CELL, "val_accuracy"]].rename(columns={"val_accuracy": "best_val"})
    near = tuned.merge(threshold, on=CELL)
    near = near[near["val_accuracy"] >= near["best_val"] - near_optimal - 1e-9]  # inclusive, float-safe
    spread = near.groupby(CELL).agg(clip_low=("clip_bound", "min"), clip_high=("clip_bound", "max"),
                                    batch_low=("batch_size", "min"), batch_high=("batch_size", "max"),
                                    near_optimal_trials=("trial_id", "size")).reset_index()
    columns = [*CELL, "clip_bound", "batch_size", "learning_rate", "base_learning_rate", "val_accuracy",
               "test_accuracy", "search_id", "trial_id"]
    return best[columns].merge(spread, on=CELL)


# ---------------------------------------------------------------------------------------------
# Sections 3 and 4: gradient norms and retention weights
# ---------------------------------------------------------------------------------------------

def diagnosed_best(results: Results) -> pd.DataFrame:
    """Per cell, the best tuned trial that recorded diagnostics, with its last diagnostic row.

    Columns of the trial plus ``diagnostic_epoch``, ``grad_norms``, ``labels``,
    ``optimal_clip_bound``, ``mse_bias``, ``mse_variance``, ``noise_multiplier``, ``dimension``.
    """
    return select_best(last_diagnostics(results), CELL)


def last_diagnostics(results: Results) -> pd.DataFrame:
    """Tuned finished trials joined with their last diagnostic row (latest probe epoch)."""
    diagnostics = results.diagnostics.sort_values("epoch").drop_duplicates(["search_id", "trial_id"], keep="last")
    columns = ["search_id", "trial_id", "epoch", "grad_norms", "labels", "optimal_clip_bound", "mse_bias",
               "mse_variance", "dimension"]
    last = diagnostics[columns].rename(columns={"epoch": "diagnostic_epoch"})
    return results.tuned.merge(last, on=["search_id", "trial_id"])


def grad_norm_samples(results: Results, strata: pd.DataFrame | None = None) -> pd.DataFrame:
    """Paper Fig. 3: per-example gradient norms ‖g_i‖ of each cell's best diagnosed trial.

    Long frame: one row per probe example with ``task``, ``epsilon``, ``epochs``, ``trial_id``,
    ``diagnostic_epoch``, ``label``, ``grad_norm`` and (with ``strata``) ``stratum``.
    """
    best = diagnosed_best(results)
    columns = [*CELL, "search_id", "trial_id", "diagnostic_epoch", "label", "grad_norm"]
    if best.empty:
        return pd.DataFrame(columns=[*columns, "stratum"] if strata is not None else columns)
    long = best[[*CELL, "search_id", "trial_id", "diagnostic_epoch", "grad_norms", "labels"]]
    long = long.explode(["grad_norms", "labels"]).dropna(subset=["grad_norms"])
    long = long.rename(columns={"grad_norms": "grad_norm", "labels": "label"}).astype(
        {"grad_norm": float, "label": "int64"})[columns].reset_index(drop=True)
    if strata is not None:
        long = long.merge(strata[["task", "label", "stratum"]], on=["task", "label"], how="left")
    return long


def retention_weights(grad_norms: Sequence[float] | np.ndarray, labels: Sequence[int] | np.ndarray,
                      clip_bounds: Sequence[float] | np.ndarray) -> pd.DataFrame:
    """Per-class retention weights of clipping (paper Eq. 3) at each clip bound.

    w_y(C) = (1/n_y) Σ_{i: y_i = y} min(1, C/‖g_i‖), with min(1, C/0) = 1. Returns one row per
    (label, clip_bound) with ``retention_weight`` in (0, 1] and ``examples`` = n_y.
    """
    norms = np.asarray(grad_norms, dtype=float)
    bounds = np.asarray(clip_bounds, dtype=float)
    if norms.shape != np.shape(labels):
        raise AnalysisError(f"grad_norms and labels differ in length ({norms.size} and {np.size(labels)})")
    if np.any(bounds <= 0):
        raise AnalysisError(f"clip bounds must be positive, got {bounds[bounds <= 0].tolist()}")
    with np.errstate(divide="ignore"):
        factors = np.minimum(1.0, bounds[None, :] / norms[:, None])
    frame = pd.DataFrame(factors, columns=bounds)
    frame["label"] = np.asarray(labels)
    weights = frame.groupby("label").mean().rename_axis(columns="clip_bound").stack()
    table = weights.rename("retention_weight").reset_index()
    table["examples"] = table["label"].map(frame["label"].value_counts())
    return table


def retention_curves(results: Results, strata: pd.DataFrame,
                     clip_bounds: Sequence[float] | None = None) -> pd.DataFrame:
    """Paper Fig. 4: mean w_y(C) over the easy and the hard classes of each cell's best diagnosed trial.

    ``clip_bounds`` default to the task's C grid (the ``clip_bin`` values of its tuned trials).
    One row per (task, ε, E, clip_bound, stratum) with ``retention_weight`` (unweighted mean of
    w_y over the stratum's classes).
    """
    columns = [*CELL, "clip_bound", "stratum", "retention_weight"]
    best = diagnosed_best(results)
    if best.empty or strata.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for trial in best.itertuples(index=False):
        grid = clip_bounds if clip_bounds is not None else sorted(
            results.tuned.loc[results.tuned["task"] == trial.task, "clip_bin"].unique())
        weights = retention_weights(trial.grad_norms, trial.labels, grid)
        weights = weights.merge(strata[strata["task"] == trial.task][["label", "stratum"]], on="label")
        means = weights.groupby(["clip_bound", "stratum"])["retention_weight"].mean().reset_index()
        rows.append(means.assign(task=trial.task, epsilon=trial.epsilon, epochs=trial.epochs))
    return pd.concat(rows, ignore_index=True)[columns]


def stratum_accuracy_by_clip(results: Results, strata: pd.DataFrame) -> pd.DataFrame:
    """Class accuracy per stratum against C: per (cell, clip_bin) the best configuration over B and η.

    Columns: task, ε, E, clip_bin, trial_id (its first replicate), test_accuracy, easy, hard
    (means over its replicates).
    """
    trials = with_strata(results.tuned, stratum_accuracy(results, strata))
    table = best_configurations(trials, [*CELL, "clip_bin"], means=STRATA)
    return table[[*CELL, "clip_bin", "trial_id", "test_accuracy", *STRATA]]


# ---------------------------------------------------------------------------------------------
# Section 5: AUTO-S against tuned C
# ---------------------------------------------------------------------------------------------

def auto_s_comparison(results: Results, strata: pd.DataFrame) -> pd.DataFrame:
    """Paper Fig. 5: per cell with AUTO-S trials, the best tuned-C and the best AUTO-S configuration.

    Columns ``tuned_*`` and ``auto_s_*`` for test accuracy, easy and hard class accuracy (means
    over the configuration's replicates) and ``trial_id`` (its first replicate);
    ``gap`` = tuned − AUTO-S test accuracy (positive: tuning C helps).
    """
    accuracy = stratum_accuracy(results, strata)
    measures = ["test_accuracy", *STRATA, "trial_id"]
    parts = []
    for name, trials in (("tuned", results.tuned), ("auto_s", results.auto_s)):
        best = best_configurations(with_strata(trials, accuracy), CELL, means=STRATA)
        parts.append(best[[*CELL, *measures]].rename(columns={m: f"{name}_{m}" for m in measures}))
    table = parts[0].merge(parts[1], on=CELL, how="inner")
    table["gap"] = table["tuned_test_accuracy"] - table["auto_s_test_accuracy"]
    return table


# ---------------------------------------------------------------------------------------------
# Section 6: cumulative noise σ√T against B and the min-step rule
# ---------------------------------------------------------------------------------------------

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
    columns = [*CELL, "batch_size", "num_train", "noise_multiplier", "steps", "cumulative_noise", "per_step_noise",
               "pruned", "val_accuracy", "test_accuracy", "trial_id", "measured_best",
               "largest_feasible_batch_size", "recommended_batch_size", "per_step_rule_batch_size"]
    trials = results.trials[results.trials["clipping"] != AUTO_S]
    if trials.empty:
        return pd.DataFrame(columns=columns)
    keys = [*CELL, "batch_size"]
    table = trials.groupby(keys).agg(num_train=("num_train", "max"), noise_multiplier=("noise_multiplier", "median"),
                                     steps=("steps", "max")).reset_index()
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
    table = table.merge(feasible.groupby(CELL)["batch_size"].max().rename("largest_feasible_batch_size").reset_index(),
                        on=CELL, how="left")
    table["recommended_batch_size"] = table["per_step_rule_batch_size"] = np.nan
    for _, cell in table.groupby(CELL):
        rows = cell[np.isfinite(cell["cumulative_noise"])]
        if rows.empty:
            continue
        sizes, steps = rows["batch_size"].tolist(), rows["steps"].tolist()
        table.loc[cell.index, "per_step_rule_batch_size"] = recommended_batch_size(
            sizes, rows["per_step_noise"].tolist(), steps, 1, PLATEAU_TOLERANCE)
        if np.isfinite(cell["min_steps"].iloc[0]):
            choice = recommended_batch_size(sizes, rows["cumulative_noise"].tolist(), steps,
                                            int(cell["min_steps"].iloc[0]), PLATEAU_TOLERANCE)
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
        rows.append({**dict(zip(CELL, key, strict=True)), "recommended_batch_size": rec_b, "best_batch_size": best_b,
                     "match": None if rec_b is None or best_b is None else rec_b == best_b,
                     "recommended_accuracy": rec_acc, "best_accuracy": best_acc, "accuracy_gap": best_acc - rec_acc,
                     "per_step_rule_batch_size": int(old.iloc[0]) if len(old) else None})
    return pd.DataFrame(rows, columns=[*CELL, "recommended_batch_size", "best_batch_size", "match",
                                       "recommended_accuracy", "best_accuracy", "accuracy_gap",
                                       "per_step_rule_batch_size"])


# ---------------------------------------------------------------------------------------------
# Section 7: clipping diagnostics
# ---------------------------------------------------------------------------------------------

def clipping_diagnostics(results: Results) -> pd.DataFrame:
    """Per cell: tuned C against C* of Theorem 5.2, and the MSE split at the tuned C.

    C* = N_{C*}ᵀ G_{C*} / (N_{C*}ᵀ N_{C*} + σ² d) is recorded per trial at its last diagnostic
    epoch (it depends on that trial's model and σ). Columns: ``tuned_clip_bound`` (the best
    trial's C), ``optimal_clip_bound`` (C* of that trial), ``optimal_clip_low/median/high``
    (C* over all diagnosed tuned trials of the cell), ``mse_bias``/``mse_variance`` of the best
    trial (squared gradient units) and ``bias_share`` = bias / (bias + variance).
    """
    diagnosed = last_diagnostics(results)
    columns = [*CELL, "trial_id", "tuned_clip_bound", "optimal_clip_bound", "optimal_clip_low",
               "optimal_clip_median", "optimal_clip_high", "mse_bias", "mse_variance", "bias_share",
               "diagnosed_trials"]
    if diagnosed.empty:
        return pd.DataFrame(columns=columns)
    best = select_best(diagnosed, CELL).rename(columns={"clip_bound": "tuned_clip_bound"})
    spread = diagnosed.groupby(CELL)["optimal_clip_bound"].agg(
        optimal_clip_low="min", optimal_clip_median="median", optimal_clip_high="max",
        diagnosed_trials="size").reset_index()
    table = best.merge(spread, on=CELL)
    table["bias_share"] = table["mse_bias"] / (table["mse_bias"] + table["mse_variance"])
    return table[columns]


def mse_split(results: Results) -> pd.DataFrame:
    """Per diagnosed tuned trial: C, C*, clipping bias, noise variance and their sum (the MSE).

    The paper's MSE(C) = bias²(C) + variance(C) trade-off, one point per trial at its own C.
    """
    diagnosed = last_diagnostics(results)
    table = diagnosed[[*CELL, "trial_id", "clip_bound", "batch_size", "optimal_clip_bound", "mse_bias",
                       "mse_variance", "val_accuracy"]].copy()
    table["mse_total"] = table["mse_bias"] + table["mse_variance"]
    return table.reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# Section 8: the guideline table and the cost of one fixed (C, B)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FixedSetting:
    """The single (C, B) used across all cells: the grid point with best mean validation accuracy.

    Only (C, B) bins evaluated (with a finished trial) in every cell are eligible; η (and any
    other option) stays best per cell on validation. ``mean_val_accuracy`` is over cells.
    """

    clip_bin: float
    batch_bin: float
    mean_val_accuracy: float
    cells: int


def fixed_setting(grid: pd.DataFrame) -> FixedSetting | None:
    """The ``FixedSetting`` of an ``accuracy_grid``; ``None`` when no (C, B) covers every cell.

    Ties in mean validation accuracy go to the smaller C, then the smaller B.
    """
    if grid.empty:
        return None
    cells = grid[CELL].drop_duplicates().shape[0]
    means = grid.groupby(["clip_bin", "batch_bin"]).agg(cells=("val_accuracy", "size"),
                                                        mean_val_accuracy=("val_accuracy", "mean")).reset_index()
    eligible = means[means["cells"] == cells]
    if eligible.empty:
        return None
    best = eligible.sort_values(["mean_val_accuracy", "clip_bin", "batch_bin"],
                                ascending=[False, True, True]).iloc[0]
    return FixedSetting(clip_bin=float(best["clip_bin"]), batch_bin=float(best["batch_bin"]),
                        mean_val_accuracy=float(best["mean_val_accuracy"]), cells=int(cells))


def guideline_table(results: Results, strata: pd.DataFrame) -> tuple[pd.DataFrame, FixedSetting | None]:
    """Paper Table 1 from these results: per cell the best (C, B, η) and the cost of a fixed (C, B).

    Per cell (task, ε, E): the best tuned configuration on mean validation accuracy
    (``best_configurations``) — ``clip_bound``, ``batch_size``, ``learning_rate`` (η used),
    ``base_learning_rate`` (η₀), ``clipping``, ``optimizer``, ``replicates``, mean ``val_accuracy``
    and ``test_accuracy`` with ``test_low``/``test_high`` (its interval), ``within_noise`` of
    ``configurations``, mean ``easy``/``hard`` class accuracy — then the configuration at the
    ``FixedSetting`` (η best per cell): ``fixed_test_accuracy``, ``fixed_hard`` and the losses
    ``loss`` = best − fixed test accuracy, ``hard_loss`` = best − fixed hard-class accuracy (NaN
    without a fixed setting). With one replicate per configuration these are the best trials.
    """
    accuracy = stratum_accuracy(results, strata)
    best = best_configurations(with_strata(results.tuned, accuracy), CELL, means=STRATA)
    columns = [*CELL, "clip_bound", "batch_size", "learning_rate", "base_learning_rate", "clipping",
               "optimizer", "replicates", "val_accuracy", "test_accuracy", "test_low", "test_high", "within_noise",
               "configurations", *STRATA, "search_id", "trial_id"]
    table = best[columns].copy()
    grid = accuracy_grid(results, accuracy)
    setting = fixed_setting(grid)
    if setting is None:
        for name in ("fixed_test_accuracy", "fixed_hard", "loss", "hard_loss"):
            table[name] = np.nan
        return table, None
    fixed = grid[(grid["clip_bin"] == setting.clip_bin) & (grid["batch_bin"] == setting.batch_bin)]
    fixed = fixed[[*CELL, "test_accuracy", HARD]]
    table = table.merge(fixed.rename(columns={"test_accuracy": "fixed_test_accuracy", HARD: "fixed_hard"}),
                        on=CELL, how="left")
    table["loss"] = table["test_accuracy"] - table["fixed_test_accuracy"]
    table["hard_loss"] = table[HARD] - table["fixed_hard"]
    return table, setting


def _direction(harder: float, easier: float, rel_tol: float = 1e-9) -> str:
    if math.isclose(harder, easier, rel_tol=rel_tol):
        return "same"
    return "larger" if harder > easier else "smaller"


def trends(guideline: pd.DataFrame, difficulty: pd.DataFrame) -> pd.DataFrame:
    """The shape of paper Table 1: how the best C and B move when the problem gets harder.

    Conditions (each compared within otherwise equal cells): ``tighter privacy`` (smallest ε
    against largest ε, per task and E), ``fewer epochs`` (smallest E against largest E, per task
    and ε), ``harder task`` (hardest against easiest task of ``difficulty``, per ε and E).
    One row per condition present with the counts of comparisons where the best C (and B) was
    larger, smaller or the same, and the comparisons spelt out.
    """
    comparisons: list[tuple[str, str, pd.Series, pd.Series]] = []
    for condition, factor, within in (("tighter privacy (smallest vs largest ε)", "epsilon", ["task", "epochs"]),
                                      ("fewer epochs (smallest vs largest E)", "epochs", ["task", "epsilon"])):
        for key, group in guideline.groupby(within):
            if group[factor].nunique() < 2:
                continue
            ordered = group.sort_values(factor)
            label = ", ".join(f"{name}={value:g}" if isinstance(value, float) else f"{value}"
                              for name, value in zip(within, key, strict=True))
            comparisons.append((condition, label, ordered.iloc[0], ordered.iloc[-1]))
    ranked = list(difficulty["task"]) if len(difficulty) else []
    if len(ranked) >= 2:
        for key, group in guideline.groupby(["epsilon", "epochs"]):
            present = group.set_index("task")
            tasks = [t for t in ranked if t in present.index]
            if len(tasks) >= 2:
                comparisons.append(("harder task (hardest vs easiest)", f"ε={key[0]:g}, E={key[1]}",
                                    present.loc[tasks[-1]], present.loc[tasks[0]]))
    rows = []
    for condition in dict.fromkeys(c[0] for c in comparisons):
        items = [c for c in comparisons if c[0] == condition]
        row: dict[str, object] = {"condition": condition, "comparisons": len(items)}
        for column, name in (("clip_bound", "C"), ("batch_size", "B")):
            moves = [_direction(float(harder[column]), float(easier[column])) for _, _, harder, easier in items]
            row[f"best {name}"] = ", ".join(f"{moves.count(m)}× {m}" for m in ("larger", "smaller", "same")
                                            if moves.count(m))
        row["details"] = "; ".join(
            f"{label}: C {easier['clip_bound']:.3g}→{harder['clip_bound']:.3g}, "
            f"B {int(easier['batch_size'])}→{int(harder['batch_size'])}" for _, label, harder, easier in items)
        rows.append(row)
    return pd.DataFrame(rows, columns=["condition", "comparisons", "best C", "best B", "details"])


# ---------------------------------------------------------------------------------------------
# Search metadata
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Configurations, replicates and uncertainty
# ---------------------------------------------------------------------------------------------

def normal_quantile(confidence: float) -> float:
    """The two-sided standard normal quantile of ``confidence`` (1.96 at 0.95)."""
    return float(stats.norm.ppf(0.5 + confidence / 2))


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise AnalysisError(f"confidence must lie strictly between 0 and 1 (e.g. 0.95), got {confidence}")


def rank_configurations(trials: pd.DataFrame, by: Sequence[str] = tuple(CELL), confidence: float = CONFIDENCE,
                        means: Sequence[str] = ()) -> pd.DataFrame:
    """One row per configuration of finished ``trials``, ranked within each group of ``by``.

    A configuration is ``[*by, "configuration_id"]``: the replicates (fresh-coin runs) of one
    sampled (C, B, η₀) of a cell. ``configuration_id`` is content-based (cell key and a digest of
    the parameters), so replicates recorded by a resumed or repeated search pool into one
    configuration; trials of datasets before schema 3 are each their own configuration (R = 1).

    Columns: ``by``, ``configuration_id``, the parameters of its first replicate (``clip_bound``,
    ``batch_size``, ``learning_rate``, ``base_learning_rate``, ``clipping``, ``optimizer``,
    ``clip_bin``/``batch_bin`` where present, ``search_id``/``trial_id`` of replicate 0 or the
    lowest recorded), ``replicates`` R; ``val_accuracy``, ``test_accuracy``, ``train_loss``: means
    over the replicates; ``val_std``/``test_std``: sample standard deviations (ddof 1, NaN at
    R = 1); ``val_se``/``test_se`` = std/√R; ``num_val``/``num_test``: split sizes (rows); each
    column of ``means`` (e.g. the ``easy``/``hard`` class accuracies): its mean over the replicates.

    Ranking (``rank``, 1 = best in its group): mean validation accuracy, ties to the lower mean
    train loss, then the smaller ``configuration_id``. Never test accuracy.

    Within noise of the best (``within_noise``): configuration k is indistinguishable from the
    group's best b when val_b − val_k ≤ z·√(se_b² + se_k²) (z = 1.96 at ``confidence`` 0.95;
    ``gap`` and ``noise_threshold`` hold both sides), where ``noise_se`` is
    - with R ≥ 2 replicates: the replicate standard error val_std/√R — the spread of the
      training coins, the noise that selection can average away. The validation split's own
      sampling noise is left out: every configuration is scored on the same rows, so it moves
      all of them together and mostly cancels in a comparison;
    - with R = 1 (no replicate spread exists): the binomial standard error of one score on the
      validation split, √(p(1 − p)/n_val), as a floor — the only noise scale a single run has, the
      selection noise of a finite split (1.2 points at n_val = 1,129 and p = 0.8); 0 when n_val is
      not recorded (then only exact ties are within noise).
    The best is within noise of itself.
    """
    _check_confidence(confidence)
    by = list(by)
    key = [*by, "configuration_id"]
    if "configuration_id" not in trials:  # a frame built without the schema-3 keys: trials are configurations
        trials = trials.assign(configuration_id=trials["trial_id"], replicate=0)
    params = [c for c in ("clip_bound", "batch_size", "learning_rate", "base_learning_rate", "clipping", "optimizer",
                          "clip_bin", "batch_bin", "epsilon", "epochs", "task", "cell_id", "search_id", "trial_id")
              if c in trials and c not in key]
    columns = [*key, *params, "replicates", "val_accuracy", "val_std", "val_se", "test_accuracy", "test_std",
               "test_se", "train_loss", "num_val", "num_test", *means, "noise_se", "rank", "gap", "noise_threshold",
               "within_noise"]
    if trials.empty:
        return _empty_with(trials[[*key, *params]], columns)
    ordered = trials.sort_values(["replicate", "search_id", "trial_id"], kind="mergesort")
    groups = ordered.groupby(key, sort=False, dropna=False)
    table = groups[params].first()
    table["replicates"] = groups.size()
    for measure in ("val_accuracy", "test_accuracy"):
        prefix = measure.split("_")[0]
        table[measure] = groups[measure].mean()
        table[f"{prefix}_std"] = groups[measure].std(ddof=1)
        table[f"{prefix}_se"] = table[f"{prefix}_std"] / np.sqrt(table["replicates"])
    for column in ("train_loss", *means):
        table[column] = groups[column].mean()
    table["num_val"] = groups["num_val"].median()
    table["num_test"] = groups["num_test"].median()
    table = table.reset_index()
    binomial = np.sqrt(table["val_accuracy"] * (1 - table["val_accuracy"]) / table["num_val"]).fillna(0.0)
    table["noise_se"] = np.where(table["replicates"] >= 2, table["val_se"], binomial)
    table = table.sort_values([*by, "val_accuracy", "train_loss", "configuration_id"],
                              ascending=[True] * len(by) + [False, True, True], na_position="last", kind="mergesort")
    table["rank"] = table.groupby(by, sort=False).cumcount() + 1
    best = table.groupby(by, sort=False)[["val_accuracy", "noise_se"]].transform("first")
    table["gap"] = best["val_accuracy"] - table["val_accuracy"]
    table["noise_threshold"] = normal_quantile(confidence) * np.sqrt(best["noise_se"] ** 2 + table["noise_se"] ** 2)
    table["within_noise"] = table["gap"] <= table["noise_threshold"] + 1e-12
    return table.reset_index(drop=True)[columns]


def _empty_with(frame: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """No rows; ``frame``'s columns keep their dtypes (so merges on them work), the others are float."""
    empty = frame.iloc[0:0].copy()
    for column in columns:
        if column not in empty:
            empty[column] = pd.Series(dtype=float)
    return empty[list(columns)]


def _mean_interval(mean: pd.Series, std: pd.Series, replicates: pd.Series, rows: pd.Series,
                   confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of the interval of a mean accuracy, clipped to [0, 1] (see ``best_configurations``)."""
    r = replicates.to_numpy(dtype=float)
    p = mean.to_numpy(dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        t = stats.t.ppf(0.5 + confidence / 2, np.maximum(r - 1, 1))
        replicated = t * std.to_numpy(dtype=float) / np.sqrt(r)
        binomial = normal_quantile(confidence) * np.sqrt(p * (1 - p) / rows.to_numpy(dtype=float))
    half = np.where(r >= 2, replicated, binomial)
    return np.clip(p - half, 0.0, 1.0), np.clip(p + half, 0.0, 1.0)


def best_configurations(trials: pd.DataFrame, by: Sequence[str] = tuple(CELL), confidence: float = CONFIDENCE,
                        means: Sequence[str] = ()) -> pd.DataFrame:
    """The best configuration of each group of ``by`` (``rank_configurations``'s rank 1), with intervals.

    Columns of ``rank_configurations`` for the best, plus ``val_low``/``val_high`` and
    ``test_low``/``test_high``: the ``confidence`` interval of its mean accuracy, and
    ``interval_source``:
    - ``"replicates"`` (R ≥ 2): Student t over the replicates, mean ± t_{R−1}·std/√R — what a
      rerun of the configuration with fresh coins scores on the same splits;
    - ``"binomial"`` (R = 1, no replicate spread exists): mean ± z·√(p(1 − p)/n), the sampling
      noise of one score on the n-row split; the training coins' spread is not measured.
    Both are clipped to [0, 1] (NaN where a split size is unrecorded). ``configurations``: how
    many the group ranked; ``within_noise``: how many are within noise of the best (≥ 1);
    ``clip_low``/``clip_high``, ``batch_low``/``batch_high``: the extreme C and B of that set.
    """
    ranked = rank_configurations(trials, by, confidence, means)
    by = list(by)
    extra = ["val_low", "val_high", "test_low", "test_high", "interval_source", "configurations", "within_noise",
             "clip_low", "clip_high", "batch_low", "batch_high"]
    if ranked.empty:
        return _empty_with(ranked.drop(columns="within_noise"), [*ranked.columns.drop("within_noise"), *extra])
    near = ranked[ranked["within_noise"]]
    spread = near.groupby(by).agg(within_noise=("configuration_id", "size"), clip_low=("clip_bound", "min"),
                                  clip_high=("clip_bound", "max"), batch_low=("batch_size", "min"),
                                  batch_high=("batch_size", "max"))
    spread["configurations"] = ranked.groupby(by).size()
    best = ranked[ranked["rank"] == 1].drop(columns="within_noise").merge(spread.reset_index(), on=by)
    for measure, rows in (("val", "num_val"), ("test", "num_test")):
        best[f"{measure}_low"], best[f"{measure}_high"] = _mean_interval(
            best[f"{measure}_accuracy"], best[f"{measure}_std"], best["replicates"], best[rows], confidence)
    best["interval_source"] = np.where(best["replicates"] >= 2, "replicates", "binomial")
    return best.sort_values(by).reset_index(drop=True)[[*[c for c in ranked.columns if c != "within_noise"], *extra]]


def _resampled_scores(group: pd.DataFrame, ranked: pd.DataFrame, resamples: int,
                      rng: np.random.Generator) -> np.ndarray:
    """(resamples, K) bootstrap mean validation accuracies of the K configurations of ``ranked``."""
    columns = []
    values = group.groupby("configuration_id")["val_accuracy"].apply(lambda s: s.to_numpy(dtype=float))
    for row in ranked.itertuples(index=False):
        own = values[row.configuration_id]
        if own.size >= 2:
            columns.append(own[rng.integers(0, own.size, size=(resamples, own.size))].mean(axis=1))
        elif np.isfinite(row.num_val) and row.num_val > 0:
            columns.append(rng.binomial(int(row.num_val), float(np.clip(own[0], 0, 1)), size=resamples) / row.num_val)
        else:
            columns.append(np.full(resamples, own[0]))
    return np.column_stack(columns)


def optimal_setting_intervals(trials: pd.DataFrame, by: Sequence[str] = tuple(CELL), resamples: int = 1000,
                              confidence: float = CONFIDENCE, seed: int = 0) -> pd.DataFrame:
    """Paper Fig. 2 with uncertainty: bootstrap intervals of the optimal C and B of each group of ``by``.

    Each of ``resamples`` rounds redraws every configuration's validation score and selects the
    best on validation again (never test): a configuration with R ≥ 2 replicates gets the mean of
    R replicates drawn with replacement; one with R = 1 a binomial draw Bin(n_val, p)/n_val of its
    validation split's sampling noise (a constant when n_val is unrecorded). Ties go to the
    better-ranked configuration (``rank_configurations``). ``clip_low``/``clip_high`` and
    ``batch_low``/``batch_high`` are the percentile interval at ``confidence`` of the selected C and
    B (inverted-CDF percentiles: the ends are values some round selected; percentiles commute with
    the logarithm, so this is also the percentile interval on a log axis);
    ``clip_bound``/``batch_size`` are the point estimate (the best configuration); ``selected_share``
    is the fraction of rounds that selected it and ``clip_share``/``batch_share`` those that selected
    its C / its B. ``source`` says which noise was resampled: ``replicates``, ``binomial`` or
    ``mixed``. ``seed`` fixes the bootstrap draws.
    With few replicates the intervals are narrow-biased: resampling R values keeps (R − 1)/R of
    their variance and never leaves their range (the within-noise set of ``rank_configurations``
    is the more cautious measure).
    """
    _check_confidence(confidence)
    if resamples < 1:
        raise AnalysisError(f"resamples must be ≥ 1, got {resamples}")
    by = list(by)
    columns = [*by, "clip_bound", "batch_size", "configurations", "replicates", "clip_low", "clip_high",
               "batch_low", "batch_high", "selected_share", "clip_share", "batch_share", "resamples", "source"]
    ranked = rank_configurations(trials, by, confidence)
    if ranked.empty:
        return pd.DataFrame(columns=columns)
    rng = np.random.default_rng(seed)
    tail = (1 - confidence) / 2
    rows = []
    for key, cell in ranked.groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        mask = np.ones(len(trials), dtype=bool)
        for name, value in zip(by, key, strict=True):
            mask &= (trials[name] == value).to_numpy()
        chosen = _resampled_scores(trials[mask], cell, resamples, rng).argmax(axis=1)
        clips, batches = cell["clip_bound"].to_numpy(dtype=float), cell["batch_size"].to_numpy(dtype=float)
        best = cell.iloc[0]
        replicated = cell["replicates"] >= 2
        interval = {}
        for name, picked in (("clip", clips[chosen]), ("batch", batches[chosen])):
            low, high = np.quantile(picked, [tail, 1 - tail], method="inverted_cdf")
            interval[f"{name}_low"], interval[f"{name}_high"] = float(low), float(high)
        rows.append({**dict(zip(by, key, strict=True)),
                     "clip_bound": best["clip_bound"], "batch_size": best["batch_size"],
                     "configurations": len(cell), "replicates": int(best["replicates"]), **interval,
                     "selected_share": float(np.mean(chosen == 0)),
                     "clip_share": float(np.mean(clips[chosen] == best["clip_bound"])),
                     "batch_share": float(np.mean(batches[chosen] == best["batch_size"])), "resamples": resamples,
                     "source": "replicates" if replicated.all() else "binomial" if not replicated.any() else "mixed"})
    return pd.DataFrame(rows, columns=columns)


@dataclass(frozen=True)
class PaperTrend:
    """A direction the paper reports for the optimal C and B when one factor makes the problem harder."""

    condition: str  # e.g. "tighter privacy"
    factor: str  # the column that varies: its smallest value is the harder problem
    within: tuple[str, ...]  # the columns held equal
    moves: dict[str, str]  # quantity ("C" or "B") → "larger" or "smaller" on the harder side


#: The paper's findings (Rehn et al., ICLR 2026; see BRIEF.md): tighter privacy → larger C and
#: smaller B; fewer epochs → avoid large B.
PAPER_TRENDS: tuple[PaperTrend, ...] = (
    PaperTrend("tighter privacy", "epsilon", ("task", "epochs"), {"C": "larger", "B": "smaller"}),
    PaperTrend("fewer epochs", "epochs", ("task", "epsilon"), {"B": "smaller"}),
)
_SETTING = {"epsilon": "ε", "epochs": "E"}
_QUANTITIES = {"C": ("clip_bound", "clip"), "B": ("batch_size", "batch")}


def paper_trend_checks(intervals: pd.DataFrame) -> pd.DataFrame:
    """Does the optimal C and B of ``optimal_setting_intervals`` move the way the paper says, beyond the noise?

    For each ``PAPER_TRENDS`` condition and each group of its ``within`` columns with two or more
    values of its factor: the smallest value (``harder``, e.g. ε = 1) against the largest
    (``easier``). ``observed`` is the point estimates' direction on the harder side
    (larger/smaller/same); ``verdict``: ``agrees`` or ``disagrees`` with ``paper`` when the two
    bootstrap intervals are disjoint; ``no change`` when both intervals are the one same value
    (every round selected it on both sides: the data says it does not move, against the paper, at
    the resolution of the values searched); else ``inconclusive`` (the intervals overlap: the
    data cannot order them). ``group`` names the equal columns, e.g. ``E = 10``.
    """
    columns = ["condition", "task", "group", "quantity", "harder", "easier", "harder_value", "harder_low",
               "harder_high", "easier_value", "easier_low", "easier_high", "paper", "observed", "verdict"]
    rows = []
    for trend in PAPER_TRENDS:
        for key, group in intervals.groupby(list(trend.within), sort=True):
            if group[trend.factor].nunique() < 2:
                continue
            ordered = group.sort_values(trend.factor)
            harder, easier = ordered.iloc[0], ordered.iloc[-1]
            held = ", ".join(f"{_SETTING[name]} = {value:g}"
                             for name, value in zip(trend.within, key, strict=True) if name != "task")
            for quantity, paper in trend.moves.items():
                value, prefix = _QUANTITIES[quantity]
                ends = [harder[f"{prefix}_low"], harder[f"{prefix}_high"],
                        easier[f"{prefix}_low"], easier[f"{prefix}_high"]]
                overlap = ends[0] <= ends[3] and ends[2] <= ends[1]
                observed = _direction(float(harder[value]), float(easier[value]))
                verdict = ("no change" if len(set(ends)) == 1 else "inconclusive" if overlap
                           else "agrees" if observed == paper else "disagrees")
                rows.append({"condition": trend.condition, "task": harder["task"], "group": held, "quantity": quantity,
                             "harder": f"{_SETTING[trend.factor]} = {harder[trend.factor]:g}",
                             "easier": f"{_SETTING[trend.factor]} = {easier[trend.factor]:g}",
                             "harder_value": harder[value], "harder_low": ends[0], "harder_high": ends[1],
                             "easier_value": easier[value], "easier_low": ends[2], "easier_high": ends[3],
                             "paper": paper, "observed": observed, "verdict": verdict})
    return pd.DataFrame(rows, columns=columns)


# ---------------------------------------------------------------------------------------------
# Search efficiency against a replicated full grid
# ---------------------------------------------------------------------------------------------

def replicated_grid_cells(trials: pd.DataFrame, by: Sequence[str] = tuple(CELL)) -> pd.DataFrame:
    """The groups of ``by`` whose finished ``trials`` form a replicated full grid: every combination
    of their distinct C, B and η₀ is a configuration, and every configuration has R ≥ 2 replicates.

    Columns: ``by``, ``configurations`` and ``replicates`` (the smallest R of the cell).
    """
    by = list(by)
    ranked = rank_configurations(trials, by)
    rows = []
    for key, cell in ranked.groupby(by, sort=True):
        size = int(np.prod([cell[c].nunique() for c in ("clip_bound", "batch_size", "base_learning_rate")]))
        if len(cell) == size >= 2 and (cell["replicates"] >= 2).all():
            rows.append({**dict(zip(by, key if isinstance(key, tuple) else (key,), strict=True)),
                         "configurations": len(cell),
                         "replicates": int(cell["replicates"].min())})
    return pd.DataFrame(rows, columns=[*by, "configurations", "replicates"])


def search_efficiency(trials: pd.DataFrame, by: Sequence[str] = tuple(CELL), tolerance: float = NEAR_OPTIMAL,
                      draw_orders: int = 1000, seed: int = 0) -> pd.DataFrame:
    """How many trials a random search needs to come within ``tolerance`` of a replicated full grid's best.

    Per cell of ``replicated_grid_cells``: the grid's best is its best configuration on mean
    validation accuracy (``rank_configurations``); the target is that configuration's mean test
    accuracy over its replicates. A random search of k trials draws k distinct configurations
    in a random order, sees one replicate of each (a random one: a single-seed run) and selects
    the best validation score seen; it *comes within* the tolerance when the selected
    configuration's mean test accuracy is ≥ target − ``tolerance`` (accuracy units). Over
    ``draw_orders`` bootstrap draw orders (``seed`` fixes them), one row per (cell, k = 1..K):
    ``within_share`` (the fraction of draw orders within the tolerance after k trials),
    ``target_test_accuracy``, ``configurations`` K and ``replicates``.
    """
    if tolerance < 0:
        raise AnalysisError(f"tolerance must be ≥ 0 (accuracy units), got {tolerance}")
    if draw_orders < 1:
        raise AnalysisError(f"draw_orders must be ≥ 1, got {draw_orders}")
    by = list(by)
    columns = [*by, "trials", "within_share", "target_test_accuracy", "configurations", "replicates"]
    cells = replicated_grid_cells(trials, by)
    rng = np.random.default_rng(seed)
    ranked = rank_configurations(trials, by)
    rows = []
    for cell in cells.itertuples(index=False):
        # a row of ``cells`` is (*by, configurations, replicates): zip keeps only its ``by`` values
        key = dict(zip(by, cell, strict=False))
        mine = ranked[(ranked[by] == pd.Series(key)).all(axis=1)].reset_index(drop=True)
        runs = trials[(trials[by] == pd.Series(key)).all(axis=1)]
        scores = runs.groupby("configuration_id")["val_accuracy"].apply(lambda s: s.to_numpy(dtype=float))
        replicate_scores = [scores[c] for c in mine["configuration_id"]]
        quality = mine["test_accuracy"].to_numpy(dtype=float)
        target = quality[0]  # rank 1: the grid's best on validation
        count = len(mine)
        order = np.argsort(rng.random((draw_orders, count)), axis=1)
        seen = np.column_stack([s[rng.integers(0, s.size, size=draw_orders)] for s in replicate_scores])
        seen = np.take_along_axis(seen, order, axis=1)
        best_seen = np.full(draw_orders, -np.inf)
        chosen = np.zeros(draw_orders, dtype=int)
        for k in range(count):
            better = seen[:, k] > best_seen  # ties keep the earlier draw
            best_seen = np.where(better, seen[:, k], best_seen)
            chosen = np.where(better, order[:, k], chosen)
            rows.append({**key, "trials": k + 1,
                         "within_share": float(np.mean(quality[chosen] >= target - tolerance - 1e-12)),
                         "target_test_accuracy": target, "configurations": count, "replicates": cell.replicates})
    return pd.DataFrame(rows, columns=columns)


def trials_needed(efficiency: pd.DataFrame, share: float, by: Sequence[str] = tuple(CELL)) -> pd.DataFrame:
    """Per cell of ``search_efficiency``: the fewest trials k whose ``within_share`` reaches ``share``
    (``trials_needed``; NaN when even the whole grid, K trials of one replicate each, does not reach
    it: single-seed scores then mislead the selection too often)."""
    by = list(by)
    reached = efficiency[efficiency["within_share"] >= share - 1e-12]
    first = reached.groupby(by)["trials"].min().rename("trials_needed")
    cells = efficiency.groupby(by)[["configurations", "target_test_accuracy"]].first()
    return cells.join(first).reset_index()
