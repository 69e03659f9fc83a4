"""Trends: which way the optimal C and B move as a problem gets harder, and the paper's findings checked."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd


def _direction(harder: float, easier: float, rel_tol: float = 1e-9) -> str:
    if math.isclose(harder, easier, rel_tol=rel_tol):
        return "same"
    return "larger" if harder > easier else "smaller"


def trends(guideline: pd.DataFrame, difficulty: pd.DataFrame) -> pd.DataFrame:
    """The shape of paper Table 1: how the best C and B move when the problem gets harder.

    Conditions (each compared within otherwise equal cells): ``tighter privacy`` (smallest ε
    against largest ε, per task and E), ``fewer epochs`` (smallest E against largest E, per task
    and ε), ``harder task`` (hardest against easiest task of ``difficulty``, per ε and E).
    One row per condition present with the counts of comparisons where the best C (and B) was
    larger, smaller or the same, how many of those moves are established (the intervals of the
    optimum over the two cells' confidence sets, ``clip_low``/``clip_high`` and
    ``batch_low``/``batch_high`` of ``guideline_table``, do not overlap), and the comparisons spelt
    out with those intervals.
    """
    comparisons: list[tuple[str, str, pd.Series, pd.Series]] = []
    for condition, factor, within in (
        ("tighter privacy (smallest vs largest ε)", "epsilon", ["task", "epochs"]),
        ("fewer epochs (smallest vs largest E)", "epochs", ["task", "epsilon"]),
    ):
        for key, group in guideline.groupby(within):
            if group[factor].nunique() < 2:
                continue
            ordered = group.sort_values(factor)
            label = ", ".join(
                f"{_SETTING[name]} = {value:g}" if name in _SETTING else f"{value}"
                for name, value in zip(within, key, strict=True)
            )
            comparisons.append((condition, label, ordered.iloc[0], ordered.iloc[-1]))
    ranked = list(difficulty["task"]) if len(difficulty) else []
    if len(ranked) >= 2:
        for key, group in guideline.groupby(["epsilon", "epochs"]):
            present = group.set_index("task")
            tasks = [t for t in ranked if t in present.index]
            if len(tasks) >= 2:
                comparisons.append(
                    (
                        "harder task (hardest vs easiest)",
                        f"ε={key[0]:g}, E={key[1]}",
                        present.loc[tasks[-1]],
                        present.loc[tasks[0]],
                    )
                )
    rows = []
    for condition in dict.fromkeys(c[0] for c in comparisons):
        items = [c for c in comparisons if c[0] == condition]
        row: dict[str, object] = {"condition": condition, "comparisons": len(items)}
        for column, name in (("clip_bound", "C"), ("batch_size", "B")):
            moves = [_direction(float(harder[column]), float(easier[column])) for _, _, harder, easier in items]
            row[f"best {name}"] = ", ".join(
                f"{moves.count(m)}× {m}" for m in ("larger", "smaller", "same") if moves.count(m)
            )
            low, high = _BOUNDS[name]
            settled = sum(harder[high] < easier[low] or easier[high] < harder[low] for _, _, harder, easier in items)
            row[f"{name} established"] = f"{settled} of {len(items)}"
        row["details"] = "; ".join(
            f"{label}: C {_span(easier, 'clip_bound', 'clip_low', 'clip_high')}→"
            f"{_span(harder, 'clip_bound', 'clip_low', 'clip_high')}, "
            f"B {_span(easier, 'batch_size', 'batch_low', 'batch_high')}→"
            f"{_span(harder, 'batch_size', 'batch_low', 'batch_high')}"
            for _, label, harder, easier in items
        )
        rows.append(row)
    return pd.DataFrame(
        rows,
        columns=["condition", "comparisons", "best C", "C established", "best B", "B established", "details"],
    )


_BOUNDS = {"C": ("clip_low", "clip_high"), "B": ("batch_low", "batch_high")}


def _span(row: pd.Series, value: str, low: str, high: str) -> str:
    """``value [low–high]`` of one cell's optimum (C: 3 significant digits; B: a whole number)."""
    shown = "{:.0f}" if value == "batch_size" else "{:.3g}"
    return f"{shown.format(row[value])} [{shown.format(row[low])}–{shown.format(row[high])}]"


