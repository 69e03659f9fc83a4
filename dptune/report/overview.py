"""Section 0: the decision (``decision.decide``), then the overview: what the results hold and miss,
what their (ε, δ) covers, and the releases."""

from __future__ import annotations

import pandas as pd

from dptune import analysis as an
from dptune.records import release_label
from dptune.report.decision import decide
from dptune.report.document import Context, Section, format_percent, format_sig


def overview(ctx: Context) -> Section:
    section = Section(0, "Decision and overview: what to release, what the results hold")
    results = ctx.results
    decide(section, results)
    section.text(
        f"Sources: {', '.join(results.sources)}. {len(results.trials)} trial records, "
        f"{len(results.finished)} finished (status ok), {len(results.tuned)} with tuned C, "
        f"{len(results.auto_s)} AUTO-S. Selection is on validation accuracy; reported accuracies "
        "are test accuracies of the selected trials, in %."
    )
    for note in an.missing_data(results):
        section.note(f"Missing: {note}.")
    for text in an.privacy_statements(results):
        section.text(f"Privacy: {text}")
    if not results.release.empty:
        columns = {
            "search_id": "search",
            "release": "release",
            "clip_bound": "C",
            "batch_size": "B",
            "base_learning_rate": "η₀",
            "learning_rate": "η",
            "noisy_val_accuracy": "noisy val acc (max, %)",
            "test_accuracy": "test acc (%)",
            "tuning_fraction": "tuned on (q₁)",
            "transfer": "transfer",
            "epsilon_total": "ε total",
            "delta_total": "δ",
        }
        section.table(
            results.release.assign(release=[release_label(row) for _, row in results.release.iterrows()])
            .reindex(columns=list(columns))
            .rename(columns=columns),
            {
                "noisy val acc (max, %)": format_percent,
                "test acc (%)": format_percent,
                "tuned on (q₁)": _tuned_on,
                "ε total": format_sig,
                "δ": format_sig,
            },
            "Releases of end-to-end private searches: the selected configuration, its noisy validation "
            "score (the maximum of the runs' noisy scores: biased upward, not an accuracy estimate) and "
            "its test accuracy where the test split is public (else withheld). Where a q₁ is shown, the "
            "runs tuned on a secret subsample of that share of the training and validation rows and the "
            "chosen configuration, transferred by the rule named, trained the released model once on every "
            "training row (Koskela & Kulkarni 2023); how well each rule transfers is measured in "
            "bench/RESULTS.md. "
            + (
                "Their runs in this report are from inside the data owner's trust boundary: not for release."
                if set(results.release["search_id"]) & set(results.trials["search_id"])
                else "Their runs are not in this report: the per-run records stay inside the data owner's trust "
                "boundary."
            ),
        )
    if not results.models.empty:
        models = results.models.assign(
            test_accuracy=[
                _with_interval(a, i)
                for a, i in zip(results.models["test_accuracy"], results.models["test_interval"], strict=True)
            ]
        )
        columns = {
            "folder": "model folder",
            "cell_id": "cell",
            "clipping": "clipping",
            "clip_bound": "C",
            "batch_size": "B",
            "learning_rate": "η",
            "val_accuracy": "val acc (%)",
            "test_accuracy": "test acc (%, 95 % interval)",
            "epsilon": "ε",
            "delta": "δ",
            "covers": "what (ε, δ) covers",
        }
        section.table(
            models.reindex(columns=list(columns)).rename(columns=columns),
            {"val acc (%)": format_percent, "ε": format_sig, "δ": format_sig, "C": format_sig, "η": format_sig},
            "Models handed back: each folder holds model.safetensors and its card (model_card.md, "
            "model_card.json); label new rows with python -m dptune.predict --model FOLDER. A private "
            "search's model shows no validation accuracy (only its noisy score is released) and a test "
            "accuracy only where the test split is public.",
        )
    if not results.trials.empty:
        coverage = an.coverage(results)
        section.table(
            coverage.drop(columns=["search_id"]),
            {"epsilon": format_sig},
            "Trials per search cell: planned (scheduled; configurations pruned by the min-step rule are "
            "recorded besides them), recorded by status, remaining.",
        )
    difficulty = an.task_difficulty(results)
    if len(difficulty):
        section.table(
            difficulty,
            {"mean_best_val_accuracy": format_percent, "median_grad_norm": format_sig},
            "Tasks ranked by difficulty (1 = easiest): mean best validation accuracy (%) over shared "
            "(ε, E) cells; median probe gradient norm of the best diagnosed trials.",
        )
    if ctx.strata.empty:
        section.note(
            "Missing: classes cannot be split into easy and hard (no per-class accuracies); "
            "per-stratum views are left out."
        )
    else:
        rule = (
            "the classes given with --hard-classes"
            if ctx.options.hard_classes
            else f"the ⌈{ctx.options.hard_fraction:g}·K⌉ classes with the lowest validation accuracy in the reference "
            "trial (the best validation trial at the task's largest ε)"
        )
        section.text(
            f"Difficulty strata: hard classes are {rule}; the others are easy. A stratum's accuracy is "
            "the unweighted mean of its classes' test accuracies."
        )
        rows = []
        for task in ctx.tasks:
            part = ctx.strata[ctx.strata["task"] == task]
            if part.empty:
                continue
            for stratum in an.STRATA:
                members = part[part["stratum"] == stratum]
                rows.append(
                    {
                        "task": task,
                        "stratum": stratum,
                        "classes": len(members),
                        "members (reference accuracy %)": ", ".join(
                            f"{n} ({format_percent(a)})"
                            for n, a in zip(members["class_name"], members["reference_accuracy"], strict=True)
                        ),
                        "reference trial": members["reference_trial"].iloc[0] if len(members) else "–",
                    }
                )
        section.table(pd.DataFrame(rows), caption="Easy and hard classes per task.")
    return section


def _tuned_on(fraction: float) -> str:
    """A release's tuning share q₁, or "all rows" for one tuned on every row (today's private mode)."""
    return "all rows" if pd.isna(fraction) else format_sig(fraction)


def _with_interval(accuracy: float | None, interval: list[float] | None) -> str:
    """A test accuracy in % with its interval, or "withheld"."""
    if accuracy is None or pd.isna(accuracy) or interval is None:
        return "withheld"
    return f"{100 * accuracy:.1f} [{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]"
