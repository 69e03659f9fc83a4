"""Section 2 (paper Fig. 2): the optimal C and B against ε, their uncertainty, and the paper's trends checked."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from dptune import analysis as an
from dptune.report.document import Context, Section, format_int, format_percent, format_sig
from dptune.report.plotting import (
    MARKERS,
    dodged,
    figure_legend,
    interval_errors,
    label_panel,
    log_axis,
    new_figure,
    series_colors,
)


def _interval(value: float, low: float, high: float, formatter: Callable[[float], str]) -> str:
    """``value [low, high]`` with one formatter ('–' parts where unknown)."""
    return f"{formatter(value)} [{formatter(low)}, {formatter(high)}]"


def _uncertainty_rule(best: pd.DataFrame, ranked: pd.DataFrame) -> list[str]:
    """How the scores, intervals and the within-noise set of ``best_configurations`` were made, in words
    (``ranked``: every configuration, whose replicates it counts)."""
    replicates = ranked["replicates"].astype(int)
    level = f"{100 * an.CONFIDENCE:g} %"
    n_val = best["num_val"].astype(float)
    low, high, _ = an.accuracy_intervals(best["val_accuracy"], n_val)
    split = (
        f"the validation split's binomial noise √(p(1 − p)/n_val) (n_val = {format_int(n_val.median())} rows; the "
        f"best's accuracy has a Wilson interval ±{format_percent(float(np.nanmedian((high - low) / 2)))} points wide "
        f"at the {level} level, the median over cells)"
    )
    interval = (
        f"The {level} interval of a configuration's mean accuracy (dptune.analysis.accuracy_intervals) combines "
        "two independent parts: the run-to-run spread of one run over fresh coins, pooled over the cell's "
        "configurations (the median of their replicate variances, robust to diverged runs; a configuration noisier "
        "than the rest keeps its own) over R, a half-width h = t·√(s²/R); and the evaluation split's binomial "
        "noise, its Wilson interval [l, u], which every replicate shares and R does not shrink. Each side adds "
        "the two in quadrature, [p − √(h² + (p − l)²), p + √(h² + (u − p)²)] (MOVER), so the interval is never "
        "narrower than the split's Wilson interval: tied replicates give a Wilson-wide interval, not a point."
    )
    if replicates.max() < 2:
        lines = [
            f"Each configuration ran once (R = 1): no replicate spread exists. Its score is its validation "
            f"accuracy; the within-noise set uses {split}, the only noise scale one run has. {interval} Here no "
            "configuration is replicated, so the coins' spread is unmeasured and every interval is the split's "
            "alone: it understates the uncertainty by whatever that spread adds; run replicates (replicates: R) "
            "to measure it."
        ]
    else:
        counts = "R = " + (
            f"{replicates.min()}"
            if replicates.min() == replicates.max()
            else f"{replicates.min()} to {replicates.max()}"
        )
        measured = int((best["interval_source"] == "coins and split").sum())
        others = (
            ""
            if measured == len(best)
            else f" ({len(best) - measured} cell(s) replicated no configuration: their intervals are the split's alone)"
        )
        lines = [
            f"Each configuration ran {counts} times with fresh coins; its score is the mean validation accuracy "
            f"over its replicates. {interval} Here {measured} of {len(best)} cells' intervals hold both parts"
            f"{others}. A configuration run once in a replicated search takes the cell's pooled spread in the "
            f"ranking, never below {split}."
        ]
    lines.append(
        f"Within noise of the best: the {level} confidence set of the best configuration (Gupta's subset "
        "selection): a configuration whose score is below the best's by at most d·√(se_best² + se²), d Gupta's "
        f"constant for the cell's K configurations ({_constants(best)}), so the set holds the configuration that "
        f"is truly best at least {level} of the time however the K compare. se is the cell's pooled replicate "
        "spread (the median variance of its configurations, robust to diverged ones; never below a "
        "configuration's own) over √R, or for a configuration run once the validation split's binomial noise. "
        "Why this and not a bootstrap of the best: resampling a few replicates of each configuration keeps "
        "picking the observed best and gives intervals like [0.12, 0.12] while many configurations cannot be "
        "told apart from it; the set asks which of K is best. The optimal C and B intervals are the ranges of C "
        "and B over the set: such settings cannot be told apart from the best on these data. Selection is "
        "always on validation, never test."
    )
    return lines


def _constants(best: pd.DataFrame) -> str:
    """Gupta's d per cell in words: one value, or its range over the cells."""
    k, d = best["configurations"].astype(int), best["set_constant"].astype(float)
    if d.nunique() == 1:
        return f"d = {d.iloc[0]:.2f} at K = {k.iloc[0]}"
    return f"d = {d.min():.2f} to {d.max():.2f} at K = {k.min()} to {k.max()}"


