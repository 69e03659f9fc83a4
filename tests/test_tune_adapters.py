"""The Ray Tune layer without a Ray runtime: the searcher over cells, per-cell ASHA and the driver's
callback, driven with Tune's own ``Trial`` objects (stubs, as Tune's tests build them) and real
samplers, results folders and ledgers."""

from __future__ import annotations

import json
import logging
import math
import pickle
import re
import signal
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from conftest import REPO_ROOT
from dptune.contract import EpochMetrics, TrialResult
from dptune.plan import sample_rate, total_steps
from dptune.plan.mechanism import wrapped
from dptune.privacy import epsilon_spent
from dptune.records import read_table, replicate_trial_id
from dptune.records.ids import configuration_id
from dptune.records.ledger import charged_runs
from dptune.search.planning.cells import CellPlan, base_trial_config
from dptune.search.planning.sampler import CellSampler, CellSpec
from dptune.search.runs.execution import (
    FinishedRun,
    TrialContext,
    charge_runs,
    run_spec,
    write_result,
)
from dptune.search.scheduling.searcher import METRIC, SCORES_KEY, CellMultiplexer, Unit
from dptune.search.scheduling.tune_adapters import (
    RUN_STATUSES_KEY,
    STORAGE_ERROR_KEY,
    CellRun,
    PerCellASHA,
    RecordAndReport,
    StopOnStorageFailure,
    TuneRunState,
)
from dptune.space import Cell, load_space

N = 100
EPOCHS = 4
SIGMA = {32: 1.1, 64: 1.7}  # σ per feasible B, as a cell's plan gives it
GRID = CellSpec(
    sampler="grid",
    seed=3,
    batch_sizes=(32, 64),
    feasible_batch_sizes=(32, 64),
    ranges={"clip_bound": {"values": [0.1, 1.0]}, "base_learning_rate": {"values": [0.01]}},
)
PARAMS = {"clip_bound": 0.5, "batch_size": 32, "base_learning_rate": 0.05}


@pytest.fixture(autouse=True)
def _driver_state() -> Iterator[None]:
    """``TuneRunState.stop_search`` silences Tune's loggers: undone after each test."""
    levels = {name: logging.getLogger(name).level for name in ("ray.tune", "ray.train", "ray.air")}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def context(root: Path, replicates: int = 2) -> TrialContext:
    space = load_space(REPO_ROOT / "tests/spaces/tiny.yaml", {"epochs": [EPOCHS], "privacy.epsilons": [8]}).space
    plan = CellPlan(Cell(8.0, EPOCHS), "normalized", N, (32, 64), (256,), wrapped(SIGMA, 8.0, 1e-5, N, EPOCHS), 5)
    return TrialContext(
        base=base_trial_config(space, plan, N, 60),
        results_root=str(root),
        search_id="s",
        cell_id=plan.cell.cell_id,
        cell_key=plan.cell_key,
        coupling="sqrt",
        reference_batch_size=64,
        replicates=replicates,
        num_train=N,
        mechanisms=plan.mechanisms,
    )


def trial(unit: Unit, last: dict[str, Any] | None = None, saved_in: TrialContext | None = None) -> Trial:
    """A stub Tune trial of ``unit`` (its file written where ``saved_in`` keeps units, when given)."""
    if saved_in is not None:
        unit.save(saved_in)
    made = Trial("dptune_unit", config=unit.config(), stub=True)
    if last is not None:
        made.run_metadata.last_result = last
    return made


def test_a_unit_is_a_plain_tune_config_of_its_cell_and_id(tmp_path: Path) -> None:
    cell = context(tmp_path)
    unit = Unit("eps1-E5", "t0", [PARAMS])
    assert unit.config() == {"cell": "eps1-E5", "unit_id": "t0"}
    with pytest.raises(FileNotFoundError, match="unit t0"):
        Unit.of(unit.config(), {"eps1-E5": cell})
    unit.save(cell)
    assert Unit.of(unit.config(), {"eps1-E5": cell}) == unit


def test_tune_state_of_a_unit_does_not_grow_with_its_configurations(tmp_path: Path) -> None:
    """A unit's Tune config, and so Tune's saved trial state, is the same size whether it runs 1 or 256
    configurations; only its file (outside Tune's state) grows."""
    cell = context(tmp_path)
    sizes = []
    for count in (1, 16, 256):
        configurations = [{**PARAMS, "clip_bound": 0.5 + index} for index in range(count)]
        made = trial(Unit("eps8-E4", f"t{count:03d}", configurations), saved_in=cell)
        sizes.append(len(pickle.dumps(made.config)) + len(json.dumps(made.config)))
        assert Unit.of(made.config, {"eps8-E4": cell}).configurations == configurations
    assert len(set(sizes)) == 1 and sizes[0] < 200


