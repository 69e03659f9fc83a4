"""The report's opening: per cell, the configuration to use, the model to release, its (ε, δ) and
what that covers, its test accuracy with its interval, and the one line of advice the runs support."""

from __future__ import annotations

import pandas as pd

from dptune import analysis as an
from dptune.records import release_label, withheld_reason
from dptune.report.document import Section, format_int, format_percent, format_sig


def decide(section: Section, results: an.Results) -> None:
    """Write the decision into ``section`` (the report's first): one table row per cell of the tuned
    runs, then the releases of end-to-end private searches, then what a selection on exact validation
    accuracy does not cover. Each quantity carries the name it has in every other section: optimal C
    and B with their intervals over the set within noise of the best (section 2), η the rate used."""
    best = an.best_configurations(results.tuned)
    models = results.models
    released = results.release["cell_id"]
    private = best["cell_id"].isin(released) if "cell_id" in best.columns else pd.Series(False, index=best.index)
    if not best.empty:
        table = pd.DataFrame(
            [_cell_row(row, models, bool(p)) for (_, row), p in zip(best.iterrows(), private, strict=True)]
        )
        covers = table["what (ε, δ) covers"].unique()
        if len(covers) == 1:  # one statement for every model: said once, under the table
            table = table.drop(columns="what (ε, δ) covers")
        section.table(
            table,
            caption="Decision per cell: the configuration to use (the best on mean validation accuracy; optimal C and "
            "B with their intervals over the configurations within noise of it, section 2), the model to release "
            "(its folder under models/, from the same configuration) with its (ε, δ) and what that covers, its "
            f"test accuracy in % with the {100 * an.CONFIDENCE:g} % interval (the model's own, from its card; "
            "without a model, the configuration's mean over its replicates), and what the runs support.",
        )
        if len(covers) == 1 and covers[0] != "–":
            section.text(f"What each model's (ε, δ) covers: {covers[0]}.")
    if private.any():
        section.text(
            "The runs of an end-to-end private search are ranked here on their exact validation accuracies, which "
            "no (ε, δ) covers: the ranking is for the data owner's understanding only. The model to release is "
            "the search's release below, chosen on noisy scores; publishing another run's model, or any of these "
            "accuracies, voids the guarantee."
        )
    if not private.all():
        section.text(
            "Choosing among configurations by their exact validation accuracy is not differentially private: each "
            "model alone is (ε, δ)-DP at its cell's ε, but its choice among the runs is not covered by any ε here, "
            "nor are the validation scores, losses and diagnostics the report shows. For one (ε, δ) that covers "
            "the tuning, the choice and the released model, run a private search: privacy.private_selection "
            "(search_spaces/private.yaml), or tuning on a secret subsample with tuning_subsample "
            "(search_spaces/private_subsample.yaml); docs/PRIVACY.md says what each covers."
        )
    if not results.release.empty:
        for _, release in results.release.iterrows():
            folder = release_folder(release, models)
            section.text(
                f"Release of the private search {release['search_id']} ({release_label(release)}): C = "
                f"{format_sig(release['clip_bound'])}, B = {format_int(release['batch_size'])}, η = "
                f"{format_sig(release['learning_rate'])}; model "
                f"{'not in these results' if folder is None else f'{folder}/model.safetensors'}; one (ε, δ) = "
                f"({format_sig(release['epsilon_total'])}, {format_sig(release['delta_total'])}) covers the "
                "tuning, the selection and this model, and nothing else is released: the runs behind it stay "
                + (
                    "inside the trust boundary: those in this report are not for release. "
                    if release["search_id"] in set(results.trials["search_id"])
                    else "inside the trust boundary and are not in this report. "
                )
                + (
                    f"Test accuracy {format_percent(release['test_accuracy'])} % (public test split)."
                    if pd.notna(release["test_accuracy"])
                    else f"Its test accuracy is withheld: {withheld_reason(release)}."
                )
            )
    if best.empty and results.release.empty:
        section.note("Missing: no finished run with a tuned clip bound and no release: nothing to decide yet.")


