"""The difficulty-stratified HTML report: ``python -m dptune.report RESULTS [RESULTS ...] --out DIR``.

Reads one or more result datasets (a search still running too) through ``dptune.analysis`` and
writes ``DIR/index.html`` — self-contained: figures embedded as base64 PNG, styles inline, no
external reference, it opens from disk — and each figure as ``DIR/<figure>.png``. It never
imports torch or Ray and draws with matplotlib's Agg canvas (no pyplot, no global state), so it
builds in seconds from Parquet alone. Sections follow the paper's evidence (figure numbers as
in Rehn et al., ICLR 2026); a section whose data is missing says what is missing.

``FIGURES`` is the index of what each figure shows (``--figure-index`` prints it as Markdown;
``reports/README.md`` holds a copy).

The modules: ``figures`` (the index and drawing constants), ``document`` (sections, tables,
formats, the figure writer), ``plotting`` (shared matplotlib helpers), one module per section
(``overview``, ``heatmaps``, ``optimal``, ``grad_norms``, ``retention``, ``auto_s``,
``batch_noise``, ``clipping``, ``guidelines``, ``efficiency``), ``private`` (the report of an
end-to-end private search: only what may be released, and where the owner's report is), ``audit``
(the section of an empirical privacy audit's folder, ``--audit DIR``: its verdicts, notes and figure,
never its canaries), ``build`` (``build_report``) and ``cli`` (``main``).
"""

from __future__ import annotations

from dptune.report.build import SECTIONS, build_report
from dptune.report.cli import main
from dptune.report.figures import FIGURES, FigureInfo, figure_index

__all__ = ["FIGURES", "SECTIONS", "FigureInfo", "build_report", "figure_index", "main"]
