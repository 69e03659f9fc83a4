"""Loading results: the ``Results`` tables with their derived columns, and the selection rule.

``load_results`` reads one or more result datasets (``dptune.records``) into one ``Results``;
the conventions it sets (tasks, cells, binning of C and B, the best-trial rule) are those of
``dptune.analysis``.

Memory: a run costs the ``Results`` a few kB (its scalar columns, one row per epoch, class and
diagnostic epoch), never the columns no analysis reads (:data:`UNREAD`: each run's configuration and
versions as JSON, and its probes' per-example gradient norms, ~5 kB a diagnostic epoch). Probes are read
for the rows asked (:meth:`Results.probes`: one per cell), then only those are kept. Every table is read
with the store's cache off and its columns held in one chunk each, so nothing keeps the buffers of the
parts it was read from.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import yaml

from dptune.errors import DptuneError
from dptune.paths import filesystem, read_file
from dptune.plan import DEFAULT_TOLERANCE
from dptune.records import SCHEMAS, TABLES, ResultsStore
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

#: Columns of each table that ``load_results`` leaves unread: ``trials``' full configuration and package
#: versions (JSON, ~1 kB a run; ``dptune.records.read_table`` reads them) and ``diagnostics``' per-example
#: probe (:data:`PROBE_COLUMNS`, read by :meth:`Results.probes` for the rows asked).
PROBE_COLUMNS: tuple[str, ...] = ("grad_norms", "labels")
UNREAD: dict[str, tuple[str, ...]] = {"trials": ("config", "versions"), "diagnostics": PROBE_COLUMNS}
#: The key of a diagnostic row (a trial's probe at one epoch).
_PROBE_KEY = ["search_id", "trial_id", "epoch"]

_SELECTION_ORDER = (["val_accuracy", "train_loss", "search_id", "trial_id"], [False, True, True, True])


class AnalysisError(DptuneError, ValueError):
    """Results or options that cannot be analysed; the message names the problem and the choices."""


@dataclass(frozen=True)
class Results:
    """The tables of one or more result datasets, concatenated, with derived columns.

    ``trials`` gains ``task``, ``clip_bin`` and ``batch_bin`` (see ``dptune.analysis``);
    ``classes`` and ``diagnostics`` gain ``task``, ``epsilon`` and ``epochs`` of their trial. The
    columns of :data:`UNREAD` are not read: ``diagnostics`` holds every diagnostic row without its
    probe, which :meth:`probes` reads for the rows asked.
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
    _probes: dict[frozenset[tuple[str, str, int]], pd.DataFrame] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def probes(self, rows: pd.DataFrame) -> pd.DataFrame:
        """``rows`` (diagnostic rows: ``search_id``, ``trial_id``, ``epoch``) with their probe's
        ``grad_norms`` (‖g_i‖ of each probe example) and ``labels``, in the order of ``rows``.

        Read from :attr:`sources` once per set of rows asked (a later dataset's row wins, as in
        ``load_results``); only the asked rows' probes are kept. A row without a probe gets NaN.
        """
        wanted = rows[_PROBE_KEY].drop_duplicates()
        key = frozenset(zip(wanted["search_id"], wanted["trial_id"], wanted["epoch"].astype(int), strict=True))
        if key not in self._probes:
            self._probes[key] = _read_probes(self.sources, wanted)
        return rows.merge(self._probes[key], on=_PROBE_KEY, how="left")

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
    """Read and join every table of the datasets at ``paths`` (see ``check_results_paths``), but the
    columns of :data:`UNREAD`.

    A dataset given twice, or two datasets sharing a search, contribute each trial once.
    """
    check_results_paths(paths)
    tables = {name: _read_table(paths, name) for name in TABLES}
    trials = tables["trials"].drop_duplicates(["search_id", "trial_id"], keep="last").reset_index(drop=True)
    trials["task"] = _task_labels(trials)
    tuned = trials["clipping"] != AUTO_S
    trials["clip_bin"], clip_binned = log_bins(
        trials["clip_bound"].where(tuned, np.nan), _sampled_from_range(tables["search"], "clip_bound")
    )
    trials["batch_bin"], batch_binned = log_bins(trials["batch_size"].astype(float))
    dedupe = {"epochs": ["epoch"], "classes": ["label"], "diagnostics": ["epoch"]}
    joined = {
        name: _one_chunk(
            _with_trial_keys(tables[name].drop_duplicates(["search_id", "trial_id", *extra], keep="last"), trials)
        )
        for name, extra in dedupe.items()
    }
    search = tables["search"].drop_duplicates().reset_index(drop=True)
    return Results(
        sources=tuple(paths),
        trials=_one_chunk(trials),
        search=_one_chunk(search),
        clip_binned=clip_binned,
        batch_binned=batch_binned,
        release=_one_chunk(tables["release"].drop_duplicates().reset_index(drop=True)),
        models=published_models(paths),
        **joined,
    )


