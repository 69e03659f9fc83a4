"""The HTML report: self-contained, its numbers equal pandas computations, partial results described."""

from __future__ import annotations

import base64
import html
import json
import math
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import expected
from dptune import analysis as an
from dptune import report
from tiny_results import Replicated, copy_results, write_replicated_search

# Under pytest-xdist this module and test_analysis.py run on one worker: their results fixtures are
# built once, and one worker waits for the real tiny search, not two.
pytestmark = pytest.mark.xdist_group("results")

REPO = Path(__file__).resolve().parent.parent


class _Tables(HTMLParser):
    """Collects every <table> as its caption and rows of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict] = []
        self._text: str | None = None
        self._row: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "table":
            self.tables.append({"caption": "", "rows": []})
        elif tag in ("caption", "td", "th"):
            self._text = ""
        elif tag == "tr":
            self._row = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "caption":
            self.tables[-1]["caption"] = self._text
        elif tag in ("td", "th"):
            self._row.append(self._text.strip())
        elif tag == "tr":
            self.tables[-1]["rows"].append(self._row)
        if tag in ("caption", "td", "th"):
            self._text = None

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text += data


def html_table(page: str, caption: str) -> pd.DataFrame:
    parser = _Tables()
    parser.feed(page)
    (table,) = [t for t in parser.tables if t["caption"].startswith(caption)]
    return pd.DataFrame(table["rows"][1:], columns=table["rows"][0])


@pytest.fixture(scope="module")
def built(result_datasets: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    index = report.build_report(result_datasets, tmp_path_factory.mktemp("reports") / "full")
    return index, index.read_text(encoding="utf-8")


def test_report_is_self_contained_with_every_figure(built: tuple[Path, str], result_datasets: list[str]) -> None:
    index, page = built
    pngs = sorted(index.parent.glob("*.png"))
    tasks = expected.read(result_datasets, "trials")[["dataset", "fraction", "backbone", "peft"]].drop_duplicates()
    always = [info for info in report.FIGURES if info.needs is None]  # the datasets hold no replicated grid
    expected_count = sum(len(tasks) if info.per_task else 1 for info in always)
    assert len(pngs) == expected_count
    embedded = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert sorted(base64.b64decode(e) for e in embedded) == sorted(p.read_bytes() for p in pngs)
    assert all(p.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    for info in always:
        assert any(p.name.startswith(info.key) for p in pngs), info.key
    references = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert references and all(r.startswith(("data:image/png;base64,", "#s")) for r in references)
    assert not re.search(r"https?://|<link|<script|@import|url\(", page)


def test_the_first_section_decides_and_names_each_quantity_once(built: tuple[Path, str]) -> None:
    """Section 0 opens with the decision per cell: the configuration, the model file, its (ε, δ) and what it
    covers, its test accuracy; the optimal C and B read the same there, in section 2 and in the guidelines."""
    index, page = built
    first = page.split('<section id="s0">')[1].split("</section>")[0]
    assert "Decision and overview: what to release" in first
    decision = html_table(page, "Decision per cell").set_index(["task", "ε", "E"])
    best = html_table(page, "Best configuration per cell").set_index(["task", "ε", "E"])
    guideline = html_table(page, "Per cell: the best (C, B, η)").set_index(["task", "ε", "E"])
    assert len(decision) == len(best) == len(guideline) >= 2
    for cell, row in decision.iterrows():
        for name in ("optimal C [interval]", "optimal B [interval]", "η"):
            assert row[name] == best.loc[cell, name] == guideline.loc[cell, name], (cell, name)
        assert row["advice"].startswith("use this configuration") == (
            guideline.loc[cell, "within noise"].startswith("1 of")
        )
    text = html.unescape(first)
    assert "Choosing among configurations by their exact validation accuracy is not differentially private" in text
    assert "privacy.private_selection" in text
    models = an.load_results([str(Path(p)) for p in _sources(page)]).models
    if models.empty:  # the synthetic searches publish no models
        assert (decision["model to release"].str.startswith("none published")).all()
        return
    for cell, row in decision.iterrows():
        folder = row["model to release"].removesuffix("/model.safetensors")
        card = json.loads((Path(folder) / "model_card.json").read_text(encoding="utf-8"))
        assert (Path(folder) / "model.safetensors").is_file()
        assert cell[1:] == (f"{card['privacy']['epsilon']:g}", str(card["configuration"]["epochs"]))
        assert row["(ε, δ)"] == f"({card['privacy']['epsilon']:.3g}, {card['privacy']['delta']:.3g})"
        covers = card["privacy"]["covers"]  # one statement for every model of the search: said once, under the table
        assert "NOT covered" in covers and text.count(f"What each model's (ε, δ) covers: {covers}.") == 1
        low, high = card["accuracy"]["test_interval"]
        assert row["model's test % [interval]"] == (
            f"{100 * card['accuracy']['test_accuracy']:.1f} [{100 * low:.1f}, {100 * high:.1f}]"
        )
        assert row["optimal C [interval]"].startswith(f"{card['configuration']['clip_bound']:.3g} [")


def _sources(page: str) -> list[str]:
    """The result folders a report names in its overview's first line."""
    return html.unescape(page).split("Sources: ")[1].split(". ")[0].split(", ")


