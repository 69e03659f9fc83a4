"""The report of an end-to-end private search (``privacy.private_selection``): what may be released, and
the owner-only report of its runs.

A private search's results folder holds only what may leave the data owner's trust boundary: its
``search`` rows, its ``release`` and the released model. Its report (:func:`release_sections`) is built
from those alone: the release with its (ε, δ) and what that covers (the search's own statement, quoted),
its public test accuracy with the model's interval, the planner's public numbers (q, T, σ per batch
size, the distribution of the secret number of runs K, the score's noise σ_s) and where the owner-only
report comes from. Nothing in it is read from inside the boundary: no run, no count of runs, no time.

The owner-only report is the full per-run report of ``<results>/inside_trust_boundary`` (the runs, with
the search and release rows of ``<results>``: :func:`with_released_parts`); :func:`owner_banner` opens
it saying, first, that it is not for release.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence

import pandas as pd

from dptune import analysis as an
from dptune.analysis.coverage import selection_plans
from dptune.records import TRUST_BOUNDARY, release_label, withheld_reason
from dptune.report.decision import decide, release_folder
from dptune.report.document import Context, Section, format_int, format_percent, format_sig


def is_release_only(results: an.Results) -> bool:
    """Whether ``results`` are a private search's public results: releases and no run."""
    return results.trials.empty and not results.release.empty


def _parent(path: str) -> str | None:
    """The results folder of ``path`` when ``path`` is a private search's trust boundary, else None (a
    local path is made absolute first: ``inside_trust_boundary`` or ``…/inside_trust_boundary/.``)."""
    local = "://" not in path
    head, _, name = (os.path.abspath(path) if local else path.rstrip("/")).rpartition("/")
    return head if name == TRUST_BOUNDARY and head else None


def is_owner_only(paths: Sequence[str]) -> bool:
    """Whether any of ``paths`` is a private search's trust boundary (``<results>/inside_trust_boundary``)."""
    return any(_parent(path) is not None for path in paths)


def with_released_parts(paths: Sequence[str]) -> list[str]:
    """``paths`` and, after each trust boundary among them, the results folder that holds it: its
    ``search`` and ``release`` rows and the released model belong in the owner's report of the runs."""
    found: list[str] = []
    for path in paths:
        found.append(path)
        parent = _parent(path)
        if parent is not None and parent not in paths:
            found.append(parent)
    return list(dict.fromkeys(found))


def owner_banner(sources: Sequence[str], left_out: Sequence[Section]) -> str:
    """The block that opens the owner-only report of the runs at ``sources``: NOT for release, why, and
    which report may be released; ``left_out``: the sections these runs cannot fill, named in one line."""
    public = [parent for parent in map(_parent, sources) if parent is not None]
    lines = [
        "<strong>OWNER-ONLY — NOT FOR RELEASE.</strong>",
        "This report is built from the per-run records inside the data owner's trust boundary "
        f"({html.escape(', '.join(s for s in sources if _parent(s) is not None))}). It shows how many runs the "
        "private search made (its secret K), every run's configuration, exact validation and test accuracies, "
        "per-class accuracies and figures drawn from them. None of it is covered by the search's (ε, δ): "
        "publishing this page, its figures or any number read from it voids the guarantee. Keep it, and the "
        "folder it is written to, inside the trust boundary.",
        "What may be released is the report of the results folder itself: "
        + html.escape(", ".join(f"python -m dptune.report {p} --out FOLDER" for p in public))
        + ". The model to release is the private search's release below (its best noisy validation score), "
        "never another run's, nor a run chosen from these exact accuracies.",
    ]
    if left_out:
        names = "; ".join(f"{s.number}. {s.title}" for s in left_out)
        lines.append(
            "Not shown: sections a private search cannot fill (its bound refuses diagnostics, AUTO-S, "
            f"replicates and a second ε or E): {html.escape(names)}."
        )
    return '<div class="owner-only">' + "".join(f"<p>{line}</p>" for line in lines) + "</div>"


