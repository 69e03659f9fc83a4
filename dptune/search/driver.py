"""The search driver: checks, the results folder's lease, the workload, the cell plans, one Ray
Tune run for every cell, the search's privacy cost from its ledger, the summary and the report.

A search runs as named phases over one :class:`SearchSession`: :func:`load` → :func:`check` →
:func:`plan` → :func:`start_ray` → :func:`run_units` → :func:`finish`. What differs between the shapes
of a search (a per-cell search, end-to-end private selection, tuning on a secret subsample) is its
mode's (:mod:`dptune.search.modes`: its plan, its Tune units, its records, its release and its privacy
statement): the driver asks it and never branches on the shape.

The driver does not import Ray: starting or joining it and the Tune run are :mod:`dptune.search.scheduling`'s
(the only place Ray is imported); a trial (``dptune.runners.trial.run_trial``) is a plain function.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dptune import __version__
from dptune.errors import SearchError, SearchIncomplete
from dptune.paths import check_name, filesystem, probe_writable
from dptune.records import ResultsStore, compact_records, read_table
from dptune.records.ledger import charged_runs, unreadable_ends
from dptune.runners.trial import check_trial_can_run
from dptune.search import preflight
from dptune.search.damaged_ledger import charge_unreadable_starts
from dptune.search.finish.live_tracking import live_logging
from dptune.search.finish.outcome import check_every_run_recorded, stopped_by_signal
from dptune.search.finish.tracking import check_server
from dptune.search.finished import composing, conclude, report_location, search_finished, show_if_finished
from dptune.search.modes import SearchMode, mode_of
from dptune.search.planning.cells import CellPlan, base_trial_config, check_runner, task_workload
from dptune.search.runs.execution import TrialContext
from dptune.search.scheduling.ray_session import check_cluster_resources, init_ray, shutdown_embedded
from dptune.search.scheduling.tune_run import run_cells, tune_storage
from dptune.search.stopping import sigterm_raises, sigterm_stops_the_search
from dptune.space import LoadedSpace, SearchSpace

if TYPE_CHECKING:
    import pandas as pd

    from dptune.data.spec import Workload
    from dptune.search.options import SearchOptions


@dataclass
class SearchSession:
    """One search as its phases build it up: the command's ``options``, the ``loaded`` space and its
    ``mode``, the results folder (``results_root``; ``runs``: where the per-run records go), the
    warnings so far (``notes``, kept in the ``search`` rows), then what each phase adds."""

    options: SearchOptions
    loaded: LoadedSpace
    mode: SearchMode
    name: str
    results_root: str
    runs: str
    notes: list[str]
    lease_token: str | None = None
    report: str | None = None  # where the report goes (None: --no-report)
    unreadable: list[str] | None = None  # --charge-unreadable-ledger: the unreadable start files, charged
    search_id: str = ""
    cluster: str | None = None  # the address of a joined cluster (None: an embedded Ray)
    embedded: str | None = None  # what init_ray said when this search started it
    workload: Workload | None = None
    plans: list[CellPlan] = field(default_factory=list)
    fused: bool = False
    tuning_rows: str | None = None
    contexts: list[TrialContext] = field(default_factory=list)
    started: float = 0.0  # time.monotonic() when the runs began

    @property
    def space(self) -> SearchSpace:
        return self.loaded.space

    def warn(self, notes: list[str]) -> None:
        """Print ``notes`` as warnings and keep them for the ``search`` rows."""
        _warn(notes)
        self.notes += notes


def _results_root(storage: str, name: str) -> str:
    return f"{storage.rstrip('/')}/{name}" if "://" in storage else str(Path(storage, name).resolve())


def check_storage(storage: str, results_root: str) -> None:
    """``--storage`` must be a usable location and the results folder under it must take a file
    (a probe is written and removed there)."""
    filesystem(storage, "--storage")
    probe_writable(results_root, "--storage")


def check_location_and_cluster(options: SearchOptions, loaded: LoadedSpace, results_root: str) -> None:
    """The checks that write nothing (before the search takes its results folder's lease), run in
    ``--dry-run`` too: the results location and the report's take a file (a probe, removed); the
    Ray address answers (or, for an embedded Ray, this machine has the resources a trial asks for)."""
    check_storage(options.storage, results_root)
    if options.report:
        probe_writable(
            report_location(results_root, options.report_dir),
            "--report-dir" if options.report_dir else "the report location (--report-dir)",
        )
    target = options.address or os.environ.get("RAY_ADDRESS")
    if target:
        preflight.check_address(target, "--address" if options.address else "RAY_ADDRESS")
    else:
        preflight.check_local_resources(loaded.space.resources)


def check_results(
    options: SearchOptions, loaded: LoadedSpace, results_root: str, runs: str, *, repeatable: bool
) -> list[str]:
    """The checks of an existing results folder (under the lease; ``--dry-run`` only says what it would
    move); returns warnings. Every part of the results folder (and of ``runs``, where a private search
    keeps its per-run records) is readable (or quarantined); on ``--resume`` Tune's state loads (or,
    cut short, is set aside where the search's proposals are ``repeatable``: ``preflight.check_tune_state``)
    and the space is the one the search started with.
    """
    notes = [
        note
        for root in dict.fromkeys((results_root, runs))
        for note in preflight.check_results_folder(root, options.quarantine_corrupt, move=not options.dry_run)
    ]
    if options.resume:
        notes += preflight.set_aside_moved_tune_state(runs, tune_storage(runs), move=not options.dry_run)
        notes += preflight.check_tune_state(runs, set_aside=repeatable and not options.dry_run)
        preflight.check_same_space(runs, loaded)
    return notes


def _warn(notes: list[str]) -> None:
    for note in notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)


def plans_that_ran(
    runs: str, search_id: str, plans: list[CellPlan], trials: pd.DataFrame | None = None
) -> list[CellPlan]:
    """The cell runs with at least one recorded trial of this search (only those get a ``search`` row);
    ``runs`` is where the search's per-run records are (``records.runs_root``), ``trials`` its ``trials``
    table where the caller has read it."""
    if trials is None:
        trials = read_table(runs, "trials", columns=["search_id", "cell_id", "clipping"])
    mine = trials[trials["search_id"] == search_id]
    recorded = set(zip(mine["cell_id"], mine["clipping"], strict=True))
    return [plan for plan in plans if (plan.cell.cell_id, plan.clipping) in recorded]


def run_search(options: SearchOptions) -> str:
    """Validate, plan and run a whole search; return the results dataset's location.

    Except for ``--dry-run``, the search holds the exclusive lease on its results folder
    (``dptune.records.lease``) from before it loads data until it returns or raises: a second search on
    the same folder is refused at once. The mode's guards come with it (``SearchMode.guards``: a private
    search creates everything owner-only, and keeps its lease, Ray's session folder and Tune's lock files
    inside).
    """
    session = load(options)
    if show_if_finished(  # reads only: a read-only folder shows it too
        options, session.loaded, session.name, session.results_root, runs=session.runs, private=session.mode.private
    ):
        return session.results_root
    check_location_and_cluster(options, session.loaded, session.results_root)
    if options.dry_run:
        return _run_search(session)
    where = f"--storage {options.storage!r} --name {session.name!r}:"
    with session.mode.guards(session.runs, where) as token, sigterm_stops_the_search():
        session.lease_token = token
        return _run_search(session)


def _run_search(session: SearchSession) -> str:
    """The phases of a search after its checks that write nothing: each returns early when it ends the search."""
    if not check(session):
        return session.results_root
    plan(session)
    if session.options.dry_run:
        return session.results_root
    start_ray(session)
    run_units(session)
    finish(session)
    return session.results_root


def load(options: SearchOptions) -> SearchSession:
    """Load the space (once), print the warnings of its settings, check its name and the MLflow server a
    finished search is logged to, and work out its mode."""
    loaded = options.load_space()
    preflight.check_task_names(loaded)  # an unknown dataset or backbone is told before anything loads
    name = options.name or loaded.space.name
    results_root = _results_root(options.storage, name)
    notes = [
        *loaded.notes,
        *preflight.flag_warnings(loaded.space, trials_per_cell_flag="sampler.trials_per_cell" in options.overrides),
    ]
    _warn(notes)
    check_name(name, "--name" if options.name else f"{loaded.path}: name")  # one folder under --storage
    check_server(loaded.space.tracking)  # the MLflow server a finished search is logged to answers
    mode = mode_of(loaded.space)
    return SearchSession(options, loaded, mode, name, results_root, mode.runs_root(results_root), list(notes))


def check(session: SearchSession) -> bool:
    """The results folder's checks and the search's id; returns whether there is anything to run (a
    ``--resume`` of a finished search shows its summary and report instead)."""
    options, runs = session.options, session.runs
    session.warn(
        check_results(
            options, session.loaded, session.results_root, runs, repeatable=session.mode.repeatable(session.space)
        )
    )
    session.report = report_location(session.results_root, options.report_dir) if options.report else None
    if not options.dry_run and not options.resume and ResultsStore(runs).completed_trial_ids():
        raise SearchError(
            f"results already exist at {session.results_root}; pass --resume to continue that search "
            "or choose another --name/--storage"
        )
    session.unreadable = [] if options.charge_unreadable_ledger else None  # charged once contexts exist
    session.search_id = preflight.folder_search_id(
        runs, session.loaded, session.name, options.resume, options.dry_run, session.unreadable
    )
    session.warn(
        [
            f"{path}: an unreadable or damaged privacy ledger end entry, skipped: the runs it closes are charged "
            "their planned steps (the printed ε stays an upper bound, looser)"
            for path in unreadable_ends(runs)
        ]
    )
    if options.resume and not options.dry_run and search_finished(session.results_root, session.search_id):
        print(f"--resume: search {session.search_id} at {session.results_root} is finished; nothing to run")
        conclude(
            session.results_root,
            session.report,
            session.search_id,
            session.space.tracking,
            private=session.mode.private,
        )
        return False
    return True


def plan(session: SearchSession) -> None:
    """Join the cluster (before data loads: one that refuses this driver fails first), load the workload,
    plan the cells (the mode prepares them: a private search's K), check the runner, print the plan.

    ``--dry-run`` plans from the same splits with nothing encoded (``workload.planned_workload``: the same
    privacy units, so the same N, q, T and σ) and says what the search would encode."""
    from dptune.data.encoding_plan import encoding_summary
    from dptune.data.workload import load_workload, planned_workload

    options, space, mode = session.options, session.space, session.mode
    session.cluster = options.address or os.environ.get("RAY_ADDRESS")
    if session.cluster and not options.dry_run:
        print(init_ray(options.address, private=mode.private), flush=True)
        sigterm_raises()
        check_cluster_resources(space)
    print(
        f"dptune {__version__}: loading {space.task.dataset_name} for {space.task.backbone}/{space.task.peft}",
        flush=True,
    )
    spec = task_workload(space, options.max_train_examples, options.max_eval_examples)
    if options.dry_run:
        session.workload, encoding = planned_workload(spec)
        print(encoding_summary(encoding, spec.peft), flush=True)
    else:
        session.workload = load_workload(spec)
    workload = session.workload
    preflight.check_steps(space, workload.num_units)
    session.plans = mode.plan(space, workload.num_units)
    if not options.dry_run:
        session.plans = mode.prepare(session.runs, session.plans)
    session.warn(preflight.data_warnings(space, workload.num_units))
    base = base_trial_config(space, session.plans[0], options.max_train_examples, options.max_eval_examples)
    session.fused = check_runner(space, session.plans, base, workload)
    mode.check_runner(session.fused)
    if (
        not session.fused
    ):  # the model and its engine (Opacus or FiLM): what run_trial trains; the fused runner uses neither
        check_trial_can_run(base)
    print(mode.format_plan(session.loaded, session.plans), flush=True)


def start_ray(session: SearchSession) -> None:
    """Draw the mode's tuning rows, write the manifest, start an embedded Ray (unless a cluster was
    joined), build each cell's context, charge unreadable start files, and announce the runs."""
    options, space, mode, runs = session.options, session.space, session.mode, session.runs
    assert session.workload is not None
    session.tuning_rows = mode.tuning_rows(runs, session.plans, session.workload)
    preflight.write_manifest(runs, session.loaded, session.name, session.search_id)  # a private start time stays inside
    if not session.cluster:
        print(embedded := init_ray(options.address, private=mode.private), flush=True)
        session.embedded = embedded
        sigterm_raises()
    session.started = time.monotonic()
    session.contexts = [
        mode.cell_context(
            space,
            plan,
            options.max_train_examples,
            options.max_eval_examples,
            runs,
            session.search_id,
            session.fused,
            session.tuning_rows,
            session.lease_token,
        )
        for plan in session.plans
    ]
    if session.unreadable:  # before anything trains
        session.warn(charge_unreadable_starts(runs, session.plans, session.contexts, mode.private))
    runner = "fused runner" if session.fused else "one trial per run"
    mode.announce(space, session.plans, runs, runner, bool(session.cluster))


