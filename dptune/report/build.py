"""Building the report: every section in order, written as ``index.html`` and PNG figures."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from dptune import analysis as an
from dptune.report.audit import FIGURE as AUDIT_FIGURE
from dptune.report.audit import audit_section, read_audit
from dptune.report.auto_s import auto_s
from dptune.report.batch_noise import batch_noise
from dptune.report.clipping import clipping
from dptune.report.document import Context, Options, ReportWriter, Section, render
from dptune.report.efficiency import efficiency
from dptune.report.figures import FIGURES
from dptune.report.grad_norms import grad_norms
from dptune.report.guidelines import guidelines
from dptune.report.heatmaps import heatmaps
from dptune.report.optimal import optimal
from dptune.report.overview import overview
from dptune.report.private import is_owner_only, is_release_only, owner_banner, release_sections, with_released_parts
from dptune.report.retention import retention

SECTIONS: tuple[Callable[[Context], Section], ...] = (
    overview,
    heatmaps,
    optimal,
    grad_norms,
    retention,
    auto_s,
    batch_noise,
    clipping,
    guidelines,
    efficiency,
)


def build_report(
    paths: Sequence[str],
    out: str | Path,
    *,
    hard_fraction: float = 0.5,
    hard_classes: Collection[str] | None = None,
    title: str | None = None,
    audit: str | None = None,
) -> Path:
    """Build the report of the result datasets at ``paths`` into folder ``out``; return its index.html.

    ``hard_fraction`` (0 < f < 1) and ``hard_classes`` (labels or names) define the strata
    (``analysis.class_strata``). The public results of an end-to-end private search (a release, no run)
    get the report of what may be released (``private.release_sections``); a path that is such a search's
    trust boundary (``<results>/inside_trust_boundary``) gets the owner-only report of its runs, with the
    search's release from ``<results>``, opened by a notice that it is not for release. ``audit``: the folder
    of an empirical privacy audit (``python -m dptune.audit --out FOLDER``), shown as the last section
    (``report.audit``; refused for a private search's public report: the audit's numbers are a release
    outside its ε_total). Raises ``AnalysisError`` for missing datasets, a missing or unreadable audit
    folder or bad options before anything is written.
    """
    started = time.monotonic()
    an.check_results_paths(paths)
    if not 0 < hard_fraction < 1:
        raise an.AnalysisError(f"hard_fraction must lie strictly between 0 and 1, got {hard_fraction}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise an.AnalysisError(f"--out {out}: exists and is not a folder")
    audited = None if audit is None else read_audit(audit)
    owner = is_owner_only(paths)
    default_title = f"dptune report: {', '.join(map(_name, paths))}"
    options = Options(
        hard_fraction=hard_fraction,
        hard_classes=tuple(hard_classes) if hard_classes else None,
        title=title or (f"OWNER-ONLY, NOT FOR RELEASE — {default_title}" if owner else default_title),
    )
    results = an.load_results(with_released_parts(paths) if owner else paths)
    if audited is not None and is_release_only(results):
        raise an.AnalysisError(
            "--audit: an audit's numbers come from a second training on the private rows, outside the private "
            "search's ε_total, so they are not part of its public report; add the audit to the owner's report "
            "(<results>/inside_trust_boundary)"
        )
    strata = an.class_strata(results, hard_fraction, options.hard_classes)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("fig*.png"):  # figures of an earlier build into the same folder
        if any(stale.name.startswith(info.key) for info in FIGURES):
            stale.unlink()
    (out / AUDIT_FIGURE).unlink(missing_ok=True)
    ctx = Context(
        results=results, strata=strata, tasks=an.task_order(results), options=options, writer=ReportWriter(out)
    )
    sections = release_sections(ctx) if is_release_only(results) else [make(ctx) for make in SECTIONS]
    if audited is not None:
        sections.append(audit_section(audited, sections[-1].number + 1, ctx.writer))
    banner = owner_banner(paths, [s for s in sections if s.left_out]) if owner else None
    index = out / "index.html"
    seconds = None if not results.release.empty else time.monotonic() - started
    index.write_text(render(sections, options.title, results.sources, seconds, banner), encoding="utf-8")
    return index


def _name(path: str) -> str:
    return Path(path.rstrip("/")).name or path
