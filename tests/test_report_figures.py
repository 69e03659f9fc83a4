"""The report's figures carry their uncertainty: bins within noise marked, no line where a move is not
established, shared ranges where panels compare, error bars on every estimate, captions that say what the
paper claims apart from what these data show. Figures are read as matplotlib objects before they are saved."""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dptune import analysis as an
from dptune import report
from dptune.report.auto_s import auto_s
from dptune.report.batch_noise import batch_noise
from dptune.report.document import Context, Options, ReportWriter, Section
from dptune.report.grad_norms import grad_norms
from dptune.report.heatmaps import WITHIN_NOISE_HATCH, heatmaps
from dptune.report.optimal import optimal
from dptune.report.retention import retention
from tiny_results import Replicated, results_paths, write_replicated_search

pytestmark = pytest.mark.xdist_group("results")


@dataclass(frozen=True)
class Capturing(ReportWriter):
    """The report's writer that also keeps each figure, by ``(key, task)``, as drawn."""

    figures: dict[tuple[str, str | None], Figure] = field(default_factory=dict)

    def figure(self, section: Section, figure: Figure, key: str, task: str | None = None) -> None:
        self.figures[(key, task)] = figure
        super().figure(section, figure, key, task)


@dataclass
class Drawn:
    """Sections built from one results folder: their figures and their text."""

    results: an.Results
    figures: dict[tuple[str, str | None], Figure]
    text: str

    def figure(self, key: str) -> Figure:
        (figure,) = [f for (k, _), f in self.figures.items() if k == key]
        return figure


def _draw(paths: list[str], out: Path, sections: list[Callable[[Context], Section]]) -> Drawn:
    results = an.load_results(paths)
    out.mkdir(parents=True, exist_ok=True)
    writer = Capturing(out)
    ctx = Context(
        results=results,
        strata=an.class_strata(results),
        tasks=an.task_order(results),
        options=Options(),
        writer=writer,
    )
    blocks = [block for make in sections for block in make(ctx).blocks]
    return Drawn(results, writer.figures, html.unescape(re.sub(r"<[^>]+>", " ", "".join(blocks))))


def _grid(best: tuple[float, int], accuracy: float, spread: float) -> list[Replicated]:
    """A 3 × 2 (C, B) grid of R = 3 configurations: ``best`` scores ``accuracy`` on average, the rest 5 points
    less; validation replicates lie ``spread`` either side of the mean, test is 1 point under validation."""
    return [
        Replicated(c, b, 1e-3, tuple(mean + d for d in (-spread, 0.0, spread)), (mean - 0.01,) * 3)
        for c in (0.1, 1.0, 10.0)
        for b in (64, 1024)
        for mean in [accuracy if (c, b) == best else accuracy - 0.05]
    ]


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Drawn:
    root = tmp_path_factory.mktemp("replicated")
    cells = {
        (1.0, 10): _grid((10.0, 64), 0.70, 0.005),  # one configuration within noise
        (8.0, 10): _grid((0.1, 1024), 0.80, 0.005),  # C and B move as the paper says: established
        (1.0, 3): _grid((10.0, 64), 0.60, 0.10),  # replicates disagree: all six within noise
        (8.0, 3): _grid((0.1, 1024), 0.65, 0.10),
    }
    paths = [write_replicated_search(root, "rep", cells)]
    return _draw(paths, root / "out", [heatmaps, optimal, batch_noise])


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Drawn:
    out = tmp_path_factory.mktemp("synthetic")
    return _draw(list(results_paths()), out, [optimal, grad_norms, retention, auto_s])


def _panels(figure: Figure) -> list[Axes]:
    """The drawn panels of a figure: visible axes that are not a colour bar."""
    return [ax for ax in figure.axes if ax.axison and ax.get_label() != "<colorbar>"]


def _by_title(figure: Figure) -> dict[str, Axes]:
    return {ax.get_title(): ax for ax in _panels(figure)}


