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
  Uncertainty (intervals, the confidence set of the best configuration, called the set within
  noise of the best, and the intervals of the optimal C and B over it) is defined in
  ``rank_configurations``, ``best_set_constant`` and ``best_configurations``; whether a move of
  the optimum is established, in ``paper_trend_checks``.
- Accuracies are fractions in [0, 1]; ``near_optimal`` and losses are in the same units
  (0.01 = one percentage point).
- Class accuracy of a stratum is the unweighted mean of its classes' test accuracies.
- C is continuous when the search spec samples it from a range (TPE, random): it is then binned
  on a logarithmic grid of ``BINS_PER_DECADE`` bins per decade aligned to powers of ten
  (``clip_bin`` holds the bin's geometric centre); from a list of values (the grid sampler) it is
  exact. Without a recorded spec (a running search), C is binned above ``MAX_EXACT_LEVELS``
  distinct values. B (``batch_bin``) is always a list in a spec: binned only above that count.

The modules follow the report's sections: ``results`` (loading, the selection rule),
``configurations`` (replicates and uncertainty), ``strata`` (easy and hard classes), ``coverage``,
``grid`` (sections 1–2), ``gradients`` (3–4), ``clipping`` (5 and 7), ``batch_size`` (6),
``guideline`` (8), ``trends`` (the paper's findings checked) and ``efficiency``. Every public
name is importable from ``dptune.analysis``.
"""

from __future__ import annotations

from dptune.analysis.batch_size import batch_size_noise, batch_size_rule_check, min_steps
from dptune.analysis.clipping import auto_s_comparison, clipping_diagnostics, mse_split
from dptune.analysis.configurations import (
    best_configurations,
    best_set_constant,
    normal_quantile,
    rank_configurations,
    with_intervals,
)
from dptune.analysis.coverage import coverage, missing_data, privacy_statements, task_difficulty, task_order
from dptune.analysis.efficiency import replicated_grid_cells, search_efficiency, trials_needed
from dptune.analysis.gradients import (
    diagnosed_best,
    grad_norm_samples,
    last_diagnostics,
    retention_curves,
    retention_weights,
    stratum_accuracy_by_clip,
)
from dptune.analysis.grid import accuracy_grid, configuration_intervals, unfinished_bins
from dptune.analysis.guideline import FixedSetting, fixed_setting, guideline_table
from dptune.analysis.intervals import IntervalSource, accuracy_interval, accuracy_intervals
from dptune.analysis.results import (
    AUTO_S,
    BINS_PER_DECADE,
    CELL,
    CONFIDENCE,
    EASY,
    FINISHED,
    HARD,
    MAX_EXACT_LEVELS,
    NEAR_OPTIMAL,
    PLATEAU_TOLERANCE,
    PROBE_COLUMNS,
    STRATA,
    TASK_COLUMNS,
    UNREAD,
    AnalysisError,
    Results,
    check_results_paths,
    finished_trials,
    load_results,
    log_bins,
    published_models,
    select_best,
    task_label,
)
from dptune.analysis.strata import class_strata, stratum_accuracy, with_strata
from dptune.analysis.trends import (
    PAPER_TRENDS,
    PaperTrend,
    optimum_interval,
    paper_trend_checks,
    replicates_to_separate,
    trends,
)

__all__ = [
    "AUTO_S",
    "AnalysisError",
    "BINS_PER_DECADE",
    "CELL",
    "CONFIDENCE",
    "EASY",
    "FINISHED",
    "FixedSetting",
    "HARD",
    "MAX_EXACT_LEVELS",
    "NEAR_OPTIMAL",
    "PAPER_TRENDS",
    "PLATEAU_TOLERANCE",
    "PROBE_COLUMNS",
    "PaperTrend",
    "Results",
    "STRATA",
    "TASK_COLUMNS",
    "UNREAD",
    "accuracy_grid",
    "auto_s_comparison",
    "batch_size_noise",
    "batch_size_rule_check",
    "best_configurations",
    "check_results_paths",
    "class_strata",
    "clipping_diagnostics",
    "configuration_intervals",
    "coverage",
    "diagnosed_best",
    "finished_trials",
    "fixed_setting",
    "grad_norm_samples",
    "guideline_table",
    "last_diagnostics",
    "load_results",
    "log_bins",
    "min_steps",
    "missing_data",
    "mse_split",
    "normal_quantile",
    "best_set_constant",
    "optimum_interval",
    "paper_trend_checks",
    "replicates_to_separate",
    "privacy_statements",
    "rank_configurations",
    "replicated_grid_cells",
    "retention_curves",
    "retention_weights",
    "search_efficiency",
    "published_models",
    "select_best",
    "stratum_accuracy",
    "stratum_accuracy_by_clip",
    "task_difficulty",
    "task_label",
    "task_order",
    "trends",
    "trials_needed",
    "unfinished_bins",
    "with_intervals",
    "with_strata",
    "IntervalSource",
    "accuracy_interval",
    "accuracy_intervals",
]