def _read_table(paths: Sequence[str], table: str) -> pd.DataFrame:
    """``table`` of every dataset at ``paths``, concatenated, without the columns of :data:`UNREAD`."""
    columns = [name for name in SCHEMAS[table].names if name not in UNREAD.get(table, ())]
    return pd.concat([_read(path, table, columns) for path in paths], ignore_index=True)


def _read(path: str, table: str, columns: list[str]) -> pd.DataFrame:
    """``columns`` of ``table`` of the dataset at ``path``, read anew (the store's cache would keep every
    part's buffers) and held in one chunk per column."""
    return _one_chunk(ResultsStore(path, cache=None).read(table, columns))


def _one_chunk(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each Arrow-backed column (strings) in one chunk, in place; returned.

    A table read from one part per run, or concatenated and joined, holds such a column as one chunk per
    part, each keeping its part's read buffers alive (~30 kB a chunk) and making every ``take`` (sort,
    join, filter) walk them all; one chunk owns only its values.
    """
    for name in frame.columns:
        if isinstance(frame[name].array, pd.arrays.ArrowExtensionArray):
            chunked = pa.array(frame[name])
            if isinstance(chunked, pa.ChunkedArray) and chunked.num_chunks != 1:
                frame[name] = pd.Series(pd.array(chunked.combine_chunks(), dtype=frame[name].dtype), index=frame.index)
    return frame


def _task_labels(trials: pd.DataFrame) -> pd.Series:
    """``task_label`` of each trial, computed once per task (not once per trial)."""
    keys = trials[list(TASK_COLUMNS)]
    tasks = keys.drop_duplicates()
    tasks = tasks.assign(task=[task_label(*row) for row in tasks.itertuples(index=False)])
    labels = keys.merge(tasks, on=list(TASK_COLUMNS), how="left")["task"]
    return pd.Series(labels.to_numpy(), index=trials.index, dtype="str")


def _read_probes(paths: Sequence[str], wanted: pd.DataFrame) -> pd.DataFrame:
    """The probes (:data:`PROBE_COLUMNS`) of the diagnostic rows ``wanted`` (keyed by ``_PROBE_KEY``) in the
    datasets at ``paths``; a later dataset's row wins. Only the wanted trials' rows are read
    (``ResultsStore.read``'s ``trial_ids``), one dataset after the other."""
    columns = [*_PROBE_KEY, *PROBE_COLUMNS]
    if wanted.empty:
        return wanted.assign(**{name: pd.Series(dtype=object) for name in PROBE_COLUMNS})
    trial_ids = set(wanted["trial_id"])
    found = [
        ResultsStore(path, cache=None).read("diagnostics", columns, trial_ids).merge(wanted, on=_PROBE_KEY)
        for path in paths
    ]
    probes = pd.concat(found, ignore_index=True).drop_duplicates(_PROBE_KEY, keep="last")
    return _one_chunk(probes.reset_index(drop=True))


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
                    "num_test": accuracy.get("num_test"),
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
