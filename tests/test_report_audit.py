"""The report's empirical privacy audit section (``python -m dptune.report RESULTS --audit DIR``).

One real audit (200 canaries, one training of the default space's middle configuration) is run once for
the module and shown in the report of the real tiny search: its table must show the audit's numbers, its
verdict, notes and figure, and nothing of the canaries' inclusion coins, which the report never reads.
"""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import dptune
from conftest import REPO_ROOT, TINY_EVAL_EXAMPLES, TINY_TRAIN_EXAMPLES, SearchRun
from dptune import analysis as an
from dptune.dp import faults
from dptune.report import build_report, main
from dptune.report.audit import FIGURE, audit_section, read_audit
from dptune.report.document import ReportWriter

SPACE = REPO_ROOT / "tests/spaces/tiny.yaml"
#: The suite's caps (one small feature cache entry shared with the other tests).
CAPS = {"max_train_examples": TINY_TRAIN_EXAMPLES, "max_eval_examples": TINY_EVAL_EXAMPLES}

pytestmark = pytest.mark.usefixtures("dptune_cache_dir")
HEADER = [
    "threat model",
    "C",
    "B",
    "η₀",
    "E",
    "claimed ε",
    "δ",
    "σ",
    "m",
    "score",
    "guesses r",
    "correct v",
    "empirical ε lower bound",
    "every guess right",
    "p-value of the claim",
    "verdict",
]


@pytest.fixture(scope="module")
def audit_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of one real audit with 200 canaries (tests only read it)."""
    folder = tmp_path_factory.mktemp("audit") / "audit"
    dptune.audit(SPACE, out=folder, canaries=200, seed=1, progress=False, **CAPS)
    return folder


@pytest.fixture(scope="module")
def built(tiny_search: SearchRun, audit_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of the real tiny search with the audit; its index.html."""
    return build_report([str(tiny_search.root)], tmp_path_factory.mktemp("report") / "report", audit=str(audit_folder))


def without_coins(audit_folder: Path, copy: Path) -> Path:
    """A copy of the audit folder without its canaries' inclusion coins (``canaries.parquet``)."""
    return Path(shutil.copytree(audit_folder, copy, ignore=shutil.ignore_patterns("canaries.parquet")))


def audit_part(page: str) -> str:
    """The HTML of the page's audit section."""
    match = re.search(r'<section id="s\d+"><h2>\d+\. Empirical privacy audit</h2>(.*?)</section>', page, flags=re.S)
    assert match, "no audit section"
    return match.group(1)


def table_rows(part: str) -> list[list[str]]:
    """The cell texts of every row of the tables in ``part``, header rows included."""
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", part, flags=re.S)
    return [
        [html.unescape(cell.strip()) for cell in re.findall(r"<t[dh]>(.*?)</t[dh]>", row, flags=re.S)] for row in rows
    ]


def expected_row(row: dict[str, Any]) -> list[str]:
    """One row of ``audit.json`` as the table must show it."""
    return [
        row["threat_model"],
        f"{row['clip_bound']:.3g}",
        str(row["batch_size"]),
        f"{row['base_learning_rate']:.3g}",
        str(row["epochs"]),
        f"{row['epsilon']:.3g}",
        f"{row['delta']:.3g}",
        f"{row['noise_multiplier']:.4g}",
        str(row["canaries"]),
        f"{row['score']} ({row['sides']})",
        str(row["guesses"]),
        str(row["correct"]),
        f"{row['epsilon_lower_bound']:.3f} at {100 * row['confidence']:g} % confidence",
        f"{row['ceiling']:.2f}",
        f"{row['claim_p_value']:.2g}",
        "REFUTED: broken mechanism" if row["claim_refuted"] else "below the claim",
    ]


def test_the_section_shows_the_audits_numbers_verdict_notes_and_figure(built: Path, audit_folder: Path) -> None:
    page = built.read_text(encoding="utf-8")
    part = audit_part(page)
    summary = json.loads((audit_folder / "audit.json").read_text(encoding="utf-8"))
    assert {row["threat_model"] for row in summary["rows"]} == {"white-box", "black-box"}
    assert table_rows(part) == [HEADER, *map(expected_row, summary["rows"])]
    text = html.unescape(part)
    assert all(not row["claim_refuted"] for row in summary["rows"])
    assert "Every empirical lower bound is below its claim" in text and "REFUTED: broken mechanism" not in text
    positions = [text.index(note) for note in summary["notes"]]
    assert positions == sorted(positions) and text.index("</table>") < positions[0]
    # the audit's figure: embedded as the report's own figures are, and written beside index.html
    png = (audit_folder / "scores.png").read_bytes()
    (embedded,) = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', part)
    assert base64.b64decode(embedded) == png == (built.parent / FIGURE).read_bytes()
    # numbered after the report's own sections
    assert '<section id="s10"><h2>10. Empirical privacy audit</h2>' in page


