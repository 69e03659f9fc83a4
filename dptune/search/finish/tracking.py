"""A search logged to an MLflow tracking server (``tracking.mlflow``; the extra ``dptune[mlflow]``).

:func:`check_server`, before anything loads or trains: MLflow's client is installed, the server
answers (one try, ``CHECK_TIMEOUT_S``) and the experiment ``tracking.experiment`` is not deleted there,
else ``PreflightError`` naming the key. ``live_tracking.live_logging``, around a search's runs (never a
private search's): a thread logs each run once its records are written. :func:`log_search`, once the
search's own records are written (runs, models, ``search`` and ``release`` tables, report): reads them
back and logs what is missing. A failure of either is one warning line: the search, its records and the
command's exit status stay what they are, and ``--resume`` logs what is missing.

What reaches the server, in the experiment ``tracking.experiment`` (by default one per search id; several
searches may share one, their runs told apart by their ``INSTANCE_TAG``), which is tagged as a classic
experiment (``EXPERIMENT_KIND_TAG``, so MLflow 3's UI does not open it as a GenAI one):

- without private selection: a run ``search`` (started with the runs; at the end the summary, the
  report, the recorded space and the whole search's ε), and nested under it one run per ``trials``
  row, logged as it is recorded: its configuration, (ε, δ), σ, q and T as params, its accuracies,
  losses, ε spent and per-epoch curves as metrics, its start and end from the record; at the end each
  published model folder (``models/<cell>/``) goes to the run of the trial it came from as an MLflow
  pyfunc model at artifact path ``model`` (:mod:`dptune.search.finish.mlflow_model`);
- an end-to-end private search, at the end only: per cell one run, its release: the ``release`` row's
  configuration with the model card's σ, q and T, its noisy score (test accuracy where the test split
  is public), (ε_total, δ), the pyfunc model, the summary and the report; nothing from inside the trust
  boundary (no run per tuning run, no count of runs, no trial id, no time of a run), and the experiment
  (when it is the search's own) is created after the search, so its times do not bracket it.

With ``tracking.registered_model: NAME`` each published model is registered as a version of the
registered model of its cell, ``NAME-<model folder name>`` (``mlflow_model.registered_name``), whose
source is its run's ``model``: one registered model per cell, one version per search. Idempotent: every
run carries the tag ``DPTUNE_RUN_TAG`` (a trial id, ``search``, or ``release <label>``:
``records.release_label``); a finished one is not logged again, an unfinished one (a failed earlier
attempt) is deleted and logged again (the ``search`` run, which ends last, is kept: its nested runs point
to it); a run's model is logged once (``MODEL_TAG``) and registered once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow.fs as pafs

from dptune import __version__
from dptune.errors import DptuneError, shown
from dptune.paths import filesystem, read_file
from dptune.records import read_table, release_label
from dptune.records.weights import CARD_JSON, MODELS_FOLDER
from dptune.search.finish.outcome import summary_text
from dptune.search.finish.publish import CONFIG_COLUMNS
from dptune.search.preflight import PreflightError
from dptune.space.tracking import TrackingSpec

if TYPE_CHECKING:
    from mlflow.entities import Metric, Run
    from mlflow.tracking import MlflowClient

#: Seconds the check before compute waits for the server (one try, no retry).
CHECK_TIMEOUT_S = 5
#: MLflow's HTTP settings for the check: forced, so a server that is down is told in seconds.
CHECK_SETTINGS = MappingProxyType(
    {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(CHECK_TIMEOUT_S), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
)
#: MLflow's HTTP settings for logging, unless the environment sets them (MLflow's own defaults retry
#: a request 7 times over minutes); and no "View run at" line per run nor progress bar per model on the console.
LOGGING_SETTINGS = MappingProxyType(
    {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }
)
#: The tag that names what a run holds: a trial id, ``search`` or ``release <release label>``.
DPTUNE_RUN_TAG = "dptune.run"
#: The tag that tells two searches of one experiment apart, and two searches of one id (the same space
#: run again in another folder, or after its folder was removed: the same trial ids). Drawn at random
#: when a search's live logging first starts and kept in its results folder (``INSTANCE_FILE``); a
#: search logged only once it finished (a private one, or one run without tracking) has instead a digest
#: of its ``search`` and ``release`` rows (:func:`_instance`), which a finished search writes once.
INSTANCE_TAG = "dptune.instance"
#: The file in a search's results folder that keeps its ``INSTANCE_TAG`` (``{"instance": hex}``).
INSTANCE_FILE = "mlflow_instance.json"
#: The experiment tag MLflow 3 reads for the kind of an experiment, and the kind of a classic one
#: (training models, not GenAI: MLflow's UI opens it on its runs).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
CLASSIC_EXPERIMENT = "custom_model_development"
#: Where a run's pyfunc model goes (a registered version's source is ``runs:/<run id>/model``).
MODEL_ARTIFACT = "model"
#: The tag a run gets once its pyfunc model is logged whole: the model folder's name.
MODEL_TAG = "dptune.model"
#: A ``trials`` row's params: its configuration and budget (besides ``publish.CONFIG_COLUMNS``).
TRIAL_PARAMS = ("epsilon", "delta", "replicate", "dataset", "backbone", "peft", "fraction", "engine")
#: A ``trials`` row's metrics (missing values are left out).
TRIAL_METRICS = (
    "val_accuracy",
    "test_accuracy",
    "noisy_val_accuracy",
    "train_loss",
    "epsilon_spent",
    "steps_taken",
    "wall_time_s",
    "examples_per_s",
)
#: The ``epochs`` table's curves, logged as ``epoch_<name>`` with the epoch as MLflow's step.
EPOCH_METRICS = ("train_loss", "val_loss", "val_accuracy", "test_accuracy")
#: A ``release`` row's params (the configuration besides the card's, and the selection's public numbers).
RELEASE_PARAMS = (
    "epsilon_per_trial",
    "score_noise_multiplier",
    "mean_trials",
    "trial_count_shape",
    "tuning_fraction",
    "transfer",
)
#: The whole search's cost, from its ``search`` rows (every row alike), as the ``search`` run's metrics.
SEARCH_METRICS = ("epsilon_search", "epsilon_search_basic", "delta_search_basic", "runs_charged", "runs_unrecorded")
#: Most params and metrics one ``log_batch`` request carries (MLflow's limit).
METRICS_PER_REQUEST = 1000


def check_server(tracking: TrackingSpec) -> None:
    """Refuse, before any compute, a ``tracking.mlflow`` whose client is not installed or whose server
    does not answer within ``CHECK_TIMEOUT_S`` or refuses (its credentials, no model registry when
    ``registered_model`` is set), and a ``tracking.experiment`` that is deleted on the server:
    ``PreflightError`` naming the key. Nothing to check without ``tracking.mlflow``."""
    uri = tracking.mlflow
    if uri is None:
        return
    where = f"tracking.mlflow {shown(uri)}"
    if importlib.util.find_spec("mlflow") is None:
        raise PreflightError(
            f"{where}: MLflow's client is not installed (install dptune's extra: pip install 'dptune[mlflow]'), "
            "or remove tracking.mlflow; nothing was loaded or trained"
        )
    with mlflow_settings(CHECK_SETTINGS, force=True):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        try:
            client.search_experiments(max_results=1)
            if tracking.registered_model is not None:
                client.search_registered_models(max_results=1)
            named = None if tracking.experiment is None else client.get_experiment_by_name(tracking.experiment)
        except Exception as error:  # whatever the client raises: refused, timed out, 401, not MLflow
            raise PreflightError(
                f"{where}: the MLflow tracking server does not answer or refuses ({reason(error)}); start it, correct "
                "the URL or its credentials (MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or "
                "MLFLOW_TRACKING_TOKEN), or remove tracking.mlflow; nothing was loaded or trained"
            ) from None
    if named is not None and named.lifecycle_stage != "active":
        raise PreflightError(_deleted(str(tracking.experiment)) + "; nothing was loaded or trained")


def _deleted(experiment: str) -> str:
    """What a ``tracking.experiment`` deleted on the server is told, and what to do."""
    return (
        f"tracking.experiment {shown(experiment)}: the experiment is deleted on the MLflow server; restore it "
        f"(mlflow experiments restore) or name another one"
    )


def log_search(tracking: TrackingSpec, results_root: str, search_id: str, *, private: bool, report: str | None) -> None:
    """Log the finished search ``search_id`` at ``results_root`` to ``tracking.mlflow`` (nothing without
    it; nothing but a note when the search has no ``search`` rows, i.e. did not finish); ``private``: an
    end-to-end private search, whose releases alone are logged; ``report``: the report's folder (logged
    when it holds an ``index.html`` on this machine). Prints one line saying where, or on any failure one
    warning naming the URL and what failed."""
    uri = tracking.mlflow
    if uri is None:
        return
    logger = SearchLogger(tracking, uri, results_root, search_id, private, report)
    try:
        with mlflow_settings(LOGGING_SETTINGS, force=False):
            done = logger.log()
    except Exception as error:  # the search's records are written: a tracking failure only warns
        warn(
            f"tracking.mlflow {uri}: {logger.doing} failed ({reason(error)}); the search's records at "
            f"{results_root} are complete (run the same command with --resume to log what is missing)"
        )
        return
    print(f"mlflow: {done}", flush=True)


class SearchLogger:
    """One logging of one search (:func:`log_search`, ``live_tracking.live_logging``); ``doing`` says what it
    was doing, for a warning; ``created`` counts the runs it created."""

    def __init__(
        self, tracking: TrackingSpec, uri: str, results_root: str, search_id: str, private: bool, report: str | None
    ) -> None:
        self.tracking, self.uri, self.results_root = tracking, uri, results_root
        self.search_id, self.private, self.report = search_id, private, report
        self.doing = "connecting"
        self.created = 0

    def open(self, instance: str) -> None:
        """Connect, open the experiment (created if missing) and read the runs of ``instance`` in it."""
        from mlflow.tracking import MlflowClient

        self.instance = instance
        self.client: MlflowClient = MlflowClient(self.uri)
        name = self.tracking.experiment or self.search_id
        self.doing = f"opening the experiment {name}"
        self.experiment_id = self._experiment(name)
        self.runs = self._active_runs()
        self.run_ids = {key: run.info.run_id for key, run in self.runs.items()}
        self.modelled = {run.info.run_id for run in self.runs.values() if MODEL_TAG in run.data.tags}

    def _experiment(self, name: str) -> str:
        """The id of the experiment ``name``, created (tagged classic) if missing; a classic kind is set on
        one that has none."""
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            tags = {EXPERIMENT_KIND_TAG: CLASSIC_EXPERIMENT, "dptune.version": __version__}
            if self.tracking.experiment is None:  # the search's own
                tags["dptune.search_id"] = self.search_id
            return str(self.client.create_experiment(name, tags=tags))
        if experiment.lifecycle_stage != "active":
            raise DptuneError(_deleted(name))
        if EXPERIMENT_KIND_TAG not in experiment.tags:
            self.client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, CLASSIC_EXPERIMENT)
        return str(experiment.experiment_id)

    def log(self) -> str:
        """Log what is missing of the finished search; return the line that says where."""
        search = read_table(self.results_root, "search")
        search = search[search["search_id"] == self.search_id]
        if search.empty:
            return f"nothing logged to {self.uri}: the search {self.search_id} has not finished"
        releases = read_table(self.results_root, "release")
        releases = releases[releases["search_id"] == self.search_id]
        self.open(_instance(self.results_root, search, releases))
        with _local_copy(f"{self.results_root.rstrip('/')}/{MODELS_FOLDER}") as models:
            cards = {card.parent: json.loads(card.read_text()) for card in sorted(models.glob(f"*/{CARD_JSON}"))}
            if self.private:
                logged = self._log_releases(releases, cards)
            else:
                logged, total = self._log_search(search.iloc[0].to_dict(), cards)
        if self.tracking.registered_model is not None:
            self._register(self.tracking.registered_model, logged)
        where = f"{self.uri}/#/experiments/{self.experiment_id}"
        if self.private:  # how many runs it holds is not said: a cell without a release has none
            return f"the release is logged at {where}"
        return f"{total} run(s) logged to {where}" + ("" if self.created == total else f" ({self.created} of them now)")

    # ----------------------------------------------------------------------- runs

    def _active_runs(self) -> dict[str, Run]:
        """The runs of this search's ``INSTANCE_TAG`` that are not deleted, by their ``DPTUNE_RUN_TAG``."""
        found: dict[str, Run] = {}
        token: str | None = None
        mine = f"tags.`{INSTANCE_TAG}` = '{self.instance}'"
        while True:
            page = self.client.search_runs([self.experiment_id], mine, max_results=1000, page_token=token)
            found |= {run.data.tags[DPTUNE_RUN_TAG]: run for run in page if DPTUNE_RUN_TAG in run.data.tags}
            token = page.token
            if not token:
                return found

    def _start(self, key: str, tags: dict[str, str], start_ms: int | None = None) -> str | None:
        """A new run for ``key`` (None: a finished one holds it); an unfinished one is deleted first."""
        existing = self.runs.get(key)
        if existing is not None:
            if existing.info.status == "FINISHED":
                return None
            self.client.delete_run(existing.info.run_id)
        return self._create(key, tags, start_ms)

    def _create(self, key: str, tags: dict[str, str], start_ms: int | None = None, name: str | None = None) -> str:
        tags = {
            DPTUNE_RUN_TAG: key,
            INSTANCE_TAG: self.instance,
            "dptune.search_id": self.search_id,
            "dptune.version": __version__,
            **tags,
        }
        self.created += 1
        run_id = self.client.create_run(self.experiment_id, start_ms, tags, name or key).info.run_id
        self.run_ids[key] = str(run_id)
        return str(run_id)

    def _values(self, run_id: str, params: dict[str, Any], metrics: list[Metric]) -> None:
        from mlflow.entities import Param

        kept = [Param(name, str(value)) for name, value in params.items() if not _missing(value)]
        first = METRICS_PER_REQUEST - len(kept)  # the params and the first metrics in one request
        self.client.log_batch(run_id, metrics=metrics[:first], params=kept)
        for start in range(first, len(metrics), METRICS_PER_REQUEST):
            self.client.log_batch(run_id, metrics=metrics[start : start + METRICS_PER_REQUEST])

    def parent(self) -> str:
        """The ``search`` run's id: this search's (an unfinished one is kept: it holds the runs logged
        before), else a new one, named by the search's id."""
        if (kept := self.run_ids.get("search")) is not None:
            return kept
        return self._create("search", {}, name=self.search_id)

    def _log_search(
        self, row: dict[str, Any], cards: dict[Path, dict[str, Any]]
    ) -> tuple[list[tuple[str, dict[str, Any]]], int]:
        """The runs not logged yet, each published model in the run of its trial, then the ``search`` run's
        values, which end last (finished, it says the whole search is logged). Returns (run id, card) per
        model and how many runs the search has."""
        self.doing = "logging the search run"
        parent = self.runs.get("search")
        parent_id = self.parent()
        every_trial = read_table(self.results_root, "trials")  # read once: the summary shows every search's
        trials = every_trial[every_trial["search_id"] == self.search_id]
        epochs = read_table(self.results_root, "epochs")
        curves = {trial: frame for trial, frame in epochs[epochs["search_id"] == self.search_id].groupby("trial_id")}
        for trial in trials.to_dict("records"):
            self.log_trial(trial, curves.get(trial["trial_id"]), parent_id)
        models = []
        for folder, card in cards.items():
            run_id = self.run_ids[card["model"]["trial_id"]]
            self._log_model(run_id, folder, card)
            models.append((run_id, card))
        if parent is None or parent.info.status != "FINISHED":
            self.doing = "logging the search run"
            now = _now_ms()
            metrics = [_metric(name, row[name], now) for name in SEARCH_METRICS if not _missing(row[name])]
            self._values(parent_id, {name: row[name] for name in ("name", "dataset", "backbone", "peft")}, metrics)
            with tempfile.TemporaryDirectory(prefix="dptune-mlflow-") as files:
                Path(files, "summary.txt").write_text(
                    summary_text(self.results_root, private=False, trials=every_trial) + "\n"
                )
                Path(files, "space.yaml").write_text(str(row["spec_yaml"]))
                self.client.log_artifacts(parent_id, files)
            self._log_report(parent_id)
            self.client.set_terminated(parent_id)
        return models, len(trials) + 1

    def log_trial(self, trial: dict[str, Any], curve: Any, parent_id: str) -> None:
        """One ``trials`` row as a run nested under ``parent_id``, unless logged before; ``curve``: its
        ``epochs`` rows (or None)."""
        self.doing = f"logging run {trial['trial_id']}"
        finished = None if _missing(trial["finished_at"]) else int(trial["finished_at"].timestamp() * 1000)
        wall = 0.0 if _missing(trial["wall_time_s"]) else float(trial["wall_time_s"])
        tags = {
            "mlflow.parentRunId": parent_id,
            "dptune.cell_id": str(trial["cell_id"]),
            "dptune.configuration_id": str(trial["configuration_id"]),
            "dptune.status": str(trial["status"]),
        }
        run_id = self._start(trial["trial_id"], tags, None if finished is None else finished - round(wall * 1000))
        if run_id is None:
            return
        stamp = finished or _now_ms()
        metrics = [_metric(name, trial[name], stamp) for name in TRIAL_METRICS if not _missing(trial[name])]
        if curve is not None:
            metrics += [
                _metric(f"epoch_{name}", value, stamp, int(epoch))
                for epoch, *values in curve[["epoch", *EPOCH_METRICS]].itertuples(index=False)
                for name, value in zip(EPOCH_METRICS, values, strict=True)
                if not _missing(value)
            ]
        self._values(run_id, {name: trial[name] for name in (*CONFIG_COLUMNS, *TRIAL_PARAMS)}, metrics)
        self.client.set_terminated(run_id, end_time=finished)

    def _log_model(self, run_id: str, folder: Path, card: dict[str, Any]) -> None:
        """The published model ``folder`` as the run's pyfunc model ``MODEL_ARTIFACT``, with the intervals
        its ``card`` prints as metrics (:func:`card_interval_metrics`), unless logged before (the run's
        ``MODEL_TAG``, set once it is whole)."""
        if run_id in self.modelled:
            return
        from dptune.search.finish.mlflow_model import log_pyfunc

        self.doing = f"logging the model {folder.name}"
        now = _now_ms()
        self.client.log_batch(run_id, metrics=[_metric(k, v, now) for k, v in card_interval_metrics(card).items()])
        log_pyfunc(self.client, run_id, folder, MODEL_ARTIFACT)
        self.client.set_tag(run_id, MODEL_TAG, folder.name)
        self.modelled.add(run_id)

    def _log_releases(
        self, releases: pd.DataFrame, cards: dict[Path, dict[str, Any]]
    ) -> list[tuple[str, dict[str, Any]]]:
        """Per ``release`` row one run: the release and its model; returns (run id, card) per model."""
        by_cell = {card["model"]["cell_id"]: (folder, card) for folder, card in cards.items()}
        models = []
        for release in releases.to_dict("records"):
            label = release_label(release)  # its own total (ε, δ), as its model folder and card name it
            key = f"release {label}"
            self.doing = f"logging the {key}"
            folder, card = by_cell[label]
            run_id = self._start(key, {"dptune.release": label})
            if run_id is not None:
                now = _now_ms()
                public_test = bool(release["test_split_public"])
                values = {
                    "noisy_val_accuracy": release["noisy_val_accuracy"],
                    "test_accuracy": release["test_accuracy"] if public_test else None,
                    "epsilon": release["epsilon_total"],
                    "delta": release["delta_total"],
                }
                metrics = [_metric(name, value, now) for name, value in values.items() if not _missing(value)]
                params = {
                    **card["configuration"],
                    **{name: release[name] for name in RELEASE_PARAMS},
                    "dataset": card["data"]["dataset"],
                    "backbone": card["data"].get("backbone"),
                    "peft": card["peft"],
                }
                self._values(run_id, params, metrics)
                self._log_model(run_id, folder, card)
                with tempfile.TemporaryDirectory(prefix="dptune-mlflow-") as summary:
                    Path(summary, "summary.txt").write_text(summary_text(self.results_root, private=True) + "\n")
                    self.client.log_artifacts(run_id, summary)
                self._log_report(run_id)
                self.client.set_terminated(run_id)
            models.append((self.run_ids[key], card))
        return models

    def _log_report(self, run_id: str) -> None:
        """The report folder as the run's artifacts ``report/``, when it was built (holds ``index.html``)."""
        if self.report is None:
            return
        self.doing = "uploading the report"
        with _local_copy(self.report) as report:
            if (report / "index.html").is_file():
                self.client.log_artifacts(run_id, str(report), "report")

    # ----------------------------------------------------------------------- the model registry

    def _register(self, base: str, models: list[tuple[str, dict[str, Any]]]) -> None:
        """Each model as a version of its cell's registered model (``mlflow_model.registered_name``),
        unless its run has one there."""
        from dptune.search.finish.mlflow_model import register_version, registered_name

        for run_id, card in models:
            self.doing = f"registering the model as {registered_name(base, card)}"
            register_version(self.client, base, card, f"runs:/{run_id}/{MODEL_ARTIFACT}", run_id, self.search_id)


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _local_copy(location: str) -> Iterator[Path]:
    """A temporary copy of the folder ``location`` (a local path or a URI, read through ``pyarrow.fs``),
    empty when there is no such folder; removed on the way out."""
    fs, path = filesystem(location)
    local = Path(tempfile.mkdtemp(prefix="dptune-mlflow-"))
    try:
        if fs.get_file_info(path).type == pafs.FileType.Directory:
            pafs.copy_files(path, str(local), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


@contextlib.contextmanager
def mlflow_settings(values: Mapping[str, str], *, force: bool) -> Iterator[None]:
    """MLflow's environment settings ``values`` (``force``: over the environment's own) and its and
    urllib3's loggers at ERROR (dptune says what failed in one line), restored on the way out."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if force or saved[name] is None})
    loggers = {name: logging.getLogger(name) for name in ("mlflow", "urllib3")}
    levels = {name: logger.level for name, logger in loggers.items()}
    for logger in loggers.values():
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, logger in loggers.items():
            logger.setLevel(levels[name])
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _instance(results_root: str, search: pd.DataFrame, releases: pd.DataFrame) -> str:
    """A finished search's ``INSTANCE_TAG``: the one its live logging kept (:func:`kept_instance`), else a
    digest of its ``search`` and ``release`` rows (public tables): a search's own (its rows'
    ``created_at``, or a private search's released configuration, drawn from fresh entropy), the same at
    every ``--resume``."""
    if (kept := kept_instance(results_root)) is not None:
        return kept
    rows = [search.to_dict("records"), releases.to_dict("records")]
    return hashlib.sha256(json.dumps(rows, default=str, sort_keys=True).encode()).hexdigest()[:16]


def kept_instance(results_root: str) -> str | None:
    """The ``INSTANCE_TAG`` kept in the results folder's ``INSTANCE_FILE`` (None: there is none)."""
    kept = read_file(results_root, INSTANCE_FILE)
    return None if kept is None else str(json.loads(kept)["instance"])


def card_interval_metrics(card: dict[str, Any]) -> dict[str, float]:
    """The accuracy intervals a model card prints, as MLflow metrics: ``<accuracy>_low``/``_high`` for
    each of its intervals (the model's, and its configuration's over replicates where it has one), the
    numbers the card, the search's summary and its report print."""
    accuracy = card["accuracy"]
    metrics = {}
    for name, value in accuracy.items():
        if name.endswith("_interval") and value is not None:
            measured = name.removesuffix("_interval") + "_accuracy"  # val_interval: val_accuracy_low/_high
            metrics[f"{measured}_low"], metrics[f"{measured}_high"] = float(value[0]), float(value[1])
    if accuracy.get("configuration_test_mean") is not None:
        metrics["configuration_test_accuracy"] = float(accuracy["configuration_test_mean"])
    return metrics


def _metric(name: str, value: Any, timestamp_ms: int, step: int = 0) -> Metric:
    from mlflow.entities import Metric

    return Metric(name, float(value), timestamp_ms, step)


def _missing(value: Any) -> bool:
    """None, NaN or NaT: a value a record does not have."""
    return bool(pd.isna(value))


def _now_ms() -> int:
    return int(time.time() * 1000)


def warn(line: str) -> None:
    """``line`` as one warning on stderr."""
    print(f"warning: {line}", file=sys.stderr, flush=True)


def reason(error: BaseException) -> str:
    """What went wrong, short: the OS error MLflow's message wraps (``[Errno 111] Connection refused``),
    else the first line of the message (at most 200 characters), else the error's type."""
    text = str(error).strip()
    if match := re.search(r"\[Errno -?\d+\][^'\")\]]*", text):
        return match.group(0).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
