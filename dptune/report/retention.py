"""Section 4 (paper Fig. 4): clipping as re-weighting: retention weights and class accuracy per stratum."""

from __future__ import annotations

import pandas as pd
from matplotlib.lines import Line2D

from dptune import analysis as an
from dptune.analysis.grid import configuration_intervals
from dptune.report.document import Context, Section
from dptune.report.figures import FIGURE_BY_KEY, STRATUM_STYLE
from dptune.report.plotting import (
    MARKERS,
    dodged,
    interval_errors,
    label_panel,
    log_axis,
    series_colors,
    task_epoch_panels,
)


def retention(ctx: Context) -> Section:
    section = Section(4, "Clipping as re-weighting: retention weights and class accuracy per stratum")
    if ctx.strata.empty:
        section.note("Missing: no per-class accuracies, so no easy/hard strata; this section needs them.")
        return section
    curves = an.retention_curves(ctx.results, ctx.strata)
    if curves.empty:
        section.note(ctx.no_diagnostics("the retention weights w_y(C)"))
    else:
        _stratum_lines(
            ctx, section, curves, "retention_weight", 1.0, "mean retention weight w_y(C)", "fig4a-retention-weights"
        )
        section.text(_down_weighting(curves))
    accuracy = _stratum_accuracy(ctx)
    if accuracy.empty:
        section.note("Missing: no per-class test accuracies of tuned trials.")
    else:
        _stratum_lines(ctx, section, accuracy, "accuracy", 100.0, "class test accuracy (%)", "fig4b-stratum-accuracy")
        section.text(_stratum_gap(accuracy))
    return section


def _stratum_accuracy(ctx: Context) -> pd.DataFrame:
    """Fig. 4b's points: per (cell, C) and stratum the best configuration's mean class accuracy (``accuracy``)
    with its interval (``low``/``high``, ``configuration_intervals``); ``clip_bound`` is the C bin."""
    keys = [*an.CELL, "clip_bin"]
    best = an.stratum_accuracy_by_clip(ctx.results, ctx.strata)
    bounds = configuration_intervals(ctx.results.tuned, keys, ctx.strata, an.stratum_accuracy(ctx.results, ctx.strata))
    best = best.merge(bounds, on=[*keys, "trial_id"], how="left")
    parts = [
        best[keys].assign(stratum=s, accuracy=best[s], low=best[f"{s}_low"], high=best[f"{s}_high"]) for s in an.STRATA
    ]
    long = pd.concat(parts, ignore_index=True).dropna(subset=["accuracy"])
    return long.rename(columns={"clip_bin": "clip_bound"})


def _stratum_lines(
    ctx: Context, section: Section, frame: pd.DataFrame, y: str, scale: float, ylabel: str, key: str
) -> None:
    """Panels per (task, E), one shared range: one line per (ε, stratum) of ``y`` against log C, with error bars
    where ``frame`` holds the interval (``low``/``high``); the series are dodged so that their bars stay apart."""
    epsilons = sorted(frame["epsilon"].unique())
    colors = dict(zip(epsilons, series_colors(len(epsilons)), strict=True))
    figure, _, panels = task_epoch_panels(ctx, frame, share=True)
    count = len(epsilons) * len(STRATUM_STYLE)
    for ax, task, n_epochs, part in panels:
        for e, epsilon in enumerate(epsilons):
            for s, (stratum, (style, marker)) in enumerate(STRATUM_STYLE.items()):
                line = part[(part["epsilon"] == epsilon) & (part["stratum"] == stratum)].sort_values("clip_bound")
                if line.empty:
                    continue
                bars = (
                    interval_errors(scale * line[y], scale * line["low"], scale * line["high"])
                    if "low" in line
                    else None
                )
                ax.errorbar(
                    dodged(line["clip_bound"], e * len(STRATUM_STYLE) + s, count, step=0.03),
                    scale * line[y],
                    yerr=bars,
                    linestyle=style,
                    marker=marker,
                    color=colors[epsilon],
                    markersize=4,
                    capsize=2,
                    elinewidth=0.8,
                )
        log_axis(ax, "x", frame["clip_bound"].unique())
        label_panel(ax, f"{task}\nE = {n_epochs}", "clip bound C (gradient norm, log scale)", ylabel)
    handles = [Line2D([], [], color=colors[e], marker=MARKERS[0], label=f"ε = {e:g}") for e in epsilons]
    handles += [
        Line2D([], [], color="black", linestyle=s, marker=m, label=f"{name} classes")
        for name, (s, m) in STRATUM_STYLE.items()
    ]
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    figure.suptitle(FIGURE_BY_KEY[key].title, fontsize=10)
    ctx.writer.figure(section, figure, key)


def _by_stratum(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """``frame``'s ``column`` per (cell, C) with one column per stratum; rows where both strata have a value."""
    wide = frame.pivot_table(index=[*an.CELL, "clip_bound"], columns="stratum", values=column)
    return wide.reindex(columns=list(an.STRATA)).dropna()


def _down_weighting(curves: pd.DataFrame) -> str:
    """What Fig. 4a shows of the paper's claim: at each cell's smallest C, do the hard classes keep less weight?"""
    wide = _by_stratum(curves, "retention_weight").reset_index()
    smallest = wide[wide["clip_bound"] == wide.groupby(an.CELL)["clip_bound"].transform("min")]
    lower = int((smallest[an.HARD] < smallest[an.EASY]).sum())
    return (
        "The paper reports that a small C down-weights the hard classes (their gradients are larger, so clipping "
        f"shrinks them more). Here: at each cell's smallest C the hard classes keep less weight than the easy ones "
        f"in {lower} of {len(smallest)} cells (weights computed from one diagnosed run's probe per cell)."
    )


def _stratum_gap(accuracy: pd.DataFrame) -> str:
    """What Fig. 4b shows: where the hard classes' interval lies wholly below the easy classes'."""
    high, low = _by_stratum(accuracy, "high"), _by_stratum(accuracy, "low")
    below = int((high[an.HARD] < low[an.EASY]).sum())
    return (
        f"Bars: the {100 * an.CONFIDENCE:g} % interval of each point (dptune.analysis.with_intervals over the "
        "stratum's accuracy; the stratum's share of the test rows taken as its share of the classes). In the "
        "paper's re-weighting view a small C down-weights the hard classes, so it should cost them accuracy. Here: "
        f"the hard classes' interval lies wholly below the easy classes' at {below} of {len(high)} (cell, C) "
        "points; whether the gap grows as C shrinks is not tested."
    )
