"""Section 3 (paper Fig. 3): per-example gradient-norm distributions of easy and hard classes."""

from __future__ import annotations

from matplotlib.patches import Patch

from dptune import analysis as an
from dptune.report.document import Context, Section, format_int, format_sig
from dptune.report.plotting import label_panel, log_axis, task_epoch_panels


def grad_norms(ctx: Context) -> Section:
    section = Section(3, "Per-example gradient-norm distributions")
    samples = an.grad_norm_samples(ctx.results, ctx.strata if not ctx.strata.empty else None)
    if samples.empty:
        section.note("Missing: no diagnostics recorded (per-example gradient norms need diagnostics: true).")
        return section
    if "stratum" not in samples:
        samples["stratum"] = "all"
    samples["stratum"] = samples["stratum"].fillna("all")
    figure, _, panels = task_epoch_panels(ctx, samples, width=4.2, height=3.2)
    strata = [s for s in (*an.STRATA, "all") if s in set(samples["stratum"])]
    width = 0.8 / len(strata)
    for ax, task, n_epochs, part in panels:
        epsilons = sorted(part["epsilon"].unique())
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
        log_axis(ax, "y", data=part["grad_norm"])
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