def test_the_searcher_tells_each_cell_what_its_units_scored(tmp_path: Path) -> None:
    cells = {"a": context(tmp_path / "a"), "b": context(tmp_path / "b")}
    searcher = CellMultiplexer(
        {"a": CellSampler(GRID), "b": CellSampler(GRID)},
        budgets={"a": 4, "b": 3},
        unit_sizes={"a": 2, "b": 1},
        contexts=cells,
        num_train=N,
        min_steps=1,
    )
    units = {trial_id: Unit.of(searcher.suggest(trial_id), cells) for trial_id in ("t0", "t1", "t2", "t3", "t4")}
    assert [(u.cell_key, len(u.configurations)) for u in units.values()] == [
        ("a", 2),
        ("b", 1),
        ("a", 2),
        ("b", 1),
        ("b", 1),
    ]
    assert searcher.suggest("t5") == CellMultiplexer.FINISHED  # every budget spent

    searcher.on_trial_complete("t0", {SCORES_KEY: [0.25, math.nan]})  # a unit that ran: a score each (NaN: failed)
    searcher.on_trial_complete("t1", {METRIC: 0.5})  # stopped early by ASHA: its last accuracy
    searcher.on_trial_complete("t2", error=True)  # its process failed
    searcher.on_trial_complete("t2", {SCORES_KEY: [0.9, 0.9]})  # told once: a restarted unit is not told again
    a, b = searcher.samplers["a"], searcher.samplers["b"]
    assert [(value, state) for _, value, state in a.told] == [
        (0.25, "complete"),
        (None, "fail"),
        (None, "fail"),
        (None, "fail"),
    ]
    assert [params for params, _, _ in a.told] == units["t0"].configurations + units["t2"].configurations
    assert b.told == [(units["t1"].configurations[0], 0.5, "complete")]
    assert b.pending == [units["t3"].configurations[0], units["t4"].configurations[0]]
    assert set(searcher.owner) == {"t3", "t4"}


def test_a_pruned_proposal_is_recorded_without_compute_and_not_counted(tmp_path: Path) -> None:
    spec = replace(
        GRID,
        sampler="random",
        batch_sizes=(32, 64),
        feasible_batch_sizes=(32,),
        ranges={"clip_bound": {"low": 0.1, "high": 1.0, "log": True}, "base_learning_rate": {"values": [0.01]}},
    )
    searcher = CellMultiplexer(
        {"a": CellSampler(spec)},
        budgets={"a": 6},
        unit_sizes={"a": 6},
        contexts={"a": context(tmp_path)},
        num_train=N,
        min_steps=10,
    )
    unit = Unit.of(searcher.suggest("t0"), {"a": context(tmp_path)})
    assert len(unit.configurations) == 6 and {p["batch_size"] for p in unit.configurations} == {32}
    pruned = read_table(str(tmp_path), "trials")
    assert len(pruned) >= 1 and set(pruned["status"]) == {"pruned_min_steps"} and set(pruned["batch_size"]) == {64}
    assert (pruned["steps"] == total_steps(N, 64, EPOCHS)).all() and (pruned["epsilon_spent"] == 0).all()
    assert searcher.suggested == {"a": 6}


