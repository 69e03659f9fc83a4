"""The HTML document: sections, tables, number formats, the figure writer and the shared context."""

from __future__ import annotations

import base64
import html
import io
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dptune import __version__
from dptune import analysis as an
from dptune.report.figures import DPI, FIGURE_BY_KEY


def format_percent(value: float) -> str:
    return "–" if value is None or not np.isfinite(value) else f"{100 * value:.1f}"


def format_points(value: float) -> str:
    return "–" if value is None or not np.isfinite(value) else f"{100 * value:+.1f}"


def format_sig(value: float) -> str:
    return "–" if value is None or not np.isfinite(value) else f"{value:.3g}"


def format_int(value: float) -> str:
    return "–" if value is None or not np.isfinite(value) else f"{int(value)}"


#: Table headers with symbols and units, by analysis column name.
_HEADERS = {
    "epsilon": "ε",
    "epochs": "E",
    "cell_id": "cell",
    "name": "search",
    "trials_planned": "planned",
    "mean_best_val_accuracy": "mean best val acc %",
    "median_grad_norm": "median ‖g‖",
    "clip_bound": "best C",
    "batch_size": "best B",
    "learning_rate": "η",
    "val_accuracy": "val %",
    "test_accuracy": "test %",
    "clip_low": "C low",
    "clip_high": "C high",
    "batch_low": "B low",
    "batch_high": "B high",
    "diagnostic_epoch": "probe epoch",
    "tuned_test_accuracy": "tuned C test %",
    "auto_s_test_accuracy": "AUTO-S test %",
    "gap": "gap (points)",
    "tuned_hard": "tuned C hard classes %",
    "auto_s_hard": "AUTO-S hard classes %",
    "recommended_batch_size": "rule's B",
    "best_batch_size": "measured best B",
    "per_step_rule_batch_size": "old per-step rule's B",
    "recommended_accuracy": "test % at rule's B",
    "best_accuracy": "test % at best B",
    "accuracy_gap": "gap (points)",
    "diagnosed_clip_bound": "C of the diagnosed run",
    "optimal_clip_bound": "C* (best trial)",
    "optimal_clip_low": "C* low",
    "optimal_clip_median": "C* median",
    "optimal_clip_high": "C* high",
    "mse_bias": "bias (‖·‖²)",
    "mse_variance": "variance (‖·‖²)",
    "bias_share": "bias share %",
    "diagnosed_trials": "diagnosed trials",
    "base_learning_rate": "η₀",
    an.EASY: "easy classes %",
    an.HARD: "hard classes %",
    "fixed_test_accuracy": "fixed (C, B) test %",
    "loss": "loss (points)",
    "hard_loss": "hard-class loss (points)",
    "replicates": "R",
    "test_interval": "test % interval",
    "noise_set": "within noise",
    "optimal_c": "optimal C [interval]",
    "optimal_b": "optimal B [interval]",
    "established": "optimum established",
    "target_test_accuracy": "grid's best test %",
}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def format_level(value: float, binned: bool) -> str:
    return f"≈{value:.2g}" if binned else f"{value:g}"


@dataclass
class Section:
    """A numbered part of the report: HTML blocks in order; ``notes`` the texts of its notes of what
    is missing (a section that holds nothing else is left out of the body, in one line each)."""

    number: int
    title: str
    blocks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def text(self, body: str) -> None:
        self.blocks.append(f"<p>{html.escape(body)}</p>")

    def note(self, body: str) -> None:
        self.blocks.append(f'<p class="missing">{html.escape(body)}</p>')
        self.notes.append(body)

    @property
    def left_out(self) -> bool:
        """Whether the section has nothing to show but what it lacks."""
        return len(self.blocks) == len(self.notes) > 0

    def table(
        self, frame: pd.DataFrame, formats: Mapping[str, Callable[[float], str]] | None = None, caption: str = ""
    ) -> None:
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
        info = FIGURE_BY_KEY[key]
        name = f"{key}-{_slug(task)}.png" if task else f"{key}.png"
        buffer = io.BytesIO()
        FigureCanvasAgg(figure)  # render with Agg: no pyplot, no GUI backend, no global state
        figure.savefig(buffer, format="png", dpi=DPI)
        self.embed_png(section, buffer.getvalue(), name, info.title + (f" — {task}" if task else ""), info.shows)

    def embed_png(self, section: Section, data: bytes, name: str, title: str, shows: str) -> None:
        """Save the PNG ``data`` as ``name`` and embed it (base64) with its ``title`` and what it ``shows``."""
        (self.out / name).write_bytes(data)
        encoded = base64.b64encode(data).decode("ascii")
        section.blocks.append(
            f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{encoded}">'
            f"<figcaption><b>{html.escape(title)}</b> ({html.escape(name)}). {html.escape(shows)}</figcaption></figure>"
        )


