"""Section 8: guidelines from these results (the shape of the paper's Table 1)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dptune import analysis as an
from dptune.report.document import Context, Section, format_level, format_percent, format_points, format_sig


def guidelines(ctx: Context) -> Section:
    section = Section(8, "Guidelines from these results (the shape of the paper's Table 1)")
    table, setting = an.guideline_table(ctx.results, ctx.strata)
    if table.empty:
        section.note("Missing: no finished trial with a tuned clip bound.")
        return section
    binned = ctx.results.clip_binned
    if setting is not None and setting.cells == 1:
        section.note(
            "The results hold a single cell: a fixed (C, B) is the tuned one there, so its cost across "
            "cells cannot be measured (it needs two or more (ε, E) cells or tasks)."
        )
    elif setting is None:
        section.note(
            "No single (C, B) was evaluated in every cell, so the cost of one fixed setting cannot be "
            "measured (it needs a grid over (C, B), or more trials per cell)."
        )
    else:
        hard = table["hard_loss"].mean()
        section.text(
            f"Fixed setting: C {format_level(setting.clip_bin, binned)}, "
            f"B {format_level(setting.batch_bin, ctx.results.batch_binned)} "
            f"— among the (C, B) evaluated in all {setting.cells} cells, the one with the best mean validation "
            f"accuracy ({format_percent(setting.mean_val_accuracy)} %), with η chosen per cell on validation. "
            f"Using it everywhere instead of tuning per cell loses {format_points(table['loss'].mean())} points of "
            "test accuracy "
            f"on average (largest loss {format_points(table['loss'].max())}), and "
            + (
                f"{format_points(hard)} points on the hard classes."
                if np.isfinite(hard)
                else "an unknown amount on the hard classes (no strata)."
            )
        )
    shown = table.assign(
        test_interval=[
            f"[{format_percent(low)}, {format_percent(high)}]"
            for low, high in zip(table["test_low"], table["test_high"], strict=True)
        ],
        noise_set=[f"{k} of {n}" for k, n in zip(table["within_noise"], table["configurations"], strict=True)],
        optimal_c=[
            f"{format_sig(v)} [{format_sig(lo)}, {format_sig(hi)}]"
            for v, lo, hi in zip(table["clip_bound"], table["clip_low"], table["clip_high"], strict=True)
        ],
        optimal_b=[
            f"{v:.0f} [{lo:.0f}, {hi:.0f}]"
            for v, lo, hi in zip(table["batch_size"], table["batch_low"], table["batch_high"], strict=True)
        ],
        established=[_established(row) for _, row in table.iterrows()],
    )
    columns = [
        *an.CELL,
        "optimal_c",
        "optimal_b",
        "established",
        "learning_rate",
        "base_learning_rate",
        "clipping",
        "replicates",
        "val_accuracy",
        "test_accuracy",
        "test_interval",
        "noise_set",
        an.EASY,
        an.HARD,
        "fixed_test_accuracy",
        "loss",
        "hard_loss",
    ]
    percent = ["val_accuracy", "test_accuracy", an.EASY, an.HARD, "fixed_test_accuracy"]
    formats = {
        "epsilon": format_sig,
        "learning_rate": format_sig,
        "base_learning_rate": format_sig,
        **{c: format_percent for c in percent},
        "loss": format_points,
        "hard_loss": format_points,
    }
    section.table(
        shown[columns],
        formats,
        "Per cell: the best (C, B, η) selected on mean validation accuracy over its R replicates, with the "
        "intervals of the optimal C and B over the configurations within noise of it (section 2 says how the set "
        "is made) and whether the optimum is established (one configuration alone within noise) or not; its mean "
        f"test accuracy with its {100 * an.CONFIDENCE:g} % interval, and the loss of the fixed (C, B).",
    )
    trend = an.trends(table, an.task_difficulty(ctx.results))
    if trend.empty:
        section.note("No condition varies within the results (one ε, one E, one task): no trend to state.")
    else:
        section.table(
            trend,
            caption="How the best C and B move as the problem gets harder: counts over comparisons of "
            "otherwise equal cells of the point estimates' moves, and how many of them are established (the "
            "intervals of the two optima do not overlap); details: easier → harder, optimum [interval]. A move "
            "that is not established is not a finding of these runs (section 2 says what would settle it).",
        )
    return section


def _established(row: pd.Series) -> str:
    """Whether one cell's optimum is pinned down by its runs, in words."""
    if int(row["within_noise"]) == 1:
        return f"yes: the only one of {int(row['configurations'])} within noise"
    return (
        f"no: {int(row['within_noise'])} of {int(row['configurations'])} within noise "
        f"(C {format_sig(row['clip_low'])}–{format_sig(row['clip_high'])}, "
        f"B {row['batch_low']:.0f}–{row['batch_high']:.0f})"
    )