def test_the_searcher_pickles_and_checkpoints_plain_data(tmp_path: Path) -> None:
    first = tmp_path / "first"
    searcher = CellMultiplexer(
        {"a": CellSampler(GRID)},
        budgets={"a": 4},
        unit_sizes={"a": 2},
        contexts={"a": context(first)},
        num_train=N,
        min_steps=1,
    )
    unit = Unit.of(searcher.suggest("t0"), {"a": context(first)})
    blob = pickle.dumps(searcher)
    assert b"optuna" not in blob and b"Unit" not in blob  # no study, no class of this module's state
    assert str(first).encode() not in blob  # nor the first driver's folder: a resume writes to its own
    resumed = context(tmp_path / "copy")
    copy = pickle.loads(blob)
    with pytest.raises(RuntimeError, match="not bound to this driver"):  # never the first driver's contexts
        _ = copy.contexts
    copy.bind({"a": resumed})  # as tuners.restore_tuner binds a restored Tuner's searcher
    assert copy.owner == {"t0": unit} and copy.contexts == {"a": resumed}
    state = TuneRunState()
    callback = pickle.dumps(RecordAndReport({"a": CellRun(context(first), "eps=8|epochs=4 normalized", 4)}, state))
    assert str(first).encode() not in callback
    unpickled = pickle.loads(callback)
    with pytest.raises(RuntimeError, match="not bound to this driver"):
        _ = unpickled.cells
    resumed_state = TuneRunState()
    unpickled.bind({"a": resumed}, resumed_state)
    assert unpickled.cells == {"a": CellRun(resumed, "eps=8|epochs=4 normalized", 4)}
    assert unpickled.state is resumed_state  # it reports into this driver's run, not the pickled one
    checkpoint = tmp_path / "searcher.json"
    searcher.save(str(checkpoint))
    restored = CellMultiplexer(
        {"a": CellSampler(GRID)},
        budgets={"a": 4},
        unit_sizes={"a": 2},
        contexts={"a": context(tmp_path)},
        num_train=N,
        min_steps=1,
    )
    restored.restore(str(checkpoint))
    assert restored.owner == {"t0": unit} and restored.suggested == {"a": 2} and restored.turn == 1
    restored.on_trial_complete("t0", {SCORES_KEY: [0.5, 0.6]})
    assert [value for _, value, _ in restored.samplers["a"].told] == [0.5, 0.6]


def _racing_searcher(cell: TrialContext) -> CellMultiplexer:
    """A searcher of one racing cell ``a``: a first pass of 2 configurations in one unit, then rounds."""
    return CellMultiplexer(
        {"a": CellSampler(GRID)},
        budgets={"a": 2},
        unit_sizes={"a": 2},
        contexts={"a": cell},
        num_train=N,
        min_steps=1,
        racing={"step": 2, "max_replicates": 4, "budget": 8, "patience": 2},
    )


def test_a_racing_unit_that_failed_is_waited_for_once_a_resume_restarts_it(tmp_path: Path) -> None:
    """A racing search's unit that errored is kept (``errored``): a restored searcher holds it as running,
    since the restored Tuner restarts it, and its cell decides no round until it ends; its end tells no
    sampler (its cell's sampler was told when it failed)."""
    cell = context(tmp_path)
    searcher = _racing_searcher(cell)
    unit = Unit.of(searcher.suggest("t0"), {"a": cell})
    searcher.on_trial_complete("t0", error=True)
    assert searcher.errored == {"t0": unit} and not searcher.owner
    told = list(searcher.samplers["a"].told)
    checkpoint = tmp_path / "searcher.json"
    searcher.save(str(checkpoint))
    restored = _racing_searcher(cell)
    restored.restore(str(checkpoint))
    restored._unrecorded = {"a": []}  # nothing for the reconciliation to hand out: the unit is Tune's to rerun
    assert restored.owner == {"t0": unit}
    assert restored.suggest("t1") is None  # its cell waits for the restarted unit before any round
    restored.on_trial_complete("t0", {SCORES_KEY: [0.5, 0.6]})
    assert not restored.owner and not restored.errored and restored.samplers["a"].told == told


def test_each_cell_has_its_own_asha() -> None:
    schedulers = {
        key: ASHAScheduler(time_attr="epoch", max_t=EPOCHS, grace_period=1, reduction_factor=2) for key in ("a", "b")
    }
    asha = PerCellASHA(schedulers)
    assert asha.set_search_properties(METRIC, "max")
    good, poor = trial(Unit("a", "t0", [PARAMS])), trial(Unit("a", "t1", [PARAMS]))
    alone = trial(Unit("b", "t2", [PARAMS]))
    for each in (good, poor, alone):
        asha.on_trial_add(None, each)
    assert asha.on_trial_result(None, good, {"epoch": 1, METRIC: 0.9}) == TrialScheduler.CONTINUE
    assert asha.on_trial_result(None, poor, {"epoch": 1, METRIC: 0.1}) == TrialScheduler.STOP  # below a's median
    # lower still, but alone at cell b's first rung: never ranked against cell a
    assert asha.on_trial_result(None, alone, {"epoch": 1, METRIC: 0.05}) == TrialScheduler.CONTINUE


