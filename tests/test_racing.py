"""Racing (``racing:`` in a space): rounds that add replicates to the configurations within noise of a
cell's best, decided from the results folder (``dptune.search.scheduling.racing``), and a real search
that races on the tiny 20 Newsgroups workload."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pandas as pd
import pytest

from conftest import ONE_CELL, REPO_ROOT, run_search, start_search
from dptune import analysis as an
from dptune.records import read_table, replicate_trial_id
from dptune.records.ids import configuration_id
from dptune.records.ledger import RunStart, charged_runs
from dptune.search.scheduling.racing import next_round, open_comparison
from dptune.space.spec import RacingSpec
from test_execution import context

NAMES = ["batch_size", "clip_bound", "base_learning_rate"]
#: Three configurations of cell eps8-E2: A and B cannot be told apart, C is far below both.
A = {"clip_bound": 0.5, "batch_size": 32, "base_learning_rate": 0.05}
B = {"clip_bound": 1.0, "batch_size": 64, "base_learning_rate": 0.05}
C = {"clip_bound": 0.1, "batch_size": 64, "base_learning_rate": 0.001}


def _rows(cell_key: str, scores: dict[str, tuple[dict[str, float], list[float]]], epsilon: float = 8.0) -> pd.DataFrame:
    """``trials`` rows of cell ``cell_key`` (ε = ``epsilon``, E = 2): each named configuration with one
    finished run per score."""
    rows = []
    for params, values in scores.values():
        configuration = configuration_id(cell_key, params)
        for replicate, value in enumerate(values):
            rows.append(
                {
                    **params,
                    "configuration_id": configuration,
                    "trial_id": replicate_trial_id(configuration, replicate),
                    "replicate": replicate,
                    "search_id": "s",
                    "cell_id": f"eps={epsilon:g}|epochs=2",
                    "epsilon": epsilon,
                    "epochs": 2,
                    "clipping": "normalized",
                    "status": "ok",
                    "val_accuracy": value,
                    "test_accuracy": value,
                    "train_loss": 1.0,
                    "num_val": 1000,
                    "num_test": 1000,
                }
            )
    return pd.DataFrame(rows)


def _start(cell_key: str, params: dict[str, float], replicate: int) -> RunStart:
    configuration = configuration_id(cell_key, params)
    trial = replicate_trial_id(configuration, replicate)
    return RunStart(trial, configuration, replicate, "s", "eps=8|epochs=2", "normalized", params, 1.0, 0.3, 7, 1e-5, 8)


SCORES = {"A": (A, [0.80, 0.81]), "B": (B, [0.79, 0.81]), "C": (C, [0.50, 0.52])}


def test_a_round_adds_replicates_to_the_confidence_set_of_the_best_only(tmp_path: Path) -> None:
    cell = context(tmp_path)
    trials = _rows(cell.cell_key, SCORES)
    ranked = an.rank_configurations(trials, by=["cell_id", "clipping"]).set_index("clip_bound")
    assert ranked["within_noise"].to_dict() == {0.5: True, 1.0: True, 0.1: False}
    chosen = next_round(cell, RacingSpec(step=2, max_replicates=8, budget=100), NAMES, trials, [], None)
    assert chosen.ended is None
    assert [p["clip_bound"] for p in chosen.configurations] == [0.5, 1.0]  # best first
    assert chosen.replicates == [[2, 3], [2, 3]]
    assert chosen.signature == [sorted(configuration_id(cell.cell_key, p) for p in (A, B)), 0.5, 1.0, 32, 64]
    spec = RacingSpec(step=2, max_replicates=8, budget=100, patience=2)
    once = next_round(cell, spec, NAMES, trials, [], chosen.signature, unchanged=0)
    assert once.ended is None and once.replicates == [[2, 3], [2, 3]]  # one unchanged round: patience 2 races on
    twice = next_round(cell, spec, NAMES, trials, [], chosen.signature, unchanged=1)
    assert twice.ended == "the confidence set and the optimal C and B intervals did not change in 2 round(s)"


def test_a_round_keeps_to_the_budget_and_max_replicates(tmp_path: Path) -> None:
    cell = context(tmp_path)
    trials = _rows(cell.cell_key, SCORES)
    tight = next_round(cell, RacingSpec(step=2, max_replicates=8, budget=3), NAMES, trials, [], None)
    assert tight.replicates == [[2, 3], [2]]  # 3 runs: two to the best, one to the next
    capped = next_round(cell, RacingSpec(step=4, max_replicates=3, budget=100), NAMES, trials, [], None)
    assert capped.replicates == [[2], [2]]
    raced = pd.concat([trials, _rows(cell.cell_key, {"A": (A, [0.80] * 3)}).iloc[2:]])  # A's third replicate
    spent = next_round(cell, RacingSpec(step=2, max_replicates=8, budget=1), NAMES, raced, [], None)
    assert spent.ended == "the cell's racing budget is spent" and not spent.configurations


def test_runs_charged_without_a_row_run_again_before_a_new_round(tmp_path: Path) -> None:
    cell = context(tmp_path)
    trials = _rows(cell.cell_key, SCORES)
    started = [_start(cell.cell_key, B, 2), _start(cell.cell_key, B, 3), _start(f"{cell.cell_key}-auto_s", A, 2)]
    lost = next_round(cell, RacingSpec(budget=100), NAMES, trials, started, ["previous"])
    assert lost.ended is None and lost.lost and lost.signature == ["previous"]
    assert lost.configurations == [B] and lost.replicates == [[2, 3]]
    failed = frozenset({replicate_trial_id(configuration_id(cell.cell_key, B), 3)})  # a unit that failed: Tune's
    after = next_round(cell, RacingSpec(budget=100), NAMES, trials, started, ["previous"], excluded=failed)
    assert after.replicates == [[2]]


def test_a_cell_at_an_end_of_an_open_comparison_races_on_though_its_set_holds_still(tmp_path: Path) -> None:
    cell = context(tmp_path)
    here = _rows(cell.cell_key, SCORES)
    other = _rows("eps1-E2", {"A": (A, [0.70, 0.71]), "B": (B, [0.70, 0.70])}, epsilon=1.0)
    assert open_comparison(cell, pd.concat([here, other])) and not open_comparison(cell, here)
    spec = RacingSpec(budget=100, patience=1)
    signature = next_round(cell, spec, NAMES, here, [], None).signature
    alone = next_round(cell, spec, NAMES, here, [], signature)
    assert alone.ended is not None and alone.ended.startswith("the confidence set and the optimal C and B")
    compared = next_round(cell, spec, NAMES, pd.concat([here, other]), [], signature)
    assert compared.ended is None and compared.replicates == [[2, 3], [2, 3]]


def test_a_set_of_one_ends_the_race(tmp_path: Path) -> None:
    cell = context(tmp_path)
    trials = _rows(cell.cell_key, {"A": (A, [0.90, 0.90, 0.91]), "C": (C, [0.50, 0.52, 0.51])})
    chosen = next_round(cell, RacingSpec(budget=100), NAMES, trials, [], None)
    assert chosen.ended == "the confidence set of the best holds one configuration" and not chosen.configurations


def test_the_space_refuses_racing_where_it_cannot_hold(tmp_path: Path) -> None:
    from dptune.space import SpaceError, load_space

    space = REPO_ROOT / "tests/spaces/tiny.yaml"
    with pytest.raises(SpaceError, match="max_replicates .* must exceed replicates"):
        load_space(space, {"replicates": 4, "racing": {"budget": 10, "max_replicates": 4}})
    with pytest.raises(SpaceError, match="racing must be absent"):
        load_space(space, {"scheduler": {"name": "asha"}, "training.runner": "trial", "racing": {"budget": 10}})


def _racing_args(storage: Path, budget: int, *more: str) -> tuple[str, ...]:
    """A one-cell racing search of the tiny space: 8 configurations twice, then rounds of 2 more."""
    return (
        "--space",
        str(REPO_ROOT / "tests/spaces/tiny.yaml"),
        "--storage",
        str(storage),
        "--name",
        "race",
        "--no-report",
        *ONE_CELL,
        "--set",
        "clip_bound.values=[0.03,0.1,0.3,1.0]",
        "--set",
        "replicates=2",
        "--set",
        f"racing={{step: 2, max_replicates: 6, budget: {budget}}}",
        *more,
    )


def test_a_racing_search_adds_runs_to_the_set_of_the_best_within_its_budget(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    budget = 16
    done = run_search(search_env, *_racing_args(tmp_path, budget))
    assert done.returncode == 0, done.stderr[-3000:]
    trials = read_table(str(tmp_path / "race"), "trials")
    ran = trials[trials["status"] != "pruned_min_steps"]
    assert ran["trial_id"].is_unique and (ran["replicate"] < 6).all()
    first = ran[ran["replicate"] < 2]
    raced = ran[ran["replicate"] >= 2]
    assert 0 < len(raced) <= budget
    ranked = an.rank_configurations(an.finished_trials(first), by=["cell_id", "clipping"])
    in_set = set(ranked.loc[ranked["within_noise"], "configuration_id"])
    round_one = set(raced.loc[raced["replicate"] == 2, "configuration_id"])
    assert in_set <= round_one or len(raced) == budget  # round 1 raced the whole first-pass set
    assert "racing ended after" in done.stdout
    search = read_table(str(tmp_path / "race"), "search")
    assert "Racing chose which configurations" in search["guarantee"].iloc[0]
    assert int(search["trials_planned"].iloc[0]) == len(first) + len(raced)
    card = json.loads(next((tmp_path / "race/models").glob("*/model_card.json")).read_text())
    assert card["privacy"]["covers"].startswith("NOTHING as released")
    best = an.best_configurations(an.finished_trials(ran), by=["cell_id", "clipping"]).iloc[0]
    assert card["accuracy"]["configuration_test_interval"] == [best["test_low"], best["test_high"]]
    assert f"[{best['test_low']:.3f}, {best['test_high']:.3f}]" in done.stdout


def test_ctrl_c_in_a_racing_round_then_resume_runs_each_planned_replicate_once(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    """SIGINT to the process group once the first round is decided: the command stops unfinished;
    --resume runs what the rounds planned, every run charged has exactly one row, and the rounds keep
    to their budget."""
    budget = 24
    args = _racing_args(tmp_path, budget, "--set", "epochs=[20]")
    driver = start_search(search_env, *args)
    assert driver.stdout is not None
    for line in driver.stdout:
        if "racing round 1:" in line:
            os.killpg(driver.pid, signal.SIGINT)
            break
    out, err = driver.communicate(timeout=900)
    assert driver.returncode == 130, err[-3000:]
    assert "racing rounds add more" in err.strip().splitlines()[-1]
    resumed = run_search(search_env, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    root = tmp_path / "race"
    trials = read_table(str(root), "trials")
    ran = trials[trials["status"] != "pruned_min_steps"]
    assert ran["trial_id"].is_unique and set(ran["status"]) == {"ok"}
    charged = charged_runs(str(root), str(ran["search_id"].iloc[0]))
    assert set(charged["trial_id"]) == set(ran["trial_id"])  # every charged run has its row
    assert 0 < int((ran["replicate"] >= 2).sum()) <= budget
