"""A cell's sampler (Optuna ask/tell, min-step pruning, plain-data state) and the Tune searcher over
cells, without running a trial."""

from __future__ import annotations

import itertools
import json
import math
import pickle
import tempfile
from pathlib import Path

import pytest

from dptune.search.planning.sampler import MAX_PRUNED_PROPOSALS, CellSampler, CellSpec, SamplerExhausted

GRID = CellSpec(
    sampler="grid",
    seed=3,
    batch_sizes=(32, 64, 128),
    feasible_batch_sizes=(32, 64, 128),
    ranges={"clip_bound": {"values": [0.1, 1.0]}, "base_learning_rate": {"values": [0.001, 0.01]}},
)
RANGES = {
    "clip_bound": {"low": 0.01, "high": 10.0, "log": True},
    "base_learning_rate": {"low": 1e-4, "high": 0.1, "log": True},
}


def _key(params: dict) -> tuple:
    return tuple(sorted((name, float(value)) for name, value in params.items()))


def test_a_grid_runs_every_point_exactly_once_across_a_restore() -> None:
    sampler = CellSampler(GRID)
    first = sampler.ask(5, on_pruned=pytest.fail)
    for params in first[:3]:
        sampler.tell(params, 0.5)
    # a checkpoint with 2 points asked and not told, restored from JSON
    restored = CellSampler.from_state(json.loads(json.dumps(sampler.state())))
    rest = restored.ask(100, on_pruned=pytest.fail)
    points = {_key(p) for p in first} | {_key(p) for p in rest}
    expected = {
        _key({"batch_size": b, "clip_bound": c, "base_learning_rate": lr})
        for b, c, lr in itertools.product((32, 64, 128), (0.1, 1.0), (0.001, 0.01))
    }
    assert len(first) + len(rest) == 12 and points == expected
    assert restored.ask(1, on_pruned=pytest.fail) == []  # exhausted
    # the 2 pending configurations are told after the resume (their unit re-ran)
    for params in first[3:] + rest:
        restored.tell(params, 0.4)
    assert restored.state()["pending"] == [] and len(restored.told) == 12


@pytest.mark.parametrize("sampler_name", ["random", "tpe"])
def test_a_restored_sampler_never_proposes_a_pending_configuration_again(sampler_name: str) -> None:
    # killed after its first unit was asked and before it was told: the restored sampler (the
    # searcher's checkpoint) must neither replay that ask nor count it twice against the budget
    spec = CellSpec(sampler=sampler_name, seed=0, batch_sizes=(32, 64), feasible_batch_sizes=(32, 64), ranges=RANGES)
    sampler = CellSampler(spec)
    pending = sampler.ask(2, on_pruned=pytest.fail)
    restored = CellSampler.from_state(json.loads(json.dumps(sampler.state())))
    later = restored.ask(3, on_pruned=pytest.fail)
    assert {_key(p) for p in later}.isdisjoint({_key(p) for p in pending}) and len({_key(p) for p in later}) == 3
    assert [t.state.name for t in restored.study.trials[:2]] == ["RUNNING", "RUNNING"]
    for params in pending + later:  # the pending unit re-ran: its values are told to the trials it holds
        restored.tell(params, 0.5)
    assert restored.pending == [] and len(restored.told) == 5
    assert sum(t.state.name == "COMPLETE" for t in restored.study.trials) == 5


def test_a_categorical_space_gives_each_configuration_once_then_runs_out() -> None:
    spec = CellSpec(
        sampler="random",
        seed=2,
        batch_sizes=(32, 64, 128),
        feasible_batch_sizes=(32, 64, 128),
        ranges={"clip_bound": {"values": [0.1, 1.0]}, "base_learning_rate": {"values": [0.001, 0.01]}},
    )
    sampler = CellSampler(spec)
    first = sampler.ask(1, on_pruned=pytest.fail)
    restored = CellSampler.from_state(sampler.state())
    rest = restored.ask(100, on_pruned=pytest.fail)
    assert len(first) + len(rest) == 12 and len({_key(p) for p in first + rest}) == 12
    assert restored.ask(1, on_pruned=pytest.fail) == []  # every configuration asked once: the cell closes


