"""The difficulty-stratified HTML report: ``python -m dptune.report RESULTS [RESULTS ...] --out DIR``.

Reads one or more result datasets (a search still running too) through ``dptune.analysis`` and
writes ``DIR/index.html`` — self-contained: figures embedded as base64 PNG, styles inline, no
external reference, it opens from disk — and each figure as ``DIR/<figure>.png``. It never
imports torch or Ray and draws with matplotlib's Agg canvas (no pyplot, no global state), so it
builds in seconds from Parquet alone. Sections follow the paper's evidence (figure numbers as
in Rehn et al., ICLR 2026); a section whose data is missing says what is missing.

``FIGURES`` is the index of what each figure shows (``--figure-index`` prints it as Markdown;
``reports/README.md`` holds a copy).
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, NullFormatter

from dptune import __version__
from dptune import analysis as an
from dptune.errors import ArgumentParser, DptuneError, report_and_exit
from dptune.paths import probe_writable

#: Colour map for ordered series (ε) and heatmaps: perceptually uniform, prints in grey.
COLOR_MAP = "viridis"
#: Line styles and markers of the strata (distinguishable without colour).
STRATUM_STYLE = {an.EASY: ("-", "o"), an.HARD: ("--", "s")}
DPI = 110
#: Bootstrap rounds of the optimal-(C, B) intervals (``analysis.optimal_setting_intervals``).
BOOTSTRAP_RESAMPLES = 1000


@dataclass(frozen=True)
class FigureInfo:
    """One figure of the report: its file stem, section, title and what it shows."""

    key: str
    section: int
    title: str
    shows: str
    per_task: bool = False  # one file per task: ``<key>-<task slug>.png``
    needs: str | None = None  # drawn only when the results hold this (None: always, or its section says why not)


FIGURES: tuple[FigureInfo, ...] = (
    FigureInfo("fig1-accuracy-heatmaps", 1, "Accuracy over (C, B) (paper Fig. 1)",
               "Per task, one panel per (E, ε): test accuracy (%) at each clip bound C × batch size B of the "
               "configuration whose η (and other options) is best on validation there (means over its replicates). "
               "Blank: not evaluated; 'pruned': T < T_min; 'failed': diverged or error. The cell chosen on "
               "validation is outlined. C is log-binned when the sampler was continuous.",
               per_task=True),
    FigureInfo("fig2-optimal-c-b", 2, "Optimal C and B against ε (paper Fig. 2)",
               "Optimal C (left) and B (right) per cell against ε, one line per task and E: the configuration "
               "with the best mean validation accuracy over its replicates; bars: 95 % bootstrap intervals of the "
               "selected C and B (replicates resampled within each configuration, or the validation score drawn "
               "from its binomial noise when R = 1, and the best re-selected on validation each round)."),
    FigureInfo("fig3-grad-norms", 3, "Per-example gradient norms (paper Fig. 3)",
               "Distribution of ‖g_i‖ on the diagnostic probe of each cell's best diagnosed trial (last "
               "diagnostic epoch), per ε, easy and hard classes side by side. Tighter privacy and harder "
               "classes shift it up (the paper's right shift)."),
    FigureInfo("fig4a-retention-weights", 4, "Retention weights w_y(C) (paper Fig. 4)",
               "Mean over the easy and over the hard classes of w_y(C) = mean_y min(1, C/‖g_i‖) (Eq. 3), "
               "computed from the probe gradient norms at the task's C grid, per ε. Small C down-weights "
               "the hard classes."),
    FigureInfo("fig4b-stratum-accuracy", 4, "Easy and hard class accuracy against C",
               "Mean test accuracy of the easy and of the hard classes of the best trial (over B, η, chosen "
               "on validation) at each C, per ε."),
    FigureInfo("fig5-auto-s", 5, "AUTO-S against tuned C (paper Fig. 5)",
               "Test accuracy (all classes and hard classes) of the best tuned-C trial and the best AUTO-S "
               "trial per cell against ε."),
    FigureInfo("fig6-cumulative-noise", 6, "Cumulative noise σ√T against B (paper Figs. 6–7)",
               "Per task, top: σ√T of the recorded trials against B per ε (columns: E), with the per-step "
               "noise σ/B (old rule, dotted, right axis), the region excluded by the min-step rule T < T_min shaded "
               "and the "
               "rule's recommended B marked; bottom: measured test accuracy of the best trial at each B, the "
               "measured best B starred.", per_task=True),
    FigureInfo("fig7a-optimal-clip", 7, "C* of Theorem 5.2 against the tuned C",
               "Per task and E: the tuned C (best on validation, bars: near-optimal range) and C* of Theorem "
               "5.2 from the best trial's probe (band: C* over all diagnosed trials of the cell) against ε."),
    FigureInfo("fig7b-mse-split", 7, "Clipping bias and noise variance against C",
               "Per task, one panel per (E, ε): the per-step MSE of the clipped noisy gradient split into "
               "clipping bias and noise variance, one point per trial at its own C; vertical lines: tuned C "
               "and the median C*.", per_task=True),
    FigureInfo("fig9-search-efficiency", 9, "Search efficiency against a replicated full grid",
               "Per cell holding a replicated full grid: the share of random draw orders (bootstrap) whose random "
               "search of k trials, one replicate seen per configuration and the best selected on validation, "
               "comes within 1 accuracy point of the mean test accuracy of the grid's best configuration, "
               "against k.", needs="a replicated full grid"),
)
_FIGURE = {info.key: info for info in FIGURES}


def figure_index() -> str:
    """The Markdown index of the report's figures (``reports/README.md`` holds a copy)."""
    lines = ["| file | section | figure | what it shows |", "|---|---|---|---|"]
    for info in FIGURES:
        name = f"`{info.key}-<task>.png`" if info.per_task else f"`{info.key}.png`"
        shows = f"{info.shows} Only when the results hold {info.needs}." if info.needs else info.shows
        lines.append(f"| {name} | {info.section} | {info.title} | {shows} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------

def _percent(value: float) -> str:
    return "–" if value is None or not np.isfinite(value) else f"{100 * value:.1f}"


def _points(value: float) -> str:
    return "–" if value is None or not np.isfinite(value) else f"{100 * value:+.1f}"


def _sig(value: float) -> str:
    return "–" if value is None or not np.isfinite(value) else f"{value:.3g}"


def _int(value: float) -> str:
    return "–" if value is None or not np.isfinite(value) else f"{int(value)}"


#: Table headers with symbols and units, by analysis column name.
_HEADERS = {
    "epsilon": "ε", "epochs": "E", "cell_id": "cell", "name": "search", "trials_planned": "planned",
    "mean_best_val_accuracy": "mean best val acc %", "median_grad_norm": "median ‖g‖", "clip_bound": "best C",
    "batch_size": "best B", "learning_rate": "η", "val_accuracy": "val %", "test_accuracy": "test %",
    "clip_low": "C low", "clip_high": "C high", "batch_low": "B low", "batch_high": "B high",
    "near_optimal_trials": "near-optimal trials", "diagnostic_epoch": "probe epoch",
    "tuned_test_accuracy": "tuned C test %", "auto_s_test_accuracy": "AUTO-S test %", "gap": "gap (points)",
    "tuned_hard": "tuned C hard classes %", "auto_s_hard": "AUTO-S hard classes %",
    "recommended_batch_size": "rule's B", "best_batch_size": "measured best B",
    "per_step_rule_batch_size": "old per-step rule's B",
    "recommended_accuracy": "test % at rule's B", "best_accuracy": "test % at best B", "accuracy_gap": "gap (points)",
    "tuned_clip_bound": "tuned C", "optimal_clip_bound": "C* (best trial)", "optimal_clip_low": "C* low",
    "optimal_clip_median": "C* median", "optimal_clip_high": "C* high", "mse_bias": "bias (‖·‖²)",
    "mse_variance": "variance (‖·‖²)", "bias_share": "bias share %", "diagnosed_trials": "diagnosed trials",
    "base_learning_rate": "η₀", an.EASY: "easy classes %", an.HARD: "hard classes %",
    "fixed_test_accuracy": "fixed (C, B) test %", "loss": "loss (points)", "hard_loss": "hard-class loss (points)",
    "replicates": "R", "test_interval": "test % interval", "noise_set": "within noise",
    "target_test_accuracy": "grid's best test %",
}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _level(value: float, binned: bool) -> str:
    return f"≈{value:.2g}" if binned else f"{value:g}"


def _series_colors(count: int) -> list[tuple[float, ...]]:
    cmap = matplotlib.colormaps[COLOR_MAP]
    return [cmap(x) for x in np.linspace(0.0, 0.85, max(count, 1))]


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


# ---------------------------------------------------------------------------------------------
# The document
# ---------------------------------------------------------------------------------------------

@dataclass
class Section:
    """A numbered part of the report: HTML blocks in order."""

    number: int
    title: str
    blocks: list[str] = field(default_factory=list)

    def text(self, body: str) -> None:
        self.blocks.append(f"<p>{html.escape(body)}</p>")

    def note(self, body: str) -> None:
        self.blocks.append(f'<p class="missing">{html.escape(body)}</p>')

    def table(self, frame: pd.DataFrame, formats: dict[str, Callable[[float], str]] | None = None,
              caption: str = "") -> None:
        shown = frame.copy()
        for column, formatter in (formats or {}).items():
            if column in shown:
                shown[column] = [formatter(v) for v in shown[column]]
        body = shown.rename(columns=_HEADERS).to_html(index=False, escape=True, na_rep="–", border=0)
        cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
        self.blocks.append(body.replace('<table class="dataframe">', f'<table class="data">{cap}', 1))


@dataclass(frozen=True)
class ReportWriter:
    """Writes figures as PNG under ``out`` and embeds them in the sections."""

    out: Path

    def figure(self, section: Section, figure: Figure, key: str, task: str | None = None) -> None:
        """Save ``figure`` as ``<key>[-<task>].png`` and embed it with its ``FIGURES`` caption."""
        info = _FIGURE[key]
        name = f"{key}-{_slug(task)}.png" if task else f"{key}.png"
        buffer = io.BytesIO()
        FigureCanvasAgg(figure)  # render with Agg: no pyplot, no GUI backend, no global state
        figure.savefig(buffer, format="png", dpi=DPI)
        data = buffer.getvalue()
        (self.out / name).write_bytes(data)
        encoded = base64.b64encode(data).decode("ascii")
        title = info.title + (f" — {task}" if task else "")
        text = html.escape(info.shows)
        section.blocks.append(
            f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{encoded}">'
            f"<figcaption><b>{html.escape(title)}</b> ({html.escape(name)}). {text}</figcaption></figure>")


def _new_figure(rows: int, columns: int, width: float = 3.8, height: float = 3.2) -> tuple[Figure, np.ndarray]:
    figure = Figure(figsize=(max(width * columns + 0.6, 7.0), height * rows + 0.5), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    return figure, axes


def _tick(value: float) -> str:
    """A tick label: whole numbers exactly (batch sizes: 1024, not 1020), others to three
    significant digits, positional (0.001), never 1e+03."""
    if value >= 1 and float(value).is_integer():
        return str(int(value))
    return np.format_float_positional(value, precision=3, unique=False, fractional=False, trim="-")


def _log_axis(ax: Axes, axis: str, ticks: Collection[float] | None = None,
              data: Collection[float] | None = None) -> None:
    """Log scale with plain-number labels.

    With few ``ticks`` (a sparse grid), ticks sit at those values. Otherwise decades are labelled,
    the 2s and 5s between them too when ``data`` spans under 40×, and every digit under 4×.
    """
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    chosen = []
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


def _empty_panel(ax: Axes, title: str) -> None:
    """A panel whose (task, ε, E) the results do not hold: say so instead of drawing axes."""
    ax.set_axis_off()
    ax.set_title(title, fontsize=8)
    ax.text(0.5, 0.5, "not in the results", ha="center", va="center", transform=ax.transAxes, color="dimgrey")


#: One drawn panel of a (task, E) grid: its axes, the task, E and the rows of the frame it shows.
Panel = tuple[Axes, str, int, pd.DataFrame]


def _task_epoch_panels(ctx: Context, frame: pd.DataFrame, width: float = 4.0,
                       height: float = 3.1) -> tuple[Figure, np.ndarray, list[Panel]]:
    """A figure with one panel per (task, E) of ``frame``: rows are the tasks in report order,
    columns the E values ascending. A panel ``frame`` has no rows for is marked empty; the others
    are returned for the caller to draw."""
    tasks = [t for t in ctx.tasks if t in set(frame["task"])]
    epochs = sorted(frame["epochs"].unique())
    figure, axes = _new_figure(len(tasks), len(epochs), width=width, height=height)
    panels: list[Panel] = []
    for row, task in enumerate(tasks):
        for column, n_epochs in enumerate(epochs):
            part = frame[(frame["task"] == task) & (frame["epochs"] == n_epochs)]
            if part.empty:
                _empty_panel(axes[row, column], f"{task}\nE = {n_epochs}")
            else:
                panels.append((axes[row, column], task, n_epochs, part))
    return figure, axes, panels


def _label_panel(ax: Axes, title: str, xlabel: str, ylabel: str, grid_axis: str = "both") -> None:
    """Axis labels, a small title and a light grid: the dress every line and box panel shares."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.grid(True, axis=grid_axis, alpha=0.3)


def _figure_legend(figure: Figure, axes: np.ndarray, columns: int) -> None:
    """One legend below the panels with every labelled artist of ``axes`` (first of each label)."""
    entries: dict[str, object] = {}
    for ax in axes.ravel():
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    if entries:
        figure.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=columns, fontsize=8)


@dataclass(frozen=True)
class Options:
    """What the report is built with (``build_report`` arguments after validation)."""

    hard_fraction: float = 0.5
    hard_classes: tuple[str, ...] | None = None
    near_optimal: float = an.NEAR_OPTIMAL
    title: str = "dptune report"


@dataclass
class Context:
    """Everything the sections share: the results, strata and task order."""

    results: an.Results
    strata: pd.DataFrame
    tasks: list[str]
    options: Options
    writer: ReportWriter


def _budgets(frame: pd.DataFrame, task: str) -> tuple[list[float], list[int]]:
    """The ε and the E values ``frame`` holds for ``task``, ascending."""
    part = frame[frame["task"] == task]
    return sorted(part["epsilon"].unique()), sorted(part["epochs"].unique())


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------

def _overview(ctx: Context) -> Section:
    section = Section(0, "Overview: what the results hold")
    results = ctx.results
    section.text(f"Sources: {', '.join(results.sources)}. {len(results.trials)} trial records, "
                 f"{len(results.finished)} finished (status ok), {len(results.tuned)} with tuned C, "
                 f"{len(results.auto_s)} AUTO-S. Selection is on validation accuracy; reported accuracies "
                 "are test accuracies of the selected trials, in %.")
    for note in an.missing_data(results):
        section.note(f"Missing: {note}.")
    for text in an.privacy_statements(results):
        section.text(f"Privacy: {text}")
    if not results.release.empty:
        columns = {"search_id": "search", "cell_id": "cell", "clip_bound": "C", "batch_size": "B",
                   "base_learning_rate": "η₀", "learning_rate": "η", "noisy_val_accuracy": "noisy val acc (max, %)",
                   "test_accuracy": "test acc (%)", "epsilon_total": "ε total", "delta_total": "δ"}
        section.table(results.release[list(columns)].rename(columns=columns),
                      {"noisy val acc (max, %)": _percent, "test acc (%)": _percent, "ε total": _sig, "δ": _sig},
                      "Releases of end-to-end private searches: the selected configuration, its noisy validation "
                      "score (the maximum of the runs' noisy scores: biased upward, not an accuracy estimate) and "
                      "its test accuracy where the test split is public (else withheld). Their runs are not in "
                      "this report: the per-run records stay inside the data owner's trust boundary.")
    if not results.trials.empty:
        coverage = an.coverage(results)
        section.table(coverage.drop(columns=["search_id"]), {"epsilon": _sig},
                      "Trials per search cell: planned (scheduled; configurations pruned by the min-step rule are "
                      "recorded besides them), recorded by status, remaining.")
    difficulty = an.task_difficulty(results)
    if len(difficulty):
        section.table(difficulty, {"mean_best_val_accuracy": _percent, "median_grad_norm": _sig},
                      "Tasks ranked by difficulty (1 = easiest): mean best validation accuracy (%) over shared "
                      "(ε, E) cells; median probe gradient norm of the best diagnosed trials.")
    if ctx.strata.empty:
        section.note("Missing: classes cannot be split into easy and hard (no per-class accuracies); "
                     "per-stratum views are left out.")
    else:
        rule = ("the classes given with --hard-classes" if ctx.options.hard_classes else
                f"the ⌈{ctx.options.hard_fraction:g}·K⌉ classes with the lowest validation accuracy in the reference "
                "trial (the best validation trial at the task's largest ε)")
        section.text(f"Difficulty strata: hard classes are {rule}; the others are easy. A stratum's accuracy is "
                     "the unweighted mean of its classes' test accuracies.")
        rows = []
        for task in ctx.tasks:
            part = ctx.strata[ctx.strata["task"] == task]
            if part.empty:
                continue
            for stratum in an.STRATA:
                members = part[part["stratum"] == stratum]
                rows.append({"task": task, "stratum": stratum, "classes": len(members),
                             "members (reference accuracy %)": ", ".join(
                                 f"{n} ({_percent(a)})" for n, a in zip(members["class_name"],
                                                                       members["reference_accuracy"], strict=True)),
                             "reference trial": members["reference_trial"].iloc[0] if len(members) else "–"})
        section.table(pd.DataFrame(rows), caption="Easy and hard classes per task.")
    return section


def _heatmaps(ctx: Context) -> Section:
    section = Section(1, "Accuracy over (C, B), best over η")
    results = ctx.results
    grid = an.accuracy_grid(results)
    if grid.empty:
        section.note("Missing: no finished trial with a tuned clip bound; no heatmap to draw.")
        return section
    if results.clip_binned:
        section.text(f"C was sampled continuously: it is binned on a log grid of {an.BINS_PER_DECADE} bins per "
                     "decade aligned to powers of ten; a bin is labelled by its geometric centre (≈).")
    unfinished = an.unfinished_bins(results)
    for task in ctx.tasks:
        part = grid[grid["task"] == task]
        if part.empty:
            continue
        others = unfinished[unfinished["task"] == task]
        epsilons, epochs = _budgets(part, task)
        clips = sorted(set(part["clip_bin"]) | set(others["clip_bin"]))
        batches = sorted(set(part["batch_bin"]) | set(others["batch_bin"]))
        figure, axes = _new_figure(len(epochs), len(epsilons), width=0.6 * len(batches) + 1.6,
                                   height=0.42 * len(clips) + 1.3)
        low, high = 100 * part["test_accuracy"].min(), 100 * part["test_accuracy"].max()
        image = None
        for row, n_epochs in enumerate(epochs):
            for column, epsilon in enumerate(epsilons):
                ax = axes[row, column]
                cell = part[(part["epsilon"] == epsilon) & (part["epochs"] == n_epochs)]
                if cell.empty:
                    _empty_panel(ax, f"ε = {epsilon:g}, E = {n_epochs}")
                    continue
                matrix = np.full((len(clips), len(batches)), np.nan)
                for item in cell.itertuples(index=False):
                    matrix[clips.index(item.clip_bin), batches.index(item.batch_bin)] = 100 * item.test_accuracy
                image = ax.imshow(matrix, origin="lower", cmap=COLOR_MAP, vmin=low, vmax=high, aspect="auto")
                for (i, j), value in np.ndenumerate(matrix):
                    if np.isfinite(value):
                        shade = (value - low) / (high - low) if high > low else 0.5
                        ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=7,
                                color="black" if shade > 0.55 else "white")
                missing = others[(others["epsilon"] == epsilon) & (others["epochs"] == n_epochs)]
                for item in missing.itertuples(index=False):
                    ax.text(batches.index(item.batch_bin), clips.index(item.clip_bin), item.outcome, ha="center",
                            va="center", fontsize=6, color="dimgrey")
                best = an.select_best(cell, an.CELL).iloc[0]
                i, j = clips.index(best["clip_bin"]), batches.index(best["batch_bin"])
                for color, width in (("white", 3.5), ("black", 1.5)):
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor=color, linewidth=width))
                ax.set_xticks(range(len(batches)), [_level(b, results.batch_binned) for b in batches],
                              rotation=45, fontsize=7)
                ax.set_yticks(range(len(clips)), [_level(c, results.clip_binned) for c in clips], fontsize=7)
                ax.set_title(f"ε = {epsilon:g}, E = {n_epochs}", fontsize=9)
                ax.set_xlabel("batch size B (examples, log-spaced)", fontsize=8)
                ax.set_ylabel("clip bound C (gradient norm, log-spaced)", fontsize=8)
        figure.suptitle(f"{task}: test accuracy (%) of the η chosen on validation", fontsize=10)
        if image is not None:
            figure.colorbar(image, ax=axes, label="test accuracy (%)", shrink=0.8)
        ctx.writer.figure(section, figure, "fig1-accuracy-heatmaps", task)
    return section


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
    split = (f"the validation split's binomial noise √(p(1 − p)/n_val) (n_val = {_int(n_val.median())} rows: "
             f"±{_percent(float(binomial.median()))} points at the {level} level for the best's accuracy, the median "
             "over cells)")
    if replicates.max() < 2:
        lines = [f"Each configuration ran once (R = 1): no replicate spread exists. Its score is its validation "
                 f"accuracy; intervals and the within-noise set use {split}, the only noise scale one run has. The "
                 "spread of the training coins is not measured, so they understate the uncertainty by whatever "
                 "that spread adds: run replicates (replicates: R) to measure it."]
    else:
        counts = "R = " + (f"{replicates.min()}" if replicates.min() == replicates.max()
                           else f"{replicates.min()} to {replicates.max()}")
        lines = [f"Each configuration ran {counts} times with fresh coins; its score is the mean validation accuracy "
                 f"over its replicates, and its standard error se = std/√R. Intervals of the best configuration's "
                 f"mean accuracies are {level} Student t intervals over its replicates (a rerun with fresh coins on "
                 "the same splits; the splits' own sampling noise comes on top). A configuration run once in a "
                 f"replicated search falls back to {split}."]
    lines.append(f"Within noise of the best: a configuration whose score is below the best's by at most "
                 f"{z}·√(se_best² + se²), se the replicate standard error (R ≥ 2) or the binomial validation noise "
                 "(R = 1); such settings cannot be told apart from the best on these data. Selection is always on "
                 "validation, never test.")
    if resamples:
        lines.append(f"Bars of the figure: {level} percentile intervals of the selected C and B over {resamples:,} "
                     "bootstrap rounds; each round resamples the replicates within every configuration (R = 1: "
                     "draws its validation score from Bin(n_val, p)/n_val) and selects the best on validation again."
                     + (" With few replicates these bars understate the spread (resampling R values keeps (R − 1)/R "
                        "of their variance and never leaves their range): the within-noise set is the more cautious "
                        "of the two." if replicates.max() >= 2 else ""))
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
        shown = _sig if row.quantity == "C" else _int
        rows.append({"condition": row.condition, "task": row.task, "held": row.group, "quantity": row.quantity,
                     "optimal, harder side": f"{row.harder}: "
                                             f"{_interval(row.harder_value, row.harder_low, row.harder_high, shown)}",
                     "optimal, easier side": f"{row.easier}: "
                                             f"{_interval(row.easier_value, row.easier_low, row.easier_high, shown)}",
                     "paper (harder side)": row.paper, "observed (harder side)": row.observed,
                     "what the data says": _VERDICTS[row.verdict]})
    section.table(pd.DataFrame(rows), caption="The paper finds the optimal C larger and the optimal B smaller under "
                                              "tighter privacy (smaller ε), and smaller B with fewer epochs. Optimal "
                                              "values with their bootstrap intervals on the harder (smallest ε or "
                                              "E) and the easier (largest) side.")
    counts = checks["verdict"].value_counts()
    against = int(counts.get("disagrees", 0) + counts.get("no change", 0))
    section.text(f"Of {len(checks)} comparisons: {int(counts.get('agrees', 0))} agree with the paper beyond the "
                 f"noise, {against} disagree with it, and {int(counts.get('inconclusive', 0))} are too wide to "
                 "conclude anything (their bootstrap intervals overlap).")
    for row in checks[checks["verdict"].isin(["disagrees", "no change"])].itertuples(index=False):
        section.note(f"Disagrees with the paper ({row.condition}): {row.task}, {row.group}: optimal {row.quantity} "
                     f"{row.harder_value:g} at {row.harder} against {row.easier_value:g} at {row.easier} (paper: "
                     f"{row.paper} on the harder side; {_VERDICTS[row.verdict].split(': ', 1)[1]}).")


def _optimal(ctx: Context) -> Section:
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
    figure, axes = _new_figure(1, 2, width=4.6, height=3.6)
    series = [(task, n) for task in ctx.tasks
              for n in sorted(intervals.loc[intervals["task"] == task, "epochs"].unique())]
    colors = _series_colors(len(series))
    for k, (task, n_epochs) in enumerate(series):
        part = intervals[(intervals["task"] == task) & (intervals["epochs"] == n_epochs)].sort_values("epsilon")
        x = part["epsilon"].to_numpy() * (1 + 0.04 * (k - (len(series) - 1) / 2))  # dodge overlapping bars
        for ax, value, low, high in ((axes[0, 0], "clip_bound", "clip_low", "clip_high"),
                                     (axes[0, 1], "batch_size", "batch_low", "batch_high")):
            y = part[value].to_numpy(dtype=float)
            errors = np.vstack([y - part[low].to_numpy(dtype=float), part[high].to_numpy(dtype=float) - y])
            ax.errorbar(x, y, yerr=errors, color=colors[k], marker=_MARKERS[k % len(_MARKERS)], capsize=3,
                        linestyle="-" if n_epochs == max(intervals["epochs"]) else "--",
                        label=f"{task}, E = {n_epochs}")
    for ax, column, low_col, high_col, name, unit in (
            (axes[0, 0], "clip_bound", "clip_low", "clip_high", "optimal clip bound C", "gradient norm"),
            (axes[0, 1], "batch_size", "batch_low", "batch_high", "optimal batch size B", "examples")):
        _log_axis(ax, "x", intervals["epsilon"].unique())
        spread = intervals[[column, low_col, high_col]].to_numpy(dtype=float).ravel()
        _log_axis(ax, "y", np.unique(spread), spread)
        ax.set_xlabel("privacy budget ε (log scale)")
        ax.set_ylabel(f"{name} ({unit}, log scale)")
        ax.grid(True, which="major", alpha=0.3)
    _figure_legend(figure, axes, 2)
    figure.suptitle(f"Optimal (C, B) per cell, selected on validation; bars: {100 * an.CONFIDENCE:g} % bootstrap "
                    "intervals", fontsize=10)
    ctx.writer.figure(section, figure, "fig2-optimal-c-b")
    section.table(_best_table(best, intervals), caption=(
        "Best configuration per cell (selected on mean validation accuracy): accuracies in % with their "
        f"{100 * an.CONFIDENCE:g} % intervals; within noise: configurations not distinguishable from the best, of "
        "all ranked, and their C and B; optimal C and B with bootstrap intervals and how often the bootstrap "
        "selected the best configuration."))
    _paper_checks(section, intervals)
    return section


def _best_table(best: pd.DataFrame, intervals: pd.DataFrame) -> pd.DataFrame:
    """The shown table of ``best_configurations`` joined with ``optimal_setting_intervals`` on the cell."""
    joined = best.merge(intervals[[*an.CELL, "clip_low", "clip_high", "batch_low", "batch_high", "selected_share"]],
                        on=an.CELL, suffixes=("", "_ci"))
    rows = []
    for row in joined.itertuples(index=False):
        rows.append({"task": row.task, "ε": _sig(row.epsilon), "E": row.epochs, "best C": _sig(row.clip_bound),
                     "best B": _int(row.batch_size), "η": _sig(row.learning_rate), "R": row.replicates,
                     "val % [interval]": _interval(row.val_accuracy, row.val_low, row.val_high, _percent),
                     "test % [interval]": _interval(row.test_accuracy, row.test_low, row.test_high, _percent),
                     "within noise": f"{row.within_noise} of {row.configurations}",
                     "C within noise": f"{_sig(row.clip_low)}–{_sig(row.clip_high)}",
                     "B within noise": f"{_int(row.batch_low)}–{_int(row.batch_high)}",
                     "optimal C [bootstrap]": f"[{_sig(row.clip_low_ci)}, {_sig(row.clip_high_ci)}]",
                     "optimal B [bootstrap]": f"[{_int(row.batch_low_ci)}, {_int(row.batch_high_ci)}]",
                     "bootstrap picks best %": _percent(row.selected_share)})
    return pd.DataFrame(rows)


def _grad_norms(ctx: Context) -> Section:
    section = Section(3, "Per-example gradient-norm distributions")
    samples = an.grad_norm_samples(ctx.results, ctx.strata if not ctx.strata.empty else None)
    if samples.empty:
        section.note("Missing: no diagnostics recorded (per-example gradient norms need diagnostics: true).")
        return section
    if "stratum" not in samples:
        samples["stratum"] = "all"
    samples["stratum"] = samples["stratum"].fillna("all")
    figure, _, panels = _task_epoch_panels(ctx, samples, width=4.2, height=3.2)
    strata = [s for s in (*an.STRATA, "all") if s in set(samples["stratum"])]
    width = 0.8 / len(strata)
    for ax, task, n_epochs, part in panels:
        epsilons = sorted(part["epsilon"].unique())
        for s, stratum in enumerate(strata):
            data = [part[(part["epsilon"] == e) & (part["stratum"] == stratum)]["grad_norm"].to_numpy()
                    for e in epsilons]
            positions = [i + (s - (len(strata) - 1) / 2) * width for i in range(len(epsilons))]
            keep = [k for k, d in enumerate(data) if len(d)]
            if not keep:
                continue
            boxes = ax.boxplot([data[k] for k in keep], positions=[positions[k] for k in keep], widths=width * 0.9,
                               patch_artist=True, showfliers=False)
            for patch in boxes["boxes"]:
                patch.set_facecolor("white" if stratum == an.EASY else "lightgrey")
                patch.set_hatch("" if stratum == an.EASY else "//")
            for median in boxes["medians"]:
                median.set_color("black")
        ax.set_xticks(range(len(epsilons)), [f"{e:g}" for e in epsilons])
        _log_axis(ax, "y", data=part["grad_norm"])
        _label_panel(ax, f"{task}\nE = {n_epochs}", "privacy budget ε", "per-example gradient norm ‖g_i‖ (log)",
                     grid_axis="y")
    handles = [Patch(facecolor="white" if s == an.EASY else "lightgrey",
                                        hatch="" if s == an.EASY else "//", edgecolor="black", label=f"{s} classes")
               for s in strata]
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    figure.suptitle("Probe gradient norms of each cell's best diagnosed trial (last diagnostic epoch)", fontsize=10)
    ctx.writer.figure(section, figure, "fig3-grad-norms")
    summary = samples.groupby([*an.CELL, "stratum", "diagnostic_epoch"])["grad_norm"].describe(
        percentiles=[0.25, 0.5, 0.75])[["count", "25%", "50%", "75%"]].reset_index()
    summary = summary.rename(columns={"count": "probe examples", "25%": "q25 ‖g‖", "50%": "median ‖g‖",
                                      "75%": "q75 ‖g‖"})
    section.table(summary, {"epsilon": _sig, "probe examples": _int, "q25 ‖g‖": _sig, "median ‖g‖": _sig,
                            "q75 ‖g‖": _sig}, "Quartiles of the probe gradient norms per cell and stratum.")
    return section


def _retention(ctx: Context) -> Section:
    section = Section(4, "Clipping as re-weighting: retention weights and class accuracy per stratum")
    if ctx.strata.empty:
        section.note("Missing: no per-class accuracies, so no easy/hard strata; this section needs them.")
        return section
    curves = an.retention_curves(ctx.results, ctx.strata)
    if curves.empty:
        section.note("Missing: no diagnostics recorded, so w_y(C) cannot be computed (needs diagnostics: true).")
    else:
        _stratum_lines(ctx, section, curves, "clip_bound", "retention_weight", 1.0,
                       "mean retention weight w_y(C)", "fig4a-retention-weights")
    accuracy = an.stratum_accuracy_by_clip(ctx.results, ctx.strata).melt(
        id_vars=[*an.CELL, "clip_bin"], value_vars=list(an.STRATA), var_name="stratum", value_name="accuracy")
    accuracy = accuracy.dropna(subset=["accuracy"])
    if accuracy.empty:
        section.note("Missing: no per-class test accuracies of tuned trials.")
    else:
        _stratum_lines(ctx, section, accuracy.rename(columns={"clip_bin": "clip_bound"}), "clip_bound", "accuracy",
                       100.0, "class test accuracy (%)", "fig4b-stratum-accuracy")
    return section


def _stratum_lines(ctx: Context, section: Section, frame: pd.DataFrame, x: str, y: str, scale: float,
                   ylabel: str, key: str) -> None:
    """Panels per (task, E): one line per (ε, stratum) of ``y`` against log ``x``."""
    epsilons = sorted(frame["epsilon"].unique())
    colors = dict(zip(epsilons, _series_colors(len(epsilons)), strict=True))
    figure, _, panels = _task_epoch_panels(ctx, frame)
    for ax, task, n_epochs, part in panels:
        for epsilon in epsilons:
            for stratum, (style, marker) in STRATUM_STYLE.items():
                line = part[(part["epsilon"] == epsilon) & (part["stratum"] == stratum)].sort_values(x)
                if len(line):
                    ax.plot(line[x], scale * line[y], linestyle=style, marker=marker, color=colors[epsilon],
                            markersize=4)
        _log_axis(ax, "x", part[x].unique())
        _label_panel(ax, f"{task}\nE = {n_epochs}", "clip bound C (gradient norm, log scale)", ylabel)
    handles = [Line2D([], [], color=colors[e], marker=_MARKERS[0], label=f"ε = {e:g}") for e in epsilons]
    handles += [Line2D([], [], color="black", linestyle=s, marker=m, label=f"{name} classes")
                for name, (s, m) in STRATUM_STYLE.items()]
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    figure.suptitle(_FIGURE[key].title, fontsize=10)
    ctx.writer.figure(section, figure, key)


def _auto_s(ctx: Context) -> Section:
    section = Section(5, "AUTO-S against tuned C")
    if ctx.results.auto_s.empty:
        section.note("Missing: the results hold no finished AUTO-S trials (run the search with "
                     "training.compare_auto_s: true to compare).")
        return section
    table = an.auto_s_comparison(ctx.results, ctx.strata)
    if table.empty:
        section.note("Missing: no cell has both a finished AUTO-S and a finished tuned-C trial.")
        return section
    figure, axes, panels = _task_epoch_panels(ctx, table)
    lines = (("tuned", "test_accuracy", "-", "o", "tuned C, all classes"),
             ("auto_s", "test_accuracy", "--", "o", "AUTO-S, all classes"),
             ("tuned", an.HARD, "-", "s", "tuned C, hard classes"),
             ("auto_s", an.HARD, "--", "s", "AUTO-S, hard classes"))
    for ax, task, n_epochs, part in panels:
        part = part.sort_values("epsilon")
        for method, measure, style, marker, label in lines:
            ax.plot(part["epsilon"], 100 * part[f"{method}_{measure}"].astype(float), linestyle=style,
                    marker=marker, color="black" if method == "tuned" else "grey", label=label)
        _log_axis(ax, "x", part["epsilon"])
        _label_panel(ax, f"{task}\nE = {n_epochs}", "privacy budget ε (log scale)", "test accuracy (%)")
    _figure_legend(figure, axes, 2)
    figure.suptitle("Best tuned-C trial against best AUTO-S trial (both selected on validation)", fontsize=10)
    ctx.writer.figure(section, figure, "fig5-auto-s")
    shown = table[[*an.CELL, "tuned_test_accuracy", "auto_s_test_accuracy", "gap", "tuned_hard", "auto_s_hard"]]
    section.table(shown, {"epsilon": _sig, "tuned_test_accuracy": _percent, "auto_s_test_accuracy": _percent,
                          "gap": _points, "tuned_hard": _percent, "auto_s_hard": _percent},
                  "Test accuracy (%) of the best tuned-C and AUTO-S trials; gap in points (positive: tuning C helps).")
    return section


def _batch_noise(ctx: Context) -> Section:
    section = Section(6, "Cumulative DP noise σ√T against B, and the min-step rule")
    table = an.batch_size_noise(ctx.results)
    if table.empty:
        section.note("Missing: no trial recorded σ and T (no finished trials yet).")
        return section
    bounds = an.min_steps(ctx.results)
    section.text("σ√T is the cumulative DP noise (σ: noise multiplier the trial trained with, T: its steps); the "
                 "rule picks the smallest B on the plateau of σ√T subject to T ≥ T_min (dptune.plan). σ/B is the "
                 "old per-step rule's noise std of the mean gradient (in units of C), which keeps falling to full "
                 "batch under fixed epochs.")
    for task in ctx.tasks:
        part = table[table["task"] == task]
        if part.empty:
            continue
        if task not in bounds:
            section.note(f"{task}: the search spec states no min_steps; the min-step bound is not drawn.")
        epsilons, epochs = _budgets(part, task)
        colors = dict(zip(epsilons, _series_colors(len(epsilons)), strict=True))
        figure, axes = _new_figure(2, len(epochs), width=4.2, height=3.0)
        for column, n_epochs in enumerate(epochs):
            top, bottom = axes[0, column], axes[1, column]
            per_step = top.twinx()
            both = part[part["epochs"] == n_epochs]
            if not np.isfinite(both["cumulative_noise"]).any():  # every B of this E was pruned
                per_step.set_axis_off()
                _empty_panel(top, f"E = {n_epochs}: no trial ran")
                _empty_panel(bottom, f"E = {n_epochs}")
                continue
            for k, epsilon in enumerate(epsilons):
                line = both[both["epsilon"] == epsilon].sort_values("batch_size")
                if line.empty:  # this (ε, E) is not in the results
                    continue
                noisy = line[np.isfinite(line["cumulative_noise"])]
                marker = _MARKERS[k % len(_MARKERS)]
                top.plot(noisy["batch_size"], noisy["cumulative_noise"], color=colors[epsilon], marker=marker)
                per_step.plot(noisy["batch_size"], noisy["per_step_noise"], color=colors[epsilon], linestyle=":",
                              linewidth=1.2)
                measured = line[np.isfinite(line["test_accuracy"])]
                bottom.plot(measured["batch_size"], 100 * measured["test_accuracy"], color=colors[epsilon],
                            marker=marker)
                recommended = noisy[noisy["batch_size"] == line["recommended_batch_size"].iloc[0]]
                top.plot(recommended["batch_size"], recommended["cumulative_noise"], marker="v", markersize=11,
                         color=colors[epsilon], markeredgecolor="black", linestyle="none")
                best = line[line["measured_best"]]
                bottom.plot(best["batch_size"], 100 * best["test_accuracy"], marker="*", markersize=14,
                            color=colors[epsilon], markeredgecolor="black", linestyle="none")
            feasible = both.loc[both["steps"] >= bounds.get(task, 0), "batch_size"]
            infeasible = both.loc[both["steps"] < bounds.get(task, 0), "batch_size"]
            if len(feasible) and len(infeasible) and infeasible.min() > feasible.max():
                edge = math.sqrt(float(feasible.max()) * float(infeasible.min()))
                for ax in (top, bottom):
                    ax.axvspan(edge, float(both["batch_size"].max()) * 1.5, color="grey", alpha=0.25, hatch="..")
            for ax in (top, bottom):
                _log_axis(ax, "x", both["batch_size"].unique())
                ax.set_xlabel("batch size B (examples, log scale)")
                ax.grid(True, alpha=0.3)
            _log_axis(per_step, "y", data=both["per_step_noise"])
            per_step.set_ylabel("per-step noise σ/B (dotted, log)", fontsize=8)
            top.set_ylabel("cumulative noise σ√T")
            bottom.set_ylabel("test accuracy (%) at B\n(C, η chosen on validation)")
            top.set_title(f"E = {n_epochs}" + (f" (T_min = {bounds[task]}; shaded: T < T_min)"
                                               if task in bounds else ""), fontsize=8)
        handles = [Line2D([], [], color=colors[e], marker=_MARKERS[k % len(_MARKERS)], label=f"ε = {e:g}")
                   for k, e in enumerate(epsilons)]
        handles += [Line2D([], [], color="black", linestyle=":", label="σ/B, old per-step rule (right axis)"),
                    Line2D([], [], color="white", marker="v", markeredgecolor="black", markersize=10,
                           label="rule's recommended B"),
                    Line2D([], [], color="white", marker="*", markeredgecolor="black", markersize=12,
                           label="measured best B (on validation)")]
        figure.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8)
        figure.suptitle(f"{task}: cumulative DP noise and measured accuracy against B", fontsize=10)
        ctx.writer.figure(section, figure, "fig6-cumulative-noise", task)
    summary = an.batch_size_rule_check(table)
    section.table(summary, {"epsilon": _sig, "recommended_accuracy": _percent, "best_accuracy": _percent,
                            "accuracy_gap": _points},
                  "Does the rule's recommended B match the measured best B (selected on validation)? Accuracies "
                  "are test accuracies (%) of the best trial at that B; gap in points.")
    return section


def _clipping(ctx: Context) -> Section:
    section = Section(7, "Clipping diagnostics: C* of Theorem 5.2 and the bias/variance split")
    table = an.clipping_diagnostics(ctx.results)
    if table.empty:
        section.note("Missing: no diagnostics recorded (C* and the MSE split need diagnostics: true).")
        return section
    section.text("C* minimises the per-step MSE of the clipped noisy gradient against the true one on the probe "
                 "(Theorem 5.2, no sampling noise); it needs the true gradients, so it explains the tuned C "
                 "rather than picking it privately. Lower MSE tightens the per-step progress bound (Theorem 5.4).")
    best = an.optimal_settings(ctx.results, ctx.options.near_optimal)
    figure, axes, panels = _task_epoch_panels(ctx, table)
    for ax, task, n_epochs, part in panels:
        part = part.sort_values("epsilon")
        tuned = best[(best["task"] == task) & (best["epochs"] == n_epochs)].sort_values("epsilon")
        ax.fill_between(part["epsilon"], part["optimal_clip_low"], part["optimal_clip_high"], color="grey",
                        alpha=0.3, label="C* range over the cell's trials")
        ax.plot(part["epsilon"], part["optimal_clip_bound"], color="grey", marker="D", linestyle="--",
                label="C* of the best trial")
        y = tuned["clip_bound"].to_numpy(dtype=float)
        ax.errorbar(tuned["epsilon"], y, yerr=np.vstack([y - tuned["clip_low"].to_numpy(dtype=float),
                                                         tuned["clip_high"].to_numpy(dtype=float) - y]),
                    color="black", marker="o", capsize=3, label="tuned C (near-optimal range)")
        _log_axis(ax, "x", part["epsilon"])
        _log_axis(ax, "y", data=[*part["optimal_clip_low"], *part["optimal_clip_high"], *tuned["clip_low"],
                                 *tuned["clip_high"]])
        _label_panel(ax, f"{task}\nE = {n_epochs}", "privacy budget ε (log scale)",
                     "clip bound (gradient norm, log scale)")
    _figure_legend(figure, axes, 3)
    figure.suptitle("Optimal clip bound C* (Theorem 5.2) against the tuned C", fontsize=10)
    ctx.writer.figure(section, figure, "fig7a-optimal-clip")
    points = an.mse_split(ctx.results)
    for task in [t for t in ctx.tasks if t in set(table["task"])]:
        part = points[points["task"] == task]
        epsilons, epoch_list = _budgets(part, task)
        figure, axes = _new_figure(len(epoch_list), len(epsilons), width=3.6, height=2.9)
        for row, n_epochs in enumerate(epoch_list):
            for column, epsilon in enumerate(epsilons):
                ax = axes[row, column]
                cell = part[(part["epochs"] == n_epochs) & (part["epsilon"] == epsilon)].sort_values("clip_bound")
                if not (cell[["mse_bias", "mse_variance"]].to_numpy() > 0).any():
                    _empty_panel(ax, f"ε = {epsilon:g}, E = {n_epochs}")
                    continue
                for measure, marker, color, label in (("mse_bias", "v", "black", "clipping bias"),
                                                      ("mse_variance", "^", "grey", "noise variance"),
                                                      ("mse_total", "o", "none", "MSE = bias + variance")):
                    positive = cell[cell[measure] > 0]
                    ax.scatter(positive["clip_bound"], positive[measure], marker=marker, s=22,
                               facecolors=color, edgecolors="black", label=label)
                row_best = table[(table["task"] == task) & (table["epochs"] == n_epochs)
                                 & (table["epsilon"] == epsilon)]
                if len(row_best):
                    ax.axvline(float(row_best["tuned_clip_bound"].iloc[0]), color="black", linestyle="-",
                               label="tuned C")
                    ax.axvline(float(row_best["optimal_clip_median"].iloc[0]), color="black", linestyle=":",
                               label="median C*")
                _log_axis(ax, "x", None if ctx.results.clip_binned else part["clip_bound"].unique(),
                          [*cell["clip_bound"],
                           *row_best[["tuned_clip_bound", "optimal_clip_median"]].to_numpy().ravel()])
                _log_axis(ax, "y", data=cell[["mse_bias", "mse_variance", "mse_total"]].to_numpy().ravel())
                _label_panel(ax, f"ε = {epsilon:g}, E = {n_epochs}", "trial clip bound C (log scale)",
                             "per-step MSE (squared gradient norm)")
        _figure_legend(figure, axes, 3)
        figure.suptitle(f"{task}: MSE of the clipped noisy gradient, one point per trial", fontsize=10)
        ctx.writer.figure(section, figure, "fig7b-mse-split", task)
    section.table(table.drop(columns=["trial_id"]),
                  {"epsilon": _sig, "tuned_clip_bound": _sig, "optimal_clip_bound": _sig, "optimal_clip_low": _sig,
                   "optimal_clip_median": _sig, "optimal_clip_high": _sig, "mse_bias": _sig, "mse_variance": _sig,
                   "bias_share": _percent},
                  "Tuned C (best trial on validation) against C* (Theorem 5.2) at the last diagnostic epoch; MSE "
                  "split of the best trial at its C (bias share in %).")
    return section


def _guidelines(ctx: Context) -> Section:
    section = Section(8, "Guidelines from these results (the shape of the paper's Table 1)")
    table, setting = an.guideline_table(ctx.results, ctx.strata)
    if table.empty:
        section.note("Missing: no finished trial with a tuned clip bound.")
        return section
    binned = ctx.results.clip_binned
    if setting is not None and setting.cells == 1:
        section.note("The results hold a single cell: a fixed (C, B) is the tuned one there, so its cost across "
                     "cells cannot be measured (it needs two or more (ε, E) cells or tasks).")
    elif setting is None:
        section.note("No single (C, B) was evaluated in every cell, so the cost of one fixed setting cannot be "
                     "measured (it needs a grid over (C, B), or more trials per cell).")
    else:
        hard = table["hard_loss"].mean()
        section.text(
            f"Fixed setting: C {_level(setting.clip_bin, binned)}, "
            f"B {_level(setting.batch_bin, ctx.results.batch_binned)} "
            f"— among the (C, B) evaluated in all {setting.cells} cells, the one with the best mean validation "
            f"accuracy ({_percent(setting.mean_val_accuracy)} %), with η chosen per cell on validation. Using it "
            f"everywhere instead of tuning per cell loses {_points(table['loss'].mean())} points of test accuracy "
            f"on average (largest loss {_points(table['loss'].max())}), and "
            + (f"{_points(hard)} points on the hard classes." if np.isfinite(hard) else
               "an unknown amount on the hard classes (no strata)."))
    shown = table.assign(
        test_interval=[f"[{_percent(low)}, {_percent(high)}]"
                       for low, high in zip(table["test_low"], table["test_high"], strict=True)],
        noise_set=[f"{k} of {n}" for k, n in zip(table["within_noise"], table["configurations"], strict=True)])
    columns = [*an.CELL, "clip_bound", "batch_size", "learning_rate", "base_learning_rate", "clipping", "replicates",
               "val_accuracy", "test_accuracy", "test_interval", "noise_set", an.EASY, an.HARD, "fixed_test_accuracy",
               "loss", "hard_loss"]
    percent = ["val_accuracy", "test_accuracy", an.EASY, an.HARD, "fixed_test_accuracy"]
    formats = {"epsilon": _sig, "clip_bound": _sig, "learning_rate": _sig, "base_learning_rate": _sig,
               **{c: _percent for c in percent}, "loss": _points, "hard_loss": _points}
    section.table(shown[columns], formats,
                  "Per cell: the best (C, B, η) selected on mean validation accuracy over its R replicates, its mean "
                  f"test accuracy with its {100 * an.CONFIDENCE:g} % interval (section 2 says how it is made), how "
                  "many configurations are within noise of it, and the loss of the fixed (C, B).")
    trend = an.trends(table, an.task_difficulty(ctx.results))
    if trend.empty:
        section.note("No condition varies within the results (one ε, one E, one task): no trend to state.")
    else:
        section.table(trend, caption="How the best C and B move as the problem gets harder (counts over "
                                     "comparisons of otherwise equal cells, point estimates: section 2 says which "
                                     "moves in ε and E are beyond the bootstrap noise).")
    return section


def _efficiency(ctx: Context) -> Section:
    section = Section(9, "Search efficiency: random search against a replicated full grid")
    tolerance = an.NEAR_OPTIMAL
    curves = an.search_efficiency(ctx.results.tuned, tolerance=tolerance, draw_orders=BOOTSTRAP_RESAMPLES)
    if curves.empty:
        section.note("Missing: no cell holds a replicated full grid (every combination of its C, B and η₀ values "
                     "run with R ≥ 2 replicates), the ground truth this measure needs: search with sampler: grid "
                     "and replicates: 2 or more.")
        return section
    section.text(f"Ground truth per cell: the grid's best configuration on mean validation accuracy over its "
                 f"replicates, and its mean test accuracy. A random search of k trials draws k distinct "
                 f"configurations, sees one replicate of each (a single-seed run) and selects the best validation "
                 f"score; it comes within {100 * tolerance:g} point when its pick's mean test accuracy is at most "
                 f"{100 * tolerance:g} point under the best's. Shares over {BOOTSTRAP_RESAMPLES:,} bootstrap draw "
                 "orders.")
    figure, axes, panels = _task_epoch_panels(ctx, curves)
    for ax, task, n_epochs, part in panels:
        epsilons = sorted(part["epsilon"].unique())
        for color, epsilon in zip(_series_colors(len(epsilons)), epsilons, strict=True):
            line = part[part["epsilon"] == epsilon]
            ax.plot(line["trials"], line["within_share"], color=color, marker="o", markersize=3,
                    label=f"ε = {epsilon:g}")
        ax.axhline(0.9, color="grey", linestyle=":", label="90 % of draw orders")
        ax.set_ylim(0, 1.02)
        _label_panel(ax, f"{task}\nE = {n_epochs}", "trials of the random search (k)",
                     f"share within {100 * tolerance:g} point of the grid's best")
    _figure_legend(figure, axes, 4)
    figure.suptitle("Random search against the replicated full grid", fontsize=10)
    ctx.writer.figure(section, figure, "fig9-search-efficiency")
    rows = []
    for share in (0.5, 0.9):
        needed = an.trials_needed(curves, share).rename(columns={"trials_needed": f"trials for {share:.0%} of orders"})
        rows.append(needed.set_index([*an.CELL, "configurations", "target_test_accuracy"]))
    table = pd.concat(rows, axis=1).reset_index()
    section.table(table, {"epsilon": _sig, "target_test_accuracy": _percent,
                          **{c: _int for c in table.columns if c.startswith("trials for")}},
                  f"Trials a random search needs to come within {100 * tolerance:g} point of the grid's best (target: "
                  "its mean test accuracy, %) for half and for 90 % of draw orders ('–': not even the whole grid, "
                  "one replicate each, gets there that often).")
    return section


SECTIONS: tuple[Callable[[Context], Section], ...] = (
    _overview, _heatmaps, _optimal, _grad_norms, _retention, _auto_s, _batch_noise, _clipping, _guidelines,
    _efficiency)

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1200px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.6em}h2{font-size:1.25em;border-bottom:1px solid #bbb;margin-top:2em}
table.data{border-collapse:collapse;font-size:.82em;margin:1em 0}
table.data th,table.data td{border:1px solid #ccc;padding:2px 6px;text-align:right}
table.data th{background:#eee}caption{text-align:left;font-style:italic;padding:4px 0}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #ddd}figcaption{font-size:.85em;color:#444}
p.missing{background:#fff4e0;border-left:4px solid #e0a030;padding:4px 8px}
nav li{margin:2px 0}
"""


def render(sections: Sequence[Section], title: str, sources: Sequence[str], seconds: float) -> str:
    """The self-contained HTML document of ``sections``."""
    contents = "".join(f'<li><a href="#s{s.number}">{s.number}. {html.escape(s.title)}</a></li>' for s in sections)
    body = "".join(f'<section id="s{s.number}"><h2>{s.number}. {html.escape(s.title)}</h2>{"".join(s.blocks)}'
                   "</section>" for s in sections)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>dptune {html.escape(__version__)}, built {stamp} in {seconds:.1f} s from "
            f"{html.escape(', '.join(sources))}.</p><nav><ol>{contents}</ol></nav>{body}</body></html>")


def build_report(paths: Sequence[str], out: str | Path, *, hard_fraction: float = 0.5,
                 hard_classes: Collection[str] | None = None, near_optimal: float = an.NEAR_OPTIMAL,
                 title: str | None = None) -> Path:
    """Build the report of the result datasets at ``paths`` into folder ``out``; return its index.html.

    ``hard_fraction`` (0 < f < 1) and ``hard_classes`` (labels or names) define the strata
    (``analysis.class_strata``); ``near_optimal`` is the tolerance of the near-optimal C range of Fig. 7a,
    in accuracy units (Fig. 2 shows bootstrap intervals instead).
    Raises ``AnalysisError`` for missing datasets or bad options before anything is written.
    """
    started = time.monotonic()
    an.check_results_paths(paths)
    if not 0 < hard_fraction < 1:
        raise an.AnalysisError(f"hard_fraction must lie strictly between 0 and 1, got {hard_fraction}")
    if near_optimal < 0:
        raise an.AnalysisError(f"near_optimal must be ≥ 0 (accuracy units), got {near_optimal}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise an.AnalysisError(f"--out {out}: exists and is not a folder")
    options = Options(hard_fraction=hard_fraction, hard_classes=tuple(hard_classes) if hard_classes else None,
                      near_optimal=near_optimal, title=title or f"dptune report: {', '.join(map(_name, paths))}")
    results = an.load_results(paths)
    strata = an.class_strata(results, hard_fraction, options.hard_classes)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("fig*.png"):  # figures of an earlier build into the same folder
        if any(stale.name.startswith(info.key) for info in FIGURES):
            stale.unlink()
    ctx = Context(results=results, strata=strata, tasks=an.task_order(results), options=options,
                  writer=ReportWriter(out))
    sections = [make(ctx) for make in SECTIONS]
    index = out / "index.html"
    index.write_text(render(sections, options.title, results.sources, time.monotonic() - started), encoding="utf-8")
    return index


def _name(path: str) -> str:
    return Path(path.rstrip("/")).name or path


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m dptune.report",
        description="Difficulty-stratified HTML report (figures as embedded PNG) from dptune result datasets.")
    parser.add_argument("results", nargs="*", metavar="RESULTS", help="result dataset folders (or URIs)")
    parser.add_argument("--out", help="output folder, e.g. reports/NAME (created; index.html and PNGs go there)")
    strata = parser.add_mutually_exclusive_group()
    strata.add_argument("--hard-fraction", type=float, default=0.5,
                        help="share of each task's classes called hard, by accuracy in the reference trial "
                             "(0 < f < 1; default %(default)s = median split)")
    strata.add_argument("--hard-classes", help="comma-separated labels or class names that are hard (overrides "
                                               "--hard-fraction)")
    parser.add_argument("--near-optimal", type=float, default=100 * an.NEAR_OPTIMAL, metavar="POINTS",
                        help="tolerance of near-optimal settings in accuracy points (default %(default)g)")
    parser.add_argument("--title", help="report title")
    parser.add_argument("--figure-index", action="store_true", help="print the Markdown index of the figures and exit")
    parser.add_argument("--version", action="version", version=f"dptune {__version__}")
    args = parser.parse_args(argv)
    if args.figure_index:
        print(figure_index())
        return
    if not args.results:
        parser.error("give one or more RESULTS folders (written by python -m dptune.search)")
    if not args.out:
        parser.error("--out is required, e.g. --out reports/NAME")
    if not 0 < args.hard_fraction < 1:
        parser.error(f"--hard-fraction must lie strictly between 0 and 1, got {args.hard_fraction}")
    if args.near_optimal < 0:
        parser.error(f"--near-optimal must be ≥ 0 accuracy points, got {args.near_optimal}")
    hard = [c.strip() for c in args.hard_classes.split(",") if c.strip()] if args.hard_classes else None
    try:
        an.check_results_paths(args.results)
        probe_writable(args.out, "--out")
        index = build_report(args.results, args.out, hard_fraction=args.hard_fraction, hard_classes=hard,
                             near_optimal=args.near_optimal / 100, title=args.title)
    except DptuneError as exc:  # bad input (a corrupt part, an unwritable --out...); anything else is a bug
        report_and_exit(exc)
    figures = len(list(index.parent.glob("fig*.png")))
    print(f"report written to {index} ({figures} figures)")


if __name__ == "__main__":
    main()