def test_heatmap_bins_say_what_they_hold_and_which_are_within_noise(replicated: Drawn) -> None:
    panels = _by_title(replicated.figure("fig1-accuracy-heatmaps"))
    hatched = {
        title: {
            (round(p.get_y() + 0.5), round(p.get_x() + 0.5))
            for p in ax.patches
            if isinstance(p, Rectangle) and p.get_hatch() == WITHIN_NOISE_HATCH
        }
        for title, ax in panels.items()
    }
    # gap .05 against d·√(2·.1²/(R ln 2)) ≈ .26: all six bins cannot be told apart from the best
    assert len(hatched["ε = 1, E = 3"]) == 6
    # spread .005: the best alone; it is at C = 10 (row 2), B = 64 (column 0)
    assert hatched["ε = 1, E = 10"] == {(2, 0)}
    assert hatched["ε = 8, E = 10"] == {(0, 1)}
    for ax in panels.values():
        assert [t.get_text() for t in ax.texts].count("1×3") == 6  # one configuration of 3 replicates a bin
    assert "14 of 24 evaluated (C, B) bins over its 4 panels are within noise" in replicated.text
    assert "the best bin is the only one within noise in 2 of 4 panels" in replicated.text


def _connectors(ax: Axes) -> set[tuple[tuple[float, float], ...]]:
    """The segments drawn between points: lines of two or more points with a visible line style."""
    return {
        tuple(sorted(zip(map(float, line.get_xdata()), map(float, line.get_ydata()), strict=True)))
        for line in ax.lines
        if line.get_linestyle() not in ("None", "none", "") and len(line.get_xdata()) >= 2
    }


@pytest.mark.parametrize("source", ["replicated", "synthetic"])
def test_optimal_c_and_b_are_joined_only_where_the_move_is_established(
    source: str, request: pytest.FixtureRequest
) -> None:
    drawn: Drawn = request.getfixturevalue(source)
    figure = drawn.figure("fig2-optimal-c-b")
    left, right = figure.axes[:2]
    assert left.get_xlim() == right.get_xlim()
    checks = an.paper_trend_checks(an.rank_configurations(drawn.results.tuned))
    established = checks[checks["verdict"].isin(["agrees", "disagrees"])]  # a move; "no change" is none
    assert len(established) < len(checks) and (source == "synthetic" or len(established) > 0)
    for ax, quantity in ((left, "C"), (right, "B")):
        ends = established[established["quantity"] == quantity]
        segments = _connectors(ax)
        assert len(segments) == len(ends)
        # every segment joins the two cells of an established comparison, at their optimal values
        values = {tuple(sorted((row.harder_value, row.easier_value))) for row in ends.itertuples()}
        assert {tuple(sorted(y for _, y in segment)) for segment in segments} <= values
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert bars and all(c.has_yerr for c in bars)
    if source == "replicated":  # as the paper at E = 10 (C and B), not established at E = 3
        assert len(_connectors(left)) == len(_connectors(right)) == 1


def test_uncertainty_rule_describes_the_interval_printed(replicated: Drawn, synthetic: Drawn) -> None:
    assert "combines two independent parts" in replicated.text
    assert "Here 4 of 4 cells' intervals hold both parts" in replicated.text
    assert "Student t" not in replicated.text + synthetic.text
    assert "Each configuration ran once (R = 1): no replicate spread exists." in synthetic.text
    assert "every interval is the split's alone" in synthetic.text


def test_gradient_norm_panels_share_one_range(synthetic: Drawn) -> None:
    panels = _panels(synthetic.figure("fig3-grad-norms"))
    assert len(panels) >= 4
    assert len({ax.get_ylim() for ax in panels}) == 1 and len({ax.get_xlim() for ax in panels}) == 1
    samples = an.grad_norm_samples(synthetic.results, an.class_strata(synthetic.results))
    low, high = panels[0].get_ylim()
    assert low <= samples["grad_norm"].quantile(0.25) and high >= samples["grad_norm"].quantile(0.75)
    medians = samples.groupby([*an.CELL, "stratum"])["grad_norm"].median().unstack()
    above = int((medians[an.HARD] > medians[an.EASY]).sum())
    assert f"Here: the hard classes' median ‖g_i‖ is above the easy classes' in {above} of {len(medians)} cells" in (
        synthetic.text
    )


