"""Section 3 (paper Fig. 3): per-example gradient-norm distributions of easy and hard classes."""

from __future__ import annotations

import pandas as pd
from matplotlib.patches import Patch

from dptune import analysis as an
from dptune.report.document import Context, Section, format_int, format_sig
from dptune.report.plotting import label_panel, log_axis, task_epoch_panels


def grad_norms(ctx: Context) -> Section:
    section = Section(3, "Per-example gradient-norm distributions")
    samples = an.grad_norm_samples(ctx.results, ctx.strata if not ctx.strata.empty else None)
    if samples.empty:
        section.note(ctx.no_diagnostics("per-example gradient norms"))
        return section
    if "stratum" not in samples:
        samples["stratum"] = "all"
    samples["stratum"] = samples["stratum"].fillna("all")
    figure, _, panels = task_epoch_panels(ctx, samples, width=4.2, height=3.2, share=True)
    strata = [s for s in (*an.STRATA, "all") if s in set(samples["stratum"])]
    width = 0.8 / len(strata)
    epsilons = sorted(samples["epsilon"].unique())  # one x position per ε in every panel
    for ax, task, n_epochs, part in panels:
        for s, stratum in enumerate(strata):
            data = [
                part[(part["epsilon"] == e) & (part["stratum"] == stratum)]["grad_norm"].to_numpy() for e in epsilons
            ]
            positions = [i + (s - (len(strata) - 1) / 2) * width for i in range(len(epsilons))]
            keep = [k for k, d in enumerate(data) if len(d)]
            if not keep:
                continue
            boxes = ax.boxplot(
                [data[k] for k in keep],
                positions=[positions[k] for k in keep],
                widths=width * 0.9,
                patch_artist=True,
                showfliers=False,
            )
            for patch in boxes["boxes"]:
                patch.set_facecolor("white" if stratum == an.EASY else "lightgrey")
                patch.set_hatch("" if stratum == an.EASY else "//")
            for median in boxes["medians"]:
                median.set_color("black")
        ax.set_xticks(range(len(epsilons)), [f"{e:g}" for e in epsilons])
        log_axis(ax, "y", data=samples["grad_norm"])
        label_panel(
            ax, f"{task}\nE = {n_epochs}", "privacy budget ε", "per-example gradient norm ‖g_i‖ (log)", grid_axis="y"
        )
    handles = [
        Patch(
            facecolor="white" if s == an.EASY else "lightgrey",
            hatch="" if s == an.EASY else "//",
            edgecolor="black",
            label=f"{s} classes",
        )
        for s in strata
    ]
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    figure.suptitle("Probe gradient norms of each cell's best diagnosed trial (last diagnostic epoch)", fontsize=10)
    ctx.writer.figure(section, figure, "fig3-grad-norms")
    section.text(_right_shift(samples))
    summary = (
        samples.groupby([*an.CELL, "stratum", "diagnostic_epoch"])["grad_norm"]
        .describe(percentiles=[0.25, 0.5, 0.75])[["count", "25%", "50%", "75%"]]
        .reset_index()
    )
    summary = summary.rename(
        columns={"count": "probe examples", "25%": "q25 ‖g‖", "50%": "median ‖g‖", "75%": "q75 ‖g‖"}
    )
    section.table(
        summary,
        {
            "epsilon": format_sig,
            "probe examples": format_int,
            "q25 ‖g‖": format_sig,
            "median ‖g‖": format_sig,
            "q75 ‖g‖": format_sig,
        },
        "Quartiles of the probe gradient norms per cell and stratum.",
    )
    return section


def _right_shift(samples: pd.DataFrame) -> str:
    """What the probes show of the paper's right shift, by medians (one probe per cell: no interval, no test)."""
    medians = samples.groupby([*an.CELL, "stratum"])["grad_norm"].median().unstack("stratum")
    parts = []
    if set(an.STRATA) <= set(medians.columns):
        paired = medians.dropna(subset=list(an.STRATA))
        larger = int((paired[an.HARD] > paired[an.EASY]).sum())
        parts.append(f"the hard classes' median ‖g_i‖ is above the easy classes' in {larger} of {len(paired)} cells")
    overall = samples.groupby(an.CELL)["grad_norm"].median().reset_index()
    compared = tighter = 0
    for _, group in overall.groupby(["task", "epochs"]):
        if group["epsilon"].nunique() >= 2:
            ordered = group.sort_values("epsilon")
            compared += 1
            tighter += int(ordered["grad_norm"].iloc[0] > ordered["grad_norm"].iloc[-1])
    if compared:
        parts.append(f"the median at the smallest ε is above the largest ε's in {tighter} of {compared} (task, E)")
    observed = "; ".join(parts) if parts else "no two strata or privacy budgets to compare"
    return (
        "The paper reports that tighter privacy and harder classes shift the distribution up (its right shift). "
        f"Here: {observed}. These are medians of one diagnosed run's probe per cell: no interval, no test, so a "
        "difference here is not established."
    )