def _cell_row(row: pd.Series, models: pd.DataFrame, private: bool) -> dict[str, str]:
    """One cell's decision: its best configuration, the model published from it, and the advice
    (``private``: the cell of an end-to-end private search, whose one model is its release)."""
    model = None if private else _model_of(row, models)
    accuracy = (
        _accuracy(model["test_accuracy"], model["test_interval"])
        if model is not None
        else f"{format_percent(row['test_accuracy'])} [{format_percent(row['test_low'])}, "
        f"{format_percent(row['test_high'])}] (mean of R = {int(row['replicates'])})"
    )
    return {
        "task": row["task"],
        "ε": format_sig(row["epsilon"]),
        "E": str(int(row["epochs"])),
        "optimal C [interval]": f"{format_sig(row['clip_bound'])} [{format_sig(row['clip_low'])}, "
        f"{format_sig(row['clip_high'])}]",
        "optimal B [interval]": f"{format_int(row['batch_size'])} [{format_int(row['batch_low'])}, "
        f"{format_int(row['batch_high'])}]",
        "η": format_sig(row["learning_rate"]),
        "model to release": _model_text(model, private),
        "(ε, δ)": "–" if model is None else f"({format_sig(model['epsilon'])}, {format_sig(model['delta'])})",
        "what (ε, δ) covers": "–" if model is None else str(model["covers"]),
        "model's test % [interval]": accuracy,
        "advice": "none: a run chosen on exact accuracies voids the guarantee" if private else advice(row),
    }


def _model_text(model: pd.Series | None, private: bool) -> str:
    """The decision's model to release: the published model's file, or why there is none."""
    if private:
        return "only the private search's release (below)"
    if model is None:
        return "none published (run dptune.search with a results folder to get models/)"
    return f"{model['folder']}/model.safetensors"


def _model_of(row: pd.Series, models: pd.DataFrame) -> pd.Series | None:
    """The published model of ``row``'s cell and clipping rule, if it was trained with ``row``'s (C, B)."""
    if models.empty or "cell_id" not in row:
        return None
    match = models[
        (models["cell_id"] == row["cell_id"])
        & (models["clipping"] == row["clipping"])
        & (models["clip_bound"] == row["clip_bound"])
        & (models["batch_size"] == row["batch_size"])
    ]
    return None if match.empty else match.iloc[0]


def release_folder(release: pd.Series, models: pd.DataFrame) -> str | None:
    """The model folder of a private search's release (its cell, C and B), or None where it is not here."""
    if models.empty:
        return None
    match = models[
        (models["cell_id"] == release_label(release))
        & (models["clip_bound"] == release["clip_bound"])
        & (models["batch_size"] == release["batch_size"])
    ]
    return None if match.empty else str(match["folder"].iloc[0])


def _accuracy(accuracy: float | None, interval: list[float] | None) -> str:
    """A model card's test accuracy in % with its interval, or "withheld"."""
    if accuracy is None or pd.isna(accuracy) or interval is None:
        return "withheld"
    return f"{100 * accuracy:.1f} [{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]"


def advice(row: pd.Series) -> str:
    """The one line the runs of a cell support (a ``best_configurations`` row): the configuration is
    established, or the range of C and B within noise of it and what would narrow it."""
    k, n = int(row["within_noise"]), int(row["configurations"])
    if k == 1:
        return f"use this configuration: the only one of {n} within noise of the best"
    spans = []
    for name, low, high, shown in (
        ("C", row["clip_low"], row["clip_high"], format_sig),
        ("B", row["batch_low"], row["batch_high"], format_int),
    ):
        spans.append(
            f"{name} is not pinned down ({shown(low)} to {shown(high)} do as well)"
            if low != high
            else f"{name} = {shown(low)} throughout"
        )
    more = (
        "more replicates per configuration"
        if int(row["replicates"]) >= 2
        else "replicates (the space key replicates: R ≥ 2)"
    )
    return f"{k} of {n} configurations are within noise: {'; '.join(spans)}; {more} would narrow it"
