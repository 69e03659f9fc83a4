"""Section 1 (paper Fig. 1): accuracy over (C, B), best over η, one heatmap per (E, ε)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.patches import Patch, Rectangle

from dptune import analysis as an
from dptune.report.document import Context, Section, budgets_of, format_level
from dptune.report.figures import COLOR_MAP
from dptune.report.plotting import empty_panel, new_figure

#: How a bin within noise of its cell's best is marked: hatched over its colour.
WITHIN_NOISE_HATCH = "////"


def _runs(item: pd.Series) -> str:
    """How much a bin holds: ``k×R`` (k configurations of R replicates each), or k and its runs where R varies."""
    configurations, trials = int(item["configurations"]), int(item["trials"])
    if trials == configurations * int(item["replicates"]):
        return f"{configurations}×{int(item['replicates'])}"
    return f"{configurations}: {trials} runs"


def _bins(ax: Axes, cell: pd.DataFrame, clips: list[float], batches: list[float], low: float, high: float) -> None:
    """Each evaluated bin's accuracy, what it holds, and a hatch where it is within noise of the cell's best."""
    for item in cell.to_dict("records"):
        i, j = clips.index(item["clip_bin"]), batches.index(item["batch_bin"])
        value = 100 * item["test_accuracy"]
        shade = (value - low) / (high - low) if high > low else 0.5
        color = "black" if shade > 0.55 else "white"
        if item["within_noise"]:
            ax.add_patch(
                Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch=WITHIN_NOISE_HATCH, edgecolor="grey", linewidth=0)
            )
        ax.text(j, i + 0.12, f"{value:.1f}", ha="center", va="center", fontsize=7, color=color, weight="bold")
        ax.text(j, i - 0.24, _runs(pd.Series(item)), ha="center", va="center", fontsize=5.5, color=color)


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
                _bins(ax, cell, clips, batches, low, high)
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
        figure.legend(
            handles=[
                Patch(facecolor="none", edgecolor="black", linewidth=1.5, label="best bin (chosen on validation)"),
                Patch(
                    facecolor="none",
                    edgecolor="grey",
                    hatch=WITHIN_NOISE_HATCH,
                    label=f"within noise of the best ({100 * an.CONFIDENCE:g} % confidence set)",
                ),
            ],
            loc="outside lower center",
            ncols=2,
            fontsize=7,
        )
        ctx.writer.figure(section, figure, "fig1-accuracy-heatmaps", task)
        section.text(_on_these_data(task, part))
    return section


def _on_these_data(task: str, part: pd.DataFrame) -> str:
    """What the heatmaps of ``task`` show about its optimum: how many bins cannot be told apart from it."""
    cells = part.groupby(["epsilon", "epochs"])
    alone = int((cells["within_noise"].sum() == 1).sum())
    return (
        f"{task}: {int(part['within_noise'].sum())} of {len(part)} evaluated (C, B) bins over its {cells.ngroups} "
        f"panels are within noise of their panel's best (hatched): their best configuration cannot be told apart "
        f"from the best on these runs; the best bin is the only one within noise in {alone} of {cells.ngroups} panels."
    )