def test_a_finished_unit_prints_its_cells_progress(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cell = context(tmp_path)
    callback = RecordAndReport({"eps8-E4": CellRun(cell, "eps=8|epochs=4 normalized", 5)}, TuneRunState())
    other = {**PARAMS, "batch_size": 64, "clip_bound": 2.0}
    unit = Unit("eps8-E4", "t0", [PARAMS, other])
    statuses = ["ok", "ok", "error", "ok"]  # the unit's runs, in unit_runs order
    last = {"done_recording": True, SCORES_KEY: [0.5, 0.625], RUN_STATUSES_KEY: json.dumps(statuses)}
    callback.on_trial_complete(0, [], trial(unit, last, saved_in=cell))
    out = capsys.readouterr().out
    assert out.startswith(
        "[eps=8|epochs=4 normalized] 2/5 configurations × 2 replicates: runs 1 error, "
        "3 ok; best so far 0.6250 (C=2 B=64 η₀=0.05); 4/10 runs done, "
    )
    assert re.fullmatch(r".*; 4/10 runs done, \d\d:\d\d elapsed, about \d\d:\d\d left\n", out)


def test_a_unit_asha_stopped_records_the_steps_of_its_last_report(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cell = context(tmp_path)
    pending = [run_spec(cell, PARAMS, replicate) for replicate in (0, 1)]
    run_ids = charge_runs(cell, pending)  # as the unit did before its first step
    finished = TrialResult(
        config=pending[0].config,
        status="ok",
        steps=12,
        steps_taken=12,
        epsilon_spent=2.0,
        num_train=N,
        val_accuracy=0.7,
    )
    write_result(cell, FinishedRun(pending[0], finished, run_ids[0]), ledger=True)  # replicate 0 recorded itself
    report = EpochMetrics(
        epoch=1, steps=3, train_loss=1.5, val_loss=1.4, val_accuracy=0.4, wall_time_s=0.2, examples_per_s=500.0
    )
    last = {**asdict(report), "done_recording": False}  # what the trainable reported after epoch 1
    state = TuneRunState()
    callback = RecordAndReport({cell.cell_key: CellRun(cell, "eps=8|epochs=4 normalized", 5)}, state)
    callback.on_trial_complete(0, [], trial(Unit(cell.cell_key, "t0", [PARAMS]), last, saved_in=cell))

    trials = read_table(str(tmp_path), "trials").set_index("replicate")
    assert trials.loc[0, "status"] == "ok" and trials.loc[0, "steps_taken"] == 12  # kept as it wrote it
    stopped = trials.loc[1]
    q = sample_rate(N, 32)
    assert stopped["status"] == "stopped_early" and stopped["reason"] == "stopped by the ASHA scheduler"
    assert stopped["steps_taken"] == 3 and stopped["steps"] == total_steps(N, 32, EPOCHS)
    assert stopped["noise_multiplier"] == SIGMA[32] and stopped["sample_rate"] == q
    assert stopped["epsilon_spent"] == pytest.approx(epsilon_spent(SIGMA[32], q, 3, cell.base.delta))
    assert stopped["val_accuracy"] == 0.4
    charged = charged_runs(str(tmp_path), "s").set_index("trial_id")
    second = replicate_trial_id(configuration_id(cell.cell_key, PARAMS), 1)
    assert charged.loc[second, "ended"] and charged.loc[second, "steps_taken"] == 3  # its start entry is closed
    # the replicate that recorded itself counts as it recorded itself, the other as stopped early
    assert state.failures == [] and callback.progress.cells[cell.cell_key].counts() == {"ok": 1, "stopped_early": 1}
    assert "(stopped early at epoch 1)" in capsys.readouterr().out


def test_a_unit_stopped_with_the_search_stays_unrecorded_for_resume(tmp_path: Path) -> None:
    state = TuneRunState()
    cell = context(tmp_path)
    callback = RecordAndReport({"eps8-E4": CellRun(cell, "eps=8|epochs=4 normalized", 5)}, state)
    unit = Unit("eps8-E4", "t0", [PARAMS])
    callback.on_trial_result(0, [], trial(unit, saved_in=cell), {STORAGE_ERROR_KEY: "No space left on device"})
    assert state.failures == ["a trial process could not write its records: No space left on device"]
    assert logging.getLogger("ray.tune").level == logging.CRITICAL
    callback.on_trial_complete(0, [], trial(unit, {"epoch": 2, "steps": 6}))
    assert read_table(str(tmp_path), "trials").empty


def test_stop_search_interrupts_tune_once() -> None:
    received: list[int] = []
    state = TuneRunState()
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: received.append(number))
    try:
        state.stop_search("first")
        state.stop_search("second")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [signal.SIGUSR1] and state.failures == ["first", "second"] and state.stopping


def test_each_tune_run_records_into_its_own_state_and_a_restored_callback_into_its_drivers() -> None:
    """Two runs (two drivers, or a run and its resume) never share what stopped them: the callbacks record into
    the state they were given, and an unpickled one (a restored Tuner's) into the one it is bound to."""
    first, second = TuneRunState(), TuneRunState()
    callback = StopOnStorageFailure(first)
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: None)
    try:
        callback.on_trial_result(0, [], trial(Unit("a", "t0", [PARAMS])), {STORAGE_ERROR_KEY: "Read-only file system"})
        restored = pickle.loads(pickle.dumps(callback))
        restored.bind({}, second)
        restored.on_trial_result(
            0, [], trial(Unit("a", "t0", [PARAMS])), {STORAGE_ERROR_KEY: "No space left on device"}
        )
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert first.failures == ["a trial process could not write its records: Read-only file system"]
    assert second.failures == ["a trial process could not write its records: No space left on device"]
    assert not TuneRunState().stopping


