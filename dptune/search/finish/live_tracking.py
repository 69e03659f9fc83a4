"""A search's runs logged to MLflow as they are recorded (``tracking.mlflow``; :mod:`dptune.search.finish.tracking`
logs the rest once the search has finished: its ``search`` run's values, its models, its report).

:func:`live_logging` goes around the search's runs (``driver.run_units``). Its thread looks at the
per-run records every ``LIVE_POLL_S`` (one listing of the ``trials`` folder; a run's ``trials`` row is
written last, so a run listed there is whole) and logs each new run of the search, nested under the
``search`` run it starts; a run logged before (``--resume``) is not logged again. Never for an end-to-end
private search: when its runs end, and how many there are, stay inside its trust boundary.

The search's ``INSTANCE_TAG`` must be known before it finishes: it is drawn at random the first time and
kept in the results folder (``tracking.INSTANCE_FILE``), so a resumed, copied or moved folder logs to the
same runs and a search run again in a new folder to new ones.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
from collections.abc import Iterator
from types import MappingProxyType

from dptune.paths import write_file_atomic
from dptune.records import ResultsStore
from dptune.search.finish.tracking import INSTANCE_FILE, SearchLogger, kept_instance, mlflow_settings, reason, warn
from dptune.space.tracking import TrackingSpec

#: Seconds between two looks of the live logging (:func:`live_logging`) for newly recorded runs.
LIVE_POLL_S = 5.0
#: Seconds one try of a request of the live logging may take. A request is tried twice (the second try at
#: once: an idle connection the server closed between two looks fails its first), so a server that does not
#: answer stops the live logging within ``2 * LIVE_TIMEOUT_S`` (the end's logging logs the rest); a slow one
#: that answers costs the search's end at most the requests of the run being logged.
LIVE_TIMEOUT_S = 10
#: MLflow's HTTP settings while logging live (forced; no "View run at" line per run).
LIVE_SETTINGS = MappingProxyType(
    {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(LIVE_TIMEOUT_S),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    }
)


@contextlib.contextmanager
def live_logging(tracking: TrackingSpec, results_root: str, search_id: str, *, private: bool) -> Iterator[None]:
    """Around a search's runs: with ``tracking.mlflow`` and unless ``private`` (a private search's runs,
    their number and their times stay inside its trust boundary), a thread logs each run of ``search_id``
    within about ``LIVE_POLL_S`` of its record at ``results_root``, nested under the ``search`` run it
    starts. On the way out it is stopped after the run it is logging (waited for: a few requests, each
    given up after ``2 * LIVE_TIMEOUT_S`` at most, and the first that fails stops the thread; not waited
    for when the search raised). A failure stops it with one warning
    line; ``tracking.log_search`` logs what it did not at the end."""
    if tracking.mlflow is None or private:
        yield
        return
    with mlflow_settings(LIVE_SETTINGS, force=True):
        live = _LiveLogger(SearchLogger(tracking, tracking.mlflow, results_root, search_id, False, None))
        live.start()
        try:
            yield
        except BaseException:
            live.stopping.set()
            raise
        live.stopping.set()
        live.join()


class _LiveLogger(threading.Thread):
    """The thread of :func:`live_logging`: logs the runs of its ``logger``'s search as they are recorded
    until ``stopping`` is set."""

    def __init__(self, logger: SearchLogger) -> None:
        super().__init__(name="dptune-mlflow-live", daemon=True)
        self.logger = logger
        self.stopping = threading.Event()

    def run(self) -> None:
        logger = self.logger
        try:
            logger.open(_live_instance(logger.results_root))
            parent_id = logger.parent()
            store = ResultsStore(logger.results_root, cache=None)
            seen: set[str] = set()
            while not self.stopping.is_set():
                logger.doing = "reading the recorded runs"
                if new := sorted(store.completed_trial_ids() - seen):
                    seen.update(new)
                    self._log_trials(store, new, parent_id)
                self.stopping.wait(LIVE_POLL_S)
        except Exception as error:  # the search goes on; log_search logs what is missing at its end
            warn(
                f"tracking.mlflow {logger.uri}: logging runs as they finish stopped: {logger.doing} failed "
                f"({reason(error)}); what is missing is logged when the search ends"
            )

    def _log_trials(self, store: ResultsStore, trial_ids: list[str], parent_id: str) -> None:
        """The recorded runs ``trial_ids`` of this search (those of another search in the folder are skipped),
        one by one until ``stopping`` is set."""
        trials = store.read("trials", trial_ids=trial_ids)
        trials = trials[trials["search_id"] == self.logger.search_id]
        if trials.empty:
            return
        epochs = store.read("epochs", trial_ids=list(trials["trial_id"]))
        curves = {trial: frame for trial, frame in epochs.groupby("trial_id")}
        for trial in trials.to_dict("records"):
            if self.stopping.is_set():
                return
            self.logger.log_trial(trial, curves.get(trial["trial_id"]), parent_id)


def _live_instance(results_root: str) -> str:
    """The ``INSTANCE_TAG`` of the search at ``results_root`` whose runs are logged live: kept in its
    ``INSTANCE_FILE``, drawn at random (and written) the first time."""
    if (kept := kept_instance(results_root)) is not None:
        return kept
    instance = secrets.token_hex(8)
    write_file_atomic(results_root, INSTANCE_FILE, json.dumps({"instance": instance}).encode())
    return instance
