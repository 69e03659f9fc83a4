"""A unit's runs, each exactly once: real trials on the tiny 20 Newsgroups + MiniLM workload, their
rows and privacy-ledger entries checked value by value (no Ray)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from dptune.plan import coupled_learning_rate, sample_rate, total_steps
from dptune.plan.mechanism import wrapped
from dptune.privacy import calibrate_noise_multiplier
from dptune.records import read_table, replicate_trial_id
from dptune.records.ids import configuration_id
from dptune.records.ledger import charged_runs
from dptune.search.planning.cells import CellPlan, base_trial_config
from dptune.search.runs.execution import (
    TrialContext,
    record_pruned,
    run_configurations,
    run_spec,
    selection_value,
)
from dptune.space import Cell, load_space

#: Training examples of the workload (the cap; 20 Newsgroups has thousands) and its epochs.
N = 100
EPOCHS = 2
EPSILON = 8.0
CELL_KEY = "eps8-E2"
BATCH_SIZES = (32, 64)


@pytest.fixture(autouse=True)
def _cache(dptune_cache_dir: Path) -> None:
    """Features and σ calibrations in the session's test cache, never the user's."""


def context(root: Path, **changes: object) -> TrialContext:
    """The context of a search's cell ε = 8, E = 2 (the mechanism per B from the plan, as the driver gives it)."""
    space = load_space(
        REPO_ROOT / "tests/spaces/tiny.yaml",
        {"training.diagnostics": False, "epochs": [EPOCHS], "privacy.epsilons": [EPSILON]},
    ).space
    sigmas = {
        b: calibrate_noise_multiplier(EPSILON, space.privacy.delta, sample_rate(N, b), total_steps(N, b, EPOCHS))
        for b in BATCH_SIZES
    }
    mechanisms = wrapped(sigmas, EPSILON, space.privacy.delta, N, EPOCHS)
    plan = CellPlan(Cell(EPSILON, EPOCHS), "normalized", N, BATCH_SIZES, (), mechanisms, 2)
    made = TrialContext(
        base=base_trial_config(space, plan, N, 60),
        results_root=str(root),
        search_id="s",
        cell_id=plan.cell.cell_id,
        cell_key=plan.cell_key,
        coupling="sqrt",
        reference_batch_size=64,
        replicates=2,
        num_train=N,
        mechanisms=plan.mechanisms,
    )
    return replace(made, **changes)


FIRST = {"clip_bound": 0.5, "batch_size": 32, "base_learning_rate": 0.05}
SECOND = {"clip_bound": 1.0, "batch_size": 64, "base_learning_rate": 0.05}


def test_run_spec_couples_the_learning_rate_and_keeps_the_coins_secret_unless_reproducible(tmp_path: Path) -> None:
    plain = context(tmp_path)
    spec = run_spec(plain, {"batch_size": 128, "base_learning_rate": 0.01}, replicate=1)
    config = spec.config
    assert config.batch_size == 128 and config.base_learning_rate == 0.01
    assert config.learning_rate == pytest.approx(0.01 * math.sqrt(128 / 64))
    assert config.learning_rate == coupled_learning_rate(0.01, 128, 64)
    assert config.clip_bound == plain.base.clip_bound  # not sampled (AUTO-S): the base's
    assert config.seed is None  # fresh OS entropy in the run
    assert run_spec(replace(plain, coupling="none"), SECOND).config.learning_rate == 0.05

    seeded = replace(plain, reproducible_seed=7)
    seeds = {replicate: run_spec(seeded, FIRST, replicate).config.seed for replicate in range(3)}
    assert seeds == {replicate: run_spec(seeded, FIRST, replicate).config.seed for replicate in range(3)}  # repeats
    assert len(set(seeds.values())) == 3 and all(0 <= seed < 2**53 for seed in seeds.values())
    assert run_spec(replace(seeded, reproducible_seed=8), FIRST).config.seed != seeds[0]


