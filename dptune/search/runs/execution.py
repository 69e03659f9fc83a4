"""Running the configurations one scheduled unit of work carries, each exactly once. Ray-free.

A search hands a unit (a Ray Tune trial, or a test calling :func:`run_configurations` directly) a
list of sampled configurations (C, B, η₀) of one cell. Each configuration runs ``replicates``
times, every run with its own fresh coins; a run is a *trial* (one row in the ``trials`` table,
id ``<configuration id>-r<replicate>``: ``records.replicate_trial_id``), described once by a
:class:`RunSpec` (:func:`run_spec`: its ids, its sampled parameters and its full config with the
mechanism the cell's plan calibrated). Runs already recorded (a crash, a kill, a resume) are not run
again: what finished is never lost and nothing runs twice.

Two runners, one mechanism. ``fused`` (:mod:`dptune.runners.fused`) trains every pending run of the unit
as one vectorised computation, each run keeping its own Poisson batches, noise, clipping and
optimizer state; ``trial`` calls :func:`dptune.runners.trial.run_trial` once per run (any model; it can
report each epoch, which ASHA needs). Rows are written atomically as each fused group, or each
trial, ends. A run that fails records what it spent (steps taken, their ε) and the others go on.

Privacy ledger (:mod:`dptune.records.ledger`): when the context knows N (``num_train``), every pending run
is charged in the ledger at its mechanism (σ, q, planned steps: the object the runner steps with, never
recalibrated) before the runner takes its first step, and its end entry is written before its rows; a
run whose start entry cannot be written does not start. A run a scheduler stopped is recorded and
accounted here too (:func:`unfinished_result`), so the Ray layer does no accounting.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import pandas as pd

from dptune.contract import (
    EpochMetrics,
    Mechanism,
    PublicSchedule,
    Reporter,
    TrialConfig,
    TrialResult,
    TrialStatus,
)
from dptune.errors import TrialConfigError, TrialFailed
from dptune.plan import coupled_learning_rate, sample_rate, total_steps
from dptune.privacy import epsilon_spent
from dptune.records import ResultsStore, compact_records, read_table, trial_rows
from dptune.records.ids import configuration_id, replicate_trial_id
from dptune.records.lease import check_holder
from dptune.records.ledger import RunEnd, RunStart, charged_runs, record_ends, record_starts
from dptune.records.weights import write_weights
from dptune.runners.checkpoint import RunCheckpoint
from dptune.runners.trial import run_trial

_VERSIONED_PACKAGES = ("dptune", "torch", "opacus", "prv-accountant", "ray", "optuna", "timm", "transformers")


@dataclass(frozen=True)
class TrialContext:
    """What every run of one cell shares.

    ``base`` holds the dataset, budgets and rules (C, B, η and the seed are filled per run);
    ``replicates`` is R, the runs per configuration; ``fused`` says whether the fused runner trains
    the runs (the driver decides once per cell: :func:`dptune.runners.fused.fused_refusal`).
    ``cell_id`` names the (ε, E) cell as the records do (``eps=1|epochs=5``); ``cell_key`` names the
    cell under its clipping rule, file-name safe (``eps1-E5``, ``eps1-E5-auto_s``): it prefixes every
    configuration id (:func:`configuration_id`), so two clipping rules of one cell never share a run.
    ``reproducible_seed`` is the space's seed when it opts into reproducible coins, else ``None``.
    ``num_train`` (N) and ``mechanisms`` (per feasible B, the :class:`~dptune.contract.Mechanism` the
    cell's plan calibrated: σ, q, T) let every run be charged in the privacy ledger before its first
    step, at exactly the mechanism its runner steps with; a search always gives N (without it, as in
    unit tests that call the runners directly, no ledger is written). ``schedules`` (per
    B): the public schedules of a cell that tunes on a secret subsample
    (``dptune.search.planning.subsample.public_schedules``); each run then samples, steps, is charged and has
    its η coupled by its schedule (η = η₀·√(q·q₁N / B_ref)). ``checkpoints``: a folder inside the
    trust boundary where each run keeps its training state between epochs
    (:mod:`dptune.runners.checkpoint`; the release of a subsample tuning): a run lost mid-training
    continues from it under its own start entry, so it is one run, charged once. ``lease_token``: the
    token of the search's lease on ``results_root`` (``dptune.records.lease``); a run starts and a
    result is written only while that search holds it (None: unchecked, as in unit tests).
    """

    base: TrialConfig
    results_root: str
    search_id: str
    cell_id: str
    cell_key: str
    coupling: str
    reference_batch_size: int
    reproducible_seed: int | None = None
    replicates: int = 1
    fused: bool = False
    num_train: int | None = None
    mechanisms: Mapping[int, Mechanism] | None = None
    schedules: Mapping[int, PublicSchedule] | None = None
    checkpoints: str | None = None
    lease_token: str | None = None


@dataclass(frozen=True)
class RunSpec:
    """One run, described once (:func:`run_spec`): replicate ``replicate`` (0-based) of the sampled
    configuration ``params`` (C, B, η₀ as the sampler gave them), the ``index``-th configuration of its
    unit, in cell ``cell_key``.

    Its ids are computed here and nowhere else in a unit: ``configuration_id`` (:func:`configuration_id`)
    and ``trial_id`` (``records.replicate_trial_id``), its rows', ledger entries' and checkpoint's name.
    ``config`` is its full :class:`~dptune.contract.TrialConfig`: η coupled, its coins' seed, its public
    schedule where it tunes on a subsample, and its ``mechanism`` (σ, q, T) as the cell's plan calibrated
    it (None for a B the min-step rule pruned: such a configuration is recorded, never run or charged).
    """

    cell_key: str
    configuration_id: str
    trial_id: str
    params: dict[str, Any]
    replicate: int
    index: int
    config: TrialConfig


def run_spec(context: TrialContext, params: dict[str, Any], replicate: int = 0, index: int = 0) -> RunSpec:
    """The :class:`RunSpec` of replicate ``replicate`` of configuration ``params`` in cell ``context``.

    Its config: the context's base with the sampled C, B and η₀, η = η₀·√(B/B_ref) under ``sqrt``
    coupling (B: the expected batch of its public schedule where it has one), and the mechanism of its
    B from the context (read, never calibrated). Its coins: ``seed=None`` (fresh OS entropy in the run)
    unless the space is reproducible; then a seed from the space's seed and the run's trial id, so
    that runs still never share coins.
    """
    configuration = configuration_id(context.cell_key, params)
    trial = replicate_trial_id(configuration, replicate)
    batch_size = int(params["batch_size"])
    base_lr = float(params["base_learning_rate"])
    schedule = None if context.schedules is None else context.schedules.get(batch_size)  # None: a pruned B
    lr = base_lr
    if context.coupling == "sqrt":
        coupled = batch_size if schedule is None else schedule.expected_batch_size
        lr = coupled_learning_rate(base_lr, coupled, context.reference_batch_size)
    clip_bound = float(params.get("clip_bound", context.base.clip_bound))
    seed = None
    if context.reproducible_seed is not None:
        digest = hashlib.sha256(f"{context.reproducible_seed}:{trial}".encode()).digest()
        seed = int.from_bytes(digest[:8], "big") >> 11  # 53 bits: exact in the float64 a pandas null column uses
    config = replace(
        context.base,
        clip_bound=clip_bound,
        batch_size=batch_size,
        base_learning_rate=base_lr,
        learning_rate=lr,
        seed=seed,
        schedule=schedule,
        mechanism=None if context.mechanisms is None else context.mechanisms.get(batch_size),  # None: a pruned B
    )
    return RunSpec(context.cell_key, configuration, trial, params, replicate, index, config)


def unit_runs(
    context: TrialContext,
    configurations: Sequence[dict[str, Any]],
    replicates: Sequence[Sequence[int]] | None = None,
) -> list[RunSpec]:
    """Every run of ``configurations`` in cell ``context``, in order (configuration, replicate): the
    replicates 0 … R − 1 of each, or ``replicates[i]`` of the i-th (a racing round's extra replicates,
    :mod:`dptune.search.scheduling.racing`)."""
    return [
        run_spec(context, params, replicate, index)
        for index, params in enumerate(configurations)
        for replicate in (range(context.replicates) if replicates is None else replicates[index])
    ]


@cache
def package_versions() -> dict[str, str]:
    """Versions of the packages a result depends on (recorded with every trial; read once per
    process: each lookup scans the installed distributions, milliseconds per package)."""
    versions = {}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


@dataclass(frozen=True)
class FinishedRun:
    """A run that ended, to be recorded: the run ``spec`` and its ``result``. ``run_id`` is the id of
    its start entry in the privacy ledger (:func:`charge_runs`), ``None`` where the writer does not
    know it (the driver recording a run ASHA stopped: its end entry then names its trial, and closes
    that trial's open start) or it has none (a pruned configuration, never charged)."""

    spec: RunSpec
    result: TrialResult
    run_id: str | None = None


def write_result(context: TrialContext, finished: FinishedRun, *, ledger: bool = False) -> None:
    """Record one run (atomic; writing the same run again replaces it); see :func:`write_results`."""
    write_results(context, [finished], ledger=ledger)


def end_entries(finished: Sequence[FinishedRun]) -> list[RunEnd]:
    """The privacy ledger's end entries of runs that ended: status, steps taken and ε spent of each."""
    return [
        RunEnd(
            run=run.run_id,
            trial_id=run.spec.trial_id,
            status=run.result.status,
            steps_taken=int(run.result.steps_taken),
            epsilon_spent=float(run.result.epsilon_spent),
        )
        for run in finished
    ]


def run_rows(context: TrialContext, run: FinishedRun) -> dict[str, list[dict[str, Any]]]:
    """A run's rows by table (``records.trial_rows``), finished now."""
    return trial_rows(
        run.result,
        search_id=context.search_id,
        trial_id=run.spec.trial_id,
        cell_id=context.cell_id,
        configuration_id=run.spec.configuration_id,
        replicate=run.spec.replicate,
        reference_batch_size=context.reference_batch_size,
        versions=package_versions(),
        finished_at=pd.Timestamp.now(tz="UTC"),
    )


def write_results(context: TrialContext, finished: Sequence[FinishedRun], *, ledger: bool = True) -> None:
    """Record runs that ended. With ``ledger``, their end entries go into the privacy ledger first
    (one file), then each run's trained parameters where it has them (``records.weights``) and its
    rows (each atomic; writing the same run again replaces it)."""
    check_holder(context.results_root, context.lease_token)  # a worker whose search is gone writes nothing
    if ledger:
        record_ends(context.results_root, end_entries(finished))
    store = ResultsStore(context.results_root)
    for run in finished:
        trial = run.spec.trial_id
        if run.result.trained is not None:  # before its rows: a recorded ok run has its weights
            write_weights(context.results_root, trial, run.result.trained)
        store.write_trial(run_rows(context, run), trial)


def charge_runs(context: TrialContext, runs: Sequence[RunSpec]) -> list[str | None]:
    """Charge ``runs`` in the privacy ledger before any takes a step, each at exactly the mechanism it
    will step with (``spec.config.mechanism``: σ, q, T, ε, δ as the cell's plan calibrated them; nothing
    is calibrated here); their run ids, in order (None each when the context has no N, so no ledger).
    A checkpointed run (``context.checkpoints``) whose start entry has no end yet keeps that entry's run
    id: it continues the same run. Raises ``TrialConfigError`` for a run without a mechanism."""
    check_holder(context.results_root, context.lease_token)  # a worker whose search is gone starts nothing
    if context.num_train is None or not runs:
        return [None] * len(runs)
    continued: dict[str, str] = {}
    if context.checkpoints is not None:
        charged = charged_runs(context.results_root, context.search_id)
        unended = charged[~charged["ended"].astype(bool)]
        continued = dict(zip(unended["trial_id"], unended["run"], strict=True))
    starts = []
    for run in runs:
        if run.trial_id in continued:
            continue
        mechanism = run.config.mechanism
        if mechanism is None:
            raise TrialConfigError(
                f"run {run.trial_id} (B = {run.config.batch_size}) has no mechanism in its cell's plan: "
                "nothing can charge it, so it does not start"
            )
        starts.append(
            RunStart(
                trial_id=run.trial_id,
                configuration_id=run.configuration_id,
                replicate=run.replicate,
                search_id=context.search_id,
                cell_id=context.cell_id,
                clipping=run.config.clipping,
                params={name: float(value) for name, value in run.params.items()},
                noise_multiplier=float(mechanism.noise_multiplier),
                sample_rate=mechanism.sample_rate,
                steps=mechanism.steps,
                delta=mechanism.delta,
                epsilon=mechanism.epsilon,
            )
        )
    charged_ids = iter(record_starts(context.results_root, starts))
    return [continued.get(run.trial_id) or next(charged_ids) for run in runs]


def record_pruned(context: TrialContext, params: dict[str, Any], num_train: int, min_steps: int) -> None:
    """Record a configuration the min-step rule removed: one row, status ``pruned_min_steps``, no compute
    (and no mechanism: its B has none in the plan)."""
    spec = run_spec(context, params)
    config = spec.config
    steps = total_steps(num_train, config.batch_size, config.epochs)
    result = TrialResult(
        config=config,
        status="pruned_min_steps",
        reason=f"T = {steps} steps < min_steps = {min_steps}",
        sample_rate=sample_rate(num_train, config.batch_size),
        steps=steps,
        steps_taken=0,
        num_train=num_train,
        epsilon_spent=0.0,
    )
    write_result(context, FinishedRun(spec, result))


def unfinished_result(
    context: TrialContext, spec: RunSpec, status: TrialStatus, reason: str, last: Mapping[str, Any], metric: str
) -> TrialResult:
    """The record of run ``spec`` stopped from outside (ASHA: status ``status``) before it recorded
    itself: Tune's function trainables block in ``report()``, so it took the steps of its last report
    (``last``: :class:`~dptune.contract.EpochMetrics` fields, its validation accuracy under ``metric``)
    and no more. Its ε spent is accounted at its mechanism (σ, q, δ; T planned), the one it was charged at."""
    mechanism = spec.config.mechanism
    assert context.num_train is not None and mechanism is not None, "a search's run carries N and its mechanism"
    epochs = [EpochMetrics(**{f: last[f] for f in EpochMetrics.__dataclass_fields__ if f in last})]
    steps_taken = int(last.get("steps", 0))
    spent = (
        epsilon_spent(mechanism.noise_multiplier, mechanism.sample_rate, steps_taken, mechanism.delta)
        if steps_taken
        else 0.0
    )
    return TrialResult(
        config=spec.config,
        status=status,
        reason=reason,
        noise_multiplier=mechanism.noise_multiplier,
        sample_rate=mechanism.sample_rate,
        steps=mechanism.steps,
        steps_taken=steps_taken,
        epsilon_spent=spent,
        num_train=context.num_train,
        epochs=epochs,
        val_accuracy=last.get(metric, float("nan")),
    )


def failed_result(
    config: TrialConfig,
    reason: str,
    *,
    steps: int = 0,
    steps_taken: int = 0,
    epsilon_spent: float = 0.0,
    noise_multiplier: float = math.nan,
    sample_rate: float = math.nan,
) -> TrialResult:
    """The record of a run that raised: status ``error`` with what it spent (nothing before its first step)."""
    return TrialResult(
        config=config,
        status="error",
        reason=reason[:2000],
        noise_multiplier=noise_multiplier,
        sample_rate=sample_rate,
        steps=steps,
        steps_taken=steps_taken,
        epsilon_spent=epsilon_spent,
    )


def selection_value(config: TrialConfig, status: str, val_accuracy: float, noisy_val_accuracy: float) -> float:
    """What the sampler is told for one run: validation accuracy (the noisy one when the run has a
    DP score), 0 for a run that diverged or failed."""
    value = noisy_val_accuracy if config.score_noise_multiplier is not None else val_accuracy
    return value if status == "ok" and math.isfinite(value) else 0.0


#: Told, as a unit's runs train (:func:`run_configurations`), how many of its pending runs (those not recorded
#: when it began) are trained so far, ≥ 0 (fractional inside a fused group: k runs at epoch e of E count
#: k·e/E), and whether that many are recorded.
UnitProgress = Callable[[float, bool], None]


@dataclass(frozen=True)
class FailedUnits:
    """The runs of a cell's units that failed for good in a Tune run: their ``trial_ids`` and the last
    line of the last error (empty when a unit's process was lost without one)."""

    trial_ids: tuple[str, ...]
    error: str


@dataclass(frozen=True)
class UnitOutcome:
    """What a unit tells its sampler: per configuration (in the order given) the mean selection
    value over its replicates and the status of its runs (``"ok"`` when every run finished);
    ``run_statuses`` holds the status of every run (configurations × replicates), for progress."""

    scores: list[float]
    statuses: list[str]
    ran: int  # runs trained by this call (recorded runs skipped)
    run_statuses: list[str]


def run_checkpoint(context: TrialContext, trial_id: str) -> RunCheckpoint | None:
    """Where run ``trial_id`` of cell ``context`` keeps its training state (None: not checkpointed)."""
    return None if context.checkpoints is None else RunCheckpoint(context.checkpoints, f"{trial_id}.pt")


def _run_one(context: TrialContext, run: RunSpec, report: Reporter | None, run_id: str | None) -> TrialResult:
    """One ``run_trial`` call, recorded whatever happens (errors with the steps they spent)."""
    config = run.config
    try:
        result = run_trial(config, report, run_checkpoint(context, run.trial_id))
    except TrialFailed as failure:  # training had begun: record what it spent
        result = failed_result(
            config,
            str(failure),
            steps=failure.steps,
            steps_taken=failure.steps_taken,
            epsilon_spent=failure.epsilon_spent,
            noise_multiplier=failure.noise_multiplier,
            sample_rate=failure.sample_rate,
        )
    except Exception as error:  # raised before the first step: nothing spent
        result = failed_result(config, f"{type(error).__name__}: {error}")
    write_result(context, FinishedRun(run, result, run_id), ledger=run_id is not None)
    return result


def run_configurations(
    context: TrialContext,
    configurations: Sequence[dict[str, Any]],
    report: Callable[[EpochMetrics], None] | None = None,
    progress: UnitProgress | None = None,
    replicates: Sequence[Sequence[int]] | None = None,
) -> UnitOutcome:
    """Run every (configuration, replicate) of ``configurations`` that is not recorded yet (the
    replicates of :func:`unit_runs`).

    ``report`` (trial runner, one configuration and one replicate only) is called after every epoch
    but the last, which the caller reports itself once the result is written. ``progress`` is told the
    pending runs trained so far as they train (:data:`UnitProgress`), never of the last: the caller
    reports the unit's end itself. Then the unit's files are compacted (``records.compact_records``: its
    rows and weights into a few files). Returns what the cell's sampler is told; recorded runs count
    with their recorded values.
    """
    store = ResultsStore(context.results_root)
    recorded = store.completed_trial_ids()
    runs = unit_runs(context, configurations, replicates)
    pending = [run for run in runs if run.trial_id not in recorded]
    results: dict[str, TrialResult] = {}  # by trial id

    def trained(runs_trained: float, written: bool) -> None:
        if progress is not None and runs_trained < len(pending):
            progress(runs_trained, written)

    run_ids = charge_runs(context, pending)
    if context.fused and pending:
        from dptune.runners.fused import FusedTrialsFailed, run_fused

        def record(positions: list[int], finished: list[TrialResult]) -> None:
            write_results(
                context,
                [FinishedRun(pending[p], result, run_ids[p]) for p, result in zip(positions, finished, strict=True)],
                ledger=context.num_train is not None,
            )
            for position, result in zip(positions, finished, strict=True):
                results[pending[position].trial_id] = result
            trained(len(results), True)

        try:
            run_fused([run.config for run in pending], on_done=record, progress=lambda runs: trained(runs, False))
        except FusedTrialsFailed as failure:  # the failed group's runs record what they spent
            unrecorded = [p for p, run in enumerate(pending) if run.trial_id not in results]
            record(unrecorded, [failure.results[p] for p in unrecorded])
    else:
        per_epoch = report if len(runs) == 1 else None
        for run, run_id in zip(pending, run_ids, strict=True):
            results[run.trial_id] = _run_one(context, run, per_epoch, run_id)
            trained(len(results), True)
    compact_records(context.results_root, [run.trial_id for run in runs])  # the unit's own files, now it ends
    return _outcome(context, runs, results, len(pending))


def _outcome(context: TrialContext, runs: Sequence[RunSpec], results: dict[str, TrialResult], ran: int) -> UnitOutcome:
    """Mean selection value and joint status per configuration (``runs``: every run of the unit, in
    order), from this call's results (by trial id) and the records of runs that finished before it."""
    rows = None
    scores, statuses, run_statuses = [], [], []
    for _, group in itertools.groupby(runs, key=lambda run: run.index):
        values, states = [], []
        for run in group:
            result = results.get(run.trial_id)
            if result is None:
                if rows is None:
                    columns = ["trial_id", "status", "val_accuracy", "noisy_val_accuracy"]
                    rows = read_table(context.results_root, "trials", columns).set_index("trial_id")
                row = rows.loc[run.trial_id]
                status, val, noisy = str(row["status"]), float(row["val_accuracy"]), float(row["noisy_val_accuracy"])
            else:
                status, val, noisy = result.status, result.val_accuracy, result.noisy_val_accuracy
            values.append(selection_value(context.base, status, val, noisy))
            states.append(status)
        scores.append(sum(values) / len(values))
        statuses.append("ok" if all(s == "ok" for s in states) else next(s for s in states if s != "ok"))
        run_statuses += states
    return UnitOutcome(scores=scores, statuses=statuses, ran=ran, run_statuses=run_statuses)