def test_infeasible_batch_sizes_are_recorded_and_never_returned() -> None:
    spec = CellSpec(sampler="random", seed=0, batch_sizes=(32, 64, 2048), feasible_batch_sizes=(32, 64), ranges=RANGES)
    sampler = CellSampler(spec)
    pruned: list[dict] = []
    asked = sampler.ask(40, on_pruned=pruned.append)
    assert len(asked) == 40 and {p["batch_size"] for p in asked} <= {32, 64}
    assert pruned and {p["batch_size"] for p in pruned} == {2048}
    assert [state for _, _, state in sampler.told].count("pruned") == len(pruned)


def test_a_sampler_that_only_proposes_pruned_sizes_gives_up() -> None:
    spec = CellSpec(sampler="random", seed=0, batch_sizes=(2048,), feasible_batch_sizes=(32,), ranges=RANGES)
    pruned: list[dict] = []
    with pytest.raises(SamplerExhausted, match="only pruned batch sizes"):
        CellSampler(spec).ask(1, on_pruned=pruned.append)
    assert len(pruned) == MAX_PRUNED_PROPOSALS


def test_tpe_asks_a_batch_of_distinct_configurations_and_learns_from_told_values() -> None:
    spec = CellSpec(
        sampler="tpe", seed=1, batch_sizes=(32, 64), feasible_batch_sizes=(32, 64), ranges=RANGES, startup_trials=4
    )
    sampler = CellSampler(spec)
    for _ in range(4):
        batch = sampler.ask(8, on_pruned=pytest.fail)
        assert len({_key(p) for p in batch}) == 8
        for params in batch:  # the best clip bounds are near 1
            sampler.tell(params, -abs(math.log10(params["clip_bound"])))
    late = sampler.ask(16, on_pruned=pytest.fail)
    assert sum(abs(math.log10(p["clip_bound"])) < 1 for p in late) >= 10  # of 16; random: about 8


def test_failed_configurations_are_told_as_failed_and_survive_the_state() -> None:
    sampler = CellSampler(GRID)
    params = sampler.ask(1, on_pruned=pytest.fail)[0]
    sampler.tell(params, None)
    restored = CellSampler.from_state(sampler.state())
    assert restored.told == [(params, None, "fail")]
    assert restored.study.trials[0].state.name == "FAIL"


def test_the_tune_searcher_checkpoints_plain_data(tmp_path: Path) -> None:
    from dptune.search.scheduling.searcher import SCORES_KEY, CellMultiplexer, Unit
    from test_tune_adapters import context

    contexts = {"a": context(tmp_path / "a"), "b": context(tmp_path / "b")}

    searcher = CellMultiplexer(
        {"a": CellSampler(GRID), "b": CellSampler(GRID)},
        budgets={"a": 12, "b": 5},
        unit_sizes={"a": 4, "b": 5},
        contexts=contexts,
        num_train=1000,
        min_steps=1,
    )
    units = {f"t{i}": Unit.of(searcher.suggest(f"t{i}"), contexts) for i in range(3)}
    assert [u.cell_key for u in units.values()] == ["a", "b", "a"]
    assert [len(u.configurations) for u in units.values()] == [4, 5, 4]
    searcher.on_trial_complete("t0", {SCORES_KEY: [0.1, 0.2, 0.3, 0.4]})
    blob = pickle.dumps(searcher)
    assert b"optuna" not in blob  # no study, sampler or generator: plain data only
    copy = pickle.loads(blob)
    copy.bind(contexts)  # as tuners.restore_tuner binds a restored Tuner's searcher to its driver
    with tempfile.NamedTemporaryFile(suffix=".json") as file:
        searcher.save(file.name)
        copy.restore(file.name)
    assert copy.suggested == {"a": 8, "b": 5} and set(copy.owner) == {"t1", "t2"}
    last = Unit.of(copy.suggest("t3"), contexts)
    assert last.cell_key == "a" and len(last.configurations) == 4
    seen = {_key(p) for u in units.values() if u.cell_key == "a" for p in u.configurations}
    assert not seen & {_key(p) for p in last.configurations}  # the grid does not repeat a point
    assert copy.suggest("t4") == "FINISHED"