def test_the_report_never_holds_or_needs_the_canaries_coins(
    built: Path, audit_folder: Path, tiny_search: SearchRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not list(built.parent.rglob("*.parquet")) and (audit_folder / "canaries.parquet").is_file()
    assert {path.name for path in built.parent.iterdir()} - {"index.html", FIGURE} == {
        path.name for path in built.parent.glob("fig*.png")
    }
    part = html.unescape(audit_part(built.read_text(encoding="utf-8")))
    assert "included" not in part and "canaries.parquet" not in part
    # from a copy of the folder without the coins, by the command: the same table
    coinless = without_coins(audit_folder, tmp_path / "coinless")
    out = tmp_path / "report"
    main([str(tiny_search.root), "--out", str(out), "--audit", str(coinless)])
    assert f"report written to {out / 'index.html'}" in capsys.readouterr().out
    shown = audit_part((out / "index.html").read_text(encoding="utf-8"))
    assert table_rows(shown) == table_rows(audit_part(built.read_text(encoding="utf-8")))


def test_a_missing_audit_folder_fails_before_any_work(
    tiny_search: SearchRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, missing = tmp_path / "never", tmp_path / "no-such-audit"
    with pytest.raises(SystemExit) as stop:
        main([str(tiny_search.root), "--out", str(out), "--audit", str(missing)])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --audit '") and "no-such-audit': no such audit folder" in line
    assert not out.exists()


def edited(change: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    """A damage to an audit folder: its audit.json rewritten as ``change`` makes it."""

    def damage(folder: Path) -> None:
        path = folder / "audit.json"
        path.write_text(json.dumps(change(json.loads(path.read_text(encoding="utf-8")))), encoding="utf-8")

    return damage


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda folder: (folder / "audit.json").unlink(), "no audit.json in the folder"),
        (lambda folder: (folder / "scores.png").unlink(), "no scores.png in the folder"),
        (lambda folder: (folder / "audit.json").write_text("{"), "audit.json is not JSON"),
        (edited(lambda summary: {"rows": []}), "not an audit summary: no rows"),
        (
            edited(lambda summary: {**summary, "figure": "../canaries.parquet"}),
            "figure: expected the name of a PNG file in the folder",
        ),
        (
            edited(lambda summary: {"rows": [{"threat_model": "white-box"}], "notes": [], "figure": "scores.png"}),
            "row 0: no batch_size",
        ),
        (
            edited(lambda summary: {**summary, "rows": [{**summary["rows"][0], "canaries": "200", "confidence": 95}]}),
            "row 0: canaries is not a whole number; confidence is not a level in (0, 1)",
        ),
    ],
)
def test_an_unreadable_audit_folder_is_refused_naming_it_before_anything_is_written(
    damage: Callable[[Path], None], message: str, audit_folder: Path, tiny_search: SearchRun, tmp_path: Path
) -> None:
    folder = without_coins(audit_folder, tmp_path / "audit")
    damage(folder)
    out = tmp_path / "never"
    with pytest.raises(an.AnalysisError) as refused:
        build_report([str(tiny_search.root)], out, audit=str(folder))
    assert str(refused.value).startswith(f"--audit {str(folder)!r}: ") and message in str(refused.value)
    assert "\n" not in str(refused.value) and not out.exists()


def test_without_an_audit_the_report_has_no_audit_section_or_figure(
    tiny_search: SearchRun, audit_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "report"
    assert "Empirical privacy audit" in build_report([str(tiny_search.root)], out, audit=str(audit_folder)).read_text()
    page = build_report([str(tiny_search.root)], out).read_text(encoding="utf-8")
    assert "Empirical privacy audit" not in page and not (out / FIGURE).exists()


def test_a_broken_mechanism_is_shown_refuted(tmp_path: Path) -> None:
    """A real audit of a training without noise: its white-box row is refuted, and the section says so."""
    with faults.injected("noise_off"):
        dptune.audit(SPACE, out=tmp_path / "broken", canaries=200, seed=1, progress=False, **CAPS)
    audit = read_audit(str(tmp_path / "broken"))
    section = audit_section(audit, 10, ReportWriter(tmp_path))
    part = "".join(section.blocks)
    rows = {row[0]: row for row in table_rows(part)[1:]}
    assert rows["white-box"][-1] == "REFUTED: broken mechanism"
    assert rows == {row["threat_model"]: expected_row(row) for row in audit.rows}
    text = html.unescape(part)
    assert text.count("REFUTED: broken mechanism") == sum(row["claim_refuted"] for row in audit.rows)
    assert "REFUTED (white-box at claimed ε = 1" in text and "the mechanism as run does not give the (ε, δ)" in text
