"""A finished search: its summary and report, shown again without writing to its results folder.

``--resume`` of a search that ran to its end (its ``search`` rows exist) computes nothing: it prints
the summary and rebuilds the report. That needs no lease and no write to the results folder, so it
works on a read-only copy too (a results pod's volume, an archived folder); a report location that
cannot be written is said so, and the summary is shown all the same. A Ctrl+C once every run is recorded
says so, and what is not done yet (:func:`composing`, :func:`conclude`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from dptune.errors import SearchInterrupted, stop_named
from dptune.paths import LocationError, probe_writable
from dptune.records import read_table
from dptune.search import preflight
from dptune.search.finish.outcome import summary_text
from dptune.search.finish.tracking import log_search

if TYPE_CHECKING:
    from dptune.search.options import SearchOptions
    from dptune.space import LoadedSpace
    from dptune.space.tracking import TrackingSpec


def report_location(results_root: str, report_dir: str | None) -> str:
    """Where the report goes: ``report_dir`` (absolute, or a URI) or ``<results_root>/report``."""
    if report_dir is None:
        return f"{results_root}/report"
    return report_dir.rstrip("/") if "://" in report_dir else str(Path(report_dir).expanduser().resolve())


def search_finished(results_root: str, search_id: str) -> bool:
    """Whether the search ``search_id`` ran to its end at ``results_root`` (its ``search`` rows exist)."""
    return search_id in set(read_table(results_root, "search", columns=["search_id"])["search_id"])


#: What a Ctrl+C (or SIGTERM: ``{how}``) says of a search it stopped after every run was recorded (``--resume``
#: then trains nothing).
STOPPED_COMPOSING = (
    "stopped by {how} after every run was recorded, before the search's outcome was written (its privacy "
    "cost, the models it hands back, its summary). Run the same command with --resume to write it; nothing trains again"
)


@contextlib.contextmanager
def composing() -> Iterator[None]:
    """Around what a search does once every run is recorded (composing its privacy cost, publishing its
    models, writing its ``search`` rows, :func:`conclude`): a Ctrl+C there raises ``SearchInterrupted``
    (exit status 130) with ``STOPPED_COMPOSING``, where the command's own handler would say that the search
    stopped before it finished its runs."""
    try:
        yield
    except KeyboardInterrupt as interrupt:
        how, number = stop_named(interrupt)
        raise SearchInterrupted(STOPPED_COMPOSING.format(how=how), number) from None


def conclude(results_root: str, report: str | None, search_id: str, tracking: TrackingSpec, *, private: bool) -> None:
    """Print where the results are and the summary (``outcome.summary_text``); build the report at
    ``report`` (unless ``None``); then log the search ``search_id`` to ``tracking.mlflow``, if set
    (``tracking.log_search``: a failure there only warns). A Ctrl+C on the way raises
    ``SearchInterrupted`` (exit status 130) saying that the search finished and which of these steps
    are not done (``--resume`` does them again, training nothing)."""
    print(f"results: {results_root}")
    done = [f"its results are at {results_root}"]
    undone = ["its summary"]
    if report is not None:
        undone.append(f"its report ({report})")
    if tracking.mlflow is not None:
        undone.append(f"its record in MLflow ({tracking.mlflow})")
    try:
        print(summary_text(results_root, private=private))
        done.append(f"{undone.pop(0)} is above")
        if report is not None:
            print(f"report: {build_report_at(results_root, report)}")
            done.append(f"{undone.pop(0)} is built")
        log_search(tracking, results_root, search_id, private=private, report=report)
    except KeyboardInterrupt as interrupt:
        how, number = stop_named(interrupt)
        raise SearchInterrupted(
            f"stopped by {how} after the search finished: {', '.join(done)}; not done: {', '.join(undone)}. "
            "Run the same command with --resume to do what is not done; it trains nothing",
            number,
        ) from None


def build_report_at(results_root: str, location: str) -> str:
    """Build the report of ``results_root`` into folder ``location`` (a local path, or a URI: built
    in a temporary folder, then copied through ``pyarrow.fs``); return its index.html's location."""
    from dptune.report import build_report

    if "://" not in location:
        return str(build_report([results_root], location))
    import tempfile

    import pyarrow.fs as pafs

    filesystem, path = pafs.FileSystem.from_uri(location)
    with tempfile.TemporaryDirectory(prefix="dptune-report-") as local:
        build_report([results_root], local)
        filesystem.create_dir(path, recursive=True)
        pafs.copy_files(local, path, destination_filesystem=filesystem)
    return f"{location}/index.html"


def show_if_finished(
    options: SearchOptions, loaded: LoadedSpace, name: str, results_root: str, *, runs: str, private: bool
) -> bool:
    """On ``--resume`` (not ``--dry-run``) of a finished search: say so, print its summary and rebuild its
    report where the report location takes a file (else say why not); return whether it was finished.
    ``runs``: where its per-run records are (``records.runs_root``; ``private``: an end-to-end private
    search's, inside its trust boundary). Reads only: the space must be the one the search ran
    (``preflight.check_same_space``), and an unreadable part is refused as a search would refuse it
    (``preflight.check_results_folder``)."""
    if not options.resume or options.dry_run:
        return False
    for root in dict.fromkeys((results_root, runs)):
        preflight.check_results_folder(root, quarantine=False, move=False)
    search_id = preflight.folder_search_id(runs, loaded, name, resume=True, dry_run=True, unreadable=[])
    if not search_finished(results_root, search_id):
        return False
    preflight.check_same_space(runs, loaded)
    print(f"--resume: search {search_id} at {results_root} is finished; nothing to run")
    report = report_location(results_root, options.report_dir) if options.report else None
    if report is not None:
        try:
            probe_writable(report, "--report-dir" if options.report_dir else "the report location (--report-dir)")
        except LocationError as error:
            print(f"warning: the report is not rebuilt: {error}", file=sys.stderr, flush=True)
            report = None
    conclude(results_root, report, search_id, loaded.space.tracking, private=private)
    return True
