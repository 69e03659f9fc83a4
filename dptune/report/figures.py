"""The report's figures: what each shows (``FIGURES``, ``--figure-index``) and the drawing constants."""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.typing import LineStyleType

from dptune import analysis as an

#: Colour map for ordered series (ε) and heatmaps: perceptually uniform, prints in grey.
COLOR_MAP = "viridis"
#: Line styles and markers of the strata (distinguishable without colour).
STRATUM_STYLE: dict[str, tuple[LineStyleType, str]] = {an.EASY: ("-", "o"), an.HARD: ("--", "s")}
DPI = 110
#: Random draw orders of the search-efficiency curves (``analysis.search_efficiency``, section 9).
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
    FigureInfo(
        "fig1-accuracy-heatmaps",
        1,
        "Accuracy over (C, B) (paper Fig. 1)",
        "Per task, one panel per (E, ε): test accuracy (%) at each clip bound C × batch size B of the "
        "configuration whose η (and other options) is best on validation there (means over its replicates). "
        "Blank: not evaluated; 'pruned': T < T_min; 'failed': diverged or error. The cell chosen on "
        "validation is outlined. Each bin also shows what it holds: k×R, its k configurations of R replicates "
        "each ('k: n runs' where R varies). Hatched: the bin's configuration is within noise of the panel's best "
        "(the 95 % confidence set of the best configuration, section 2), so these runs cannot tell it apart "
        "from the best. C is log-binned when the sampler was continuous.",
        per_task=True,
    ),
    FigureInfo(
        "fig2-optimal-c-b",
        2,
        "Optimal C and B against ε (paper Fig. 2)",
        "Optimal C (left) and B (right) per cell against ε, one marker per task and E: the configuration "
        "with the best mean validation accuracy over its replicates; bars: the range of C and B over the "
        "configurations within noise of it, the 95 % confidence set of the best configuration (Gupta's "
        "subset selection; section 2 says how it is made). Points are not joined: a segment joins two cells "
        "only where section 2's comparison establishes the move (their intervals are disjoint). The paper "
        "reports a larger C and a smaller B under tighter privacy; the table below says what these runs "
        "establish.",
    ),
    FigureInfo(
        "fig3-grad-norms",
        3,
        "Per-example gradient norms (paper Fig. 3)",
        "Distribution of ‖g_i‖ on the diagnostic probe of each cell's best diagnosed trial (last "
        "diagnostic epoch), per ε, easy and hard classes side by side; the panels share one range. The paper "
        "reports that tighter privacy and harder classes shift it up (its right shift); the text below says "
        "what these probes show (medians of one run per cell, not a test).",
    ),
    FigureInfo(
        "fig4a-retention-weights",
        4,
        "Retention weights w_y(C) (paper Fig. 4)",
        "Mean over the easy and over the hard classes of w_y(C) = mean_y min(1, C/‖g_i‖) (Eq. 3), "
        "computed from the probe gradient norms at the task's C grid, per ε; the panels share one range. The "
        "paper reports that a small C down-weights the hard classes; the text below says whether these probes "
        "show it.",
    ),
    FigureInfo(
        "fig4b-stratum-accuracy",
        4,
        "Easy and hard class accuracy against C",
        "Mean test accuracy of the easy and of the hard classes of the best configuration (over B, η, chosen "
        "on validation; means over its replicates) at each C, per ε; bars: its 95 % interval "
        "(dptune.analysis.with_intervals); the panels share one range.",
    ),
    FigureInfo(
        "fig5-auto-s",
        5,
        "AUTO-S against tuned C (paper Fig. 5)",
        "Test accuracy (all classes and hard classes) of the best tuned-C and the best AUTO-S configuration "
        "per cell (chosen on validation) against ε; bars: 95 % intervals (dptune.analysis.with_intervals); the "
        "panels share one range.",
    ),
    FigureInfo(
        "fig6-cumulative-noise",
        6,
        "Cumulative noise σ√T against B (paper Figs. 6–7)",
        "Per task, top: σ√T of the recorded trials against B per ε (columns: E), with the per-step "
        "noise σ/B (old rule, dotted, right axis), the region excluded by the min-step rule T < T_min shaded "
        "and the "
        "rule's recommended B marked; bottom: measured test accuracy of the best configuration at each B with "
        "its 95 % interval (bars), the measured best B starred. Each row shares one range.",
        per_task=True,
    ),
    FigureInfo(
        "fig7a-optimal-clip",
        7,
        "C* of Theorem 5.2 against the optimal C",
        "Per task and E: the optimal C (best configuration on validation, bars: its confidence set; points not "
        "joined) and C* of Theorem 5.2 from the best diagnosed trial's probe (band: C* over all diagnosed trials "
        "of the cell) against ε; the panels share one range.",
    ),
    FigureInfo(
        "fig7b-mse-split",
        7,
        "Clipping bias and noise variance against C",
        "Per task, one panel per (E, ε): the per-step MSE of the clipped noisy gradient split into "
        "clipping bias and noise variance, one point per trial at its own C; vertical lines: C of the "
        "diagnosed run and the median C*; the panels share one range.",
        per_task=True,
    ),
    FigureInfo(
        "fig9-search-efficiency",
        9,
        "Search efficiency against a replicated full grid",
        "Per cell holding a replicated full grid: the share of random draw orders (bootstrap) whose random "
        "search of k trials, one replicate seen per configuration and the best selected on validation, "
        "comes within 1 accuracy point of the mean test accuracy of the grid's best configuration, "
        "against k.",
        needs="a replicated full grid",
    ),
)
FIGURE_BY_KEY = {info.key: info for info in FIGURES}


def figure_index() -> str:
    """The Markdown index of the report's figures (``reports/README.md`` holds a copy)."""
    lines = ["| file | section | figure | what it shows |", "|---|---|---|---|"]
    for info in FIGURES:
        name = f"`{info.key}-<task>.png`" if info.per_task else f"`{info.key}.png`"
        shows = f"{info.shows} Only when the results hold {info.needs}." if info.needs else info.shows
        lines.append(f"| {name} | {info.section} | {info.title} | {shows} |")
    return "\n".join(lines)
