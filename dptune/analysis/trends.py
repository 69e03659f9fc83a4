"""Trends: which way the optimal C and B move as a problem gets harder, and the paper's findings checked."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    larger, smaller or the same, and the comparisons spelt out.
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
                f"{name}={value:g}" if isinstance(value, float) else f"{value}"
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
        row["details"] = "; ".join(
            f"{label}: C {easier['clip_bound']:.3g}→{harder['clip_bound']:.3g}, "
            f"B {int(easier['batch_size'])}→{int(harder['batch_size'])}"
            for _, label, harder, easier in items
        )
        rows.append(row)
    return pd.DataFrame(rows, columns=["condition", "comparisons", "best C", "best B", "details"])


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
_QUANTITIES = {"C": ("clip_bound", "clip"), "B": ("batch_size", "batch")}


def paper_trend_checks(intervals: pd.DataFrame) -> pd.DataFrame:
    """Does the optimal C and B of ``optimal_setting_intervals`` move the way the paper says, beyond the noise?

    For each ``PAPER_TRENDS`` condition and each group of its ``within`` columns with two or more
    values of its factor: the smallest value (``harder``, e.g. ε = 1) against the largest
    (``easier``). ``observed`` is the point estimates' direction on the harder side
    (larger/smaller/same); ``verdict``: ``agrees`` or ``disagrees`` with ``paper`` when the two
    bootstrap intervals are disjoint; ``no change`` when both intervals are the one same value
    (every round selected it on both sides: the data says it does not move, against the paper, at
    the resolution of the values searched); else ``inconclusive`` (the intervals overlap: the
    data cannot order them). ``group`` names the equal columns, e.g. ``E = 10``.
    """
    columns = [
        "condition",
        "task",
        "group",
        "quantity",
        "harder",
        "easier",
        "harder_value",
        "harder_low",
        "harder_high",
        "easier_value",
        "easier_low",
        "easier_high",
        "paper",
        "observed",
        "verdict",
    ]
    rows = []
    for trend in PAPER_TRENDS:
        for key, group in intervals.groupby(list(trend.within), sort=True):
            if group[trend.factor].nunique() < 2:
                continue
            ordered = group.sort_values(trend.factor)
            harder, easier = ordered.iloc[0], ordered.iloc[-1]
            held = ", ".join(
                f"{_SETTING[name]} = {value:g}" for name, value in zip(trend.within, key, strict=True) if name != "task"
            )
            for quantity, paper in trend.moves.items():
                value, prefix = _QUANTITIES[quantity]
                ends = [
                    harder[f"{prefix}_low"],
                    harder[f"{prefix}_high"],
                    easier[f"{prefix}_low"],
                    easier[f"{prefix}_high"],
                ]
                overlap = ends[0] <= ends[3] and ends[2] <= ends[1]
                observed = _direction(float(harder[value]), float(easier[value]))
                verdict = (
                    "no change"
                    if len(set(ends)) == 1
                    else "inconclusive"
                    if overlap
                    else "agrees"
                    if observed == paper
                    else "disagrees"
                )
                rows.append(
                    {
                        "condition": trend.condition,
                        "task": harder["task"],
                        "group": held,
                        "quantity": quantity,
                        "harder": f"{_SETTING[trend.factor]} = {harder[trend.factor]:g}",
                        "easier": f"{_SETTING[trend.factor]} = {easier[trend.factor]:g}",
                        "harder_value": harder[value],
                        "harder_low": ends[0],
                        "harder_high": ends[1],
                        "easier_value": easier[value],
                        "easier_low": ends[2],
                        "easier_high": ends[3],
                        "paper": paper,
                        "observed": observed,
                        "verdict": verdict,
                    }
                )
    return pd.DataFrame(rows, columns=columns)