def run_units(session: SearchSession) -> None:
    """The mode's proposals, the Tune run, the checks that every planned run is recorded, and what the
    mode runs after the units; an embedded Ray the mode no longer needs is shut down."""
    options, space, mode = session.options, session.space, session.mode
    plans, contexts = session.plans, session.contexts
    proposals = mode.propose(space, plans, contexts)
    with live_logging(space.tracking, session.results_root, session.search_id, private=mode.private):
        failures, signals, failed = run_cells(space, plans, contexts, options.resume, mode)
    stopped_by_signal(signals, session.runs, session.search_id, space, plans, mode.private)
    if failures:
        raise SearchIncomplete(
            f"--storage {options.storage}: the results folder {session.results_root} took no more writes "
            f"({failures[0]}); the search stopped. Free space (or make the folder writable), then run the same "
            "command with --resume: what finished is kept, and every training that took a step stays charged in "
            "the privacy ledger"
        )
    check_every_run_recorded(session.runs, session.search_id, space.resources.max_retries, mode.private, failed)
    mode.check_complete(contexts, proposals)
    mode.after_units(space, plans, contexts)
    if mode.shuts_down_ray and session.embedded is not None:
        shutdown_embedded(session.embedded)  # nothing of the search needs Ray now
    print(mode.finished_line(time.monotonic() - session.started), flush=True)


