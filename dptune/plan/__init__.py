"""The plan, before any compute: steps and schedules, σ calibrated once per run, and the batch-size table.

``python -m dptune.plan --n 50000 --eps 1 8 --epochs 10`` prints one block per ε with one row per
batch size B and marks the B the paper's rule recommends (:mod:`dptune.plan.cli`).

The modules:

- :mod:`dptune.plan.schedule`: the arithmetic, accounting-free. With Poisson sampling at rate
  q = B/N (``sample_rate``) E epochs are T = round(E·N/B) steps (``total_steps``), rounded once
  over the whole budget; epoch e ends at step round(e·N/B) (``epoch_steps``); ``full_schedule`` and
  ``run_schedule`` (a tuning run's public schedule where it has one); √B learning-rate coupling
  η = η₀·√(B/B_ref) (``coupled_learning_rate``); the default grid, the min-step rule's checks and the
  rule's pick (``recommended_batch_size``);
- :mod:`dptune.plan.mechanism`: the one place outside :mod:`dptune.privacy` where σ is calibrated:
  a run's :class:`~dptune.contract.Mechanism` (σ, q, T, epoch split, expected batch, (ε, δ)), which
  every consumer (runners, ledger, accounting of unfinished runs) reads and none recomputes;
- :mod:`dptune.plan.table`: the batch-size rule's table per (ε, B) (Rehn et al., ICLR 2026, §6):
  σ, σ/B, cumulative noise σ√T, T ≥ T_min, the recommended B (``plan``, ``format_plan``, ``write_plan``);
- :mod:`dptune.plan.cli`: the command line (flags checked before any accounting).

Called, the package is the planner in Python: ``dptune.plan(50000, [1, 8], epochs=10)`` is the table
as a pandas DataFrame, one row per (ε, B) (:class:`PlanRow`'s fields as columns).

Every name of ``schedule``, ``table`` and ``cli`` is re-exported here (``from dptune.plan import
total_steps, plan, main``); ``dptune.plan.mechanism`` is imported as itself, so that the one module
that calibrates σ is named wherever σ is calibrated.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from dptune.plan.cli import main
from dptune.plan.schedule import (
    DEFAULT_BASE_LEARNING_RATE,
    DEFAULT_DELTA,
    DEFAULT_MIN_STEPS,
    DEFAULT_REFERENCE_BATCH_SIZE,
    DEFAULT_TOLERANCE,
    MAX_STEPS,
    SMALLEST_DEFAULT_BATCH_SIZE,
    PlanError,
    check_max_steps,
    check_min_steps_reachable,
    coupled_learning_rate,
    default_batch_sizes,
    epoch_steps,
    full_schedule,
    recommended_batch_size,
    run_schedule,
    sample_rate,
    total_steps,
)
from dptune.plan.table import RECOMMENDED_MARK, PlanRow, format_plan, plan, write_plan

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "DEFAULT_BASE_LEARNING_RATE",
    "DEFAULT_DELTA",
    "DEFAULT_MIN_STEPS",
    "DEFAULT_REFERENCE_BATCH_SIZE",
    "DEFAULT_TOLERANCE",
    "MAX_STEPS",
    "RECOMMENDED_MARK",
    "SMALLEST_DEFAULT_BATCH_SIZE",
    "PlanError",
    "PlanRow",
    "check_max_steps",
    "check_min_steps_reachable",
    "coupled_learning_rate",
    "default_batch_sizes",
    "epoch_steps",
    "format_plan",
    "full_schedule",
    "main",
    "plan",
    "recommended_batch_size",
    "run_schedule",
    "sample_rate",
    "total_steps",
    "write_plan",
]


class _Planner(types.ModuleType):
    """This package, callable: ``dptune.plan(...)`` is :func:`~dptune.plan.table.plan` as a DataFrame."""

    def __call__(
        self,
        num_examples: int,
        epsilons: float | Sequence[float],
        *,
        epochs: int,
        delta: float = DEFAULT_DELTA,
        batch_sizes: Sequence[int] | None = None,
        min_steps: int = DEFAULT_MIN_STEPS,
        tolerance: float = DEFAULT_TOLERANCE,
        base_learning_rate: float = DEFAULT_BASE_LEARNING_RATE,
        reference_batch_size: int = DEFAULT_REFERENCE_BATCH_SIZE,
    ) -> pd.DataFrame:
        """The batch-size plan before any compute: one row per (ε, B) with q, T, σ, σ/B, σ√T, whether
        T ≥ ``min_steps``, the √B-coupled learning rate and the B the rule recommends per ε; N =
        ``num_examples`` privacy units. :class:`PlanError` names a bad argument before any accounting."""
        import pandas as pd

        targets = [epsilons] if isinstance(epsilons, (int, float)) else list(epsilons)
        rows = plan(
            num_examples,
            targets,
            delta,
            epochs,
            batch_sizes,
            min_steps,
            tolerance,
            base_learning_rate=base_learning_rate,
            reference_batch_size=reference_batch_size,
        )
        return pd.DataFrame([asdict(row) for row in rows])


sys.modules[__name__].__class__ = _Planner
