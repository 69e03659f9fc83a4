"""Section 7: clipping diagnostics: C* of Theorem 5.2 and the bias/variance split."""

from __future__ import annotations

from dptune import analysis as an
from dptune.report.document import Context, Section, budgets_of, format_percent, format_sig
from dptune.report.plotting import (
    empty_panel,
    figure_legend,
    interval_errors,
    label_panel,
    log_axis,
    new_figure,
    task_epoch_panels,
)


def clipping(ctx: Context) -> Section:
    section = Section(7, "Clipping diagnostics: C* of Theorem 5.2 and the bias/variance split")
    table = an.clipping_diagnostics(ctx.results)
    if table.empty:
        section.note(ctx.no_diagnostics("C* and the MSE split"))
        return section
    section.text(
        "C* minimises the per-step MSE of the clipped noisy gradient against the true one on the probe "
        "(Theorem 5.2, no sampling noise); it needs the true gradients, so it explains the optimal C "
        "rather than picking it privately. Lower MSE tightens the per-step progress bound (Theorem 5.4)."
    )
    best = an.best_configurations(ctx.results.tuned)
    figure, axes, panels = task_epoch_panels(ctx, table, share=True)
    for ax, task, n_epochs, part in panels:
        part = part.sort_values("epsilon")
        tuned = best[(best["task"] == task) & (best["epochs"] == n_epochs)].sort_values("epsilon")
        ax.fill_between(
            part["epsilon"],
            part["optimal_clip_low"],
            part["optimal_clip_high"],
            color="grey",
            alpha=0.3,
            label="C* range over the cell's trials",
        )
        ax.plot(
            part["epsilon"],
            part["optimal_clip_bound"],
            color="grey",
            marker="D",
            linestyle="--",
            label="C* of the best trial",
        )
        ax.errorbar(
            tuned["epsilon"],
            tuned["clip_bound"],
            yerr=interval_errors(tuned["clip_bound"], tuned["clip_low"], tuned["clip_high"]),
            color="black",
            marker="o",
            capsize=3,
            linestyle="none",
            label="optimal C (best configuration; bars: its confidence set)",
        )
        log_axis(ax, "x", table["epsilon"].unique())
        log_axis(
            ax,
            "y",
            data=[*table["optimal_clip_low"], *table["optimal_clip_high"], *best["clip_low"], *best["clip_high"]],
        )
        label_panel(
            ax, f"{task}\nE = {n_epochs}", "privacy budget ε (log scale)", "clip bound (gradient norm, log scale)"
        )
    figure_legend(figure, axes, 3)
    figure.suptitle("Clip bound C* of Theorem 5.2 against the optimal C", fontsize=10)
    ctx.writer.figure(section, figure, "fig7a-optimal-clip")
    points = an.mse_split(ctx.results)
    for task in [t for t in ctx.tasks if t in set(table["task"])]:
        part = points[points["task"] == task]
        epsilons, epoch_list = budgets_of(part, task)
        figure, axes = new_figure(len(epoch_list), len(epsilons), width=3.6, height=2.9, share=True)
        for row, n_epochs in enumerate(epoch_list):
            for column, epsilon in enumerate(epsilons):
                ax = axes[row, column]
                cell = part[(part["epochs"] == n_epochs) & (part["epsilon"] == epsilon)].sort_values("clip_bound")
                if not (cell[["mse_bias", "mse_variance"]].to_numpy() > 0).any():
                    empty_panel(ax, f"ε = {epsilon:g}, E = {n_epochs}")
                    continue
                for measure, marker, color, label in (
                    ("mse_bias", "v", "black", "clipping bias"),
                    ("mse_variance", "^", "grey", "noise variance"),
                    ("mse_total", "o", "none", "MSE = bias + variance"),
                ):
                    positive = cell[cell[measure] > 0]
                    ax.scatter(
                        positive["clip_bound"],
                        positive[measure],
                        marker=marker,
                        s=22,
                        facecolors=color,
                        edgecolors="black",
                        label=label,
                    )
                row_best = table[
                    (table["task"] == task) & (table["epochs"] == n_epochs) & (table["epsilon"] == epsilon)
                ]
                if len(row_best):
                    ax.axvline(
                        float(row_best["diagnosed_clip_bound"].iloc[0]),
                        color="black",
                        linestyle="-",
                        label="C of the diagnosed run",
                    )
                    ax.axvline(
                        float(row_best["optimal_clip_median"].iloc[0]), color="black", linestyle=":", label="median C*"
                    )
                log_axis(
                    ax,
                    "x",
                    None if ctx.results.clip_binned else part["clip_bound"].unique(),
                    [
                        *part["clip_bound"],
                        *table.loc[table["task"] == task, ["diagnosed_clip_bound", "optimal_clip_median"]]
                        .to_numpy()
                        .ravel(),
                    ],
                )
                log_axis(ax, "y", data=part[["mse_bias", "mse_variance", "mse_total"]].to_numpy().ravel())
                label_panel(
                    ax,
                    f"ε = {epsilon:g}, E = {n_epochs}",
                    "trial clip bound C (log scale)",
                    "per-step MSE (squared gradient norm)",
                )
        figure_legend(figure, axes, 3)
        figure.suptitle(f"{task}: MSE of the clipped noisy gradient, one point per trial", fontsize=10)
        ctx.writer.figure(section, figure, "fig7b-mse-split", task)
    section.table(
        table.drop(columns=["trial_id"]),
        {
            "epsilon": format_sig,
            "diagnosed_clip_bound": format_sig,
            "optimal_clip_bound": format_sig,
            "optimal_clip_low": format_sig,
            "optimal_clip_median": format_sig,
            "optimal_clip_high": format_sig,
            "mse_bias": format_sig,
            "mse_variance": format_sig,
            "bias_share": format_percent,
        },
        "C of the diagnosed run (per cell, the best on validation among the runs that recorded diagnostics: "
        "not the optimal C of section 2 where the best configuration recorded none) against C* (Theorem 5.2) at "
        "its last diagnostic epoch; its MSE split at its C (bias share in %).",
    )
    return section