@dataclass(frozen=True)
class PaperTrend:
    """A direction the paper reports for the optimal C and B when one factor makes the problem harder."""

    condition: str  # e.g. "tighter privacy"
    factor: str  # the column that varies: its smallest value is the harder problem
    within: tuple[str, ...]  # the columns held equal
    moves: dict[str, str]  # quantity ("C" or "B") → "larger" or "smaller" on the harder side


#: The paper's findings (Rehn et al., ICLR 2026; see BRIEF.md): tighter privacy → larger C and
#: smaller B; fewer epochs → avoid large B.
PAPER_TRENDS: tuple[PaperTrend, ...] = (
    PaperTrend("tighter privacy", "epsilon", ("task", "epochs"), {"C": "larger", "B": "smaller"}),
    PaperTrend("fewer epochs", "epochs", ("task", "epsilon"), {"B": "smaller"}),
)
_SETTING = {"epsilon": "ε", "epochs": "E"}
_QUANTITIES = {"C": "clip_bound", "B": "batch_size"}
#: The replicate counts tried when asking how many would separate two optima (``replicates_to_separate``).
REPLICATE_STEPS: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def optimum_interval(cell: pd.DataFrame, column: str, replicates: int | None = None) -> tuple[float, float, float]:
    """(best, low, high) of ``column`` over one cell's confidence set of the best configuration.

    ``cell`` is one group of ``rank_configurations`` (all its configurations). With ``replicates``
    R′, the set the same mean scores would give if every configuration had R′ replicates: each
    standard error scaled by √(R_k/R′), Gupta's constant kept (a what-if of the observed gaps taken
    as real, not a prediction).
    """
    if replicates is None:
        within = cell["within_noise"].to_numpy(dtype=bool)
    else:
        se = cell["noise_se"].to_numpy(dtype=float) * np.sqrt(cell["replicates"].to_numpy(dtype=float) / replicates)
        best = int(np.argmin(cell["rank"].to_numpy()))
        threshold = cell["set_constant"].to_numpy(dtype=float) * np.sqrt(se[best] ** 2 + se**2)
        within = cell["gap"].to_numpy(dtype=float) <= threshold + 1e-12
    values = cell[column].to_numpy(dtype=float)
    best_value = float(values[int(np.argmin(cell["rank"].to_numpy()))])
    return best_value, float(values[within].min()), float(values[within].max())


