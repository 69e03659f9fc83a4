"""The search driver: checks, the results folder's lease, the workload, the cell plans, one Ray
Tune run for every cell, the search's privacy cost from its ledger, the summary and the report.

Ray appears only here and in :mod:`dptune.search.tune_adapters`: a trial (``dptune.runners.trial.run_trial``)
is a plain function.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dptune import __version__
from dptune._thirdparty import without_raylet_messages
from dptune.errors import (
    SearchError,
    SearchIncomplete,
)
from dptune.paths import check_name, filesystem, probe_writable, write_file_atomic
from dptune.records import TRUST_BOUNDARY_README, ResultsStore, owner_only, read_table, runs_root
from dptune.records.ledger import charged_runs, started_runs, unreadable_ends
from dptune.runners.trial import check_trial_can_run
from dptune.search import preflight
from dptune.search.cells import (
    CellPlan,
    base_trial_config,
    cell_context,
    cell_spec,
    check_runner,
    format_plan,
    kept_trial_counts,
    plan_cells,
    private_chunk_size,
    task_workload,
)
from dptune.search.damaged_ledger import charge_unreadable_starts
from dptune.search.embedded_ray import end_orphans, private_ray_folder, private_session_folder, record_session
from dptune.search.execution import TrialContext, record_pruned
from dptune.search.finished import composing, conclude, report_location, search_finished, show_if_finished
from dptune.search.lease import hold_lease
from dptune.search.outcome import (
    FailedUnits,
    check_every_run_recorded,
    release_choices,
    release_rows,
    search_rows,
    stopped_by_signal,
)
from dptune.search.private_units import kept_proposals, unrecorded_runs
from dptune.search.publish import publish_models
from dptune.search.sampler import CellSampler
from dptune.search.stopping import sigterm_raises, sigterm_stops_the_search
from dptune.search.subsample import (
    RELEASE_PARAMETERS,
    draw_tuning_rows,
    kept_release_choice,
    release_context,
)
from dptune.search.tracking import check_server
from dptune.search.tuners import private_tuner, search_tuner
from dptune.space import LoadedSpace, SearchSpace, load_space

if TYPE_CHECKING:
    from dptune.search.options import SearchOptions


#: Tries of an embedded Ray start whose processes time out registering (an overloaded machine: Ray
#: waits a fixed 30 s), and the seconds between them.
RAY_START_ATTEMPTS = 3
RAY_START_RETRY_PAUSE_S = 15.0


#: What a private search on a cluster prints: what of K the cluster's own views still show.
CLUSTER_TIMING_NOTE = (
    "note: every unit loads the workload and starts the same Ray actors and tasks whatever the secret number "
    "of runs K, but the units' durations (the dashboard, `ray list tasks --detail`), their memory beyond the "
    "workload and the job's wall time grow with K: the cluster's dashboard, state API and nodes are inside "
    "your trust boundary, or K's order of magnitude is public (docs/PRIVACY.md)"
)

#: How :func:`init_ray`'s answer begins when it started an embedded Ray.
EMBEDDED_STARTED = "started embedded local Ray"


def init_ray(address: str | None, num_cpus: int | None = None, *, private: bool = False) -> str:
    """Join a cluster (``--address`` or RAY_ADDRESS) or start an embedded local Ray.

    ``private`` (an end-to-end private search): Ray logs critical errors only, so the console (and ``ray
    job logs``) carries none of Ray's or Tune's timestamped lines, also when a unit's process dies; an
    embedded Ray keeps its session folder in the owner-only temporary folder :func:`private_ray_folder`
    made, removed at the end.

    A plain ``ray.init()`` would silently join whatever cluster a leftover file points to, so
    the embedded case asks for ``address="local"`` explicitly. A cluster that cannot be joined
    raises ``PreflightError`` naming the address and, when no token is set, token authentication
    (``preflight.cluster_join_error``). An embedded start first ends what a killed embedded driver
    left running and records its own session (:mod:`dptune.search.embedded_ray`). An embedded start
    that times out (Ray waits 30 s for its processes to register: an overloaded machine) is tried up
    to ``RAY_START_ATTEMPTS`` times, ``RAY_START_RETRY_PAUSE_S`` apart, then raises
    ``SearchIncomplete`` saying the machine is overloaded and what to do.
    """
    import ray

    target = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return "already initialised"
    quiet: dict[str, Any] = {"logging_level": logging.CRITICAL} if private else {}
    if private:  # Tune's own lines (its end line, a dead unit's ERROR lines, with a time) go through the same logger
        logging.getLogger("ray").setLevel(logging.CRITICAL)
    # Every worker process first leaves a deleted working directory (inherited from the
    # `ray start` of its node), which would otherwise kill trials at `import torch`.
    runtime_env = {"worker_process_setup_hook": "dptune.runners.trial.leave_deleted_working_directory"}
    # dptune says what failed in one line; an error object no one fetched would print Ray's traceback above it
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    if target:
        try:
            ray.init(address=target, log_to_driver=False, runtime_env=runtime_env, **quiet)
        except (ConnectionError, RuntimeError) as error:
            raise preflight.cluster_join_error(target, "--address" if address else "RAY_ADDRESS", error) from None
        return f"joined Ray cluster at {target}"
    cpus = num_cpus or os.cpu_count()
    end_orphans()  # what an earlier embedded driver, killed, left running
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            started = ray.init(
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env=runtime_env,
                _temp_dir=private_session_folder() if private else None,
                **quiet,
            )
            session = cast(Any, started).address_info["session_dir"]  # a RayContext, typed as its base
            record_session(session, private_session_folder(parent=True))
            break
        except Exception as error:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(error):
                raise
            with contextlib.suppress(Exception):
                ray.shutdown()
            load = os.getloadavg()[0]
            if attempt == RAY_START_ATTEMPTS:
                raise SearchIncomplete(
                    f"the embedded Ray did not start: its processes did not register within Ray's startup wait, "
                    f"{RAY_START_ATTEMPTS} times (load average {load:.1f} on {os.cpu_count()} cores: this machine is "
                    "overloaded). Run again when the load is lower (with --resume), or start Ray once yourself "
                    "(`ray start --head --num-cpus N`) and pass its address with --address; nothing was trained"
                ) from None
            print(
                f"warning: the embedded Ray timed out during startup (load average {load:.1f} on "
                f"{os.cpu_count()} cores); attempt {attempt + 1} of {RAY_START_ATTEMPTS} "
                f"in {RAY_START_RETRY_PAUSE_S:g} s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(RAY_START_RETRY_PAUSE_S)
    return f"{EMBEDDED_STARTED} ({cpus} CPUs)"


def check_cluster_resources(space: SearchSpace) -> None:
    """Refuse per-trial resources no node of the joined Ray cluster has (``preflight.PreflightError``),
    disconnecting from it (``ray.shutdown``) first."""
    import ray

    try:
        preflight.check_cluster_resources(space.resources, ray.nodes())
    except preflight.PreflightError:
        ray.shutdown()
        raise


def _tune_storage(results_root: str) -> str:
    return f"{results_root}/_tune" if "://" in results_root else str(Path(results_root, "_tune").resolve())


def run_cells(
    space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext], resume: bool
) -> tuple[list[str], list[str], dict[str, FailedUnits]]:
    """One Ray Tune run for every cell of the search (resumed from its experiment state when asked);
    returns what ended it early: the results writes that failed (``tune_adapters.DRIVER_FAILURES``)
    and the stop signals received (``tune_adapters.STOP_SIGNALS``: Ctrl+C, SIGTERM), both empty when
    it ran to its end; and the runs of the units that failed for good, by cell (``searcher.failed_units``).

    The cells share the trial processes (one set-up, not one per cell) and run side by side. A unit
    whose process is lost runs again up to ``resources.max_retries`` times (Tune's ``FailureConfig``);
    ``resume`` restarts units that still errored, and those a stopped search left unfinished. A
    search's units carry sampled configurations (:func:`tuners.search_tuner`); an end-to-end private
    search's carry public unit numbers only (:func:`tuners.private_tuner`).
    """
    from ray import tune

    from dptune.search import tune_adapters as adapters
    from dptune.search.searcher import DRIVER_CONTEXTS, failed_units

    adapters.DRIVER_FAILURES.clear()
    DRIVER_CONTEXTS.clear()
    DRIVER_CONTEXTS.update({plan.cell_key: context for plan, context in zip(plans, contexts, strict=True)})
    # The longest units first (most epochs), so the last ones to finish are short: cells take turns
    # in this order (dicts keep it).
    cells = sorted(zip(plans, contexts, strict=True), key=lambda pair: -pair[0].cell.epochs)
    by_key = {plan.cell_key: context for plan, context in cells}
    private = space.privacy.private_selection is not None
    function = (
        tune.with_parameters(
            adapters.private_unit_trainable, contexts=by_key, chunk=private_chunk_size(space, contexts[0].fused)
        )
        if private
        else tune.with_parameters(adapters.tune_trainable, contexts=by_key)
    )
    trainable = tune.with_resources(function, {"cpu": space.resources.cpus, "gpu": space.resources.gpu})
    storage = _tune_storage(contexts[0].results_root)
    experiment = f"{storage}/search"
    preflight.record_tune_location(contexts[0].results_root, storage)
    # Save Tune's experiment state (searcher included) at most every 5 s instead of Tune's
    # adaptive period, so a resume repeats little; repeats are caught by configuration_id.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "5")
    # Tune's default output counts its own units (one Tune trial carries many runs), prints times and a
    # TensorBoard hint to a folder of nothing a user wants; verbose=0 of the older one prints nothing,
    # and dptune's progress lines count runs
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    # Tune's "Wrote the latest version..." lines; a private search shows none of its warnings either: they
    # carry a time ("The `process_trial_result` operation took 2.1 s" on a busy machine)
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL if private else logging.WARNING)
    if resume and tune.Tuner.can_restore(experiment):
        tuner = tune.Tuner.restore(
            experiment, trainable=trainable, resume_unfinished=True, resume_errored=False, restart_errored=True
        )
    else:
        if resume and not started_runs(contexts[0].results_root, contexts[0].search_id):  # else: Tune's state set aside
            print(f"--resume: no search to resume at {contexts[0].results_root}; starting it", flush=True)
        run_config = tune.RunConfig(
            name="search",
            storage_path=storage,
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=space.resources.max_retries, fail_fast=False),
        )
        build = private_tuner if private else search_tuner
        tuner = build(space, [plan for plan, _ in cells], by_key, trainable, run_config)
    with adapters.stop_on_signals():
        results = tuner.fit()
    return list(adapters.DRIVER_FAILURES), list(adapters.STOP_SIGNALS), failed_units(results, by_key)


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


def check_results(options: SearchOptions, loaded: LoadedSpace, results_root: str, runs: str) -> list[str]:
    """The checks of an existing results folder (under the lease; ``--dry-run`` only says what it would
    move); returns warnings. Every part of the results folder (and of ``runs``, where a private search
    keeps its per-run records) is readable (or quarantined); on ``--resume`` Tune's state loads (or,
    cut short, is set aside: ``preflight.check_tune_state``) and the space is the one the search
    started with.
    """
    space = loaded.space
    notes = [
        note
        for root in dict.fromkeys((results_root, runs))
        for note in preflight.check_results_folder(root, options.quarantine_corrupt, move=not options.dry_run)
    ]
    if options.resume:
        repeatable = space.sampler.name in ("grid", "random") and space.privacy.private_selection is None
        notes += preflight.set_aside_moved_tune_state(runs, _tune_storage(runs), move=not options.dry_run)
        notes += preflight.check_tune_state(runs, set_aside=repeatable and not options.dry_run)
        preflight.check_same_space(runs, loaded)
    return notes


def _warn(notes: list[str]) -> None:
    for note in notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)


def plans_that_ran(runs: str, search_id: str, plans: list[CellPlan]) -> list[CellPlan]:
    """The cell runs with at least one recorded trial of this search (only those get a ``search`` row);
    ``runs`` is where the search's per-run records are (``records.runs_root``)."""
    trials = read_table(runs, "trials", columns=["search_id", "cell_id", "clipping"])
    mine = trials[trials["search_id"] == search_id]
    recorded = set(zip(mine["cell_id"], mine["clipping"], strict=True))
    return [plan for plan in plans if (plan.cell.cell_id, plan.clipping) in recorded]


