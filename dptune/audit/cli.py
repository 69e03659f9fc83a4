"""``python -m dptune.audit``: an empirical privacy audit on the terminal.

``python -m dptune.audit --space search_spaces/default.yaml --out audit`` trains the space's first cell
at the middle of its ranges once with 1,000 canaries and prints one line per threat model with its
"empirical ε lower bound" (then the notes); ``--configuration C,B,ETA0`` (repeatable) or ``--model DIR``
picks what is audited, ``--epsilon``/``--epochs`` the cell. Every flag is checked before any compute.
"""

from __future__ import annotations

from dptune import __version__
from dptune.audit.api import DEFAULT_CANARIES, Configuration, audit
from dptune.audit.cite import cite_audit
from dptune.audit.run import RUNNERS, AuditInterrupted
from dptune.errors import ArgumentParser, DptuneError, report_and_exit, shown, stop_named
from dptune.space import SpaceError, parse_overrides


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m dptune.audit",
        description="Empirical privacy audit (Steinke, Nasr & Jagielski 2023): one training with canaries through "
        "the runner a search uses, and an empirical ε lower bound at 95%% confidence, black-box and white-box. "
        "A bound above the claimed ε proves a bug; one below it proves only that the audit found none.",
    )
    parser.add_argument("--version", action="version", version=f"dptune {__version__}")
    parser.add_argument(
        "--space", default="search_spaces/default.yaml", help="search-space YAML (default: %(default)s)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a space key")
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--configuration",
        action="append",
        metavar="C,B,ETA0",
        help="a configuration to audit (repeatable: they train together); default: the middle of the space's ranges",
    )
    what.add_argument("--model", help="a published model folder: audit its configuration, ε and epochs")
    parser.add_argument(
        "--cite",
        action="store_true",
        help="with --model: cite the audit on the model's card (model_card.json and .md), with the privacy of the "
        "model and its published audit together",
    )
    parser.add_argument("--epsilon", type=float, help="the cell's ε (default: the space's first cell)")
    parser.add_argument("--epochs", type=int, help="the cell's epoch budget E")
    parser.add_argument("--canaries", type=int, default=DEFAULT_CANARIES, help="m, the canaries (default %(default)s)")
    parser.add_argument(
        "--runner",
        choices=RUNNERS,
        default="fused",
        help="fused: every configuration at once, as a search of heads; trial: one at a time with the space's "
        "training.engine (film or opacus) (default %(default)s)",
    )
    parser.add_argument("--max-train-examples", type=int, help="cap the training set (quick runs and tests)")
    parser.add_argument("--max-eval-examples", type=int, help="cap the validation and test sets (quick runs and tests)")
    parser.add_argument("--confidence", type=float, default=0.95, help="of the lower bound (default %(default)s)")
    parser.add_argument("--out", required=True, help="the audit's own folder (its secret inclusion coins go there)")
    return parser


def _configuration(parser: ArgumentParser, text: str) -> Configuration:
    parts = text.split(",")
    try:
        clip_bound, batch_size, rate = float(parts[0]), int(parts[1]), float(parts[2])
        if len(parts) != 3:
            raise ValueError
    except (ValueError, IndexError):
        parser.error(f"--configuration {shown(text)}: expected C,B,ETA0, e.g. 0.3,256,0.003")
    return clip_bound, batch_size, rate


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, run :func:`~dptune.audit.api.audit` and print its summary; a bad flag or value is
    told in one line before any compute, a Ctrl+C ends it in one line (exit status 130)."""
    parser = _parser()
    args = parser.parse_args(argv)
    configurations = [_configuration(parser, c) for c in args.configuration or []]
    try:
        overrides = parse_overrides(args.set)
    except SpaceError as error:
        parser.error(str(error))
    if args.cite and args.model is None:
        parser.error("--cite cites the audit on a published model's card: give the model with --model DIR")
    try:
        report = audit(
            args.space,
            out=args.out,
            overrides=overrides,
            configurations=configurations or None,
            model=args.model,
            epsilon=args.epsilon,
            epochs=args.epochs,
            canaries=args.canaries,
            confidence=args.confidence,
            runner=args.runner,
            max_train_examples=args.max_train_examples,
            max_eval_examples=args.max_eval_examples,
        )
        cited = cite_audit(args.model, args.out) if args.cite else None
    except DptuneError as error:
        report_and_exit(error)
    except KeyboardInterrupt as interrupt:
        how, number = stop_named(interrupt)
        report_and_exit(
            AuditInterrupted(
                f"stopped by {how} before the audit finished: it wrote no audit.json (a folder without one holds "
                "no finished audit, and the report and --cite refuse it); run the same command again",
                number,
            )
        )
    print(report, end="")
    print(f"wrote {args.out}")
    if cited is not None:
        print(
            f"cited on {args.model}/model_card.json: the model and its published audit together are "
            f"(ε, δ) = ({cited['epsilon_with_audit']:.4g}, {cited['delta']:.3g})"
        )