def test_report_states_what_each_search_guarantees(built: tuple[Path, str], result_datasets: list[str]) -> None:
    _, page = built
    search = expected.read(result_datasets, "search")
    for search_id, rows in search.groupby("search_id"):
        recorded = rows["guarantee"].dropna()
        statement = recorded.iloc[0] if len(recorded) else "no statement of what (ε, δ) covers was recorded"
        assert html.escape(f"Privacy: {search_id}: {statement}") in page


def _rounds(shown: str, value: float) -> bool:
    """Whether ``shown`` (one decimal) is ``value`` rounded, up to the float error of computing ``value``
    another way: a mean of differences against a difference of means can fall on either side of x.x5."""
    return abs(float(shown) - value) <= 0.05 + 1e-9 * max(1.0, abs(value))


def test_guideline_table_equals_pandas(built: tuple[Path, str], result_datasets: list[str]) -> None:
    _, page = built
    want, (clip, batch) = expected.guideline(result_datasets)
    shown = html_table(page, "Per cell: the best (C, B, η)")
    results = an.load_results(result_datasets)
    labels = results.trials[["task", "dataset", "backbone"]].drop_duplicates().set_index("task")
    shown["dataset"] = shown["task"].map(labels["dataset"])
    shown["backbone"] = shown["task"].map(labels["backbone"])
    assert len(shown) == len(want)
    for row in want.itertuples(index=False):
        line = shown[
            (shown["dataset"] == row.dataset)
            & (shown["backbone"] == row.backbone)
            & (shown["ε"] == f"{row.epsilon:.3g}")
            & (shown["E"] == str(row.epochs))
        ]
        assert len(line) == 1
        line = line.iloc[0]
        assert line["optimal C [interval]"].startswith(f"{row.clip_bound:.3g} [")
        assert line["optimal B [interval]"].startswith(f"{row.batch_size} [")
        assert line["η"] == f"{row.learning_rate:.3g}"
        for column, value in (
            ("test %", row.test_accuracy),
            ("val %", row.val_accuracy),
            ("hard classes %", row.hard),
            ("fixed (C, B) test %", row.test_accuracy_fixed),
            ("loss (points)", row.loss),
            ("hard-class loss (points)", row.hard_loss),
        ):
            assert _rounds(line[column], 100 * value), (column, line[column], 100 * value)
    assert f"Fixed setting: C {clip:g}, B {batch:g}" in page
    loss = re.search(r"loses ([+-][0-9.]+) points of test accuracy on average", page)
    hard_loss = re.search(r"([+-][0-9.]+) points on the hard classes", page)
    assert loss and _rounds(loss[1], 100 * want["loss"].mean())
    assert hard_loss and _rounds(hard_loss[1], 100 * want["hard_loss"].mean())