_VERDICTS = {
    "agrees": "established: moves as the paper says (the intervals do not overlap)",
    "disagrees": "established: DISAGREES with the paper, it moves the other way (the intervals do not overlap)",
    "no change": "established: DISAGREES with the paper, no move (each cell's set holds this one value alone, at "
    "the resolution of the values searched)",
    "not established": "not established by these runs (the intervals overlap)",
}


def _needed(count: float, harder_value: float, easier_value: float) -> str:
    """What would settle a comparison that these runs do not: replicates (``count``, NaN: none up to
    1,024 would), or configurations between the two optima's values."""
    if np.isfinite(count):
        return f"about {int(count)} replicates per configuration would separate them, if the observed gaps are real"
    if harder_value == easier_value:
        return (
            "no replicate count would: the best configurations on both sides share this value; a move, if any, "
            "lies between the values searched (search values between them)"
        )
    return "no replicate count up to 1,024 would: the gaps to the best are too small against the noise"


def _paper_checks(section: Section, checks: pd.DataFrame) -> None:
    """The table and the plain statement of where the optimal C and B move as the paper says (``checks``:
    ``paper_trend_checks``)."""
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
                f"{_interval(row.harder_value, row.harder_low, row.harder_high, shown)} ({row.harder_set})",
                "optimal, easier side": f"{row.easier}: "
                f"{_interval(row.easier_value, row.easier_low, row.easier_high, shown)} ({row.easier_set})",
                "paper (harder side)": row.paper,
                "observed (harder side)": row.observed,
                "what the data says": _VERDICTS[row.verdict]
                + (
                    ""
                    if row.verdict != "not established"
                    else f"; {_needed(row.replicates_needed, row.harder_value, row.easier_value)}"
                ),
            }
        )
    section.table(
        pd.DataFrame(rows),
        caption="The paper finds the optimal C larger and the optimal B smaller under "
        "tighter privacy (smaller ε), and smaller B with fewer epochs. Optimal "
        "values with their intervals over the confidence set of the best (its size of all configurations "
        "in brackets) on the harder (smallest ε or E) and the easier (largest) side. A move is established "
        "only when the two intervals do not overlap.",
    )
    counts = checks["verdict"].value_counts()
    against = int(counts.get("disagrees", 0) + counts.get("no change", 0))
    section.text(
        f"Of {len(checks)} comparisons: {int(counts.get('agrees', 0))} establish the paper's move, {against} "
        f"establish a disagreement with it, and {int(counts.get('not established', 0))} are not established by "
        "these runs (their intervals overlap)."
    )
    for row in checks[checks["verdict"].isin(["disagrees", "no change"])].itertuples(index=False):
        section.note(
            f"Disagrees with the paper ({row.condition}): {row.task}, {row.group}: optimal {row.quantity} "
            f"{row.harder_value:g} at {row.harder} against {row.easier_value:g} at {row.easier} (paper: "
            f"{row.paper} on the harder side; {_VERDICTS[row.verdict].split(', ', 1)[1]})."
        )


def optimal(ctx: Context) -> Section:
    section = Section(2, "Optimal C and B against ε, with their uncertainty")
    best = an.best_configurations(ctx.results.tuned)
    if best.empty:
        section.note("Missing: no finished trial with a tuned clip bound.")
        return section
    ranked = an.rank_configurations(ctx.results.tuned)
    if best["epsilon"].nunique() < 2:
        section.note("Only one ε in the results: the trend against ε needs two or more privacy budgets.")
    for line in _uncertainty_rule(best, ranked):
        section.text(line)
    checks = an.paper_trend_checks(ranked)
    figure = _optimal_figure(ctx, best, checks)
    ctx.writer.figure(section, figure, "fig2-optimal-c-b")
    section.table(
        _best_table(best),
        caption=(
            "Best configuration per cell (selected on mean validation accuracy): accuracies in % with their "
            f"{100 * an.CONFIDENCE:g} % intervals; within noise: the configurations of the confidence set of the "
            "best, of all ranked; optimal C and B: the best's, with their range over that set as the interval."
        ),
    )
    _paper_checks(section, checks)
    return section


