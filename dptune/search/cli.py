"""``python -m dptune.search``: the command line, parsed and validated before anything heavy loads.

A bad flag, path or space file is answered from this module, which imports neither torch, Ray,
Optuna nor pandas: :func:`main` checks the flags and loads and validates the space, and only then
imports the driver (:mod:`dptune.search.driver`).
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Any

from dptune import __version__
from dptune.errors import (
    ArgumentParser,
    DptuneError,
    SearchIncomplete,
    SearchInterrupted,
    report_and_exit,
    stop_named,
    storage_error,
)
from dptune.search.api import run, search_options
from dptune.search.options import SearchOptions
from dptune.space import SpaceError, parse_overrides


def parse_args(argv: list[str] | None = None) -> SearchOptions:
    """The command line's options: its flags parsed (:func:`_parser`) and the space overrides they make
    (:func:`_overrides`), checked as :func:`dptune.search.api.search_options` checks the API's arguments; a
    mistake exits with the usage and one line."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return search_options(
            Path(args.space),
            storage=args.storage,
            name=args.name,
            address=args.address,
            resume=args.resume,
            dry_run=args.dry_run,
            report=args.report,
            report_dir=args.report_dir,
            overrides=_overrides(parser, args),
            max_train_examples=args.max_train_examples,
            max_eval_examples=args.max_eval_examples,
            quarantine_corrupt=args.quarantine_corrupt,
            charge_unreadable_ledger=args.charge_unreadable_ledger,
        )
    except DptuneError as exc:
        parser.error(str(exc))


def _parser() -> ArgumentParser:
    """The flags, in the order ``--help`` lists them."""
    parser = ArgumentParser(
        prog="python -m dptune.search",
        description="Joint DP hyperparameter search over clip bound C, batch size B and learning rate η₀ "
        "per (ε, epochs) cell, on Ray Tune.",
    )
    parser.add_argument("--version", action="version", version=f"dptune {__version__}")
    _add_where_flags(parser)
    _add_run_flags(parser)
    _add_override_flags(parser)
    _add_recovery_flags(parser)
    return parser


def _add_where_flags(parser: ArgumentParser) -> None:
    """What to search and where: the space file, the results, the search's name and the Ray cluster."""
    parser.add_argument(
        "--space", default="search_spaces/default.yaml", help="search-space YAML (default: %(default)s)"
    )
    parser.add_argument("--storage", default="results", help="results folder or URI (default: %(default)s)")
    parser.add_argument("--name", help="search name, a folder under --storage (default: the space's name)")
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray)")


def _add_run_flags(parser: ArgumentParser) -> None:
    """How the search runs: resumed, planned only, and its report."""
    parser.add_argument("--resume", action="store_true", help="continue an interrupted search of the same name")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (cells, configurations, pruning, σ per B) and what would be encoded, and stop: "
        "nothing is encoded, trained or written",
    )
    parser.add_argument("--no-report", dest="report", action="store_false", help="do not build the HTML report")
    parser.add_argument(
        "--report-dir",
        metavar="DIR",
        help="folder or URI for the HTML report (default: <storage>/<name>/report, beside the results)",
    )


def _add_override_flags(parser: ArgumentParser) -> None:
    """Changes to the space (``--set`` and its shortcuts) and caps on the data (quick runs and tests)."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a space key, e.g. --set privacy.epsilons=[1] (YAML value; repeatable)",
    )
    parser.add_argument("--trials-per-cell", type=int, help="override sampler.trials_per_cell")
    parser.add_argument("--max-train-examples", type=int, help="cap the training set (quick runs and tests)")
    parser.add_argument("--max-eval-examples", type=int, help="cap the validation and test sets (quick runs and tests)")


def _add_recovery_flags(parser: ArgumentParser) -> None:
    """Resuming from damage: unreadable result parts and unreadable start files of the privacy ledger."""
    parser.add_argument(
        "--quarantine-corrupt",
        action="store_true",
        help="move unreadable Parquet parts of the results folder to <results>/quarantine/ "
        "instead of refusing to start",
    )
    parser.add_argument(
        "--charge-unreadable-ledger",  # records.ledger.CHARGE_UNREADABLE_FLAG (its refusal names it)
        action="store_true",
        help="charge each unreadable start file of the privacy ledger conservatively (every run one start file "
        "can hold, at every mechanism the plan can start; a loose upper bound) instead of refusing to resume",
    )


def _overrides(parser: ArgumentParser, args: Namespace) -> dict[str, Any]:
    """The space overrides of ``--set`` and ``--trials-per-cell``, each value parsed; the data caps checked."""
    try:
        overrides = parse_overrides(args.set)
    except SpaceError as exc:
        parser.error(str(exc))
    if args.trials_per_cell is not None:
        if args.trials_per_cell < 1:
            parser.error(f"--trials-per-cell must be ≥ 1 (got {args.trials_per_cell})")
        overrides["sampler.trials_per_cell"] = args.trials_per_cell
    return overrides


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and validate the space and its dataset and backbone names (answering a mistake at
    once), then run the search. A Ctrl+C ends it with one line (exit status 130), no traceback; once
    every run is recorded the driver's own line says what is not done (``finished.composing``)."""
    options = parse_args(argv)
    try:
        run(options)  # a bad space is told before the driver loads
    except DptuneError as exc:  # bad input, or a search that could not finish; anything else is a bug...
        report_and_exit(exc)
    except KeyboardInterrupt as interrupt:  # before every run is recorded, outside the Tune run or a second stop in it
        how, number = stop_named(interrupt)
        report_and_exit(
            SearchInterrupted(
                f"stopped by {how} during the dry run; nothing was written"
                if options.dry_run
                else f"stopped by {how} before the search finished. Run the same command with --resume to "
                "run the rest, each exactly once (what finished is kept, and every training that took a step stays "
                "charged in the privacy ledger)",
                number,
            )
        )
    except Exception as exc:  # ...and keeps its traceback, unless the results folder took no more writes
        if (what := storage_error(exc)) is None:
            raise
        report_and_exit(
            SearchIncomplete(
                f"--storage {options.storage}: cannot write the results: {what}. Free space (or make the folder "
                "writable), then run the same command with --resume: what finished is kept, and every training that "
                "took a step stays charged in the privacy ledger"
            )
        )