def _bars(ax: Axes) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each error-bar series of ``ax``: its points (x, y) and its bars' (low, high) ends."""
    series = []
    for container in ax.containers:
        assert isinstance(container, ErrorbarContainer) and container.has_yerr
        line, _, (bars, *_) = container.lines
        ends = np.array([[segment[0][1], segment[1][1]] for segment in bars.get_segments()])
        series.append((np.column_stack([line.get_xdata(), line.get_ydata()]), ends))
    return series


def test_stratum_accuracy_lines_carry_the_one_interval(synthetic: Drawn) -> None:
    """Fig. 4b: one series with bars per (ε, stratum) in each panel; at R = 1 a point's bar is the Wilson interval
    of its stratum's share of the test rows (the classes' share), the interval of ``accuracy_intervals``."""
    figure = synthetic.figure("fig4b-stratum-accuracy")
    panels = _panels(figure)
    assert len({ax.get_ylim() for ax in panels}) == 1
    strata = an.class_strata(synthetic.results)
    share = strata.groupby("task")["stratum"].value_counts(normalize=True)
    per_clip = an.stratum_accuracy_by_clip(synthetic.results, strata)
    tuned = synthetic.results.tuned
    for ax in panels:
        series = _bars(ax)
        assert len(series) == 2 * tuned["epsilon"].nunique() and all(len(points) >= 2 for points, _ in series)
    task = per_clip["task"].iloc[0]
    row = per_clip[per_clip["task"] == task].iloc[0]
    rows = float(tuned.loc[tuned["task"] == task, "num_test"].median()) * share[(task, an.HARD)]
    low, high = an.accuracy_interval(row[an.HARD], rows)
    drawn = [
        ends
        for ax in panels
        for points, bars in _bars(ax)
        for (_, y), ends in zip(points, bars, strict=True)
        if math.isclose(y, 100 * row[an.HARD])
    ]
    assert any(np.allclose(ends, [100 * low, 100 * high]) for ends in drawn)


def test_auto_s_and_batch_size_accuracies_have_bars(synthetic: Drawn, replicated: Drawn) -> None:
    for ax in _panels(synthetic.figure("fig5-auto-s")):
        assert len(_bars(ax)) == 4  # tuned C and AUTO-S, all and hard classes
    figure = replicated.figure("fig6-cumulative-noise")
    bottom = [ax for ax in _panels(figure) if "test accuracy" in ax.get_ylabel()]
    assert bottom
    best = an.best_configurations(replicated.results.tuned, [*an.CELL, "batch_size"])
    for ax in bottom:
        for points, bars in _bars(ax):
            for (_, y), ends in zip(points, bars, strict=True):
                row = best[np.isclose(100 * best["test_accuracy"], y)].iloc[0]
                assert np.allclose(ends, [100 * row["test_low"], 100 * row["test_high"]])
    assert "tuned C's test interval lies wholly above AUTO-S's in" in synthetic.text


#: Words of the paper's expected effects: a caption sentence that names one must attribute it to the paper.
_EFFECTS = re.compile(r"shift|down-weight|larger C|smaller B|costs? the hard")


def test_captions_put_the_paper_beside_the_data_never_as_fact() -> None:
    sentences = [s for info in report.FIGURES for s in re.split(r"(?<=\.) ", info.shows)]
    claims = [s for s in sentences if _EFFECTS.search(s)]
    assert claims
    for sentence in claims:
        assert re.search(r"[Tt]he paper reports", sentence), sentence
    assert "Tighter privacy and harder classes shift it up" not in report.figure_index()
