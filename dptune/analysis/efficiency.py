"""Search efficiency against a replicated full grid: how many trials a search needs to land near the best."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from dptune.analysis.configurations import rank_configurations
from dptune.analysis.results import CELL, NEAR_OPTIMAL, AnalysisError


def replicated_grid_cells(trials: pd.DataFrame, by: Sequence[str] = tuple(CELL)) -> pd.DataFrame:
    """The groups of ``by`` whose finished ``trials`` form a replicated full grid: every combination
    of their distinct C, B and η₀ is a configuration, and every configuration has R ≥ 2 replicates.

    Columns: ``by``, ``configurations`` and ``replicates`` (the smallest R of the cell).
    """
    by = list(by)
    ranked = rank_configurations(trials, by)
    rows = []
    for key, cell in ranked.groupby(by, sort=True):
        size = int(np.prod([cell[c].nunique() for c in ("clip_bound", "batch_size", "base_learning_rate")]))
        if len(cell) == size >= 2 and (cell["replicates"] >= 2).all():
            rows.append(
                {
                    **dict(zip(by, key if isinstance(key, tuple) else (key,), strict=True)),
                    "configurations": len(cell),
                    "replicates": int(cell["replicates"].min()),
                }
            )
    return pd.DataFrame(rows, columns=[*by, "configurations", "replicates"])


def search_efficiency(
    trials: pd.DataFrame,
    by: Sequence[str] = tuple(CELL),
    tolerance: float = NEAR_OPTIMAL,
    draw_orders: int = 1000,
    seed: int = 0,
) -> pd.DataFrame:
    """How many trials a random search needs to come within ``tolerance`` of a replicated full grid's best.

    Per cell of ``replicated_grid_cells``: the grid's best is its best configuration on mean
    validation accuracy (``rank_configurations``); the target is that configuration's mean test
    accuracy over its replicates. A random search of k trials draws k distinct configurations
    in a random order, sees one replicate of each (a random one: a single-seed run) and selects
    the best validation score seen; it *comes within* the tolerance when the selected
    configuration's mean test accuracy is ≥ target − ``tolerance`` (accuracy units). Over
    ``draw_orders`` bootstrap draw orders (``seed`` fixes them), one row per (cell, k = 1..K):
    ``within_share`` (the fraction of draw orders within the tolerance after k trials),
    ``target_test_accuracy``, ``configurations`` K and ``replicates``.
    """
    if tolerance < 0:
        raise AnalysisError(f"tolerance must be ≥ 0 (accuracy units), got {tolerance}")
    if draw_orders < 1:
        raise AnalysisError(f"draw_orders must be ≥ 1, got {draw_orders}")
    by = list(by)
    columns = [*by, "trials", "within_share", "target_test_accuracy", "configurations", "replicates"]
    cells = replicated_grid_cells(trials, by)
    rng = np.random.default_rng(seed)
    ranked = rank_configurations(trials, by)
    rows = []
    for cell in cells.itertuples(index=False):
        # a row of ``cells`` is (*by, configurations, replicates): zip keeps only its ``by`` values
        key = dict(zip(by, cell, strict=False))
        mine = ranked[(ranked[by] == pd.Series(key)).all(axis=1)].reset_index(drop=True)
        runs = trials[(trials[by] == pd.Series(key)).all(axis=1)]
        scores = runs.groupby("configuration_id")["val_accuracy"].apply(lambda s: s.to_numpy(dtype=float))
        replicate_scores = [scores[c] for c in mine["configuration_id"]]
        quality = mine["test_accuracy"].to_numpy(dtype=float)
        target = quality[0]  # rank 1: the grid's best on validation
        count = len(mine)
        order = np.argsort(rng.random((draw_orders, count)), axis=1)
        seen = np.column_stack([s[rng.integers(0, s.size, size=draw_orders)] for s in replicate_scores])
        seen = np.take_along_axis(seen, order, axis=1)
        best_seen = np.full(draw_orders, -np.inf)
        chosen = np.zeros(draw_orders, dtype=int)
        for k in range(count):
            better = seen[:, k] > best_seen  # ties keep the earlier draw
            best_seen = np.where(better, seen[:, k], best_seen)
            chosen = np.where(better, order[:, k], chosen)
            rows.append(
                {
                    **key,
                    "trials": k + 1,
                    "within_share": float(np.mean(quality[chosen] >= target - tolerance - 1e-12)),
                    "target_test_accuracy": target,
                    "configurations": count,
                    "replicates": cell.replicates,
                }
            )
    return pd.DataFrame(rows, columns=columns)


def trials_needed(efficiency: pd.DataFrame, share: float, by: Sequence[str] = tuple(CELL)) -> pd.DataFrame:
    """Per cell of ``search_efficiency``: the fewest trials k whose ``within_share`` reaches ``share``
    (``trials_needed``; NaN when even the whole grid, K trials of one replicate each, does not reach
    it: single-seed scores then mislead the selection too often)."""
    by = list(by)
    reached = efficiency[efficiency["within_share"] >= share - 1e-12]
    first = reached.groupby(by)["trials"].min().rename("trials_needed")
    cells = efficiency.groupby(by)[["configurations", "target_test_accuracy"]].first()
    return cells.join(first).reset_index()