#: Fig. 2's panels: the axes column, the quantity of ``paper_trend_checks``, its columns and axis label.
_PANELS = (
    (0, "C", "clip_bound", "clip_low", "clip_high", "optimal clip bound C (gradient norm, log scale)"),
    (1, "B", "batch_size", "batch_low", "batch_high", "optimal batch size B (examples, log scale)"),
)


def _optimal_figure(ctx: Context, best: pd.DataFrame, checks: pd.DataFrame) -> Figure:
    """Fig. 2: each cell's optimal C and B as a point with its interval over the confidence set of the best, and
    a segment only for the moves ``paper_trend_checks`` establishes (the two cells' intervals are disjoint)."""
    figure, axes = new_figure(1, 2, width=4.6, height=3.6)
    axes[0, 1].sharex(axes[0, 0])
    series = [(task, n) for task in ctx.tasks for n in sorted(best.loc[best["task"] == task, "epochs"].unique())]
    colors = series_colors(len(series))
    position: dict[tuple[str, float, int], float] = {}
    for k, (task, n_epochs) in enumerate(series):
        part = best[(best["task"] == task) & (best["epochs"] == n_epochs)].sort_values("epsilon")
        x = dodged(part["epsilon"], k, len(series))
        position.update({(task, e, n_epochs): float(v) for e, v in zip(part["epsilon"], x, strict=True)})
        for column, _, value, low, high, _ in _PANELS:
            axes[0, column].errorbar(
                x,
                part[value],
                yerr=interval_errors(part[value], part[low], part[high]),
                color=colors[k],
                marker=MARKERS[k % len(MARKERS)],
                capsize=3,
                linestyle="none",
                label=f"{task}, E = {n_epochs}",
            )
    established = checks[checks["verdict"].isin(["agrees", "disagrees"])]  # a move (a "no change" is none)
    for column, quantity, *_ in _PANELS:
        for row in established[established["quantity"] == quantity].itertuples(index=False):
            ends = [
                (position[(row.task, row.harder_epsilon, row.harder_epochs)], row.harder_value),
                (position[(row.task, row.easier_epsilon, row.easier_epochs)], row.easier_value),
            ]
            axes[0, column].plot(*zip(*ends, strict=True), color="black", linewidth=1.2, label=_SEGMENT)
    for column, _, value, low, high, label in _PANELS:
        ax = axes[0, column]
        log_axis(ax, "x", best["epsilon"].unique())
        spread = best[[value, low, high]].to_numpy(dtype=float).ravel()
        log_axis(ax, "y", np.unique(spread), spread)
        label_panel(ax, "", "privacy budget ε (log scale)", label, grid_axis="both")
    figure_legend(figure, axes, 3)
    figure.suptitle(
        f"Optimal (C, B) per cell, selected on validation; bars: C and B over the {100 * an.CONFIDENCE:g} % "
        f"confidence set of the best;\n{len(established)} of {len(checks)} compared moves established "
        "(drawn as segments)",
        fontsize=10,
    )
    return figure


_SEGMENT = "established move (intervals disjoint)"


def _best_table(best: pd.DataFrame) -> pd.DataFrame:
    """The shown table of ``best_configurations``: one row per cell."""
    rows = []
    for row in best.itertuples(index=False):
        rows.append(
            {
                "task": row.task,
                "ε": format_sig(row.epsilon),
                "E": row.epochs,
                "η": format_sig(row.learning_rate),
                "R": row.replicates,
                "val % [interval]": _interval(row.val_accuracy, row.val_low, row.val_high, format_percent),
                "test % [interval]": _interval(row.test_accuracy, row.test_low, row.test_high, format_percent),
                "within noise": f"{row.within_noise} of {row.configurations}",
                "optimal C [interval]": _interval(row.clip_bound, row.clip_low, row.clip_high, format_sig),
                "optimal B [interval]": _interval(row.batch_size, row.batch_low, row.batch_high, format_int),
            }
        )
    return pd.DataFrame(rows)
