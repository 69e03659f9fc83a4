"""Report section 8: the guideline table (optimal C and B per cell) and the cost of one fixed (C, B)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dptune.analysis.configurations import best_configurations
from dptune.analysis.grid import accuracy_grid
from dptune.analysis.results import CELL, HARD, STRATA, Results
from dptune.analysis.strata import stratum_accuracy, with_strata


@dataclass(frozen=True)
class FixedSetting:
    """The single (C, B) used across all cells: the grid point with best mean validation accuracy.

    Only (C, B) bins evaluated (with a finished trial) in every cell are eligible; η (and any
    other option) stays best per cell on validation. ``mean_val_accuracy`` is over cells.
    """

    clip_bin: float
    batch_bin: float
    mean_val_accuracy: float
    cells: int


def fixed_setting(grid: pd.DataFrame) -> FixedSetting | None:
    """The ``FixedSetting`` of an ``accuracy_grid``; ``None`` when no (C, B) covers every cell.

    Ties in mean validation accuracy go to the smaller C, then the smaller B.
    """
    if grid.empty:
        return None
    cells = grid[CELL].drop_duplicates().shape[0]
    means = (
        grid.groupby(["clip_bin", "batch_bin"])
        .agg(cells=("val_accuracy", "size"), mean_val_accuracy=("val_accuracy", "mean"))
        .reset_index()
    )
    eligible = means[means["cells"] == cells]
    if eligible.empty:
        return None
    best = eligible.sort_values(["mean_val_accuracy", "clip_bin", "batch_bin"], ascending=[False, True, True]).iloc[0]
    return FixedSetting(
        clip_bin=float(best["clip_bin"]),
        batch_bin=float(best["batch_bin"]),
        mean_val_accuracy=float(best["mean_val_accuracy"]),
        cells=int(cells),
    )


def guideline_table(results: Results, strata: pd.DataFrame) -> tuple[pd.DataFrame, FixedSetting | None]:
    """Paper Table 1 from these results: per cell the best (C, B, η) and the cost of a fixed (C, B).

    Per cell (task, ε, E): the best tuned configuration on mean validation accuracy
    (``best_configurations``) — ``clip_bound``, ``batch_size``, ``learning_rate`` (η used),
    ``base_learning_rate`` (η₀), ``clipping``, ``optimizer``, ``replicates``, mean ``val_accuracy``
    and ``test_accuracy`` with ``test_low``/``test_high`` (its interval), ``within_noise`` of
    ``configurations`` with ``clip_low``/``clip_high`` and ``batch_low``/``batch_high`` (the
    intervals of the optimal C and B over that confidence set of the best), mean ``easy``/``hard``
    class accuracy — then the configuration at the ``FixedSetting`` (η best per cell):
    ``fixed_test_accuracy``, ``fixed_hard`` and the losses ``loss`` = best − fixed test accuracy,
    ``hard_loss`` = best − fixed hard-class accuracy (NaN without a fixed setting).
    With one replicate per configuration these are the best trials.
    """
    accuracy = stratum_accuracy(results, strata)
    best = best_configurations(with_strata(results.tuned, accuracy), CELL, means=STRATA)
    columns = [
        *CELL,
        "clip_bound",
        "batch_size",
        "learning_rate",
        "base_learning_rate",
        "clipping",
        "optimizer",
        "replicates",
        "val_accuracy",
        "test_accuracy",
        "test_low",
        "test_high",
        "within_noise",
        "configurations",
        "clip_low",
        "clip_high",
        "batch_low",
        "batch_high",
        *STRATA,
        "search_id",
        "trial_id",
    ]
    table = best[columns].copy()
    grid = accuracy_grid(results, accuracy)
    setting = fixed_setting(grid)
    if setting is None:
        for name in ("fixed_test_accuracy", "fixed_hard", "loss", "hard_loss"):
            table[name] = np.nan
        return table, None
    fixed = grid[(grid["clip_bin"] == setting.clip_bin) & (grid["batch_bin"] == setting.batch_bin)]
    fixed = fixed[[*CELL, "test_accuracy", HARD]]
    table = table.merge(
        fixed.rename(columns={"test_accuracy": "fixed_test_accuracy", HARD: "fixed_hard"}), on=CELL, how="left"
    )
    table["loss"] = table["test_accuracy"] - table["fixed_test_accuracy"]
    table["hard_loss"] = table[HARD] - table["fixed_hard"]
    return table, setting
