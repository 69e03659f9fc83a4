"""Section 2 (paper Fig. 2): the optimal C and B against ε, their uncertainty, and the paper's trends checked."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from dptune import analysis as an
from dptune.report.document import Context, Section, format_int, format_percent, format_sig
from dptune.report.figures import BOOTSTRAP_RESAMPLES
from dptune.report.plotting import MARKERS, figure_legend, log_axis, new_figure, series_colors


def _interval(value: float, low: float, high: float, formatter: Callable[[float], str]) -> str:
    """``value [low, high]`` with one formatter ('–' parts where unknown)."""
    return f"{formatter(value)} [{formatter(low)}, {formatter(high)}]"


def _uncertainty_rule(best: pd.DataFrame, resamples: int | None = None) -> list[str]:
    """How the scores, intervals and the within-noise set of ``best_configurations`` were made, in words."""
    replicates = best["replicates"].astype(int)
    z = f"{an.normal_quantile(an.CONFIDENCE):.2f}"
    level = f"{100 * an.CONFIDENCE:g} %"
    p, n_val = best["val_accuracy"].astype(float), best["num_val"].astype(float)
    binomial = an.normal_quantile(an.CONFIDENCE) * np.sqrt(p * (1 - p) / n_val)
    split = (
        f"the validation split's binomial noise √(p(1 − p)/n_val) (n_val = {format_int(n_val.median())} rows: "
        f"±{format_percent(float(binomial.median()))} points at the {level} level for the best's accuracy, the median "
        "over cells)"
    )
    if replicates.max() < 2:
        lines = [
            f"Each configuration ran once (R = 1): no replicate spread exists. Its score is its validation "
            f"accuracy; intervals and the within-noise set use {split}, the only noise scale one run has. The "
            "spread of the training coins is not measured, so they understate the uncertainty by whatever "
            "that spread adds: run replicates (replicates: R) to measure it."
        ]
    else:
        counts = "R = " + (
            f"{replicates.min()}"
            if replicates.min() == replicates.max()
            else f"{replicates.min()} to {replicates.max()}"
        )
        lines = [
            f"Each configuration ran {counts} times with fresh coins; its score is the mean validation accuracy "
            f"over its replicates, and its standard error se = std/√R. Intervals of the best configuration's "
            f"mean accuracies are {level} Student t intervals over its replicates (a rerun with fresh coins on "
            "the same splits; the splits' own sampling noise comes on top). A configuration run once in a "
            f"replicated search falls back to {split}."
        ]
    lines.append(
        f"Within noise of the best: a configuration whose score is below the best's by at most "
        f"{z}·√(se_best² + se²), se the replicate standard error (R ≥ 2) or the binomial validation noise "
        "(R = 1); such settings cannot be told apart from the best on these data. Selection is always on "
        "validation, never test."
    )
    if resamples:
        lines.append(
            f"Bars of the figure: {level} percentile intervals of the selected C and B over {resamples:,} "
            "bootstrap rounds; each round resamples the replicates within every configuration (R = 1: "
            "draws its validation score from Bin(n_val, p)/n_val) and selects the best on validation again."
            + (
                " With few replicates these bars understate the spread (resampling R values keeps (R − 1)/R "
                "of their variance and never leaves their range): the within-noise set is the more cautious "
                "of the two."
                if replicates.max() >= 2
                else ""
            )
        )
    return lines


_VERDICTS = {
    "agrees": "moves as the paper says, beyond the bootstrap noise",
    "disagrees": "DISAGREES with the paper: it moves the other way, beyond the bootstrap noise",
    "no change": "DISAGREES with the paper: every bootstrap round selected the same value on both sides (no move "
    "at the resolution of the values searched)",
    "inconclusive": "the intervals overlap: too wide to conclude",
}


def _paper_checks(section: Section, intervals: pd.DataFrame) -> None:
    """The table and the plain statement of where the optimal C and B move as the paper says."""
    checks = an.paper_trend_checks(intervals)
    if checks.empty:
        return
    rows = []
    for row in checks.itertuples(index=False):
        shown = format_sig if row.quantity == "C" else format_int
        rows.append(
            {
                "condition": row.condition,
                "task": row.task,
                "held": row.group,
                "quantity": row.quantity,
                "optimal, harder side": f"{row.harder}: "
                f"{_interval(row.harder_value, row.harder_low, row.harder_high, shown)}",
                "optimal, easier side": f"{row.easier}: "
                f"{_interval(row.easier_value, row.easier_low, row.easier_high, shown)}",
                "paper (harder side)": row.paper,
                "observed (harder side)": row.observed,
                "what the data says": _VERDICTS[row.verdict],
            }
        )
    section.table(
        pd.DataFrame(rows),
        caption="The paper finds the optimal C larger and the optimal B smaller under "
        "tighter privacy (smaller ε), and smaller B with fewer epochs. Optimal "
        "values with their bootstrap intervals on the harder (smallest ε or "
        "E) and the easier (largest) side.",
    )
    counts = checks["verdict"].value_counts()
    against = int(counts.get("disagrees", 0) + counts.get("no change", 0))
    section.text(
        f"Of {len(checks)} comparisons: {int(counts.get('agrees', 0))} agree with the paper beyond the "
        f"noise, {against} disagree with it, and {int(counts.get('inconclusive', 0))} are too wide to "
        "conclude anything (their bootstrap intervals overlap)."
    )
    for row in checks[checks["verdict"].isin(["disagrees", "no change"])].itertuples(index=False):
        section.note(
            f"Disagrees with the paper ({row.condition}): {row.task}, {row.group}: optimal {row.quantity} "
            f"{row.harder_value:g} at {row.harder} against {row.easier_value:g} at {row.easier} (paper: "
            f"{row.paper} on the harder side; {_VERDICTS[row.verdict].split(': ', 1)[1]})."
        )


def optimal(ctx: Context) -> Section:
    section = Section(2, "Optimal C and B against ε, with their uncertainty")
    best = an.best_configurations(ctx.results.tuned)
    if best.empty:
        section.note("Missing: no finished trial with a tuned clip bound.")
        return section
    intervals = an.optimal_setting_intervals(ctx.results.tuned, resamples=BOOTSTRAP_RESAMPLES)
    if best["epsilon"].nunique() < 2:
        section.note("Only one ε in the results: the trend against ε needs two or more privacy budgets.")
    for line in _uncertainty_rule(best, BOOTSTRAP_RESAMPLES):
        section.text(line)
    figure, axes = new_figure(1, 2, width=4.6, height=3.6)
    series = [
        (task, n) for task in ctx.tasks for n in sorted(intervals.loc[intervals["task"] == task, "epochs"].unique())
    ]
    colors = series_colors(len(series))
    for k, (task, n_epochs) in enumerate(series):
        part = intervals[(intervals["task"] == task) & (intervals["epochs"] == n_epochs)].sort_values("epsilon")
        x = part["epsilon"].to_numpy() * (1 + 0.04 * (k - (len(series) - 1) / 2))  # dodge overlapping bars
        for ax, value, low, high in (
            (axes[0, 0], "clip_bound", "clip_low", "clip_high"),
            (axes[0, 1], "batch_size", "batch_low", "batch_high"),
        ):
            y = part[value].to_numpy(dtype=float)
            errors = np.vstack([y - part[low].to_numpy(dtype=float), part[high].to_numpy(dtype=float) - y])
            ax.errorbar(
                x,
                y,
                yerr=errors,
                color=colors[k],
                marker=MARKERS[k % len(MARKERS)],
                capsize=3,
                linestyle="-" if n_epochs == max(intervals["epochs"]) else "--",
                label=f"{task}, E = {n_epochs}",
            )
    for ax, column, low_col, high_col, name, unit in (
        (axes[0, 0], "clip_bound", "clip_low", "clip_high", "optimal clip bound C", "gradient norm"),
        (axes[0, 1], "batch_size", "batch_low", "batch_high", "optimal batch size B", "examples"),
    ):
        log_axis(ax, "x", intervals["epsilon"].unique())
        spread = intervals[[column, low_col, high_col]].to_numpy(dtype=float).ravel()
        log_axis(ax, "y", np.unique(spread), spread)
        ax.set_xlabel("privacy budget ε (log scale)")
        ax.set_ylabel(f"{name} ({unit}, log scale)")
        ax.grid(True, which="major", alpha=0.3)
    figure_legend(figure, axes, 2)
    figure.suptitle(
        f"Optimal (C, B) per cell, selected on validation; bars: {100 * an.CONFIDENCE:g} % bootstrap intervals",
        fontsize=10,
    )
    ctx.writer.figure(section, figure, "fig2-optimal-c-b")
    section.table(
        _best_table(best, intervals),
        caption=(
            "Best configuration per cell (selected on mean validation accuracy): accuracies in % with their "
            f"{100 * an.CONFIDENCE:g} % intervals; within noise: configurations not distinguishable from the best, of "
            "all ranked, and their C and B; optimal C and B with bootstrap intervals and how often the bootstrap "
            "selected the best configuration."
        ),
    )
    _paper_checks(section, intervals)
    return section


def _best_table(best: pd.DataFrame, intervals: pd.DataFrame) -> pd.DataFrame:
    """The shown table of ``best_configurations`` joined with ``optimal_setting_intervals`` on the cell."""
    joined = best.merge(
        intervals[[*an.CELL, "clip_low", "clip_high", "batch_low", "batch_high", "selected_share"]],
        on=an.CELL,
        suffixes=("", "_ci"),
    )
    rows = []
    for row in joined.itertuples(index=False):
        rows.append(
            {
                "task": row.task,
                "ε": format_sig(row.epsilon),
                "E": row.epochs,
                "best C": format_sig(row.clip_bound),
                "best B": format_int(row.batch_size),
                "η": format_sig(row.learning_rate),
                "R": row.replicates,
                "val % [interval]": _interval(row.val_accuracy, row.val_low, row.val_high, format_percent),
                "test % [interval]": _interval(row.test_accuracy, row.test_low, row.test_high, format_percent),
                "within noise": f"{row.within_noise} of {row.configurations}",
                "C within noise": f"{format_sig(row.clip_low)}–{format_sig(row.clip_high)}",
                "B within noise": f"{format_int(row.batch_low)}–{format_int(row.batch_high)}",
                "optimal C [bootstrap]": f"[{format_sig(row.clip_low_ci)}, {format_sig(row.clip_high_ci)}]",
                "optimal B [bootstrap]": f"[{format_int(row.batch_low_ci)}, {format_int(row.batch_high_ci)}]",
                "bootstrap picks best %": format_percent(row.selected_share),
            }
        )
    return pd.DataFrame(rows)
