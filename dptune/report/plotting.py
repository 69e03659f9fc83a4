"""Matplotlib helpers every figure shares: (task, E) panel grids, log axes, colours, legends."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Literal

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter
from numpy.typing import ArrayLike

from dptune.report.document import Context
from dptune.report.figures import COLOR_MAP


def series_colors(count: int) -> list[tuple[float, float, float, float]]:
    cmap = matplotlib.colormaps[COLOR_MAP]
    return [cmap(x) for x in np.linspace(0.0, 0.85, max(count, 1))]


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def new_figure(
    rows: int, columns: int, width: float = 3.8, height: float = 3.2, share: bool = False
) -> tuple[Figure, np.ndarray]:
    """A figure of ``rows`` × ``columns`` panels; with ``share``, every panel has the same x and y range
    (panels that compare one quantity: a reader compares positions, not tick labels)."""
    figure = Figure(figsize=(max(width * columns + 0.6, 7.0), height * rows + 0.5), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False, sharex=share, sharey=share)
    return figure, axes


def dodged(x: ArrayLike, index: int, count: int, step: float = 0.04) -> np.ndarray:
    """``x`` (a log axis) shifted by a factor 1 + ``step``·(index − centre), so that the bars of ``count``
    series at the same x stay apart."""
    return np.asarray(x, dtype=float) * (1 + step * (index - (count - 1) / 2))


def interval_errors(value: ArrayLike, low: ArrayLike, high: ArrayLike) -> np.ndarray:
    """The 2 × n ``yerr`` of ``errorbar`` for intervals [low, high] around ``value`` (0 where unknown)."""
    centre = np.asarray(value, dtype=float)
    below = centre - np.asarray(low, dtype=float)
    above = np.asarray(high, dtype=float) - centre
    return np.nan_to_num(np.clip(np.vstack([below, above]), 0.0, None))


def _tick(value: float) -> str:
    """A tick label: whole numbers exactly (batch sizes: 1024, not 1020), others to three
    significant digits, positional (0.001), never 1e+03; below 0.001 in powers of ten (1e-14, not
    0.00000000000001: a per-example gradient that all but vanished)."""
    if value >= 1 and float(value).is_integer():
        return str(int(value))
    if value < 1e-3:
        return f"{value:.3g}"
    return np.format_float_positional(value, precision=3, unique=False, fractional=False, trim="-")


def log_axis(
    ax: Axes, axis: str, ticks: Collection[float] | None = None, data: Collection[float] | None = None
) -> None:
    """Log scale with plain-number labels.

    With few ``ticks`` (a sparse grid), ticks sit at those values. Otherwise decades are labelled,
    the 2s and 5s between them too when ``data`` spans under 40×, and every digit under 4×.
    """
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    chosen: list[float] = []
    for value in sorted({float(v) for v in (ticks if ticks is not None else ()) if np.isfinite(v) and v > 0}):
        if not chosen or value >= 1.5 * chosen[-1]:  # labels closer than 1.5x would overlap
            chosen.append(value)
    if 0 < len(chosen) <= 8:
        target.set_ticks(chosen, labels=[_tick(t) for t in chosen])
        target.set_minor_formatter(NullFormatter())
        return
    target.set_major_formatter(FuncFormatter(lambda value, _: _tick(value)))
    values = np.asarray([v for v in (data if data is not None else ()) if np.isfinite(v) and v > 0], dtype=float)
    span = values.max() / values.min() if values.size else math.inf
    labelled = range(1, 10) if span < 4 else (2, 5) if span < 40 else ()

    def minor(value: float, _: int) -> str:
        return _tick(value) if round(value / 10 ** math.floor(math.log10(value) + 1e-9)) in labelled else ""

    target.set_minor_formatter(FuncFormatter(minor) if labelled else NullFormatter())


def empty_panel(ax: Axes, title: str) -> None:
    """A panel whose (task, ε, E) the results do not hold: say so instead of drawing axes."""
    ax.set_axis_off()
    ax.set_title(title, fontsize=8)
    ax.text(0.5, 0.5, "not in the results", ha="center", va="center", transform=ax.transAxes, color="dimgrey")


#: One drawn panel of a (task, E) grid: its axes, the task, E and the rows of the frame it shows.
Panel = tuple[Axes, str, int, pd.DataFrame]


def task_epoch_panels(
    ctx: Context, frame: pd.DataFrame, width: float = 4.0, height: float = 3.1, share: bool = False
) -> tuple[Figure, np.ndarray, list[Panel]]:
    """A figure with one panel per (task, E) of ``frame``: rows are the tasks in report order,
    columns the E values ascending (``share``: one x and y range for all, ``new_figure``). A panel
    ``frame`` has no rows for is marked empty; the others are returned for the caller to draw."""
    tasks = [t for t in ctx.tasks if t in set(frame["task"])]
    epochs = sorted(frame["epochs"].unique())
    figure, axes = new_figure(len(tasks), len(epochs), width=width, height=height, share=share)
    panels: list[Panel] = []
    for row, task in enumerate(tasks):
        for column, n_epochs in enumerate(epochs):
            part = frame[(frame["task"] == task) & (frame["epochs"] == n_epochs)]
            if part.empty:
                empty_panel(axes[row, column], f"{task}\nE = {n_epochs}")
            else:
                panels.append((axes[row, column], task, n_epochs, part))
    return figure, axes, panels


def label_panel(ax: Axes, title: str, xlabel: str, ylabel: str, grid_axis: Literal["both", "x", "y"] = "both") -> None:
    """Axis labels, a small title and a light grid: the dress every line and box panel shares."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.grid(True, axis=grid_axis, alpha=0.3)


def figure_legend(figure: Figure, axes: np.ndarray, columns: int) -> None:
    """One legend below the panels with every labelled artist of ``axes`` (first of each label)."""
    entries: dict[str, Artist] = {}
    for ax in axes.ravel():
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    if entries:
        figure.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=columns, fontsize=8)
