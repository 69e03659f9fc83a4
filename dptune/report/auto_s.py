"""Section 5 (paper Fig. 5): AUTO-S against tuned C."""

from __future__ import annotations

from dptune import analysis as an
from dptune.report.document import Context, Section, format_percent, format_points, format_sig
from dptune.report.plotting import figure_legend, label_panel, log_axis, task_epoch_panels


def auto_s(ctx: Context) -> Section:
    section = Section(5, "AUTO-S against tuned C")
    if ctx.results.auto_s.empty:
        section.note(
            "Missing: the results hold no finished AUTO-S trials (run the search with "
            "training.compare_auto_s: true to compare)."
        )
        return section
    table = an.auto_s_comparison(ctx.results, ctx.strata)
    if table.empty:
        section.note("Missing: no cell has both a finished AUTO-S and a finished tuned-C trial.")
        return section
    figure, axes, panels = task_epoch_panels(ctx, table)
    lines = (
        ("tuned", "test_accuracy", "-", "o", "tuned C, all classes"),
        ("auto_s", "test_accuracy", "--", "o", "AUTO-S, all classes"),
        ("tuned", an.HARD, "-", "s", "tuned C, hard classes"),
        ("auto_s", an.HARD, "--", "s", "AUTO-S, hard classes"),
    )
    for ax, task, n_epochs, part in panels:
        part = part.sort_values("epsilon")
        for method, measure, style, marker, label in lines:
            ax.plot(
                part["epsilon"],
                100 * part[f"{method}_{measure}"].astype(float),
                linestyle=style,
                marker=marker,
                color="black" if method == "tuned" else "grey",
                label=label,
            )
        log_axis(ax, "x", part["epsilon"])
        label_panel(ax, f"{task}\nE = {n_epochs}", "privacy budget ε (log scale)", "test accuracy (%)")
    figure_legend(figure, axes, 2)
    figure.suptitle("Best tuned-C trial against best AUTO-S trial (both selected on validation)", fontsize=10)
    ctx.writer.figure(section, figure, "fig5-auto-s")
    shown = table[[*an.CELL, "tuned_test_accuracy", "auto_s_test_accuracy", "gap", "tuned_hard", "auto_s_hard"]]
    section.table(
        shown,
        {
            "epsilon": format_sig,
            "tuned_test_accuracy": format_percent,
            "auto_s_test_accuracy": format_percent,
            "gap": format_points,
            "tuned_hard": format_percent,
            "auto_s_hard": format_percent,
        },
        "Test accuracy (%) of the best tuned-C and AUTO-S trials; gap in points (positive: tuning C helps).",
    )
    return section