def test_strata_table_lists_the_hard_classes(built: tuple[Path, str], result_datasets: list[str]) -> None:
    _, page = built
    hard = expected.hard_labels(result_datasets)
    classes = expected.read(result_datasets, "classes")[["dataset", "backbone", "label", "class_name"]]
    classes = classes.drop_duplicates()
    shown = html_table(page, "Easy and hard classes per task.")
    results = an.load_results(result_datasets)
    keys = results.trials[["task", "dataset", "backbone"]].drop_duplicates().set_index("task")
    rows = shown[shown["stratum"] == "hard"]
    assert len(rows) == len(hard)
    for _, row in rows.iterrows():
        dataset, backbone = keys.loc[row["task"], "dataset"], keys.loc[row["task"], "backbone"]
        names = classes[
            (classes["dataset"] == dataset)
            & (classes["backbone"] == backbone)
            & classes["label"].isin(hard[(dataset, backbone)])
        ]["class_name"]
        listed = re.findall(r"([^,(]+) \(", row["members (reference accuracy %)"])
        assert sorted(n.strip() for n in listed) == sorted(names) and int(row["classes"]) == len(names)


def test_partial_results_build_and_say_what_is_missing(result_datasets: list[str], tmp_path: Path) -> None:
    one = copy_results(
        result_datasets,
        tmp_path / "one",
        keep=lambda t: (t["epsilon"] == t["epsilon"].max()) & (t["clipping"] != "auto_s"),
        tables=("trials", "classes", "search"),
    )
    out = tmp_path / "out-one"
    out.mkdir()
    (out / "fig5-auto-s.png").write_bytes(b"stale")
    (out / "notes.txt").write_text("kept")
    page = report.build_report(one, out).read_text(encoding="utf-8")
    for text in (
        "the results hold no finished AUTO-S trials",
        "no diagnostics recorded",
        "Only one ε in the results",
        "Missing: only one privacy budget ε",
    ):
        assert text in page
    names = {p.name.split("-")[0] for p in out.glob("*.png")}
    assert names == {"fig1", "fig2", "fig4b", "fig6"} and (out / "notes.txt").exists()

    bare = report.build_report(
        copy_results(result_datasets, tmp_path / "bare", tables=("search",)), tmp_path / "out-bare"
    )
    page = bare.read_text(encoding="utf-8")
    assert "no trial has finished yet" in page and not list(bare.parent.glob("*.png"))
    assert page.count('class="missing"') >= 8  # every section says what it lacks

    ragged = lambda t: ~((t["epsilon"] == t["epsilon"].max()) & (t["epochs"] == t["epochs"].max()))  # noqa: E731
    no_classes = copy_results(
        result_datasets, tmp_path / "noclasses", keep=ragged, tables=("trials", "search", "diagnostics")
    )
    page = report.build_report(no_classes, tmp_path / "out-noclasses").read_text(encoding="utf-8")
    assert "classes cannot be split into easy and hard" in page
    cells = expected.tuned(no_classes)[expected.CELL].drop_duplicates()
    assert ("an unknown amount on the hard classes" if len(cells) > 1 else "The results hold a single cell") in page


def test_tick_labels_stay_short_on_every_scale() -> None:
    from dptune.report.plotting import _tick

    assert [_tick(v) for v in (1024.0, 64.0, 0.5, 0.12, 0.001)] == ["1024", "64", "0.5", "0.12", "0.001"]
    assert [_tick(v) for v in (1e-14, 2.5e-7, 0.000999)] == ["1e-14", "2.5e-07", "0.000999"]


