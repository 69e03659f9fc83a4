"""The models a finished search hands back: ``<results>/models/<model>/`` holds ``model.safetensors``
(the trained parameters, from ``runs/weights``, :mod:`dptune.records.weights`), ``model_card.md``
(for a person) and ``model_card.json`` (for :mod:`dptune.predict`; written last, so a folder with
it is whole). Ray-free and torch-free.

Which model, and what its (ε, δ) covers:

- A search without private selection publishes, per cell and clipping rule, the best configuration
  by mean validation accuracy (``analysis.best_configurations``) and of its replicates the one with
  the best validation accuracy. The model alone is (ε_cell, δ)-DP, the per-run budget of its cell;
  choosing it by exact validation accuracy is not covered by that ε, and the search as a whole (every
  run whose outcome is recorded) costs ``epsilon_search`` (the ``search`` row's guarantee text).
- An end-to-end private search publishes per cell the run its private selection released
  (``outcome.release_choices``), and the card records what its ``release`` row does: the
  configuration, the noisy validation score, the test accuracy only where the test split is public,
  and (ε_total, δ), which covers the tuning, the selection and this model. Nothing that orders it
  among the runs (no trial id, no time) leaves the trust boundary.

The card (``model_card.json``), each field in its JSON type:

- ``dptune_version`` (string); ``peft`` and ``logits`` (strings: ``contract.LogitsRule``);
- ``model``: ``cell_id``, ``clipping`` (strings), ``trial_id`` (string; null in a private release);
- ``data``: ``dataset`` (string), ``class_names`` (strings, in label order), ``data_sha256`` (string; null
  in a private release), the features' provenance as the model file records it (strings: ``backbone``,
  ``weights_sha256``, ``precision``, ``pooling``, ``privacy_unit``, ``input_column``, ``frozen_sha256``,
  where the run has them) but ``max_tokens``, an integer (null for an image backbone), and ``notes``;
- ``parameters``: each trained parameter's shape (integers);
- ``configuration``: ``CONFIG_COLUMNS``, each in the JSON type of its ``trials`` column (integers, numbers,
  strings; null where the record has none);
- ``privacy``: ``epsilon``, ``delta`` (numbers), ``covers``, ``search_guarantee`` (strings);
- ``accuracy``: accuracies (numbers), their 95 % intervals (two numbers, or null;
  :func:`dptune.analysis.accuracy_interval`: this model's, the split's Wilson interval) and the rows or
  people they were measured on (integers); a private release's ``test_*`` are null where its test split
  is not public, and ``test_withheld`` says why (a string, else null). A search without private
  selection adds its configuration's mean accuracies over its replicates with the intervals the
  summary and the report print (``configuration_*``; ``configuration_interval_source``: ``split`` or
  ``coins and split``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd
import pyarrow as pa

from dptune import __version__
from dptune.contract import TrainedModel
from dptune.paths import write_file_atomic
from dptune.records import SCHEMAS, read_table, release_label, withheld_reason
from dptune.records.weights import CARD_JSON, CARD_MD, MODEL_FILE, MODELS_FOLDER, read_weights, weights_bytes

#: Confidence of the accuracy intervals on a card (Wilson score interval of one run's k of n).
CARD_CONFIDENCE = 0.95
#: Provenance keys that describe the private rows themselves: never in a private release's files.
PRIVATE_PROVENANCE = frozenset({"data_sha256"})
#: The configuration a card states, from the run's record.
CONFIG_COLUMNS = (
    "clip_bound",
    "batch_size",
    "base_learning_rate",
    "learning_rate",
    "reference_batch_size",
    "epochs",
    "optimizer",
    "clipping",
    "noise_multiplier",
    "sample_rate",
    "steps",
)


@dataclass(frozen=True)
class Disclosure:
    """What a published model's files say of its run and its data: ``names_run``: the card holds the
    trial id (it orders the run among the runs); ``withheld``: the provenance keys left out of the
    model file and the card; ``data_note``: what the card says of the data's sha256."""

    names_run: bool
    withheld: frozenset[str]
    data_note: str


#: A per-cell search's model: its run and data fingerprint are the user's to see.
SEARCH_DISCLOSURE = Disclosure(
    names_run=True,
    withheld=frozenset(),
    data_note="data_sha256 hashes the training rows: it identifies them and is not covered by (ε, δ)",
)
#: An end-to-end private release: neither the trial id nor the data's sha256 (``PRIVATE_PROVENANCE``).
RELEASE_DISCLOSURE = Disclosure(
    names_run=False,
    withheld=PRIVATE_PROVENANCE,
    data_note="the data's sha256 is withheld (a hash of the private rows is not covered by (ε, δ))",
)