def release_sections(ctx: Context) -> list[Section]:
    """The sections of a private search's public report: the release, the plan, the owner-only report."""
    return [_release(ctx.results), _plan(ctx.results), _owner_pointer(ctx.results)]


def _release(results: an.Results) -> Section:
    section = Section(0, "The release: what may be published")
    section.text(
        "These results are those of an end-to-end private search (privacy.private_selection): they hold only "
        "what may leave the data owner's trust boundary — the released configuration and model, its noisy "
        "validation score and, where the test split is public, its test accuracy — and this report shows "
        "nothing else. The runs behind the release stay inside the trust boundary (section 2)."
    )
    decide(section, results)
    rows = [_release_row(release, results.models) for _, release in results.release.iterrows()]
    section.table(
        pd.DataFrame(rows),
        caption="The release: its name (the total (ε, δ) and E), the model file, the configuration, the noisy "
        "validation score (the maximum of the runs' noisy scores: biased upward, not an accuracy estimate) and "
        f"the test accuracy with its {100 * an.CONFIDENCE:g} % interval (the model's own on the test rows, as its "
        "card prints it), or why it is withheld. q₁: the share of the rows the runs tuned on, where the "
        "configuration was transferred to a model trained once on every row by the rule named.",
    )
    for text in an.privacy_statements(results):
        section.text(f"What (ε, δ) covers, as the search recorded it — {text}")
    return section


def _release_row(release: pd.Series, models: pd.DataFrame) -> dict[str, str]:
    """One release as the report's table shows it."""
    folder = release_folder(release, models)
    return {
        "release": release_label(release),
        "model file": "not in these results" if folder is None else f"{folder}/model.safetensors",
        "C": format_sig(release["clip_bound"]),
        "B": format_int(release["batch_size"]),
        "η₀": format_sig(release["base_learning_rate"]),
        "η": format_sig(release["learning_rate"]),
        "E": format_int(release["epochs"]),
        "noisy val score (max, %)": format_percent(release["noisy_val_accuracy"]),
        f"test % [{100 * an.CONFIDENCE:g} % interval]": _test_accuracy(release, models, folder),
        "tuned on (q₁)": "all rows" if pd.isna(release["tuning_fraction"]) else format_sig(release["tuning_fraction"]),
        "transfer": "–" if pd.isna(release["transfer"]) else str(release["transfer"]),
        "ε": format_sig(release["epsilon_total"]),
        "δ": format_sig(release["delta_total"]),
    }


def _test_accuracy(release: pd.Series, models: pd.DataFrame, folder: str | None) -> str:
    """The release's test accuracy in % with its model card's interval (the model's, on its test rows), or
    why it has none."""
    if pd.isna(release["test_accuracy"]):
        return f"withheld: {withheld_reason(release)}"
    card = models[models["folder"] == folder] if folder is not None and not models.empty else models.iloc[0:0]
    if card.empty or card["test_interval"].iloc[0] is None:
        return f"{format_percent(release['test_accuracy'])} (its model card is not in these results)"
    (low, high), rows = card["test_interval"].iloc[0], int(card["num_test"].iloc[0])
    return f"{format_percent(release['test_accuracy'])} [{format_percent(low)}, {format_percent(high)}] on {rows} rows"