def test_a_run_spec_names_its_run_once_and_carries_the_plans_mechanism(tmp_path: Path) -> None:
    cell = context(tmp_path)
    spec = run_spec(cell, SECOND, replicate=1, index=3)
    assert spec.configuration_id == configuration_id(CELL_KEY, SECOND)
    assert spec.trial_id == replicate_trial_id(spec.configuration_id, 1) == f"{spec.configuration_id}-r1"
    assert (spec.cell_key, spec.params, spec.replicate, spec.index) == (CELL_KEY, SECOND, 1, 3)
    assert cell.mechanisms is not None and spec.config.mechanism is cell.mechanisms[64]  # read, never calibrated
    assert spec.config.mechanism.noise_multiplier == calibrate_noise_multiplier(
        EPSILON, cell.base.delta, sample_rate(N, 64), total_steps(N, 64, EPOCHS)
    )
    assert "mechanism" not in spec.config.row()  # rows carry σ, q and T in their own columns
    assert run_spec(cell, {**SECOND, "batch_size": 128}).config.mechanism is None  # not in the plan: no mechanism


def test_every_run_is_charged_then_recorded_once_and_a_rerun_trains_nothing(tmp_path: Path) -> None:
    cell = context(tmp_path)
    outcome = run_configurations(cell, [FIRST, SECOND])
    assert outcome.ran == 4 and outcome.statuses == ["ok", "ok"] and outcome.run_statuses == ["ok"] * 4

    trials = read_table(str(tmp_path), "trials").set_index("trial_id")
    ids = {
        replicate_trial_id(configuration_id(CELL_KEY, params), replicate): params
        for params in (FIRST, SECOND)
        for replicate in (0, 1)
    }
    assert set(trials.index) == set(ids)
    assert set(trials["cell_id"]) == {"eps=8|epochs=2"} and set(trials["search_id"]) == {"s"}
    assert (trials["status"] == "ok").all() and (trials["num_train"] == N).all()
    for trial_id, params in ids.items():
        row = trials.loc[trial_id]
        assert row["batch_size"] == params["batch_size"] and row["clip_bound"] == params["clip_bound"]
        assert row["steps_taken"] == row["steps"] == total_steps(N, params["batch_size"], EPOCHS)
        assert row["noise_multiplier"] == cell.mechanisms[params["batch_size"]].noise_multiplier
    for index, params in enumerate((FIRST, SECOND)):  # each score: the mean over the two replicates
        rows = trials.loc[[replicate_trial_id(configuration_id(CELL_KEY, params), r) for r in (0, 1)]]
        assert outcome.scores[index] == pytest.approx(rows["val_accuracy"].mean())

    charged = charged_runs(str(tmp_path), "s").set_index("trial_id")
    assert set(charged.index) == set(ids) and charged["ended"].all() and set(charged["status"]) == {"ok"}
    for trial_id, params in ids.items():  # the ledger charges what the rows say was spent
        assert charged.loc[trial_id, "noise_multiplier"] == cell.mechanisms[params["batch_size"]].noise_multiplier
        assert charged.loc[trial_id, "sample_rate"] == sample_rate(N, params["batch_size"])
        assert charged.loc[trial_id, "steps_taken"] == trials.loc[trial_id, "steps_taken"]
        assert charged.loc[trial_id, "epsilon_spent"] == pytest.approx(trials.loc[trial_id, "epsilon_spent"])
        assert 0 < charged.loc[trial_id, "epsilon_spent"] <= EPSILON * (1 + 1e-6)

    again = run_configurations(cell, [SECOND, FIRST])  # a resume: every run is recorded, none trains
    assert again.ran == 0 and again.scores == pytest.approx(outcome.scores[::-1])
    assert len(read_table(str(tmp_path), "trials")) == 4 and len(charged_runs(str(tmp_path), "s")) == 4