def _disjoint(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    return a[2] < b[1] or b[2] < a[1]


def replicates_to_separate(harder: pd.DataFrame, easier: pd.DataFrame, column: str) -> int | None:
    """The fewest replicates per configuration (of ``REPLICATE_STEPS``, above those run) at which the
    two cells' intervals of the optimal ``column`` would no longer overlap, if the observed mean
    scores were the true ones; ``None`` when no count up to 1,024 separates them (their best
    configurations share the value, or the gaps are too small to matter)."""
    ran = int(max(harder["replicates"].max(), easier["replicates"].max()))
    for count in REPLICATE_STEPS:
        if count > ran and _disjoint(optimum_interval(harder, column, count), optimum_interval(easier, column, count)):
            return count
    return None


def paper_trend_checks(ranked: pd.DataFrame) -> pd.DataFrame:
    """Do the optimal C and B move the way the paper says, and is the move established by these runs?

    ``ranked`` is ``rank_configurations`` over cells (task, ε, E). For each ``PAPER_TRENDS``
    condition and each group of its ``within`` columns with two or more values of its factor: the
    smallest value (``harder``, e.g. ε = 1) against the largest (``easier``). The interval of each
    optimum is the range of the value over its cell's confidence set of the best configuration
    (``optimum_interval``). ``observed`` is the point estimates' direction on the harder side
    (larger/smaller/same). ``verdict``: ``agrees`` or ``disagrees`` with ``paper`` when the two
    intervals are disjoint (the move is established); ``no change`` when both intervals are the one
    same value (each cell's set holds that value alone: no move, at the resolution of the values
    searched); else ``not established`` (the intervals overlap), with ``replicates_needed``
    (``replicates_to_separate``; NaN where no count up to 1,024 would do). ``group`` names the equal
    columns, e.g. ``E = 10``; ``harder_epsilon``/``harder_epochs`` and ``easier_epsilon``/``easier_epochs``
    are the two cells' ε and E (the points a figure joins).
    """
    columns = [
        "condition",
        "task",
        "group",
        "quantity",
        "harder",
        "easier",
        "harder_epsilon",
        "harder_epochs",
        "easier_epsilon",
        "easier_epochs",
        "harder_value",
        "harder_low",
        "harder_high",
        "easier_value",
        "easier_low",
        "easier_high",
        "harder_set",
        "easier_set",
        "paper",
        "observed",
        "verdict",
        "replicates_needed",
    ]
    rows = []
    cells = {key: cell for key, cell in ranked.groupby(["task", "epsilon", "epochs"], sort=True)}
    summary = pd.DataFrame(
        [{"task": t, "epsilon": e, "epochs": n} for t, e, n in cells], columns=["task", "epsilon", "epochs"]
    )
    for trend in PAPER_TRENDS:
        for key, group in summary.groupby(list(trend.within), sort=True):
            if group[trend.factor].nunique() < 2:
                continue
            ordered = group.sort_values(trend.factor)
            harder, easier = ordered.iloc[0], ordered.iloc[-1]
            hard_cell = cells[(harder["task"], harder["epsilon"], harder["epochs"])]
            easy_cell = cells[(easier["task"], easier["epsilon"], easier["epochs"])]
            held = ", ".join(
                f"{_SETTING[name]} = {value:g}" for name, value in zip(trend.within, key, strict=True) if name != "task"
            )
            for quantity, paper in trend.moves.items():
                column = _QUANTITIES[quantity]
                hard, easy = optimum_interval(hard_cell, column), optimum_interval(easy_cell, column)
                observed = _direction(hard[0], easy[0])
                if _disjoint(hard, easy):
                    verdict, needed = ("agrees" if observed == paper else "disagrees"), math.nan
                elif len({*hard, *easy}) == 1:
                    verdict, needed = "no change", math.nan
                else:
                    count = replicates_to_separate(hard_cell, easy_cell, column)
                    verdict, needed = "not established", math.nan if count is None else float(count)
                rows.append(
                    {
                        "condition": trend.condition,
                        "task": harder["task"],
                        "group": held,
                        "quantity": quantity,
                        "harder": f"{_SETTING[trend.factor]} = {harder[trend.factor]:g}",
                        "easier": f"{_SETTING[trend.factor]} = {easier[trend.factor]:g}",
                        "harder_epsilon": harder["epsilon"],
                        "harder_epochs": harder["epochs"],
                        "easier_epsilon": easier["epsilon"],
                        "easier_epochs": easier["epochs"],
                        "harder_value": hard[0],
                        "harder_low": hard[1],
                        "harder_high": hard[2],
                        "easier_value": easy[0],
                        "easier_low": easy[1],
                        "easier_high": easy[2],
                        "harder_set": f"{int(hard_cell['within_noise'].sum())} of {len(hard_cell)}",
                        "easier_set": f"{int(easy_cell['within_noise'].sum())} of {len(easy_cell)}",
                        "paper": paper,
                        "observed": observed,
                        "verdict": verdict,
                        "replicates_needed": needed,
                    }
                )
    return pd.DataFrame(rows, columns=columns)