def test_cli_missing_path_fails_before_any_work(
    result_datasets: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "never"
    missing = str(tmp_path / "no-such-search")
    with pytest.raises(SystemExit) as stop:
        report.main([result_datasets[0], missing, "--out", str(out)])
    assert stop.value.code == 2
    assert f"{missing}: no such results dataset" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "x", "--hard-fraction", "1.5"], "--hard-fraction must lie strictly between 0 and 1, got 1.5"),
        (["--out", "x", "--hard-fraction", "0.3", "--hard-classes", "1"], "not allowed with argument"),
        (["--out", "x", "--hard-classes", "nope"], "hard classes nope are in no task"),
        ([], "--out is required"),
    ],
)
def test_cli_rejects_bad_options(
    result_datasets: list[str], argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a if a != "x" else str(tmp_path / "out") for a in argv]
    with pytest.raises(SystemExit) as stop:
        report.main([*result_datasets, *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out" / "index.html").exists()


def test_cli_builds_into_a_new_folder_without_torch_or_ray(result_datasets: list[str], tmp_path: Path) -> None:
    loose = copy_results(result_datasets, tmp_path / "loose", keep=lambda t: t["epsilon"] == t["epsilon"].max())
    out = tmp_path / "nested" / "reports" / "tiny"
    code = (
        "import sys; from dptune.report import main; "
        f"main({[*loose, '--out', str(out), '--hard-fraction', '0.25']!r}); "
        "print('heavy:', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert f"report written to {out / 'index.html'}" in done.stdout
    assert "heavy: []" in done.stdout
    always = [info for info in report.FIGURES if info.needs is None]
    assert (out / "index.html").is_file() and len(list(out.glob("fig*.png"))) >= len(always)


def test_figure_index_is_in_the_reports_readme(capsys: pytest.CaptureFixture[str]) -> None:
    report.main(["--figure-index"])
    printed = capsys.readouterr().out.strip()
    assert printed == report.figure_index()
    assert report.figure_index() in (REPO / "reports" / "README.md").read_text(encoding="utf-8")


def _grid(best: tuple[float, int], accuracy: float, spread: float) -> list[Replicated]:
    """A 3 × 2 (C, B) grid of R = 3 configurations: ``best`` scores ``accuracy`` on average, the rest 5 points
    less; replicates lie ``spread`` either side of the mean (validation), test is 1 point under validation."""
    return [
        Replicated(c, b, 1e-3, tuple(mean + d for d in (-spread, 0.0, spread)), (mean - 0.01,) * 3)
        for c in (0.1, 1.0, 10.0)
        for b in (64, 1024)
        for mean in [accuracy if (c, b) == best else accuracy - 0.05]
    ]


def test_replicated_results_show_intervals_and_where_the_paper_holds(tmp_path: Path) -> None:
    cells = {
        (1.0, 10): _grid((10.0, 64), 0.70, 0.005),
        (8.0, 10): _grid((0.1, 1024), 0.80, 0.005),  # as the paper
        (1.0, 3): _grid((10.0, 64), 0.60, 0.10),
        (8.0, 3): _grid((0.1, 1024), 0.65, 0.10),  # replicates disagree
        (1.0, 20): _grid((0.1, 64), 0.70, 0.005),
        (8.0, 20): _grid((10.0, 64), 0.80, 0.005),
    }  # against it
    page = report.build_report([write_replicated_search(tmp_path, "rep", cells)], tmp_path / "out").read_text(
        encoding="utf-8"
    )
    best = html_table(page, "Best configuration per cell").set_index(["ε", "E"])
    sure = best.loc[("1", "10")]
    assert (sure["optimal C [interval]"], sure["optimal B [interval]"], sure["R"]) == (
        "10 [10, 10]",
        "64 [64, 64]",
        "3",
    )
    # the one interval function at the cell's pooled spread: every configuration's std is .005 at R = 3, each
    # variance scaled by the median of χ²₂/2 (ln 2), with Σ(R − 1)/2 = 6 degrees of freedom; n_val = 300
    low, high = an.accuracy_interval(0.70, 300, 3, 0.005**2 / math.log(2), 6)
    assert sure["val % [interval]"] == f"70.0 [{100 * low:.1f}, {100 * high:.1f}]"
    wilson = an.accuracy_interval(0.70, 300)
    assert low <= wilson[0] and high >= wilson[1]  # never narrower than the split's own interval
    assert sure["within noise"] == "1 of 6"
    wide = best.loc[("1", "3")]  # gap .05 < d·√(2·.1²/3) ≈ .2 (d ≈ 2.4 at K = 6): every configuration is within noise
    assert wide["within noise"] == "6 of 6" and wide["optimal C [interval]"] == "10 [0.1, 10]"
    checks = html_table(page, "The paper finds the optimal C larger")
    privacy = checks[checks["condition"] == "tighter privacy"].set_index(["held", "quantity"])
    said = privacy["what the data says"]
    assert said[("E = 10", "C")].startswith("established: moves as the paper says")
    assert said[("E = 10", "B")] == said[("E = 10", "C")]
    # gap .05 against se s/√R, s² = .1²/(median χ²₂/2) = .0144 the pooled variance: separated once
    # d·s·√(2/R) < .05, R > 84 at d ≈ 2.7 (K = 6, ν = 6): the first count tried above that is 96
    s = 0.1 / math.sqrt(math.log(2))
    d = an.best_set_constant(6, 0.95, 6)
    assert 64 < 2 * (d * s / 0.05) ** 2 <= 96
    unsettled = "not established by these runs (the intervals overlap); about 96 replicates per configuration"
    assert said[("E = 3", "C")] == said[("E = 3", "B")] and said[("E = 3", "C")].startswith(unsettled)
    assert said[("E = 20", "C")].startswith("established: DISAGREES with the paper, it moves the other way")
    assert said[("E = 20", "B")].startswith("established: DISAGREES with the paper, no move")
    assert privacy.loc[("E = 20", "C"), "optimal, harder side"] == "ε = 1: 0.1 [0.1, 0.1] (1 of 6)"
    epochs = checks[checks["condition"] == "fewer epochs"].set_index("held")  # B only: E = 3 against E = 20
    assert epochs.loc["ε = 1", "optimal, harder side"] == "E = 3: 64 [64, 1024] (6 of 6)"
    # B 64 is the best at E = 3 and at E = 20 (ε = 1): no replicate count separates equal optima
    assert epochs.loc["ε = 1", "what the data says"] == (
        "not established by these runs (the intervals overlap); no replicate count would: the best "
        "configurations on both sides share this value; a move, if any, lies between the values searched "
        "(search values between them)"
    )
    text = html.unescape(page)
    assert (
        "Of 8 comparisons: 2 establish the paper's move, 2 establish a disagreement with it, and 4 are not "
        "established by these runs"
    ) in text
    assert (
        "Disagrees with the paper (tighter privacy): 20newsgroups · minilm · head, E = 20: optimal C 0.1 at ε = 1 "
        "against 10 at ε = 8"
    ) in text
    assert "Each configuration ran R = 3 times with fresh coins" in text
    guideline = html_table(page, "Per cell: the best (C, B, η)").set_index(["ε", "E"])
    assert guideline.loc[("8", "10"), "R"] == "3" and guideline.loc[("8", "10"), "within noise"] == "1 of 6"
    assert guideline.loc[("8", "10"), "optimum established"] == "yes: the only one of 6 within noise"
    assert guideline.loc[("8", "3"), "optimum established"] == "no: 6 of 6 within noise (C 0.1–10, B 64–1024)"
    assert guideline.loc[("8", "10"), "optimal C [interval]"] == "0.1 [0.1, 0.1]"
    assert guideline.loc[("8", "10"), "test %"] == "79.0"  # the mean over the best configuration's replicates
    # every cell is a replicated full grid: section 9 draws the search-efficiency figure
    assert (tmp_path / "out" / "fig9-search-efficiency.png").read_bytes().startswith(b"\x89PNG")
    needed = html_table(page, "Trials a random search needs").set_index(["ε", "E"])
    assert len(needed) == 6 and needed.loc[("1", "10"), "configurations"] == "6"
    assert needed.loc[("1", "10"), "grid's best test %"] == "69.0"
    # 6 configurations, the best 5 points ahead whatever replicate is seen: within after k trials w.p. k/6
    curve = an.search_efficiency(an.load_results([str(tmp_path / "rep")]).tuned)
    curve = curve[(curve["epsilon"] == 1.0) & (curve["epochs"] == 10)]
    assert np.allclose(curve["within_share"], curve["trials"] / 6, atol=0.05)
    assert needed.loc[("1", "10"), "trials for 50% of orders"] in ("3", "4")  # 3/6 = 50 %: either side of it
    assert needed.loc[("1", "10"), "trials for 90% of orders"] == "6"  # 5/6 < 90 % ≤ 6/6


def test_single_replicate_results_say_no_replicate_spread_exists(built: tuple[Path, str]) -> None:
    _, page = built
    assert "Each configuration ran once (R = 1): no replicate spread exists." in html.unescape(page)
    # a section with nothing to show is left out of the body, one line saying what it lacks
    (left_out,) = page.split('<section id="sections-left-out">')[1:]
    assert "no cell holds a replicated full grid" in left_out and "Missing:" not in left_out
    best = html_table(page, "Best configuration per cell")
    assert (best["R"] == "1").all() and best["within noise"].str.fullmatch(r"\d+ of \d+").all()
