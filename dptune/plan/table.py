"""The batch-size plan's table: σ, cumulative noise σ√T and the min-step rule per (ε, B), and its files.

The batch-size rule (Rehn et al., ICLR 2026, §6): under a fixed epoch budget, T = E·N/B, so doubling
B halves the steps. The per-step noise std σC/B keeps falling towards full batch and would always
pick B = N; the cumulative DP noise σ√T instead has a plateau near its minimum, flatter for tighter
privacy. The rule: among the B with T ≥ T_min (too few steps never converge; ~20 on one of the
paper's datasets, dataset dependent), find the minimum of σ√T and recommend the *smallest* B whose
σ√T is within a relative ``tolerance`` of it. Tighter ε → wider plateau → smaller recommended B.
σ comes from :func:`dptune.plan.mechanism.mechanisms`.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dptune.plan.mechanism import mechanisms
from dptune.plan.schedule import (
    DEFAULT_BASE_LEARNING_RATE,
    DEFAULT_MIN_STEPS,
    DEFAULT_REFERENCE_BATCH_SIZE,
    DEFAULT_TOLERANCE,
    PlanError,
    _is_count,
    check_max_steps,
    check_min_steps_reachable,
    coupled_learning_rate,
    default_batch_sizes,
    recommended_batch_size,
    sample_rate,
)
from dptune.privacy import MAX_EPSILON, MIN_EPSILON, check_delta


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
    found = mechanisms(
        ((epsilon, epochs, batch_size) for epsilon in epsilons for batch_size in sizes), delta, num_examples, progress
    )
    rows = []
    for epsilon in epsilons:
        block = [(b, found[epsilon, epochs, b].steps, found[epsilon, epochs, b].noise_multiplier) for b in sizes]
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
