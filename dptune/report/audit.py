"""The empirical privacy audit's section: the verdicts of a folder ``python -m dptune.audit`` wrote.

An audit folder holds ``audit.json`` (one row per audited configuration and threat model, and the
audit's notes), ``scores.png`` (its canary scores, in against out) and the audit's secret, the
canaries' inclusion coins (``canaries.parquet``). The report reads the first two only (:func:`read_audit`,
before any work) and shows the rows as a table, the notes word for word and the figure, embedded and
copied beside ``index.html`` as :data:`FIGURE` (:func:`audit_section`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs

from dptune import analysis as an
from dptune.errors import shown
from dptune.paths import filesystem
from dptune.report.document import ReportWriter, Section, format_int, format_sig

#: The audit's summary in its folder: rows, notes and the name of its figure.
SUMMARY = "audit.json"
#: The audit's figure as the report writes it beside ``index.html``.
FIGURE = "audit-scores.png"
_FIGURE_TITLE = "Canary scores, in against out"
_FIGURE_SHOWS = (
    "Per threat model, the audit's first configuration: the histogram of the score its guesses were made by "
    "(its best), for the canaries trained on (in) and those left out (out); each panel's title gives its "
    "empirical ε lower bound and the claimed ε. Drawn by python -m dptune.audit."
)
#: A figure name ``audit.json`` may give: one PNG file in the audit folder, no path.
_PNG_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.png")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _is_count(value: object) -> bool:
    """Whether ``value`` is a whole number (not a flag)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """Whether ``value`` is a number (not a flag)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_level(value: object) -> bool:
    """Whether ``value`` is a confidence level: a number strictly between 0 and 1."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1


#: The row keys of ``audit.json`` the section shows: what each holds (null where not finite) and its check.
_ROW_KEYS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "threat_model": ("a text", lambda value: isinstance(value, str)),
    **{key: ("a whole number", _is_count) for key in ("batch_size", "epochs", "canaries", "guesses", "correct")},
    **{
        key: ("a number or null", lambda value: value is None or _is_number(value))
        for key in (
            "clip_bound",
            "base_learning_rate",
            "epsilon",
            "delta",
            "noise_multiplier",
            "epsilon_lower_bound",
            "claim_p_value",
            "ceiling",
        )
    },
    "score": ("a text", lambda value: isinstance(value, str)),
    "sides": ("a text", lambda value: isinstance(value, str)),
    "confidence": ("a level in (0, 1)", _is_level),
    "claim_refuted": ("true or false", lambda value: isinstance(value, bool)),
}


@dataclass(frozen=True)
class Audit:
    """An audit folder as the report shows it: its ``rows`` and ``notes`` (``audit.json``) and its figure
    (``figure``: PNG bytes)."""

    folder: str
    rows: tuple[Mapping[str, Any], ...]
    notes: tuple[str, ...]
    figure: bytes


def read_audit(folder: str) -> Audit:
    """Read the audit folder ``folder`` (a local path or URI): ``audit.json`` and the figure it names,
    nothing else. Raises ``AnalysisError`` (``LocationError`` for an unusable URI) naming the folder and
    what is missing or wrong."""
    where = f"--audit {shown(folder)}"
    fs, root = filesystem(folder, "--audit")
    kind = fs.get_file_info(root).type
    if kind == pafs.FileType.NotFound:
        raise an.AnalysisError(f"{where}: no such audit folder (written by python -m dptune.audit --out FOLDER)")
    if kind != pafs.FileType.Directory:
        raise an.AnalysisError(f"{where}: not an audit folder (a file, expected the folder of python -m dptune.audit)")
    try:
        summary = json.loads(_read(fs, root, SUMMARY, where))
    except (ValueError, RecursionError) as error:
        raise an.AnalysisError(f"{where}: {SUMMARY} is not JSON ({_first_line(error)})") from None
    problem = _summary_problem(summary)
    if problem is not None:
        raise an.AnalysisError(f"{where}: {SUMMARY} is not an audit summary: {problem}")
    figure = _read(fs, root, summary["figure"], where)
    if not figure.startswith(_PNG_SIGNATURE):
        raise an.AnalysisError(f"{where}: {summary['figure']} is not a PNG image")
    return Audit(folder=folder, rows=tuple(summary["rows"]), notes=tuple(summary["notes"]), figure=figure)


