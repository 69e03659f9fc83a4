"""Loading results: the ``Results`` tables with their derived columns, and the selection rule.

``load_results`` reads one or more result datasets (``dptune.records``) into one ``Results``;
the conventions it sets (tasks, cells, binning of C and B, the best-trial rule) are those of
``dptune.analysis``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow.fs as pafs
import yaml

from dptune.errors import DptuneError
from dptune.paths import filesystem, read_file
from dptune.plan import DEFAULT_TOLERANCE
from dptune.records import TABLES, read_table
from dptune.records.weights import CARD_JSON, MODELS_FOLDER

#: Status of a trial that trained to the end; only these are ranked.
FINISHED = "ok"
#: Clipping rule of the automatic-clipping comparison (Bu et al. 2023).
AUTO_S = "auto_s"
#: Columns that identify a task and a cell.
TASK_COLUMNS: tuple[str, ...] = ("dataset", "fraction", "backbone", "peft")
CELL: list[str] = ["task", "epsilon", "epochs"]
#: Difficulty strata of classes.
EASY, HARD = "easy", "hard"
STRATA: tuple[str, ...] = (EASY, HARD)
#: Up to this many distinct values, C and B are shown exactly; above it they are log-binned.
MAX_EXACT_LEVELS = 12
BINS_PER_DECADE = 4
#: Relative width of the σ√T plateau of the batch-size rule (``dptune.plan``'s default).
PLATEAU_TOLERANCE = DEFAULT_TOLERANCE
#: Default tolerance of "near-optimal" (accuracy units: 0.01 = one percentage point).
NEAR_OPTIMAL = 0.01
#: Two-sided confidence of the intervals and of the within-noise rule of configurations.
CONFIDENCE = 0.95

_SELECTION_ORDER = (["val_accuracy", "train_loss", "search_id", "trial_id"], [False, True, True, True])


class AnalysisError(DptuneError, ValueError):
    """Results or options that cannot be analysed; the message names the problem and the choices."""


@dataclass(frozen=True)
class Results:
    """The tables of one or more result datasets, concatenated, with derived columns.

    ``trials`` gains ``task``, ``clip_bin`` and ``batch_bin`` (see ``dptune.analysis``);
    ``classes`` and ``diagnostics`` gain ``task``, ``epsilon`` and ``epochs`` of their trial.
    ``clip_binned``/``batch_binned`` say whether C/B were binned (else exact values).
    ``release`` holds the releases of end-to-end private searches, whose per-run records are not
    in their dataset (they stay inside the data owner's trust boundary). ``models`` lists the models
    the searches handed back (:func:`published_models`).
    """

    sources: tuple[str, ...]
    trials: pd.DataFrame
    epochs: pd.DataFrame
    classes: pd.DataFrame
    diagnostics: pd.DataFrame
    search: pd.DataFrame
    clip_binned: bool
    batch_binned: bool
    release: pd.DataFrame
    models: pd.DataFrame

    @property
    def finished(self) -> pd.DataFrame:
        """Trials with status ``ok`` and a finite validation accuracy (``finished_trials``)."""
        return finished_trials(self.trials)

    @property
    def tuned(self) -> pd.DataFrame:
        """Finished trials with a tuned clip bound (any clipping rule but AUTO-S)."""
        finished = self.finished
        return finished[finished["clipping"] != AUTO_S]

    @property
    def auto_s(self) -> pd.DataFrame:
        """Finished AUTO-S trials."""
        finished = self.finished
        return finished[finished["clipping"] == AUTO_S]


def check_results_paths(paths: Sequence[str]) -> None:
    """Raise ``AnalysisError`` unless every path is a results dataset (before reading anything).

    A dataset is a folder (local path or URI) holding a ``trials/`` or ``search/`` folder, as
    ``dptune.search`` writes it.
    """
    if not paths:
        raise AnalysisError("no results given: pass one or more result dataset folders")
    for path in paths:
        if "://" in path:
            filesystem, root = pafs.FileSystem.from_uri(path)
        else:
            filesystem, root = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
        info = filesystem.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise AnalysisError(f"{path}: no such results dataset (the folder does not exist)")
        if info.type != pafs.FileType.Directory:
            raise AnalysisError(f"{path}: not a results dataset (a file, expected a folder)")
        tables = [filesystem.get_file_info(f"{root}/{name}").type for name in ("trials", "search")]
        if all(kind != pafs.FileType.Directory for kind in tables):
            raise AnalysisError(
                f"{path}: not a dptune results dataset: expected a trials/ or search/ folder "
                f"(tables {', '.join(TABLES)}, written by python -m dptune.search)"
            )


def task_label(dataset: str, fraction: float, backbone: str, peft: str) -> str:
    """Human name of a task, e.g. ``20newsgroups (10%) · minilm · head``."""
    share = "" if fraction >= 1 else f" ({fraction:.0%})"
    return f"{dataset}{share} · {backbone} · {peft}"


def log_bins(
    values: pd.Series,
    continuous: bool | None = None,
    max_levels: int = MAX_EXACT_LEVELS,
    bins_per_decade: int = BINS_PER_DECADE,
) -> tuple[pd.Series, bool]:
    """Map positive ``values`` to log-grid bins; return (representatives, whether binned).

    ``continuous`` says whether the values were sampled from a range (bin them) or a list (keep
    them); when unknown (``None``) they are binned only above ``max_levels`` distinct values.
    Value v falls in bin k = ⌊bins_per_decade·log10 v⌋ and is represented by the bin's geometric
    centre 10^((k + ½)/bins_per_decade); the grid is aligned to powers of ten, so bins agree
    across searches.
    """
    finite = values[np.isfinite(values) & (values > 0)]
    if continuous is False or (continuous is None and finite.nunique() <= max_levels):
        return values.astype(float), False
    index = np.floor(np.log10(values.astype(float)) * bins_per_decade + 1e-9)
    centres = 10.0 ** ((index + 0.5) / bins_per_decade)
    return pd.Series(np.round(centres, 12), index=values.index), True


def _with_trial_keys(frame: pd.DataFrame, trials: pd.DataFrame) -> pd.DataFrame:
    keys = trials[["search_id", "trial_id", *CELL]]
    return frame.merge(keys, on=["search_id", "trial_id"], how="inner")


def load_results(paths: Sequence[str]) -> Results:
    """Read and join every table of the datasets at ``paths`` (see ``check_results_paths``).

    A dataset given twice, or two datasets sharing a search, contribute each trial once.
    """
    check_results_paths(paths)
    tables = {name: pd.concat([read_table(path, name) for path in paths], ignore_index=True) for name in TABLES}
    trials = tables["trials"].drop_duplicates(["search_id", "trial_id"], keep="last").reset_index(drop=True)
    trials["task"] = pd.Series(
        [task_label(*row) for row in trials[list(TASK_COLUMNS)].itertuples(index=False)],
        index=trials.index,
        dtype="str",
    )
    tuned = trials["clipping"] != AUTO_S
    trials["clip_bin"], clip_binned = log_bins(
        trials["clip_bound"].where(tuned, np.nan), _sampled_from_range(tables["search"], "clip_bound")
    )
    trials["batch_bin"], batch_binned = log_bins(trials["batch_size"].astype(float))
    dedupe = {"epochs": ["epoch"], "classes": ["label"], "diagnostics": ["epoch"]}
    joined = {
        name: _with_trial_keys(tables[name].drop_duplicates(["search_id", "trial_id", *extra], keep="last"), trials)
        for name, extra in dedupe.items()
    }
    search = tables["search"].drop_duplicates().reset_index(drop=True)
    return Results(
        sources=tuple(paths),
        trials=trials,
        search=search,
        clip_binned=clip_binned,
        batch_binned=batch_binned,
        release=tables["release"].drop_duplicates().reset_index(drop=True),
        models=published_models(paths),
        **joined,
    )


def published_models(paths: Sequence[str]) -> pd.DataFrame:
    """One row per model the datasets at ``paths`` hold under ``<path>/models/<model>/``, from its
    ``model_card.json``: its folder, cell, clipping rule, configuration, accuracies with their 95 %
    intervals, and the (ε, δ) with what it covers (the card's words)."""
    import json

    rows = []
    for path in paths:
        fs, root = filesystem(path)
        folder = f"{root.rstrip('/')}/{MODELS_FOLDER}"
        if fs.get_file_info(folder).type != pafs.FileType.Directory:
            continue
        for entry in sorted(fs.get_file_info(pafs.FileSelector(folder)), key=lambda e: e.path):
            card_bytes = read_file(f"{path.rstrip('/')}/{MODELS_FOLDER}/{entry.base_name}", CARD_JSON)
            if entry.type != pafs.FileType.Directory or card_bytes is None:
                continue  # a folder without its card (written last) is not a whole model
            card = json.loads(card_bytes)
            accuracy, config, privacy = card["accuracy"], card["configuration"], card["privacy"]
            rows.append(
                {
                    "folder": f"{path.rstrip('/')}/{MODELS_FOLDER}/{entry.base_name}",
                    "cell_id": card["model"]["cell_id"],
                    "clipping": card["model"]["clipping"],
                    **{key: config.get(key) for key in ("clip_bound", "batch_size", "learning_rate", "epochs")},
                    "val_accuracy": accuracy.get("val_accuracy"),
                    "test_accuracy": accuracy.get("test_accuracy"),
                    "test_interval": accuracy.get("test_interval"),
                    "epsilon": privacy["epsilon"],
                    "delta": privacy["delta"],
                    "covers": privacy["covers"],
                }
            )
    return pd.DataFrame(rows)


def _sampled_from_range(search: pd.DataFrame, key: str) -> bool | None:
    """Whether any search spec samples ``key`` from a range (``low``/``high``) rather than ``values``.

    None when no spec is recorded (a search still running writes its ``search`` rows at the end).
    """
    specs = [yaml.safe_load(text) for text in search["spec_yaml"].dropna().unique()]
    ranges = [spec[key] for spec in specs if isinstance(spec, dict) and isinstance(spec.get(key), dict)]
    return any("low" in spec for spec in ranges) if ranges else None


def finished_trials(trials: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``trials`` that may be ranked: status ``ok`` and a finite validation accuracy
    (a trial stopped early or failed is listed, never ranked)."""
    return trials[(trials["status"] == FINISHED) & np.isfinite(trials["val_accuracy"])]


def select_best(trials: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """One row per group of ``by``: the trial with the best validation accuracy (module rules)."""
    columns, ascending = _SELECTION_ORDER
    ordered = trials.sort_values(columns, ascending=ascending, na_position="last", kind="mergesort")
    return ordered.drop_duplicates(list(by), keep="first").sort_values(list(by)).reset_index(drop=True)
