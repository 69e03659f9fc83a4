"""The batch-size plan, before any compute: σ, cumulative noise σ√T and the min-step rule per (ε, B).

``python -m dptune.plan --n 50000 --eps 1 8 --epochs 10`` prints one block per ε with one row per
batch size B and marks the B the paper's rule recommends.

Single source of truth for how a trial turns (N, B, E) into DP-SGD steps: with Poisson sampling at
rate q = B/N (``sample_rate``) a step visits each example with probability q, so E epochs are
E·N/B steps; a trial runs exactly T = round(E·N/B) steps (``total_steps``), rounded once over
the whole budget, and σ is calibrated for that (q, T). The expected passes over the data, T·q,
are then within q/2 of E. (Rounding per epoch instead, E·round(N/B), drifts: N = 50000, B = 32768
gives 2 steps per epoch at q = 0.655, 1.31 passes per epoch.) Epoch e ends at step round(e·N/B)
(``epoch_steps``), so every epoch boundary is within q/2 passes of e as well.

The batch-size rule (Rehn et al., ICLR 2026, §6): under a fixed epoch budget, T = E·N/B, so doubling
B halves the steps. The per-step noise std σC/B keeps falling towards full batch and would always
pick B = N; the cumulative DP noise σ√T instead has a plateau near its minimum, flatter for tighter
privacy. The rule: among the B with T ≥ T_min (too few steps never converge; ~20 on one of the
paper's datasets, dataset dependent), find the minimum of σ√T and recommend the *smallest* B whose
σ√T is within a relative ``tolerance`` of it. Tighter ε → wider plateau → smaller recommended B.

√B learning-rate coupling (the paper's DP-Adam finding): η = η₀·√(B/B_ref) (``coupled_learning_rate``).
"""

from __future__ import annotations

import argparse
import itertools
import math
import numbers
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

from tqdm import tqdm

from dptune import __version__
from dptune.contract import PublicSchedule, TrialConfig
from dptune.errors import ArgumentParser, DptuneError, report_and_exit, shown
from dptune.paths import probe_writable
from dptune.privacy import MAX_EPSILON, MIN_EPSILON, calibrate_noise_multiplier, check_delta

#: T_min of the min-step rule: the paper saw no convergence below ~20 steps on one dataset.
DEFAULT_MIN_STEPS = 20
#: Relative tolerance that defines the σ√T plateau: within 5% of the minimum.
DEFAULT_TOLERANCE = 0.05
DEFAULT_DELTA = 1e-5
#: η₀ and B_ref of the √B coupling (a common DP-Adam rate at a mid-sized batch).
DEFAULT_BASE_LEARNING_RATE = 1e-3
DEFAULT_REFERENCE_BATCH_SIZE = 256
#: Smallest batch size of the default grid (powers of two from here up to N, plus N).
SMALLEST_DEFAULT_BATCH_SIZE = 16
#: Most steps T one configuration may plan: σ calibration (PRV accountant) grows with T, from
#: about 10 s at T ≈ 2·10⁴ to 35 s at 2·10⁵ and past a minute (and gigabytes) beyond 10⁶ on
#: 2 cores, so a larger T is refused before any accounting instead of hanging.
MAX_STEPS = 1_000_000