def model_name(cell_id: str, clipping: str) -> str:
    """The folder name of a cell's model: its cell id and clipping rule, in file-name-safe characters."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", f"{cell_id}-{clipping}")


def accuracy_interval(accuracy: float, rows: int) -> list[float] | None:
    """A model's accuracy measured on ``rows`` rows with its ``CARD_CONFIDENCE`` interval, as every
    output prints it (:func:`dptune.analysis.accuracy_interval`: the split's Wilson interval); None
    where there is none."""
    from dptune.analysis import accuracy_interval as interval_of

    interval = interval_of(float(accuracy), int(rows), confidence=CARD_CONFIDENCE)
    return None if interval is None else list(interval)


def _search_accuracy(run: pd.Series, configuration: pd.Series) -> dict[str, Any]:
    """A search's card's ``accuracy``: its ``run``'s and its ``configuration``'s (``best_configurations``)."""
    return {
        "val_accuracy": float(run["val_accuracy"]),
        "val_interval": accuracy_interval(run["val_accuracy"], int(run["num_val"])),
        "num_val": int(run["num_val"]),
        "test_accuracy": float(run["test_accuracy"]),
        "test_interval": accuracy_interval(run["test_accuracy"], int(run["num_test"])),
        "num_test": int(run["num_test"]),
        "configuration_val_mean": float(configuration["val_accuracy"]),
        "configuration_val_interval": _pair(configuration["val_low"], configuration["val_high"]),
        "configuration_test_mean": float(configuration["test_accuracy"]),
        "configuration_test_interval": _pair(configuration["test_low"], configuration["test_high"]),
        "configuration_interval_source": str(configuration["interval_source"]),
        "configuration_replicates": int(configuration["replicates"]),
    }


def _pair(low: float, high: float) -> list[float] | None:
    """An interval as a card stores it (two numbers), or None where it has none."""
    return None if pd.isna(low) or pd.isna(high) else [float(low), float(high)]


def show_models(results_root: str, folders: list[str]) -> list[str]:
    """Say where a finished search published its models (``folders``, as :func:`publish_search_models` or
    :func:`publish_release_models` return them, whichever the search's mode publishes); returns them."""
    if folders:
        print(f"models: {len(folders)} in {results_root.rstrip('/')}/{MODELS_FOLDER} (a model card in each)")
        for folder in folders:
            print(f"  {folder}", flush=True)
    return folders


def publish_search_models(
    results_root: str,
    runs: str,
    search_rows: list[dict[str, Any]],
    *,
    adaptive: bool,
    trials: pd.DataFrame | None = None,
) -> list[str]:
    """Publish the best model of each cell and clipping rule of a search without private selection;
    ``adaptive``: TPE proposed, ASHA stopped or racing replicated runs on exact validation accuracies. Returns the
    models' folders. A cell whose best run left no weights (results from before weights were kept)
    is skipped. ``trials``: the ``trials`` table of ``runs`` (every search's rows) when the caller has
    read it once every run was recorded; None: read here."""
    from dptune.analysis import best_configurations, finished_trials

    search_id = search_rows[0]["search_id"]
    trials = read_table(runs, "trials") if trials is None else trials
    trials = trials[trials["search_id"] == search_id]
    best = best_configurations(finished_trials(trials), by=["cell_id", "clipping"])
    guarantees = {(row["cell_id"], row["clipping"]): row for row in search_rows}
    folders = []
    for _, configuration in best.iterrows():
        key = (configuration["cell_id"], configuration["clipping"])
        replicates = trials[
            (trials["configuration_id"] == configuration["configuration_id"]) & (trials["status"] == "ok")
        ]
        run = replicates.sort_values(["val_accuracy", "trial_id"], ascending=[False, True]).iloc[0]
        row = guarantees[key]
        privacy = _privacy(
            run["epsilon"],
            run["delta"],
            (
                "NOTHING as released: the search adapted to exact validation accuracies (TPE proposals, ASHA "
                "stops or racing), so which runs exist, and this model, depend on private rows; ε is its run's noisy "
                "steps' budget for a configuration fixed in advance"
                if adaptive
                else "this model's training alone: it is (ε, δ)-DP with ε = its cell's per-run budget. Choosing "
                "it among the search's runs by their exact validation accuracy is NOT covered; every recorded "
                f"run together costs ε_search = {row['epsilon_search']:.4g} at δ = {row['delta']:.3g}"
            ),
            row["guarantee"],
        )
        accuracy = _search_accuracy(run, configuration)
        folder = _publish(results_root, runs, str(run["trial_id"]), key, run, privacy, accuracy, SEARCH_DISCLOSURE)
        if folder is not None:
            folders.append(folder)
    return folders


def publish_release_models(results_root: str, runs: str, choices: list[tuple[dict[str, Any], pd.Series]]) -> list[str]:
    """Publish the released model of each cell of an end-to-end private search: ``choices`` pairs each
    ``release`` row with the run it released (``outcome.release_choices``). Returns the folders."""
    folders = []
    for release, run in choices:
        privacy = _privacy(
            release["epsilon_total"],
            release["delta_total"],
            "the whole tuning: every run of the search, the private selection of this run and this model "
            "(end-to-end private tuning)",
            release["guarantee"],
        )
        public = bool(release["test_split_public"])
        accuracy = {
            "noisy_val_accuracy": float(release["noisy_val_accuracy"]),
            "test_accuracy": float(release["test_accuracy"]) if public else None,
            "test_interval": accuracy_interval(release["test_accuracy"], int(run["num_test"])) if public else None,
            "num_test": int(run["num_test"]) if public else None,
            "test_withheld": None if public else withheld_reason(release),
        }
        key = (release_label(release), str(run["clipping"]))
        folder = _publish(results_root, runs, str(run["trial_id"]), key, run, privacy, accuracy, RELEASE_DISCLOSURE)
        if folder is not None:
            folders.append(folder)
    return folders


def _privacy(epsilon: float, delta: float, covers: str, search_guarantee: str) -> dict[str, Any]:
    """A card's privacy section: the model's (ε, δ), what it covers, and the search's statement."""
    return {"epsilon": float(epsilon), "delta": float(delta), "covers": covers, "search_guarantee": search_guarantee}


def _publish(
    results_root: str,
    runs: str,
    trial_id: str,
    key: tuple[str, str],
    run: pd.Series,
    privacy: dict[str, Any],
    accuracy: dict[str, Any],
    disclosure: Disclosure,
) -> str | None:
    """Write run ``trial_id``'s model and cards under ``models/<model_name(*key)>``; None: it left no weights.

    The model file and the card are written from one :func:`released_model`, redacted once by the
    search's ``disclosure`` (an end-to-end private release's, ``RELEASE_DISCLOSURE``: neither holds the
    trial id, which orders the run among the runs, nor the data's sha256, ``PRIVATE_PROVENANCE``). The
    class names are on every card: they name the model's outputs, so the label set is taken as public
    (the card says so)."""
    trained = read_weights(runs, trial_id)
    if trained is None:
        return None
    released = released_model(trained, disclosure)
    provenance = dict(released.provenance)
    class_names = json.loads(provenance.pop("class_names", "[]"))
    fingerprint = provenance.pop("data_sha256", None)
    data_note = disclosure.data_note
    card: dict[str, Any] = {
        "dptune_version": __version__,
        "model": {"cell_id": key[0], "clipping": key[1], "trial_id": trial_id if disclosure.names_run else None},
        "data": {
            "dataset": str(run["dataset"]),
            "class_names": class_names,
            "data_sha256": fingerprint,
            **{name: _card_value(name, value) for name, value in provenance.items()},
            "notes": f"{data_note}; the class names (the model's outputs) are taken as public",
        },
        "peft": str(run["peft"]),
        "logits": trained.logits,
        "parameters": {name: list(value.shape) for name, value in trained.parameters.items()},
        "configuration": {name: _typed(run[name], SCHEMAS["trials"].field(name).type) for name in CONFIG_COLUMNS},
        "privacy": privacy,
        "accuracy": accuracy,
    }
    folder = f"{results_root.rstrip('/')}/{MODELS_FOLDER}/{model_name(*key)}"
    write_file_atomic(folder, MODEL_FILE, weights_bytes(released))
    write_file_atomic(folder, CARD_MD, card_markdown(card).encode())
    write_file_atomic(folder, CARD_JSON, json.dumps(card, indent=1, ensure_ascii=False).encode())
    return folder


def released_model(trained: TrainedModel, disclosure: Disclosure) -> TrainedModel:
    """What leaves of a run's saved model: its parameters, logits rule and provenance, the provenance
    redacted once by the search's ``disclosure``: an end-to-end private release's withholds
    ``PRIVATE_PROVENANCE`` (the data's sha256: a hash of the private rows is no DP release, whoever
    knows all rows but one can test guesses of it). The model file's header and the cards are both
    written from the one object this returns."""
    if not disclosure.withheld:
        return trained
    provenance = {name: value for name, value in trained.provenance.items() if name not in disclosure.withheld}
    return replace(trained, provenance=provenance)


def _card_value(name: str, value: str) -> Any:
    """A provenance value (a string in the model file's header) in its card's JSON type: ``max_tokens`` an
    int, or None where the model file says ``"None"`` (an image backbone); every other a string."""
    if name == "max_tokens":
        return None if value == "None" else int(value)
    return value


def _typed(value: Any, column: pa.DataType) -> Any:
    """A record's value in the JSON type of its ``column`` (int, float or str), missing as None: an integer
    column read with a missing value elsewhere comes back as floats, and numpy scalars are no JSON."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return None
    if pa.types.is_integer(column):
        return int(value)
    return float(value) if pa.types.is_floating(column) else str(value)


def _unit_text(unit: str | None) -> str:
    """A card's privacy unit in words (``row``, ``person:<column>``; None: a model from before units)."""
    if unit is None or unit == "row":
        return "one row (a person with several rows is protected per row, not as a person)"
    column = unit.removeprefix("person:")
    return f"one person, identified by `{column}`, with all their rows (user-level DP)"


def _configuration_line(accuracy: dict[str, Any]) -> str:
    """The card's line of its configuration's mean test accuracy with the interval the summary prints."""
    low, high = accuracy["configuration_test_interval"]
    spread = (
        "the coins' run-to-run spread pooled over the cell and the split's sampling noise"
        if accuracy.get("configuration_interval_source") == "coins and split"
        else "the split's sampling noise only: the coins' spread was not measured (no replicate in the cell)"
    )
    return (
        f"- this configuration, mean test accuracy over its {accuracy['configuration_replicates']} run(s): "
        f"{accuracy['configuration_test_mean']:.1%} (95% interval {low:.1%}–{high:.1%}: {spread}; "
        "the search's summary and report print the same)"
    )


def card_markdown(card: dict[str, Any]) -> str:
    """The model card for a person: what the model is, what it was trained on, what its ε covers."""
    privacy, accuracy, config = card["privacy"], card["accuracy"], card["configuration"]
    units = "rows" if card["data"].get("privacy_unit", "row") == "row" else "people"

    def share(name: str) -> str:
        value, interval = accuracy.get(name), accuracy.get(name.replace("accuracy", "interval"))
        if value is None:
            return "withheld"
        bounds = f" (95% interval {interval[0]:.1%}–{interval[1]:.1%}, this model on this split)" if interval else ""
        return f"{value:.1%}{bounds}"

    lines = [
        f"# dptune model: {card['model']['cell_id']} [{card['model']['clipping']}]",
        "",
        f"Trained with dptune {card['dptune_version']} on `{card['data']['dataset']}` "
        f"({len(card['data']['class_names'])} classes), backbone `{card['data'].get('backbone')}`, "
        f"peft `{card['peft']}`.",
        "",
        "## Privacy",
        "",
        f"(ε, δ) = ({privacy['epsilon']:.4g}, {privacy['delta']:.3g}), covering {privacy['covers']}.",
        "",
        f"Privacy unit: {_unit_text(card['data'].get('privacy_unit'))}.",
        "",
        f"Search guarantee: {privacy['search_guarantee']}",
        "",
        "## Accuracy",
        "",
    ]
    if "val_accuracy" in accuracy:
        lines.append(f"- validation: {share('val_accuracy')} on {accuracy['num_val']} {units}")
    else:
        lines.append(
            f"- noisy validation score (the private selection's, biased upward): {accuracy['noisy_val_accuracy']:.1%}"
        )
    lines.append(
        f"- test: {share('test_accuracy')}"
        + (f" on {accuracy['num_test']} {units}" if accuracy.get("num_test") else "")
        + (f" ({accuracy['test_withheld']})" if accuracy.get("test_withheld") else "")
    )
    if accuracy.get("configuration_test_interval"):
        lines.append(_configuration_line(accuracy))
    lines += ["", "## Configuration", ""]
    lines += [f"- {name}: {value}" for name, value in config.items()]
    lines += [
        "",
        "Predict with `python -m dptune.predict --model <this folder> --input FILE --output FILE` (the input"
        " column by default the one the model was trained on; `--column COL` names another), or in Python"
        " `dptune.load_model(<this folder>).predict(texts)`.",
        "",
    ]
    return "\n".join(lines)
