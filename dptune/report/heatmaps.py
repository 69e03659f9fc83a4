"""Section 1 (paper Fig. 1): accuracy over (C, B), best over η, one heatmap per (E, ε)."""

from __future__ import annotations

import numpy as np
from matplotlib.patches import Rectangle

from dptune import analysis as an
from dptune.report.document import Context, Section, budgets_of, format_level
from dptune.report.figures import COLOR_MAP
from dptune.report.plotting import empty_panel, new_figure


def heatmaps(ctx: Context) -> Section:
    section = Section(1, "Accuracy over (C, B), best over η")
    results = ctx.results
    grid = an.accuracy_grid(results)
    if grid.empty:
        section.note("Missing: no finished trial with a tuned clip bound; no heatmap to draw.")
        return section
    if results.clip_binned:
        section.text(
            f"C was sampled continuously: it is binned on a log grid of {an.BINS_PER_DECADE} bins per "
            "decade aligned to powers of ten; a bin is labelled by its geometric centre (≈)."
        )
    unfinished = an.unfinished_bins(results)
    for task in ctx.tasks:
        part = grid[grid["task"] == task]
        if part.empty:
            continue
        others = unfinished[unfinished["task"] == task]
        epsilons, epochs = budgets_of(part, task)
        clips = sorted(set(part["clip_bin"]) | set(others["clip_bin"]))
        batches = sorted(set(part["batch_bin"]) | set(others["batch_bin"]))
        figure, axes = new_figure(
            len(epochs), len(epsilons), width=0.6 * len(batches) + 1.6, height=0.42 * len(clips) + 1.3
        )
        low, high = 100 * part["test_accuracy"].min(), 100 * part["test_accuracy"].max()
        image = None
        for row, n_epochs in enumerate(epochs):
            for column, epsilon in enumerate(epsilons):
                ax = axes[row, column]
                cell = part[(part["epsilon"] == epsilon) & (part["epochs"] == n_epochs)]
                if cell.empty:
                    empty_panel(ax, f"ε = {epsilon:g}, E = {n_epochs}")
                    continue
                matrix = np.full((len(clips), len(batches)), np.nan)
                for item in cell.itertuples(index=False):
                    matrix[clips.index(item.clip_bin), batches.index(item.batch_bin)] = 100 * item.test_accuracy
                image = ax.imshow(matrix, origin="lower", cmap=COLOR_MAP, vmin=low, vmax=high, aspect="auto")
                for (i, j), value in np.ndenumerate(matrix):
                    if np.isfinite(value):
                        shade = (value - low) / (high - low) if high > low else 0.5
                        ax.text(
                            j,
                            i,
                            f"{value:.1f}",
                            ha="center",
                            va="center",
                            fontsize=7,
                            color="black" if shade > 0.55 else "white",
                        )
                missing = others[(others["epsilon"] == epsilon) & (others["epochs"] == n_epochs)]
                for item in missing.itertuples(index=False):
                    ax.text(
                        batches.index(item.batch_bin),
                        clips.index(item.clip_bin),
                        item.outcome,
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="dimgrey",
                    )
                best = an.select_best(cell, an.CELL).iloc[0]
                i, j = clips.index(best["clip_bin"]), batches.index(best["batch_bin"])
                for color, width in (("white", 3.5), ("black", 1.5)):
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor=color, linewidth=width))
                ax.set_xticks(
                    range(len(batches)),
                    [format_level(b, results.batch_binned) for b in batches],
                    rotation=45,
                    fontsize=7,
                )
                ax.set_yticks(range(len(clips)), [format_level(c, results.clip_binned) for c in clips], fontsize=7)
                ax.set_title(f"ε = {epsilon:g}, E = {n_epochs}", fontsize=9)
                ax.set_xlabel("batch size B (examples, log-spaced)", fontsize=8)
                ax.set_ylabel("clip bound C (gradient norm, log-spaced)", fontsize=8)
        figure.suptitle(f"{task}: test accuracy (%) of the η chosen on validation", fontsize=10)
        if image is not None:
            figure.colorbar(image, ax=axes, label="test accuracy (%)", shrink=0.8)
        ctx.writer.figure(section, figure, "fig1-accuracy-heatmaps", task)
    return section
