"""``python -m dptune.plan``: the batch-size plan on the terminal (and in a .csv or .parquet file).

``python -m dptune.plan --n 50000 --eps 1 8 --epochs 10`` prints one block per ε with one row per
batch size B and marks the B the paper's rule recommends. Every flag is checked before any accounting.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dptune import __version__
from dptune.errors import ArgumentParser, DptuneError, report_and_exit, shown
from dptune.paths import probe_writable
from dptune.plan.schedule import (
    DEFAULT_BASE_LEARNING_RATE,
    DEFAULT_DELTA,
    DEFAULT_MIN_STEPS,
    DEFAULT_REFERENCE_BATCH_SIZE,
    DEFAULT_TOLERANCE,
    MAX_STEPS,
)
from dptune.plan.table import format_plan, plan, write_plan
from dptune.privacy import MAX_EPSILON, MIN_EPSILON


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m dptune.plan",
        description="Batch-size plan before any compute (Rehn et al. 2026): per ε and B, the noise multiplier σ "
        "(PRV accountant), steps T = round(E·N/B), per-step noise σ/B, cumulative noise σ√T, "
        "the min-step rule T ≥ T_min, the recommended B (smallest B on the σ√T plateau) and the "
        "√B-coupled learning rate.",
    )
    parser.add_argument("--version", action="version", version=f"dptune {__version__}")
    parser.add_argument("--n", type=int, required=True, help="number of training examples N (≥ 1)")
    parser.add_argument(
        "--eps",
        type=float,
        nargs="+",
        required=True,
        help=f"one or more ε targets, each in [{MIN_EPSILON:g}, {MAX_EPSILON:g}]",
    )
    parser.add_argument("--delta", type=float, default=DEFAULT_DELTA, help="δ, in (0, 1) (default %(default)g)")
    parser.add_argument(
        "--epochs",
        type=int,
        required=True,
        help=f"epoch budget E (≥ 1; at most {MAX_STEPS:,} steps T = round(E·N/B) at the smallest B)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        help="batch sizes B in [1, N] (default: powers of two from 16 up to N, plus N)",
    )
    parser.add_argument(
        "--min-steps",
        type=int,
        default=DEFAULT_MIN_STEPS,
        help="T_min of the min-step rule, ≥ 1 and reached by the smallest B (default %(default)s, the paper's "
        "value on one dataset)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="relative width of the σ√T plateau, ≥ 0 (default %(default)s = 5%%)",
    )
    parser.add_argument(
        "--base-lr",
        type=float,
        default=DEFAULT_BASE_LEARNING_RATE,
        help="base learning rate η₀ of the √B coupling, > 0 (default %(default)g)",
    )
    parser.add_argument(
        "--reference-batch-size",
        type=int,
        default=DEFAULT_REFERENCE_BATCH_SIZE,
        help="B_ref of the √B coupling, η = η₀·√(B/B_ref), ≥ 1 (default %(default)s)",
    )
    parser.add_argument("--out", type=Path, help="also write the rows to this .csv or .parquet file")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.out is not None and args.out.suffix not in (".csv", ".parquet"):
        parser.error(f"--out must end in .csv or .parquet, got {shown(str(args.out))}")
    if args.out is not None and not args.out.parent.is_dir():
        parser.error(f"--out: folder {shown(str(args.out.parent))} does not exist")
    if args.out is not None and args.out.is_dir():
        parser.error(f"--out {shown(str(args.out))}: is a folder (give a file name ending in .csv or .parquet)")
    try:
        if args.out is not None:
            probe_writable(str(args.out.parent), "--out")
        rows = plan(
            args.n,
            args.eps,
            args.delta,
            args.epochs,
            args.batch_sizes,
            args.min_steps,
            args.tolerance,
            base_learning_rate=args.base_lr,
            reference_batch_size=args.reference_batch_size,
            progress=True,
        )
    except DptuneError as error:  # bad flags (checked before any accounting) or an unreachable ε
        report_and_exit(error)
    print(format_plan(rows, args.min_steps, args.tolerance, args.base_lr, args.reference_batch_size))
    if args.out is not None:
        write_plan(rows, args.out)
        print(f"wrote {len(rows)} rows to {args.out}")