@dataclass(frozen=True)
class Options:
    """What the report is built with (``build_report`` arguments after validation)."""

    hard_fraction: float = 0.5
    hard_classes: tuple[str, ...] | None = None
    title: str = "dptune report"


@dataclass
class Context:
    """Everything the sections share: the results, strata and task order."""

    results: an.Results
    strata: pd.DataFrame
    tasks: list[str]
    options: Options
    writer: ReportWriter

    def no_diagnostics(self, needs: str) -> str:
        """The note of a section drawn from diagnostics the results lack; ``needs``: what needs them. A
        private search's (its results hold a release) can have none: private mode refuses them."""
        if not self.results.release.empty:
            return f"Missing: a private search records no diagnostics ({needs} would read exact gradient norms)."
        return f"Missing: no diagnostics recorded ({needs} need diagnostics: true)."


def budgets_of(frame: pd.DataFrame, task: str) -> tuple[list[float], list[int]]:
    """The ε and the E values ``frame`` holds for ``task``, ascending."""
    part = frame[frame["task"] == task]
    return sorted(part["epsilon"].unique()), sorted(part["epochs"].unique())


_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1200px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.6em}h2{font-size:1.25em;border-bottom:1px solid #bbb;margin-top:2em}
table.data{border-collapse:collapse;font-size:.82em;margin:1em 0}
table.data th,table.data td{border:1px solid #ccc;padding:2px 6px;text-align:right}
table.data th{background:#eee}caption{text-align:left;font-style:italic;padding:4px 0}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #ddd}figcaption{font-size:.85em;color:#444}
p.missing,li.missing{background:#fff4e0;border-left:4px solid #e0a030;padding:4px 8px}
nav li{margin:2px 0}
div.owner-only{background:#fde8e8;border:3px solid #b00020;padding:4px 12px;margin:1em 0}
div.owner-only strong{color:#b00020;font-size:1.15em}
"""


def render(
    sections: Sequence[Section], title: str, sources: Sequence[str], seconds: float | None, banner: str | None = None
) -> str:
    """The self-contained HTML document of ``sections``: those with something to show in full, then
    one line for each left out for lack of data (:attr:`Section.left_out`), saying what it lacks.
    ``seconds``: how long the build took, shown with its time; None (a report that holds a private
    search's release): neither is shown, since the build follows the search's end, and its time
    and duration would date a search whose wall time grows with its secret number of runs.
    ``banner``: HTML that opens the page, under the title (an owner-only report's notice, which names
    the sections left out itself: no list of them follows)."""
    shown = [s for s in sections if not s.left_out]
    contents = "".join(f'<li><a href="#s{s.number}">{s.number}. {html.escape(s.title)}</a></li>' for s in shown)
    body = "".join(
        f'<section id="s{s.number}"><h2>{s.number}. {html.escape(s.title)}</h2>{"".join(s.blocks)}</section>'
        for s in shown
    )
    if banner is None and (left := [s for s in sections if s.left_out]):
        lines = "".join(
            f'<li class="missing" id="s{s.number}">{s.number}. {html.escape(s.title)}: '
            f"{html.escape(' '.join(note.removeprefix('Missing: ') for note in s.notes))}</li>"
            for s in left
        )
        contents += '<li><a href="#sections-left-out">left out for lack of data</a></li>'
        body += f'<section id="sections-left-out"><h2>Left out for lack of data</h2><ul>{lines}</ul></section>'

    built = (
        "" if seconds is None else f", built {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {seconds:.1f} s"
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{banner or ''}"
        f"<p>dptune {html.escape(__version__)}{built} from "
        f"{html.escape(', '.join(sources))}.</p><nav><ol>{contents}</ol></nav>{body}</body></html>"
    )
