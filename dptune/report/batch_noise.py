"""Section 6 (paper Figs. 6–7): cumulative DP noise σ√T against B, and the min-step rule."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.lines import Line2D

from dptune import analysis as an
from dptune.analysis.grid import configuration_intervals
from dptune.report.document import Context, Section, budgets_of, format_percent, format_points, format_sig
from dptune.report.plotting import (
    MARKERS,
    dodged,
    empty_panel,
    interval_errors,
    log_axis,
    new_figure,
    series_colors,
)


def batch_noise(ctx: Context) -> Section:
    section = Section(6, "Cumulative DP noise σ√T against B, and the min-step rule")
    table = an.batch_size_noise(ctx.results)
    if table.empty:
        section.note("Missing: no trial recorded σ and T (no finished trials yet).")
        return section
    keys = [*an.CELL, "batch_size", "trial_id"]
    intervals = configuration_intervals(ctx.results.tuned, keys[:-1])[[*keys, "test_low", "test_high"]]
    table = table.merge(intervals, on=keys, how="left")
    bounds = an.min_steps(ctx.results)
    section.text(
        "σ√T is the cumulative DP noise (σ: noise multiplier the trial trained with, T: its steps); the "
        "rule picks the smallest B on the plateau of σ√T subject to T ≥ T_min (dptune.plan). σ/B is the "
        "old per-step rule's noise std of the mean gradient (in units of C), which keeps falling to full "
        "batch under fixed epochs."
    )
    for task in ctx.tasks:
        part = table[table["task"] == task]
        if part.empty:
            continue
        if task not in bounds:
            section.note(f"{task}: the search spec states no min_steps; the min-step bound is not drawn.")
        epsilons, epochs = budgets_of(part, task)
        colors = dict(zip(epsilons, series_colors(len(epsilons)), strict=True))
        figure, axes = new_figure(2, len(epochs), width=4.2, height=3.0)
        for column, n_epochs in enumerate(epochs):
            top, bottom = axes[0, column], axes[1, column]
            if column:  # the columns compare one quantity across E: one range per row
                top.sharey(axes[0, 0])
                bottom.sharey(axes[1, 0])
            per_step = top.twinx()
            both = part[part["epochs"] == n_epochs]
            if not np.isfinite(both["cumulative_noise"]).any():  # every B of this E was pruned
                per_step.set_axis_off()
                empty_panel(top, f"E = {n_epochs}: no trial ran")
                empty_panel(bottom, f"E = {n_epochs}")
                continue
            for k, epsilon in enumerate(epsilons):
                line = both[both["epsilon"] == epsilon].sort_values("batch_size")
                if line.empty:  # this (ε, E) is not in the results
                    continue
                noisy = line[np.isfinite(line["cumulative_noise"])]
                marker = MARKERS[k % len(MARKERS)]
                top.plot(noisy["batch_size"], noisy["cumulative_noise"], color=colors[epsilon], marker=marker)
                per_step.plot(
                    noisy["batch_size"], noisy["per_step_noise"], color=colors[epsilon], linestyle=":", linewidth=1.2
                )
                measured = line[np.isfinite(line["test_accuracy"])]
                accuracy = 100 * measured["test_accuracy"]
                bottom.errorbar(
                    dodged(measured["batch_size"], k, len(epsilons), step=0.03),
                    accuracy,
                    yerr=interval_errors(accuracy, 100 * measured["test_low"], 100 * measured["test_high"]),
                    color=colors[epsilon],
                    marker=marker,
                    capsize=2,
                    elinewidth=0.8,
                )
                recommended = noisy[noisy["batch_size"] == line["recommended_batch_size"].iloc[0]]
                top.plot(
                    recommended["batch_size"],
                    recommended["cumulative_noise"],
                    marker="v",
                    markersize=11,
                    color=colors[epsilon],
                    markeredgecolor="black",
                    linestyle="none",
                )
                best = line[line["measured_best"]]
                bottom.plot(
                    dodged(best["batch_size"], k, len(epsilons), step=0.03),
                    100 * best["test_accuracy"],
                    marker="*",
                    markersize=14,
                    color=colors[epsilon],
                    markeredgecolor="black",
                    linestyle="none",
                )
            feasible = both.loc[both["steps"] >= bounds.get(task, 0), "batch_size"]
            infeasible = both.loc[both["steps"] < bounds.get(task, 0), "batch_size"]
            if len(feasible) and len(infeasible) and infeasible.min() > feasible.max():
                edge = math.sqrt(float(feasible.max()) * float(infeasible.min()))
                for ax in (top, bottom):
                    ax.axvspan(edge, float(both["batch_size"].max()) * 1.5, color="grey", alpha=0.25, hatch="..")
            for ax in (top, bottom):
                log_axis(ax, "x", both["batch_size"].unique())
                ax.set_xlabel("batch size B (examples, log scale)")
                ax.grid(True, alpha=0.3)
            log_axis(per_step, "y", data=both["per_step_noise"])
            per_step.set_ylabel("per-step noise σ/B (dotted, log)", fontsize=8)
            top.set_ylabel("cumulative noise σ√T")
            bottom.set_ylabel(
                f"test accuracy (%) at B\n(C, η chosen on validation;\nbars: {100 * an.CONFIDENCE:g} % intervals)"
            )
            top.set_title(
                f"E = {n_epochs}" + (f" (T_min = {bounds[task]}; shaded: T < T_min)" if task in bounds else ""),
                fontsize=8,
            )
        handles = [
            Line2D([], [], color=colors[e], marker=MARKERS[k % len(MARKERS)], label=f"ε = {e:g}")
            for k, e in enumerate(epsilons)
        ]
        handles += [
            Line2D([], [], color="black", linestyle=":", label="σ/B, old per-step rule (right axis)"),
            Line2D(
                [], [], color="white", marker="v", markeredgecolor="black", markersize=10, label="rule's recommended B"
            ),
            Line2D(
                [],
                [],
                color="white",
                marker="*",
                markeredgecolor="black",
                markersize=12,
                label="measured best B (on validation)",
            ),
        ]
        figure.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8)
        figure.suptitle(f"{task}: cumulative DP noise and measured accuracy against B", fontsize=10)
        ctx.writer.figure(section, figure, "fig6-cumulative-noise", task)
    summary = an.batch_size_rule_check(table)
    section.table(
        summary,
        {
            "epsilon": format_sig,
            "recommended_accuracy": format_percent,
            "best_accuracy": format_percent,
            "accuracy_gap": format_points,
        },
        "Does the rule's recommended B match the measured best B (selected on validation)? Accuracies "
        "are test accuracies (%) of the best trial at that B; gap in points.",
    )
    return section
