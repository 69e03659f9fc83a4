"""Section 9: search efficiency: random search against a replicated full grid."""

from __future__ import annotations

import pandas as pd

from dptune import analysis as an
from dptune.report.document import Context, Section, format_int, format_percent, format_sig
from dptune.report.figures import BOOTSTRAP_RESAMPLES
from dptune.report.plotting import figure_legend, label_panel, series_colors, task_epoch_panels


def efficiency(ctx: Context) -> Section:
    section = Section(9, "Search efficiency: random search against a replicated full grid")
    tolerance = an.NEAR_OPTIMAL
    curves = an.search_efficiency(ctx.results.tuned, tolerance=tolerance, draw_orders=BOOTSTRAP_RESAMPLES)
    if curves.empty:
        section.note(
            "Missing: no cell holds a replicated full grid (every combination of its C, B and η₀ values "
            "run with R ≥ 2 replicates), the ground truth this measure needs: search with sampler: grid "
            "and replicates: 2 or more."
        )
        return section
    section.text(
        f"Ground truth per cell: the grid's best configuration on mean validation accuracy over its "
        f"replicates, and its mean test accuracy. A random search of k trials draws k distinct "
        f"configurations, sees one replicate of each (a single-seed run) and selects the best validation "
        f"score; it comes within {100 * tolerance:g} point when its pick's mean test accuracy is at most "
        f"{100 * tolerance:g} point under the best's. Shares over {BOOTSTRAP_RESAMPLES:,} bootstrap draw "
        "orders."
    )
    figure, axes, panels = task_epoch_panels(ctx, curves, share=True)
    for ax, task, n_epochs, part in panels:
        epsilons = sorted(part["epsilon"].unique())
        for color, epsilon in zip(series_colors(len(epsilons)), epsilons, strict=True):
            line = part[part["epsilon"] == epsilon]
            ax.plot(
                line["trials"], line["within_share"], color=color, marker="o", markersize=3, label=f"ε = {epsilon:g}"
            )
        ax.axhline(0.9, color="grey", linestyle=":", label="90 % of draw orders")
        ax.set_ylim(0, 1.02)
        label_panel(
            ax,
            f"{task}\nE = {n_epochs}",
            "trials of the random search (k)",
            f"share within {100 * tolerance:g} point of the grid's best",
        )
    figure_legend(figure, axes, 4)
    figure.suptitle("Random search against the replicated full grid", fontsize=10)
    ctx.writer.figure(section, figure, "fig9-search-efficiency")
    rows = []
    for share in (0.5, 0.9):
        needed = an.trials_needed(curves, share).rename(columns={"trials_needed": f"trials for {share:.0%} of orders"})
        rows.append(needed.set_index([*an.CELL, "configurations", "target_test_accuracy"]))
    table = pd.concat(rows, axis=1).reset_index()
    section.table(
        table,
        {
            "epsilon": format_sig,
            "target_test_accuracy": format_percent,
            **{c: format_int for c in table.columns if c.startswith("trials for")},
        },
        f"Trials a random search needs to come within {100 * tolerance:g} point of the grid's best (target: "
        "its mean test accuracy, %) for half and for 90 % of draw orders ('–': not even the whole grid, "
        "one replicate each, gets there that often).",
    )
    return section