def _plan(results: an.Results) -> Section:
    section = Section(1, "The planner's public numbers")
    plans = selection_plans(results)
    search = results.search.drop_duplicates("search_id").set_index("search_id")
    for _, release in results.release.iterrows():
        row = search.loc[release["search_id"]] if release["search_id"] in search.index else None
        section.text(_budget_text(release, row))
        mine = plans[plans["search_id"] == release["search_id"]]
        if not mine.empty:
            section.table(
                mine.drop(columns="search_id")
                .assign(released=["◀ released" if b == release["batch_size"] else "" for b in mine["batch_size"]])
                .rename(columns=_PLAN_HEADERS),
                {
                    "B": format_int,
                    "q": format_sig,
                    "T": format_int,
                    "σ": lambda v: "–" if pd.isna(v) else f"{v:.4f}",
                    "σ√T": lambda v: "–" if pd.isna(v) else f"{v:.2f}",
                },
                caption=f"{release_label(release)}: per batch size B of the space, what the plan made of it and, "
                "for each B a run may draw, its sample rate q = B/N, steps T = round(E·N/B), noise multiplier σ "
                "(calibrated to the per-run ε at δ, PRV accountant) and cumulative noise σ√T (for C = 1). "
                + (
                    "These are the mechanisms of the release's one training on every row; each tuning run on the "
                    f"subsample stands for one of these B with q and T by the rule '{release['transfer']}' "
                    "(python -m dptune.search --dry-run prints them)."
                    if pd.notna(release["tuning_fraction"])
                    else "Each run draws its B, C and η₀ at random from the space."
                ),
            )
        section.text(_trial_count_text(release))
    return section


#: The plan table's headers, by ``selection_plans`` column.
_PLAN_HEADERS = {
    "batch_size": "B",
    "sample_rate": "q",
    "steps": "T",
    "noise_multiplier": "σ",
    "cumulative_noise": "σ√T",
    "planned": "plan",
    "released": "",
}


def _budget_text(release: pd.Series, search: pd.Series | None) -> str:
    """The split of a release's total budget: the bound its plan met and the per-run ε."""
    total = f"({format_sig(release['epsilon_total'])}, {format_sig(release['delta_total'])})"
    per_run = f"ε = {release['epsilon_per_trial']:.4g} per run at δ = {format_sig(release['delta_total'])}"
    if search is None:
        return f"{release_label(release)}: total (ε, δ) = {total}; {per_run}."
    bound = "PRV-and-RDP total" if pd.notna(release["tuning_fraction"]) else "private-selection bound"
    return (
        f"{release_label(release)}: total (ε, δ) = {total}, met by the plan's {bound} ε = "
        f"{search['epsilon_selection']:.3g}; {per_run}; N = {format_int(search['num_train'])} training "
        f"privacy units (rows, or people under a person unit), E = {format_int(search['epochs'])} epochs."
    )


def _trial_count_text(release: pd.Series) -> str:
    """The public distribution of the secret number of runs K and the noise of each run's score."""
    shape = float(release["trial_count_shape"])
    family = "geometric on {1, 2, …}" if shape == 1 else "truncated negative binomial on {1, 2, …}"
    return (
        f"The number of runs K is secret: drawn once per search from fresh OS entropy, {family} with shape "
        f"η = {shape:g} and mean {format_sig(release['mean_trials'])} (Papernot & Steinke 2022, Def. 1). Only "
        "its distribution is public; the runs' number, their configurations and their scores are not in this "
        f"report. Each run's validation score is its count of correct validation predictions plus Gaussian noise "
        f"of std σ_s = {format_sig(release['score_noise_multiplier'])} predictions; the release is the run "
        "with the highest noisy score."
    )


def _owner_pointer(results: an.Results) -> Section:
    section = Section(2, "Owner-only: the runs behind the release (not for release)")
    commands = "; ".join(
        f"python -m dptune.report {source.rstrip('/')}/{TRUST_BOUNDARY} --out FOLDER" for source in results.sources
    )
    section.blocks.append(
        '<div class="owner-only"><p><strong>Not for release.</strong> The per-run records (every run, the '
        "secret number of runs, exact validation accuracies, timings) stay in the results' "
        f"{TRUST_BOUNDARY}/ folder. The data owner builds the full per-run report from them with "
        f"<code>{html.escape(commands)}</code>, into a folder inside the trust boundary: that page says at its "
        "top that it is not for release, and publishing it, or anything in that folder, voids the "
        "guarantee.</p></div>"
    )
    return section