def _is_count(value: object) -> bool:
    """An integer ≥ 1 (numpy integers included, bool excluded)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1


def _check_sizes(num_examples: int, batch_size: int) -> None:
    if not _is_count(num_examples):
        raise ValueError(f"num_examples (N) must be an integer ≥ 1, got {num_examples!r}")
    if not (_is_count(batch_size) and batch_size <= num_examples):
        raise ValueError(f"batch_size (B) must be an integer in [1, num_examples={num_examples}], got {batch_size!r}")


def sample_rate(num_examples: int, batch_size: int) -> float:
    """Poisson sampling rate q = B/N (B is the expected batch size)."""
    _check_sizes(num_examples, batch_size)
    return batch_size / num_examples


def _steps_after(num_examples: int, batch_size: int, epochs: int) -> int:
    """round(E·N/B), exactly (integer arithmetic; Python's round: halves go to the even side).
    It is ≥ E, as B ≤ N."""
    return round(Fraction(epochs * num_examples, batch_size))


def _check_epochs(epochs: int) -> None:
    if not _is_count(epochs):
        raise ValueError(f"epochs (E) must be an integer ≥ 1, got {epochs!r}")


def total_steps(num_examples: int, batch_size: int, epochs: int) -> int:
    """Steps T a trial runs: round(E·N/B) (≥ E ≥ 1 as B ≤ N), the fixed-epoch budget E·N/B rounded once.

    σ is calibrated for exactly this T at q = B/N; the expected passes over the data T·q then satisfy
    |T·q − E| ≤ q/2.
    """
    _check_sizes(num_examples, batch_size)
    _check_epochs(epochs)
    return _steps_after(num_examples, batch_size, epochs)


def epoch_steps(num_examples: int, batch_size: int, epochs: int) -> list[int]:
    """The steps of each of the E epochs: epoch e ends at step round(e·N/B) (= max(e, round(e·N/B))
    as B ≤ N).

    Invariants: E entries, each ≥ 1 (consecutive ends differ by N/B ≥ 1 before rounding), summing to
    ``total_steps(N, B, E)``; after epoch e the expected passes over the data are within q/2 of e.
    Full batch (B = N) gives [1]·E; B dividing N gives [N/B]·E; otherwise the entries are
    ⌊N/B⌋ or ⌈N/B⌉ (e.g. N = 10, B = 4, E = 4: [2, 3, 3, 2]).
    """
    _check_sizes(num_examples, batch_size)
    _check_epochs(epochs)
    ends = [_steps_after(num_examples, batch_size, epoch) for epoch in range(epochs + 1)]
    return [end - start for start, end in itertools.pairwise(ends)]


def run_schedule(config: TrialConfig, num_train: int) -> PublicSchedule:
    """The Poisson schedule ``config`` trains by on ``num_train`` rows: its public one where it has one
    (a tuning run on a secret subsample), else q = B/N, T = ``total_steps``, ``epoch_steps`` and q·N = B."""
    if config.schedule is not None:
        return config.schedule
    batch_size, epochs = config.batch_size, config.epochs
    return PublicSchedule(
        sample_rate=sample_rate(num_train, batch_size),
        steps=total_steps(num_train, batch_size, epochs),
        epoch_steps=tuple(epoch_steps(num_train, batch_size, epochs)),
        expected_batch_size=float(batch_size),
    )


def coupled_learning_rate(base_learning_rate: float, batch_size: float, reference_batch_size: int) -> float:
    """√B coupling: η = η₀·√(B/B_ref) (B an expected batch: a tuning run's q·q₁·N may be fractional)."""
    if not base_learning_rate > 0:
        raise ValueError(f"base_learning_rate (η₀) must be > 0, got {base_learning_rate!r}")
    if not (batch_size > 0 and reference_batch_size >= 1):
        raise ValueError(f"batch sizes must be > 0 (B_ref ≥ 1), got B={batch_size!r}, B_ref={reference_batch_size!r}")
    return base_learning_rate * math.sqrt(batch_size / reference_batch_size)


def default_batch_sizes(num_examples: int) -> list[int]:
    """Powers of two from 16 up to N, plus full batch N."""
    sizes = []
    batch_size = SMALLEST_DEFAULT_BATCH_SIZE
    while batch_size < num_examples:
        sizes.append(batch_size)
        batch_size *= 2
    return sizes + [num_examples]


@dataclass(frozen=True)
class PlanRow:
    """One (ε, B) of the plan. Noise figures are for clip bound C = 1 (they scale with C)."""

    epsilon: float
    delta: float
    num_examples: int
    epochs: int
    batch_size: int
    sample_rate: float  # q = B/N
    steps: int  # T = round(E·N/B)
    passes: float  # T·q: expected passes over the data, within q/2 of E
    noise_multiplier: float  # σ
    noise_std_per_step: float  # σ·C/B: std of the noise on the averaged gradient, per step
    cumulative_noise: float  # σ·√T
    meets_min_steps: bool  # T ≥ T_min
    recommended: bool  # the B the rule picks for this ε
    learning_rate: float  # η₀·√(B/B_ref)


def recommended_batch_size(
    batch_sizes: Sequence[int],
    cumulative_noise: Sequence[float],
    steps: Sequence[int],
    min_steps: int,
    tolerance: float,
) -> int | None:
    """The smallest B with T ≥ ``min_steps`` and σ√T ≤ (1 + ``tolerance``)·min{σ√T : T ≥ min_steps}.

    None when no B meets the min-step rule.
    """
    eligible = [(b, noise) for b, noise, t in zip(batch_sizes, cumulative_noise, steps, strict=True) if t >= min_steps]
    if not eligible:
        return None
    floor = min(noise for _, noise in eligible)
    return min(b for b, noise in eligible if noise <= (1 + tolerance) * floor)


class PlanError(DptuneError, ValueError):
    """A planning input out of range; the message names the parameter, its flag and what is allowed."""


def _validate(
    num_examples: int,
    epsilons: Sequence[float],
    delta: float,
    epochs: int,
    batch_sizes: Sequence[int] | None,
    min_steps: int,
    tolerance: float,
    base_learning_rate: float,
    reference_batch_size: int,
) -> None:
    if not _is_count(num_examples):
        raise PlanError(f"num_examples (--n) must be an integer ≥ 1, got {num_examples!r}")
    if not epsilons or not all(MIN_EPSILON <= e <= MAX_EPSILON for e in epsilons):
        raise PlanError(
            f"epsilons (--eps) must be one or more values in [{MIN_EPSILON:g}, {MAX_EPSILON:g}], got {list(epsilons)}"
        )
    if not 0 < delta < 1:
        raise PlanError(f"delta (--delta) must be in (0, 1), got {delta!r}")
    if not _is_count(epochs):
        raise PlanError(f"epochs (--epochs) must be an integer ≥ 1, got {epochs!r}")
    if batch_sizes is not None and not (batch_sizes and all(_is_count(b) and b <= num_examples for b in batch_sizes)):
        raise PlanError(
            f"batch sizes (--batch-sizes) must be integers in [1, N={num_examples}], got {list(batch_sizes)}"
        )
    if not _is_count(min_steps):
        raise PlanError(f"min_steps (--min-steps) must be an integer ≥ 1, got {min_steps!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise PlanError(f"tolerance (--tolerance) must be a relative tolerance ≥ 0 (e.g. 0.05), got {tolerance!r}")
    if not (math.isfinite(base_learning_rate) and base_learning_rate > 0):
        raise PlanError(f"base learning rate (--base-lr) must be > 0, got {base_learning_rate!r}")
    if not _is_count(reference_batch_size):
        raise PlanError(
            f"reference batch size (--reference-batch-size) must be an integer ≥ 1, got {reference_batch_size!r}"
        )
    smallest = min(batch_sizes or default_batch_sizes(num_examples))
    check_max_steps(num_examples, smallest, epochs, "--n, --epochs, --batch-sizes")
    check_min_steps_reachable(num_examples, smallest, epochs, min_steps)


def check_min_steps_reachable(num_examples: int, smallest_batch_size: int, epochs: int, min_steps: int) -> None:
    """Refuse a plan in which no B qualifies: T = round(E·N/B) < ``min_steps`` even at the smallest B, which
    gives the most steps (``PlanError`` saying so and what would let one qualify: a lower T_min, more
    epochs, or smaller batch sizes)."""
    most = total_steps(num_examples, smallest_batch_size, epochs)
    if most >= min_steps:
        return
    more_epochs = math.ceil(Fraction(2 * min_steps - 1, 2) * smallest_batch_size / num_examples)
    while total_steps(num_examples, smallest_batch_size, more_epochs) < min_steps:
        more_epochs += 1  # round() takes halves to the even side: at most one more
    largest = math.floor(Fraction(epochs * num_examples) / Fraction(2 * min_steps - 1, 2))
    while largest >= 1 and total_steps(num_examples, largest, epochs) < min_steps:
        largest -= 1
    smaller = f", or give batch sizes B ≤ {largest} (--batch-sizes)" if largest >= 1 else ""
    raise PlanError(
        f"--min-steps {min_steps}: no batch size qualifies: T = round(E·N/B) < {min_steps} for every B (N = "
        f"{num_examples}, E = {epochs}: the most steps are T = {most}, at B = {smallest_batch_size}). Lower "
        f"--min-steps to {most} or less, raise --epochs to {more_epochs} or more{smaller}"
    )


def check_max_steps(num_examples: int, batch_size: int, epochs: int, where: str) -> None:
    """Refuse a configuration whose T = round(E·N/B) exceeds ``MAX_STEPS`` (``PlanError`` naming ``where``)."""
    steps = total_steps(num_examples, batch_size, epochs)
    if steps > MAX_STEPS:
        smallest = math.ceil(epochs * num_examples / MAX_STEPS)
        fix = f"batch sizes B ≥ {smallest} or fewer epochs" if smallest <= num_examples else "fewer epochs"
        raise PlanError(
            f"{where}: B = {batch_size} gives T = E·N/B = {steps} steps (N = {num_examples}, "
            f"E = {epochs}), more than the {MAX_STEPS} steps σ can be calibrated for in bounded time "
            f"(use {fix})"
        )


def plan(
    num_examples: int,
    epsilons: Sequence[float],
    delta: float,
    epochs: int,
    batch_sizes: Sequence[int] | None = None,
    min_steps: int = DEFAULT_MIN_STEPS,
    tolerance: float = DEFAULT_TOLERANCE,
    *,
    base_learning_rate: float = DEFAULT_BASE_LEARNING_RATE,
    reference_batch_size: int = DEFAULT_REFERENCE_BATCH_SIZE,
    progress: bool = False,
) -> list[PlanRow]:
    """One row per (ε, B), distinct ε in the given order and B ascending; exactly one row per ε is
    ``recommended``.

    All inputs are checked (``PlanError`` naming the parameter and its CLI flag) before any
    accounting, that some B meets T ≥ ``min_steps`` included; a δ above 1/N is warned about.
    ``progress`` shows a tqdm bar on stderr while σ is calibrated (calibrations are cached, so a
    repeated plan is fast).
    """
    _validate(
        num_examples,
        epsilons,
        delta,
        epochs,
        batch_sizes,
        min_steps,
        tolerance,
        base_learning_rate,
        reference_batch_size,
    )
    sizes = sorted(set(default_batch_sizes(num_examples) if batch_sizes is None else batch_sizes))
    epsilons = list(dict.fromkeys(epsilons))
    check_delta(delta, num_examples)
    rows = []
    with tqdm(
        total=len(epsilons) * len(sizes),
        desc="calibrating σ",
        unit="σ",
        disable=not progress,
        file=sys.stderr,
        leave=False,
    ) as bar:
        for epsilon in epsilons:
            block = []
            for batch_size in sizes:
                steps = total_steps(num_examples, batch_size, epochs)
                sigma = calibrate_noise_multiplier(epsilon, delta, sample_rate(num_examples, batch_size), steps)
                bar.update()
                block.append((batch_size, steps, sigma))
            pick = recommended_batch_size(
                [b for b, _, _ in block],
                [s * math.sqrt(t) for _, t, s in block],
                [t for _, t, _ in block],
                min_steps,
                tolerance,
            )
            rows += [
                PlanRow(
                    epsilon=float(epsilon),
                    delta=delta,
                    num_examples=num_examples,
                    epochs=epochs,
                    batch_size=b,
                    sample_rate=sample_rate(num_examples, b),
                    steps=t,
                    passes=t * sample_rate(num_examples, b),
                    noise_multiplier=s,
                    noise_std_per_step=s / b,
                    cumulative_noise=s * math.sqrt(t),
                    meets_min_steps=t >= min_steps,
                    recommended=b == pick,
                    learning_rate=coupled_learning_rate(base_learning_rate, b, reference_batch_size),
                )
                for b, t, s in block
            ]
    return rows


# --------------------------------------------------------------------------- terminal table and files

RECOMMENDED_MARK = "◀ recommended"


def format_plan(
    rows: Sequence[PlanRow], min_steps: int, tolerance: float, base_learning_rate: float, reference_batch_size: int
) -> str:
    """Aligned table, one block per ε, the recommended row marked with ``RECOMMENDED_MARK``."""
    header = ("B", "q", "T", "passes", "σ", "σ/B", "σ√T", "σ√T/min", f"T≥{min_steps}", "η", "")
    blocks = []
    for epsilon in dict.fromkeys(row.epsilon for row in rows):
        block = [row for row in rows if row.epsilon == epsilon]
        floor = min(row.cumulative_noise for row in block if row.meets_min_steps)
        (pick,) = [row.batch_size for row in block if row.recommended]
        first = block[0]
        title = f"ε = {epsilon:g}, δ = {first.delta:g}, N = {first.num_examples}, E = {first.epochs}: "
        title += f"recommended B = {pick}"
        table = [header] + [
            (
                str(row.batch_size),
                f"{row.sample_rate:.4g}",
                str(row.steps),
                f"{row.passes:.2f}",
                f"{row.noise_multiplier:.4f}",
                f"{row.noise_std_per_step:.3e}",
                f"{row.cumulative_noise:.2f}",
                f"{row.cumulative_noise / floor:.3f}",
                "yes" if row.meets_min_steps else "no",
                f"{row.learning_rate:.3g}",
                RECOMMENDED_MARK if row.recommended else "",
            )
            for row in block
        ]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        lines = [
            "  ".join(cell.rjust(width) for cell, width in zip(line[:-1], widths[:-1], strict=True)) + "  " + line[-1]
            for line in table
        ]
        blocks.append("\n".join([title, *(line.rstrip() for line in lines)]))
    legend = textwrap.fill(
        "T = round(E·N/B): steps; passes = T·q: expected passes over the data (E up to rounding). "
        f"σ: noise multiplier (PRV accountant, add/remove adjacency). σ/B: per-step noise std on the averaged "
        f"gradient, σ√T: cumulative noise, both for C = 1. σ√T/min: relative to the minimum over B with "
        f"T ≥ {min_steps}. Rule: the smallest B with T ≥ {min_steps} within {tolerance:.0%} of that minimum. "
        f"η = {base_learning_rate:g}·√(B/{reference_batch_size}).",
        width=100,
    )
    return "\n\n".join(blocks + [legend])


def write_plan(rows: Sequence[PlanRow], path: Path) -> None:
    """Write the rows as CSV (``.csv``) or Parquet (``.parquet``), one column per ``PlanRow`` field."""
    import pyarrow as pa

    table = pa.Table.from_pylist([asdict(row) for row in rows])
    if path.suffix == ".csv":
        import pyarrow.csv

        pyarrow.csv.write_csv(table, path)
    else:
        import pyarrow.parquet

        pyarrow.parquet.write_table(table, path)


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
    parser.add_argument("--eps", type=float, nargs="+", required=True, help="one or more ε targets, each > 0")
    parser.add_argument("--delta", type=float, default=DEFAULT_DELTA, help="δ, in (0, 1) (default %(default)g)")
    parser.add_argument("--epochs", type=int, required=True, help="epoch budget E (≥ 1)")
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
        help="T_min of the min-step rule (default %(default)s, the paper's value on one dataset)",
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
        help="base learning rate η₀ of the √B coupling (default %(default)g)",
    )
    parser.add_argument(
        "--reference-batch-size",
        type=int,
        default=DEFAULT_REFERENCE_BATCH_SIZE,
        help="B_ref of the √B coupling, η = η₀·√(B/B_ref) (default %(default)s)",
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


if __name__ == "__main__":
    main()
