"""Section 4 (paper Fig. 4): clipping as re-weighting: retention weights and class accuracy per stratum."""

from __future__ import annotations

import pandas as pd
from matplotlib.lines import Line2D

from dptune import analysis as an
from dptune.report.document import Context, Section
from dptune.report.figures import FIGURE_BY_KEY, STRATUM_STYLE
from dptune.report.plotting import MARKERS, label_panel, log_axis, series_colors, task_epoch_panels


def retention(ctx: Context) -> Section:
    section = Section(4, "Clipping as re-weighting: retention weights and class accuracy per stratum")
    if ctx.strata.empty:
        section.note("Missing: no per-class accuracies, so no easy/hard strata; this section needs them.")
        return section
    curves = an.retention_curves(ctx.results, ctx.strata)
    if curves.empty:
        section.note("Missing: no diagnostics recorded, so w_y(C) cannot be computed (needs diagnostics: true).")
    else:
        _stratum_lines(
            ctx,
            section,
            curves,
            "clip_bound",
            "retention_weight",
            1.0,
            "mean retention weight w_y(C)",
            "fig4a-retention-weights",
        )
    accuracy = an.stratum_accuracy_by_clip(ctx.results, ctx.strata).melt(
        id_vars=[*an.CELL, "clip_bin"], value_vars=list(an.STRATA), var_name="stratum", value_name="accuracy"
    )
    accuracy = accuracy.dropna(subset=["accuracy"])
    if accuracy.empty:
        section.note("Missing: no per-class test accuracies of tuned trials.")
    else:
        _stratum_lines(
            ctx,
            section,
            accuracy.rename(columns={"clip_bin": "clip_bound"}),
            "clip_bound",
            "accuracy",
            100.0,
            "class test accuracy (%)",
            "fig4b-stratum-accuracy",
        )
    return section


def _stratum_lines(
    ctx: Context, section: Section, frame: pd.DataFrame, x: str, y: str, scale: float, ylabel: str, key: str
) -> None:
    """Panels per (task, E): one line per (ε, stratum) of ``y`` against log ``x``."""
    epsilons = sorted(frame["epsilon"].unique())
    colors = dict(zip(epsilons, series_colors(len(epsilons)), strict=True))
    figure, _, panels = task_epoch_panels(ctx, frame)
    for ax, task, n_epochs, part in panels:
        for epsilon in epsilons:
            for stratum, (style, marker) in STRATUM_STYLE.items():
                line = part[(part["epsilon"] == epsilon) & (part["stratum"] == stratum)].sort_values(x)
                if len(line):
                    ax.plot(
                        line[x], scale * line[y], linestyle=style, marker=marker, color=colors[epsilon], markersize=4
                    )
        log_axis(ax, "x", part[x].unique())
        label_panel(ax, f"{task}\nE = {n_epochs}", "clip bound C (gradient norm, log scale)", ylabel)
    handles = [Line2D([], [], color=colors[e], marker=MARKERS[0], label=f"ε = {e:g}") for e in epsilons]
    handles += [
        Line2D([], [], color="black", linestyle=s, marker=m, label=f"{name} classes")
        for name, (s, m) in STRATUM_STYLE.items()
    ]
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    figure.suptitle(FIGURE_BY_KEY[key].title, fontsize=10)
    ctx.writer.figure(section, figure, key)