def _read(fs: pafs.FileSystem, root: str, name: str, where: str) -> bytes:
    """The bytes of file ``name`` in the audit folder ``root``."""
    path = f"{root.rstrip('/')}/{name}"
    if fs.get_file_info(path).type != pafs.FileType.File:
        what = (
            "the audit's summary, written last: not an audit folder, or an audit that did not finish"
            if name == SUMMARY
            else f"the figure {SUMMARY} names"
        )
        raise an.AnalysisError(f"{where}: no {name} in the folder ({what})")
    try:
        with fs.open_input_stream(path) as stream:
            return bytes(stream.read())
    except (pa.ArrowException, OSError) as error:
        raise an.AnalysisError(f"{where}: {name} cannot be read: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name where it has none)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _summary_problem(summary: object) -> str | None:
    """What makes ``summary`` (``audit.json``, parsed) no audit summary, or None."""
    if not isinstance(summary, dict):
        return "expected an object with rows, notes and figure"
    rows, notes, figure = summary.get("rows"), summary.get("notes"), summary.get("figure")
    if not isinstance(rows, list) or not rows:
        return "no rows"
    if not isinstance(notes, list) or not all(isinstance(note, str) for note in notes):
        return "notes: expected a list of texts"
    if not isinstance(figure, str) or not _PNG_NAME.fullmatch(figure):
        return f"figure: expected the name of a PNG file in the folder, got {shown(figure)}"
    for position, row in enumerate(rows):
        problem = _row_problem(row)
        if problem is not None:
            return f"row {position}: {problem}"
    return None


def _row_problem(row: object) -> str | None:
    """What makes ``row`` no row of an audit, or None."""
    if not isinstance(row, dict):
        return "expected an object"
    missing = [key for key in _ROW_KEYS if key not in row]
    if missing:
        return f"no {', '.join(missing)}"
    wrong = [f"{key} is not {kind}" for key, (kind, holds) in _ROW_KEYS.items() if not holds(row[key])]
    return "; ".join(wrong) or None


def _fixed(value: float | None, spec: str) -> str:
    """``value`` in format ``spec``; "–" where it is null or not finite."""
    return "–" if value is None or not math.isfinite(value) else format(value, spec)


def _verdict(row: Mapping[str, Any]) -> str:
    """The audit's verdict on one row's claimed (ε, δ)."""
    return "REFUTED: broken mechanism" if row["claim_refuted"] else "below the claim"


def _table_row(row: Mapping[str, Any]) -> dict[str, str]:
    """One row of ``audit.json`` as the section's table shows it."""
    return {
        "threat model": row["threat_model"],
        "C": format_sig(row["clip_bound"]),
        "B": format_int(row["batch_size"]),
        "η₀": format_sig(row["base_learning_rate"]),
        "E": format_int(row["epochs"]),
        "claimed ε": format_sig(row["epsilon"]),
        "δ": format_sig(row["delta"]),
        "σ": _fixed(row["noise_multiplier"], ".4g"),
        "m": format_int(row["canaries"]),
        "score": f"{row['score']} ({row['sides']})",
        "guesses r": format_int(row["guesses"]),
        "correct v": format_int(row["correct"]),
        "empirical ε lower bound": f"{_fixed(row['epsilon_lower_bound'], '.3f')} "
        f"at {100 * row['confidence']:g} % confidence",
        "every guess right": _fixed(row["ceiling"], ".2f"),
        "p-value of the claim": _fixed(row["claim_p_value"], ".2g"),
        "verdict": _verdict(row),
    }


def audit_section(audit: Audit, number: int, writer: ReportWriter) -> Section:
    """Section ``number``: the audit's table, its verdict, its notes word for word and its figure."""
    section = Section(number, "Empirical privacy audit")
    section.text(
        f"From the audit in {audit.folder}: one training per configuration, as a search runs it, with m canaries "
        "each trained on by a secret coin of probability ½. The auditor guesses in or out for the r canaries "
        "it is most sure of by a score; v right guesses give, by the one-run theorem of Steinke, Nasr & "
        "Jagielski (NeurIPS 2023), a lower bound on the ε of the mechanism that holds at the stated confidence. "
        "The bound cannot exceed what every guess right would show (the theorem caps it by m and δ). The "
        "canaries' coins stay in the audit "
        "folder: this report does not read them."
    )
    section.table(
        pd.DataFrame([_table_row(row) for row in audit.rows]),
        caption="Per configuration (C, B, η₀, E) and threat model: the claimed (ε, δ) and σ it trained with; "
        "m canaries, r guesses by the score named (on the sides named), v right; the empirical ε lower bound, "
        "what the audit would show with every guess right (where that is below the claim, no outcome of this "
        "audit could refute it) and the p-value of the claimed (ε, δ) given v. REFUTED: the lower bound "
        "exceeds the claimed ε.",
    )
    section.text(_overall(audit))
    for note in audit.notes:
        section.text(note)
    writer.embed_png(section, audit.figure, FIGURE, _FIGURE_TITLE, _FIGURE_SHOWS)
    return section


def _overall(audit: Audit) -> str:
    """The verdict of the whole audit in a sentence."""
    refuted = [row for row in audit.rows if row["claim_refuted"]]
    if refuted:
        which = "; ".join(f"{row['threat_model']} at claimed ε = {format_sig(row['epsilon'])}" for row in refuted)
        return (
            f"REFUTED ({which}): the mechanism as run does not give the (ε, δ) it claims — a broken mechanism, "
            "or the audit's chance of a false alarm (1 − confidence). Publish nothing trained with it until "
            "this is explained."
        )
    return (
        "Every empirical lower bound is below its claim: this audit found no violation of the claimed (ε, δ). "
        "That does not prove the claim: the bound only shows what these canaries could find."
    )