def run_search(options: SearchOptions) -> str:
    """Validate, plan and run a whole search; return the results dataset's location.

    Except for ``--dry-run``, the search holds the exclusive lease on its results folder
    (``dptune.search.lease``) from before it loads data until it returns or raises: a second search on
    the same folder is refused at once.
    """
    loaded = load_space(options.space_path, options.overrides)
    preflight.check_task_names(loaded)  # an unknown dataset or backbone is told before anything loads
    name = options.name or loaded.space.name
    results_root = _results_root(options.storage, name)
    _warn(preflight.flag_warnings(loaded.space, trials_per_cell_flag="sampler.trials_per_cell" in options.overrides))
    check_name(name, "--name" if options.name else f"{loaded.path}: name")  # one folder under --storage
    check_server(loaded.space.tracking)  # the MLflow server a finished search is logged to answers
    if show_if_finished(options, loaded, name, results_root):  # reads only: a read-only folder shows it too
        return results_root
    check_location_and_cluster(options, loaded, results_root)
    if options.dry_run:
        return _run_search(options, loaded, name, results_root)
    private = loaded.space.privacy.private_selection is not None
    # a private search creates everything owner-only; its lease (whose times bracket the search), Ray's
    # session folder and Tune's lock files stay inside
    with (
        owner_only() if private else contextlib.nullcontext(),
        hold_lease(runs_root(results_root, private), f"--storage {options.storage!r} --name {name!r}:") as token,
        private_ray_folder() if private else contextlib.nullcontext(),
        without_raylet_messages() if private else contextlib.nullcontext(),  # a dead unit: dptune's own line
        sigterm_stops_the_search(),
    ):
        return _run_search(options, loaded, name, results_root, token)