def finish(session: SearchSession) -> None:
    """Compact the per-run records, compose the search's outcome from its ``trials`` table (read once),
    release and publish it, write its ``search`` rows, then show the summary, build the report and log it
    (``finished.conclude``)."""
    with composing():  # a Ctrl+C from here on: every run is recorded, --resume trains nothing
        compact_records(session.runs)  # every file left (killed units, runs ASHA stopped) into a few
        trials = read_table(session.runs, "trials")
        ran = plans_that_ran(session.runs, session.search_id, session.plans, trials)
        _warn(
            idle := [
                f"cell {p.cell.cell_id} [{p.clipping}] recorded no trial; no search row is written for it"
                for p in session.plans
                if p not in ran
            ]
        )
        if ran:
            print(session.mode.composing_message, flush=True)
            _publish(session, ran, trials, idle)
        conclude(
            session.results_root,
            session.report,
            session.search_id,
            session.space.tracking,
            private=session.mode.private,
        )


def _publish(session: SearchSession, ran: list[CellPlan], trials: pd.DataFrame, idle: list[str]) -> None:
    """The ``search`` rows of the cells that ``ran`` (with every warning), the releases, the models: the
    models first, then the release, then the search rows (a search row marks a finished search)."""
    from dptune.data.workload import dataset_info

    space, mode, runs, search_id = session.space, session.mode, session.runs, session.search_id
    assert session.workload is not None
    public_test = dataset_info(session.workload.spec).official_test_split
    rows = [
        {**row, "warnings": json.dumps(session.notes + idle, ensure_ascii=False)}
        for row in mode.search_rows(
            session.loaded,
            ran,
            search_id,
            trials,
            official_test_split=public_test,
            charged=charged_runs(runs, search_id, trials),
        )
    ]
    choices = mode.release_choices(ran, rows, trials)
    released = mode.release_rows(space, choices, official_test_split=public_test)
    mode.publish(
        space, session.results_root, runs, rows, [(r, c) for r, (_, _, c) in zip(released, choices, strict=True)]
    )
    store = ResultsStore(session.results_root)
    if released:
        store.write_part("release", search_id, released)
    store.write_part("search", search_id, rows)
