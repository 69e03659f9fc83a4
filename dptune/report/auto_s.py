"""Section 5 (paper Fig. 5): AUTO-S against tuned C."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dptune import analysis as an
from dptune.analysis.grid import configuration_intervals
from dptune.report.document import Context, Section, format_percent, format_points, format_sig
from dptune.report.plotting import dodged, figure_legend, interval_errors, label_panel, log_axis, task_epoch_panels


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
    table = _with_bounds(ctx, table)
    figure, axes, panels = task_epoch_panels(ctx, table, share=True)
    lines = (
        ("tuned", "test_accuracy", "test", "-", "o", "tuned C, all classes"),
        ("auto_s", "test_accuracy", "test", "--", "o", "AUTO-S, all classes"),
        ("tuned", an.HARD, an.HARD, "-", "s", "tuned C, hard classes"),
        ("auto_s", an.HARD, an.HARD, "--", "s", "AUTO-S, hard classes"),
    )
    for ax, task, n_epochs, part in panels:
        part = part.sort_values("epsilon")
        for k, (method, measure, bound, style, marker, label) in enumerate(lines):
            value = 100 * part[f"{method}_{measure}"].astype(float)
            ax.errorbar(
                dodged(part["epsilon"], k, len(lines), step=0.03),
                value,
                yerr=interval_errors(value, 100 * part[f"{method}_{bound}_low"], 100 * part[f"{method}_{bound}_high"]),
                linestyle=style,
                marker=marker,
                color="black" if method == "tuned" else "grey",
                capsize=2,
                elinewidth=0.8,
                label=label,
            )
        log_axis(ax, "x", table["epsilon"].unique())
        label_panel(ax, f"{task}\nE = {n_epochs}", "privacy budget ε (log scale)", "test accuracy (%)")
    figure_legend(figure, axes, 2)
    figure.suptitle(
        f"Best tuned-C against best AUTO-S configuration (both selected on validation); bars: "
        f"{100 * an.CONFIDENCE:g} % intervals",
        fontsize=10,
    )
    ctx.writer.figure(section, figure, "fig5-auto-s")
    section.text(_difference(table))
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


def _with_bounds(ctx: Context, table: pd.DataFrame) -> pd.DataFrame:
    """``auto_s_comparison``'s table with the intervals of each side's test and hard-class accuracy
    (``configuration_intervals``): ``<side>_test_low``/``_high`` and ``<side>_hard_low``/``_high``."""
    accuracy = an.stratum_accuracy(ctx.results, ctx.strata)
    for side, trials in (("tuned", ctx.results.tuned), ("auto_s", ctx.results.auto_s)):
        bounds = configuration_intervals(trials, an.CELL, ctx.strata, accuracy)
        columns = [c for c in bounds if c.endswith(("_low", "_high"))]
        bounds = bounds[[*an.CELL, "trial_id", *columns]].rename(
            columns={"trial_id": f"{side}_trial_id", **{c: f"{side}_{c}" for c in columns}}
        )
        table = table.merge(bounds, on=[*an.CELL, f"{side}_trial_id"], how="left")
    for column in (f"{side}_{an.HARD}_{end}" for side in ("tuned", "auto_s") for end in ("low", "high")):
        if column not in table:
            table[column] = np.nan
    return table


def _difference(table: pd.DataFrame) -> str:
    """What Fig. 5 shows: in how many cells the two test-accuracy intervals are disjoint, and which way."""
    tuned_above = int((table["tuned_test_low"] > table["auto_s_test_high"]).sum())
    auto_above = int((table["auto_s_test_low"] > table["tuned_test_high"]).sum())
    return (
        "The paper reports that AUTO-S matches tuned C only on easy tasks with loose privacy. Here: tuned C's test "
        f"interval lies wholly above AUTO-S's in {tuned_above} of {len(table)} cells and below it in {auto_above}; "
        f"in the other {len(table) - tuned_above - auto_above} the intervals overlap (no difference established)."
    )