def _run_search(
    options: SearchOptions, loaded: LoadedSpace, name: str, results_root: str, lease_token: str | None = None
) -> str:
    from dptune.data import load_workload
    from dptune.data.workload import dataset_info

    space = loaded.space
    private = space.privacy.private_selection is not None
    runs = runs_root(results_root, private)
    notes = preflight.flag_warnings(space, trials_per_cell_flag="sampler.trials_per_cell" in options.overrides)
    _warn(checked := check_results(options, loaded, results_root, runs))
    notes += checked
    report = report_location(results_root, options.report_dir) if options.report else None
    store = ResultsStore(results_root)
    if not options.dry_run and not options.resume and ResultsStore(runs).completed_trial_ids():
        raise SearchError(
            f"results already exist at {results_root}; pass --resume to continue that search "
            "or choose another --name/--storage"
        )

    unreadable: list[str] | None = [] if options.charge_unreadable_ledger else None  # charged once contexts exist
    search_id = preflight.folder_search_id(runs, loaded, name, options.resume, options.dry_run, unreadable)
    _warn(
        skipped := [
            f"{path}: an unreadable or damaged privacy ledger end entry, skipped: the runs it closes are charged "
            "their planned steps (the printed ε stays an upper bound, looser)"
            for path in unreadable_ends(runs)
        ]
    )
    notes += skipped
    if options.resume and not options.dry_run and search_finished(results_root, search_id):
        print(f"--resume: search {search_id} at {results_root} is finished; nothing to run")
        conclude(results_root, report, search_id, space.tracking, private=private)
        return results_root

    cluster = options.address or os.environ.get("RAY_ADDRESS")
    if cluster and not options.dry_run:  # a cluster that refuses this driver (its token) fails before data loads
        print(init_ray(options.address, private=private), flush=True)
        sigterm_raises()
        check_cluster_resources(space)
    print(
        f"dptune {__version__}: loading {space.task.dataset_name} for {space.task.backbone}/{space.task.peft}",
        flush=True,
    )
    workload = load_workload(task_workload(space, options.max_train_examples, options.max_eval_examples))
    preflight.check_steps(space, len(workload.train))
    plans = plan_cells(space, len(workload.train))
    if private and not options.dry_run:  # K once per search, inside the trust boundary
        write_file_atomic(runs, "README.txt", TRUST_BOUNDARY_README.encode())
        if "://" not in runs:  # made before this search was private-only, or by an older dptune
            os.chmod(runs, 0o700)
        plans = kept_trial_counts(runs, plans)
    _warn(data_notes := preflight.data_warnings(space, len(workload.train)))
    notes += data_notes
    base = base_trial_config(space, plans[0], options.max_train_examples, options.max_eval_examples)
    fused = check_runner(space, plans, base, workload)
    subsample = plans[0].tuning is not None
    if subsample and not fused:
        raise SearchError(
            "privacy.private_selection.tuning_subsample: the tuning runs take q and T from public numbers, which "
            "only the fused runner does (peft 'head', training.runner auto or fused, no scheduler)"
        )
    if not fused:  # the model and its engine (Opacus or FiLM): what run_trial trains; the fused runner uses neither
        check_trial_can_run(base)
    print(format_plan(loaded, plans), flush=True)
    if options.dry_run:
        return results_root
    tuning = plans[0].tuning  # X₁, once per search, inside the trust boundary
    tuning_rows = (
        None if tuning is None else draw_tuning_rows(runs, len(workload.train), len(workload.val), tuning.fraction)
    )

    preflight.write_manifest(runs, loaded, name, search_id)  # a private search's start time stays inside its boundary
    embedded = None
    if not cluster:
        print(embedded := init_ray(options.address, private=private), flush=True)
        sigterm_raises()
    started = time.monotonic()
    contexts = [
        cell_context(
            space,
            plan,
            options.max_train_examples,
            options.max_eval_examples,
            runs,
            search_id,
            fused,
            tuning_rows,
            lease_token,
        )
        for plan in plans
    ]
    if unreadable:  # before anything trains
        _warn(stand_ins := charge_unreadable_starts(runs, plans, contexts, private))
        notes += stand_ins
    runner = "fused runner" if fused else "one trial per run"
    if private:  # K, its progress and the search's duration stay inside the trust boundary
        print(
            f"running the private search ({runner}); no per-run progress is shown: it would reveal the "
            f"secret number of runs (per-run records: {runs})",
            flush=True,
        )
        if cluster:
            print(CLUSTER_TIMING_NOTE, flush=True)
    else:
        replicates = f" × {space.replicates} replicates" if space.replicates > 1 else ""
        print(
            f"running {sum(plan.configurations for plan in plans)} configurations{replicates} in {len(plans)} "
            f"cell runs side by side ({runner})",
            flush=True,
        )
    if private:  # every proposal of every cell, drawn once from its secret sampler, kept inside the boundary
        proposals = kept_proposals(
            runs, [plan.cell_key for plan in plans], partial(_propose, space, {p.cell_key: p for p in plans}, contexts)
        )
    failures, signals, failed = run_cells(space, plans, contexts, options.resume)
    stopped_by_signal(signals, runs, search_id, space, plans, private)
    if failures:
        raise SearchIncomplete(
            f"--storage {options.storage}: the results folder {results_root} took no more writes ({failures[0]}); "
            "the search stopped. Free space (or make the folder writable), then run the same command with "
            "--resume: what finished is kept, and every training that took a step stays charged in the "
            "privacy ledger"
        )
    check_every_run_recorded(runs, search_id, space.resources.max_retries, private, failed)
    if private and any(unrecorded_runs(context, proposals[context.cell_key]) for context in contexts):
        raise SearchIncomplete(
            "the private search stopped before every planned run was recorded; nothing is released. Run the same "
            "command with --resume to run the rest (what finished is kept, and every training that took a step "
            "stays charged in the privacy ledger)"
        )
    if subsample:
        train_releases(space, plans, contexts)
    if not private and embedded is not None and embedded.startswith(EMBEDDED_STARTED):
        import ray

        ray.shutdown()  # nothing of the search needs Ray now; in this thread: no Ray object outlives it
    print("\nsearch finished" + ("" if private else f" in {time.monotonic() - started:.0f} s"), flush=True)
    with composing():  # a Ctrl+C from here on: every run is recorded, --resume trains nothing
        ran = plans_that_ran(runs, search_id, plans)
        _warn(
            idle := [
                f"cell {p.cell.cell_id} [{p.clipping}] recorded no trial; no search row is written for it"
                for p in plans
                if p not in ran
            ]
        )
        if ran:
            print(
                "selecting the release by its noisy validation score..."
                if private
                else "composing the privacy cost of every trial (PLD accountant)...",
                flush=True,
            )
            trials = read_table(runs, "trials")
            public_test = dataset_info(workload.spec).official_test_split
            rows = [
                {**row, "warnings": json.dumps(notes + idle, ensure_ascii=False)}
                for row in search_rows(
                    loaded,
                    ran,
                    search_id,
                    trials,
                    official_test_split=public_test,
                    charged=charged_runs(runs, search_id, trials),
                )
            ]
            choices = release_choices(space, ran, rows, trials)
            released = release_rows(space, choices, official_test_split=public_test)
            # the models, then the release, then the search rows: a search row marks a finished search
            publish_models(
                space, results_root, runs, rows, [(r, c) for r, (_, _, c) in zip(released, choices, strict=True)]
            )
            if released:
                store.write_part("release", search_id, released)
            store.write_part("search", search_id, rows)
        conclude(results_root, report, search_id, space.tracking, private=private)
    return results_root


