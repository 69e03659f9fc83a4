"""The command line: ``python -m dptune.report RESULTS [RESULTS ...] --out DIR``."""

from __future__ import annotations

from dptune import __version__
from dptune import analysis as an
from dptune.errors import ArgumentParser, DptuneError, report_and_exit
from dptune.paths import probe_writable
from dptune.report.audit import read_audit
from dptune.report.build import build_report
from dptune.report.figures import figure_index
from dptune.report.private import is_owner_only


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m dptune.report",
        description="Difficulty-stratified HTML report (figures as embedded PNG) from dptune result datasets.",
    )
    parser.add_argument("results", nargs="*", metavar="RESULTS", help="result dataset folders (or URIs)")
    parser.add_argument("--out", help="output folder, e.g. reports/NAME (created; index.html and PNGs go there)")
    strata = parser.add_mutually_exclusive_group()
    strata.add_argument(
        "--hard-fraction",
        type=float,
        default=0.5,
        help="share of each task's classes called hard, by accuracy in the reference trial "
        "(0 < f < 1; default %(default)s = median split)",
    )
    strata.add_argument(
        "--hard-classes", help="comma-separated labels or class names that are hard (overrides --hard-fraction)"
    )
    parser.add_argument("--title", help="report title")
    parser.add_argument(
        "--audit",
        metavar="DIR",
        help="folder of an empirical privacy audit (written by python -m dptune.audit --out DIR), shown as a section",
    )
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
    hard = [c.strip() for c in args.hard_classes.split(",") if c.strip()] if args.hard_classes else None
    try:
        an.check_results_paths(args.results)
        if args.audit is not None:
            read_audit(args.audit)
        probe_writable(args.out, "--out")
        index = build_report(
            args.results,
            args.out,
            hard_fraction=args.hard_fraction,
            hard_classes=hard,
            title=args.title,
            audit=args.audit,
        )
    except DptuneError as exc:  # bad input (a corrupt part, an unwritable --out...); anything else is a bug
        report_and_exit(exc)
    figures = len(list(index.parent.glob("fig*.png"))) + (args.audit is not None)
    owner = (
        "owner-only report (NOT for release: the runs inside the trust boundary) "
        if is_owner_only(args.results)
        else "report "
    )
    print(f"{owner}written to {index} ({figures} figures)")