def _charge(cell: TrialContext, params: dict[str, Any], accuracy: float | None = None) -> None:
    """Charge both replicates of ``params`` as a unit does before its first step; with ``accuracy``, also
    record them as finished."""
    pending = [run_spec(cell, params, replicate) for replicate in (0, 1)]
    run_ids = charge_runs(cell, pending)
    if accuracy is not None:
        for run, run_id in zip(pending, run_ids, strict=True):
            result = TrialResult(
                config=run.config,
                status="ok",
                steps=12,
                steps_taken=12,
                epsilon_spent=2.0,
                num_train=N,
                val_accuracy=accuracy,
            )
            write_result(cell, FinishedRun(run, result, run_id), ledger=True)


def test_a_resumed_searcher_runs_what_was_charged_after_tune_last_saved_and_asks_no_more_than_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cell = context(tmp_path)
    spec = replace(
        GRID, sampler="random", ranges={**GRID.ranges, "base_learning_rate": {"low": 1e-3, "high": 1e-1, "log": True}}
    )

    def searcher() -> CellMultiplexer:
        return CellMultiplexer(
            {"a": CellSampler(spec)},
            budgets={"a": 4},
            unit_sizes={"a": 1},
            contexts={"a": cell},
            num_train=N,
            min_steps=1,
        )

    first = searcher()
    (saved,) = Unit.of(first.suggest("t0"), {"a": cell}).configurations
    checkpoint = tmp_path / "searcher.json"
    first.save(str(checkpoint))  # Tune's last saved state: t0 asked, nothing else
    (charged,) = Unit.of(first.suggest("t1"), {"a": cell}).configurations
    _charge(cell, charged)  # started, then the driver was killed: no row, and Tune never saved it
    (recorded,) = Unit.of(first.suggest("t2"), {"a": cell}).configurations
    _charge(cell, recorded, accuracy=0.75)  # ran to its rows after the last save

    resumed = searcher()
    resumed.restore(str(checkpoint))
    assert Unit.of(resumed.suggest("t3"), {"a": cell}).configurations == [charged]  # first, as it was charged
    assert "1 configuration(s) charged in the privacy ledger after Tune last saved its state run again" in (
        capsys.readouterr().out
    )
    sampler = resumed.samplers["a"]
    assert sampler.pending == [saved, charged]  # t0 runs again as Tune restores it; t1 as the searcher gave it
    assert [(params, value, state) for params, value, state in sampler.told] == [(recorded, 0.75, "complete")]
    (new,) = Unit.of(resumed.suggest("t4"), {"a": cell}).configurations
    assert new not in (saved, charged, recorded)
    assert resumed.suggest("t5") == CellMultiplexer.FINISHED  # 4 planned: t0, t1, t2 and t4
    resumed.on_trial_complete("t3", {SCORES_KEY: [0.5]})
    assert sampler.pending == [saved, new] and sampler.told[-1] == (charged, 0.5, "complete")

    again = searcher()  # a later resume from the same saved state: t1 is recorded now, nothing is run twice
    again.restore(str(checkpoint))
    _charge(cell, charged, accuracy=0.5)
    (after,) = Unit.of(again.suggest("t6"), {"a": cell}).configurations
    assert after not in (saved, charged, recorded) and again.suggested == {"a": 4}