def _propose(
    space: SearchSpace, plans: dict[str, CellPlan], contexts: list[TrialContext], cell_key: str
) -> list[dict[str, Any]]:
    """Cell ``cell_key``'s K proposals from its secret sampler (fresh OS entropy); proposals of a B the
    min-step rule removes are recorded inside the boundary (no compute) and drawn again."""
    plan = plans[cell_key]
    (context,) = [c for c in contexts if c.cell_key == cell_key]
    sampler = CellSampler(cell_spec(space, plan))
    return sampler.ask(
        plan.configurations, partial(record_pruned, context, num_train=plan.num_train, min_steps=space.min_steps)
    )


def train_releases(space: SearchSpace, plans: list[CellPlan], contexts: list[TrialContext]) -> None:
    """Tuning on a subsample: per cell, the configuration its tuning chose (the best noisy validation
    score, ``privacy.search.select_release``, kept inside the trust boundary before anything trains:
    ``subsample.kept_release_choice``) trains once on every training row, as one Ray task through
    ``private_units.run_release`` (charged in the privacy ledger before its first step, recorded,
    skipped when a resume finds it recorded; it returns nothing). Nothing is trained for a cell none of
    whose runs finished."""
    import ray

    from dptune.search.private_units import run_release

    train = ray.remote(num_cpus=space.resources.cpus, num_gpus=space.resources.gpu)(run_release)
    for plan, context in zip(plans, contexts, strict=True):
        assert plan.tuning is not None
        params = kept_release_choice(context.results_root, plan.cell_key, partial(_chosen, context, plan))
        if params is None:
            continue
        print("training the release on every training row with the tuned configuration...", flush=True)
        ray.get(train.remote(release_context(context, plan.tuning), params))


def _chosen(context: TrialContext, plan: CellPlan) -> dict[str, float] | None:
    """The sampled configuration of cell ``plan``'s run with the best noisy validation score (None: no run finished)."""
    from dptune.privacy.search import select_release

    trials = read_table(context.results_root, "trials")
    mine = trials[(trials["search_id"] == context.search_id) & (trials["cell_id"] == plan.cell.cell_id)]
    chosen = select_release(mine, runs=plan.configurations)
    return None if chosen is None else {name: float(chosen[name]) for name in RELEASE_PARAMETERS}