def test_a_run_that_raises_before_its_first_step_is_recorded_as_spending_nothing(tmp_path: Path) -> None:
    broken = {"clip_bound": -1.0, "batch_size": 32, "base_learning_rate": 0.05}  # refused by the trial's checks
    outcome = run_configurations(context(tmp_path, replicates=1), [broken, FIRST])
    assert outcome.statuses == ["error", "ok"] and outcome.scores[0] == 0.0 and outcome.scores[1] > 0
    trials = read_table(str(tmp_path), "trials").set_index("trial_id")
    failed = trials.loc[replicate_trial_id(configuration_id(CELL_KEY, broken), 0)]
    assert failed["status"] == "error" and "clip" in failed["reason"]
    assert failed["steps_taken"] == 0 and failed["epsilon_spent"] == 0.0
    charged = charged_runs(str(tmp_path), "s").set_index("trial_id")
    assert charged.loc[failed.name, "ended"] and charged.loc[failed.name, "epsilon_spent"] == 0.0


def test_the_fused_runner_records_the_same_rows_and_ledger_entries(tmp_path: Path) -> None:
    outcome = run_configurations(context(tmp_path, replicates=1, fused=True), [FIRST, SECOND])
    assert outcome.ran == 2 and outcome.statuses == ["ok", "ok"]
    trials = read_table(str(tmp_path), "trials")
    assert set(trials["engine"]) == {"fused"} and (trials["steps_taken"] == trials["steps"]).all()
    charged = charged_runs(str(tmp_path), "s")
    assert charged["ended"].all() and sorted(charged["trial_id"]) == sorted(trials["trial_id"])


def test_a_pruned_configuration_is_one_row_that_spent_nothing(tmp_path: Path) -> None:
    record_pruned(context(tmp_path), {"clip_bound": 1.0, "batch_size": 64, "base_learning_rate": 0.01}, N, min_steps=10)
    (row,) = read_table(str(tmp_path), "trials").to_dict("records")
    assert row["status"] == "pruned_min_steps" and row["reason"] == "T = 3 steps < min_steps = 10"
    assert row["steps"] == total_steps(N, 64, EPOCHS) == 3 and row["steps_taken"] == 0 and row["epsilon_spent"] == 0
    assert charged_runs(str(tmp_path), "s").empty  # never charged: it never trains


def test_the_sampler_is_told_the_noisy_score_when_the_run_has_one_and_zero_for_a_failure(tmp_path: Path) -> None:
    base = context(tmp_path).base
    assert selection_value(base, "ok", 0.6, math.nan) == 0.6
    noisy = replace(base, score_noise_multiplier=2.0)
    assert selection_value(noisy, "ok", 0.6, 0.55) == 0.55
    assert selection_value(base, "diverged", 0.6, math.nan) == 0.0
    assert selection_value(base, "ok", math.nan, math.nan) == 0.0


def test_a_resume_reconciles_a_cell_beside_its_auto_s_twin_whose_starts_have_no_clip_bound(tmp_path: Path) -> None:
    """The start entries read on ``--resume`` are every cell's: the AUTO-S twin's (cell key ``<key>-auto_s``,
    no C sampled) share the normalized cell's key as a prefix and are not its configurations."""
    import pandas as pd

    from dptune.records.ledger import RunStart
    from dptune.search.planning.sampler import CellSampler, CellSpec
    from dptune.search.scheduling.reconcile import unknown_configurations

    cell = context(tmp_path)
    values = {"clip_bound": {"values": [0.5]}, "base_learning_rate": {"values": [0.05]}}
    sampler = CellSampler(CellSpec("grid", 0, BATCH_SIZES, BATCH_SIZES, values))

    def start(cell_key: str, params: dict[str, float]) -> RunStart:
        configuration = configuration_id(cell_key, params)
        trial = replicate_trial_id(configuration, 0)
        return RunStart(trial, configuration, 0, "s", cell.cell_id, "normalized", params, 1.0, 0.3, 7, 1e-5, EPSILON)

    own = {"clip_bound": 0.5, "batch_size": 32, "base_learning_rate": 0.05}
    twin = {"batch_size": 32, "base_learning_rate": 0.05}
    trials = pd.DataFrame(columns=["configuration_id", "trial_id", "status"])
    found = unknown_configurations(
        cell, sampler, [start(f"{cell.cell_key}-auto_s", twin), start(cell.cell_key, own)], trials
    )
    assert found.unrecorded == [own] and found.told == []
