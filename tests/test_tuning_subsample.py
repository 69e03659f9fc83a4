"""The plan of tuning on a private subsample: the transfer rule's schedules, the spec's refusals, and
a total ε recomputed independently from the plan's σ."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import TINY_EVAL_EXAMPLES, TINY_TRAIN_EXAMPLES
from dptune.contract import PublicSchedule, TrialConfig, WorkloadSpec
from dptune.data.spec import People, Workload, WorkloadError
from dptune.data.workload import SplitRows, tuning_rows_bytes, tuning_subset
from dptune.errors import SearchError, TrialConfigError
from dptune.plan import epoch_steps, sample_rate, total_steps
from dptune.privacy import calibrate_noise_multiplier
from dptune.privacy.checks import bound_text
from dptune.privacy.composition import TrialMechanism
from dptune.privacy.selection import SELECTION_EPSILON_RTOL
from dptune.privacy.subsampled_tuning import subsampled_tuning_cost
from dptune.records import TRUST_BOUNDARY, read_table
from dptune.records.ledger import charged_runs
from dptune.runners.fused import run_fused
from dptune.runners.trial import run_trial
from dptune.search.planning.cells import format_subsample_plan, plan_subsample_cell
from dptune.search.planning.subsample import (
    RELEASE_SUFFIX,
    TUNING_ROWS_FILE,
    draw_tuning_rows,
    public_schedules,
    tunable_batch_sizes,
    tuning_schedule,
)
from dptune.space import SpaceError, load_space
from expected import subsampled_tuning_epsilon
from hidden_runs import assert_nothing_of_the_hidden_runs_outside, assert_owner_only, private_search
from trial_configs import planned

PRIVATE = Path(__file__).resolve().parent.parent / "search_spaces" / "private.yaml"
SUBSAMPLE = "privacy.private_selection.tuning_subsample"


def subsample_space(fraction: float, transfer: str, batch_sizes: list[int]):  # noqa: ANN201
    return load_space(
        PRIVATE, {SUBSAMPLE: {"fraction": fraction, "transfer": transfer}, "batch_size": {"values": batch_sizes}}
    )


def test_a_tuning_run_keeps_the_sample_rate_or_the_expected_batch_size() -> None:
    # N = 10,000, B = 250, E = 10, q₁ = 0.2: the release runs q = 0.025 for T = 400 steps
    assert tuning_schedule(10_000, 250, 10, 0.2, "sample_rate") == (0.025, 400)
    # an expected batch of 250 on the nominal 2,000 rows of the subsample: q = 0.125, T = 10·2000/250
    assert tuning_schedule(10_000, 250, 10, 0.2, "batch_size") == (0.125, 80)
    assert tuning_schedule(10_000, 2000, 1, 0.2, "batch_size") == (1.0, 1)
    with pytest.raises(ValueError, match="batch_size 2001 exceeds the tuning set's nominal size q₁·N = 2000"):
        tuning_schedule(10_000, 2001, 10, 0.2, "batch_size")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"fraction": 1.0}, "fraction"),
        ({"fraction": 0}, "fraction"),
        ({"fraction": 0.1, "transfer": "learning_rate"}, "'sample_rate' or 'batch_size'"),
        ({"fraction": 0.1, "variant": 2}, "variant"),
    ],
)
def test_the_spec_refuses_what_the_analysis_does_not_cover(value: dict, expected: str) -> None:
    with pytest.raises(SpaceError, match=expected):
        load_space(PRIVATE, {SUBSAMPLE: value})


def test_batch_sizes_above_the_subsample_are_not_tuned_and_none_left_is_refused() -> None:
    space = subsample_space(0.2, "batch_size", [64, 256, 512]).space
    assert tunable_batch_sizes(space, (64, 256, 512), 2000) == (64, 256)  # q₁·N = 400
    assert tunable_batch_sizes(subsample_space(0.2, "sample_rate", [512]).space, (512,), 2000) == (512,)
    with pytest.raises(SearchError, match=r"no batch size fits the tuning set's nominal size q₁·N = 20 "):
        tunable_batch_sizes(subsample_space(0.01, "batch_size", [64]).space, (64,), 2000)


@pytest.mark.usefixtures("dptune_cache_dir")
def test_the_planned_total_is_met_and_recomputes_from_the_plans_sigmas() -> None:
    loaded = subsample_space(0.2, "batch_size", [64, 256, 512])
    plan = plan_subsample_cell(loaded.space, 2000)
    tuning = plan.tuning
    assert tuning is not None and plan.feasible_batch_sizes == (64, 256) and tuning.untunable == (512,)
    assert tuning.schedules == {b: tuning_schedule(2000, b, 10, 0.2, "batch_size") for b in (64, 256)}
    assert plan.cell.epsilon == tuning.epsilon_per_run and plan.noise_multipliers == tuning.release_noise_multipliers
    for b in (64, 256):  # every run, tuning and release, is calibrated to the same per-run ε
        rate, steps = tuning.schedules[b]
        assert tuning.noise_multipliers[b] == calibrate_noise_multiplier(tuning.epsilon_per_run, 1e-5, rate, steps)
        release = calibrate_noise_multiplier(tuning.epsilon_per_run, 1e-5, b / 2000, round(10 * 2000 / b))
        assert plan.noise_multipliers[b] == release
    recomputed = subsampled_tuning_cost(
        [TrialMechanism(tuning.noise_multipliers[b], *tuning.schedules[b]) for b in (64, 256)],
        [TrialMechanism(plan.noise_multipliers[b], b / 2000, round(10 * 2000 / b)) for b in (64, 256)],
        0.2,
        10,
        1e-5,
        score_noise_multiplier=5.0,
    )
    assert recomputed.epsilon == pytest.approx(tuning.epsilon_total, rel=1e-9)
    assert 8.0 * (1 - 2 * SELECTION_EPSILON_RTOL) < tuning.epsilon_total <= 8.0  # the largest per-run ε that fits
    assert tuning.epsilon_tuning < tuning.epsilon_total and tuning.epsilon_release < tuning.epsilon_total
    text = format_subsample_plan(loaded, [plan])
    assert "tuning on a secret subsample: q₁ = 0.2 of the training and validation rows, transfer 'batch_size'" in text
    assert f"the RDP bound of the whole: ε = {bound_text(tuning.epsilon_total, 4)}" in text
    assert f"     64   0.16         62   {tuning.noise_multipliers[64]:.4f}" in text
    assert "not tuned, larger than the subsample's q₁·N rows: B = [512]" in text and "pruned" not in text


@pytest.mark.usefixtures("dptune_cache_dir")
@pytest.mark.parametrize(("fraction", "transfer"), [(0.1, "sample_rate"), (0.5, "batch_size")])
def test_the_planned_total_matches_an_independent_computation(fraction: float, transfer: str) -> None:
    space = subsample_space(fraction, transfer, [64, 256, 1024]).space
    plan = plan_subsample_cell(space, 10_000)
    tuning = plan.tuning
    assert tuning is not None
    selection = space.privacy.private_selection
    independent = subsampled_tuning_epsilon(
        [(tuning.noise_multipliers[b], *tuning.schedules[b]) for b in plan.feasible_batch_sizes],
        [(tuning.release_noise_multipliers[b], b / 10_000, total_steps(10_000, b, 10)) for b in tuning.schedules],
        fraction,
        space.sampler.trials_per_cell,
        selection.score_noise_multiplier,
        space.privacy.delta,
    )
    assert independent <= selection.epsilon and independent == pytest.approx(tuning.epsilon_total, rel=0.02)


def test_keeping_the_sample_rate_gives_tuning_runs_the_releases_noise() -> None:
    plan = plan_subsample_cell(subsample_space(0.1, "sample_rate", [128]).space, 2000)
    assert plan.tuning is not None and plan.tuning.noise_multipliers == plan.noise_multipliers
    assert plan.tuning.schedules == {128: (128 / 2000, round(10 * 2000 / 128))}


def test_public_schedules_cut_the_tuning_steps_into_epochs_and_scale_the_expected_batch() -> None:
    plan = plan_subsample_cell(subsample_space(0.25, "sample_rate", [64, 128]).space, 2000)
    assert plan.tuning is not None
    kept = public_schedules(plan.tuning, 2000, 10)
    for b in (64, 128):  # the release's own q, T and epochs; an expected batch of q₁·B on X₁
        assert kept[b] == PublicSchedule(b / 2000, total_steps(2000, b, 10), tuple(epoch_steps(2000, b, 10)), 0.25 * b)
    plan = plan_subsample_cell(subsample_space(0.3, "batch_size", [64, 128]).space, 2000)
    assert plan.tuning is not None
    for b, schedule in public_schedules(plan.tuning, 2000, 10).items():  # B on X₁'s nominal 600 rows
        assert (schedule.sample_rate, schedule.steps) == (b / 600, round(10 * 600 / b))
        assert len(schedule.epoch_steps) == 10 and sum(schedule.epoch_steps) == schedule.steps
        assert min(schedule.epoch_steps) >= 1 and schedule.expected_batch_size == pytest.approx(b)


def sized_workload(num_train: int, num_val: int, people: People | None = None) -> Workload:
    """A workload of ``num_train`` training and ``num_val`` validation rows (their content unused)."""
    rows = [TensorDataset(torch.zeros(n, 1), torch.zeros(n, dtype=torch.int64)) for n in (num_train, num_val, 1)]
    spec = WorkloadSpec("sized", "none", "head")
    return Workload(spec, 2, ["a", "b"], *rows, modality="features", feature_dim=1, people=people)


def test_the_tuning_subsample_is_drawn_once_per_row_from_fresh_coins_and_kept(tmp_path: Path) -> None:
    first = draw_tuning_rows(str(tmp_path / "a"), sized_workload(40_000, 8_000), 0.25)
    assert first == f"{tmp_path / 'a'}/{TUNING_ROWS_FILE}"
    with np.load(first) as rows:
        train, val, sizes = rows["train"], rows["val"], rows["sizes"]
    # each row kept independently with probability q₁: binomial counts within 5 standard deviations
    for kept, n in ((train, 40_000), (val, 8_000)):
        assert abs(len(kept) - 0.25 * n) < 5 * np.sqrt(n * 0.25 * 0.75) and len(np.unique(kept)) == len(kept)
        assert kept.min() >= 0 and kept.max() < n
    assert list(sizes) == [40_000, 8_000]
    # a resume reads the kept draw back; another search draws other coins
    before = Path(first).read_bytes()
    again = draw_tuning_rows(str(tmp_path / "a"), sized_workload(40_000, 8_000), 0.25)
    assert again == first and Path(first).read_bytes() == before
    with np.load(draw_tuning_rows(str(tmp_path / "b"), sized_workload(40_000, 8_000), 0.25)) as other:
        assert not np.array_equal(other["train"], train)
    with pytest.raises(SearchError, match="drawn for 40000 training and 8000 validation rows"):
        draw_tuning_rows(str(tmp_path / "a"), sized_workload(40_001, 8_000), 0.25)


def test_the_tuning_subsample_of_people_keeps_whole_people(tmp_path: Path) -> None:
    rows_per_person = np.random.default_rng(0).zipf(2.0, size=4_000).clip(max=50)
    train = np.repeat(np.arange(4_000), rows_per_person)
    val = np.repeat(np.arange(500), 3)
    people = People("user", train=train, val=val, test=np.zeros(1, dtype=np.int64))
    with np.load(draw_tuning_rows(str(tmp_path), sized_workload(len(train), len(val), people), 0.25)) as rows:
        kept_train, kept_val = rows["train"], rows["val"]
    for kept, index in ((kept_train, train), (kept_val, val)):
        chosen = np.unique(index[kept])  # every row of a chosen person, no row of another
        assert np.array_equal(np.sort(kept), np.flatnonzero(np.isin(index, chosen)))
        n = index.max() + 1  # people, not rows, are the draws: binomial over people
        assert abs(len(chosen) - 0.25 * n) < 5 * np.sqrt(n * 0.25 * 0.75)


def test_a_workload_on_the_subsample_keeps_its_rows_of_train_and_validation_only(tmp_path: Path) -> None:
    rows = SplitRows(np.arange(10, 20), np.arange(30, 35), np.arange(50, 60), (0, 1), np.arange(2))
    (tmp_path / "x1.npz").write_bytes(tuning_rows_bytes(np.array([0, 3, 9]), np.array([4]), (10, 5)))
    kept = tuning_subset(rows, str(tmp_path / "x1.npz"))
    assert kept.train.tolist() == [10, 13, 19] and kept.val.tolist() == [34]
    assert kept.test.tolist() == rows.test.tolist()
    (tmp_path / "other.npz").write_bytes(tuning_rows_bytes(np.array([0]), np.array([0]), (11, 5)))
    with pytest.raises(WorkloadError, match="drawn for 11 training and 5 validation rows"):
        tuning_subset(rows, str(tmp_path / "other.npz"))
    with pytest.raises(WorkloadError, match="cannot read the tuning subsample"):
        tuning_subset(rows, str(tmp_path / "missing.npz"))


TUNING = TrialConfig(
    workload=WorkloadSpec("20newsgroups", "minilm", "head", max_train_examples=200, max_eval_examples=120),
    epsilon=4.0,
    delta=1e-5,
    epochs=3,
    clip_bound=1.0,
    batch_size=40,
    learning_rate=0.05,
    base_learning_rate=0.05,
    threads=1,
    diagnostics=False,
    score_noise_multiplier=5.0,
)


def test_the_fused_runner_trains_the_subsample_by_its_public_schedule(tmp_path: Path, dptune_cache_dir: Path) -> None:
    # X₁: 50 of the 200 training and 30 of the 120 validation rows; q and T from N = 200 and B = 40
    (tmp_path / "x1.npz").write_bytes(tuning_rows_bytes(np.arange(0, 200, 4), np.arange(0, 120, 4), (200, 120)))
    schedule = PublicSchedule(40 / 200, 15, (5, 5, 5), 0.25 * 40)
    config = replace(TUNING, workload=replace(TUNING.workload, tuning_rows=str(tmp_path / "x1.npz")), schedule=schedule)
    config = planned(config, num_train=50)  # its mechanism on its public schedule (q, T from N = 200, not |X₁|)
    assert config.mechanism is not None and config.mechanism.schedule == schedule
    (result,) = run_fused([config])
    assert result.status == "ok" and (result.num_train, result.num_val) == (50, 30)
    assert (result.sample_rate, result.steps, result.steps_taken) == (0.2, 15, 15)
    assert [epoch.steps for epoch in result.epochs] == [5, 10, 15]
    assert result.noise_multiplier == pytest.approx(calibrate_noise_multiplier(4.0, 1e-5, 0.2, 15))
    with pytest.raises(TrialConfigError, match="fused runner only"):
        run_trial(config)


def test_a_private_subsample_search_trains_one_release_on_every_row_and_shows_nothing_else(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    space_file = Path(__file__).resolve().parent.parent / "search_spaces" / "private_subsample.yaml"
    overrides = {"sampler.trials_per_cell": 3, "epochs": [5], f"{SUBSAMPLE}.fraction": 0.5}
    flags = [part for name, value in overrides.items() for part in ("--set", f"{name}={json.dumps(value)}")]
    completed = private_search(search_env, tmp_path, space_file, "private_subsample", *flags)
    root = tmp_path / "private_subsample"
    inside = root / TRUST_BOUNDARY
    trials, release = read_table(str(inside), "trials"), read_table(str(root), "release")
    (row,) = read_table(str(root), "search").itertuples()
    space = load_space(space_file, overrides).space
    plan = plan_subsample_cell(space, TINY_TRAIN_EXAMPLES)
    assert plan.tuning is not None and row.epsilon_selection == pytest.approx(plan.tuning.epsilon_total)
    assert row.epsilon_selection <= 8 and row.epsilon_per_trial == pytest.approx(plan.tuning.epsilon_per_run)
    # the tuning runs trained on X₁'s rows, with q and T of the public N
    with np.load(inside / TUNING_ROWS_FILE) as x1:
        kept = (len(x1["train"]), len(x1["val"]))
    tuned = trials[(trials["cell_id"] == plan.cell.cell_id) & (trials["status"] == "ok")]
    assert len(tuned) >= 1 and (tuned["num_train"] == kept[0]).all() and (tuned["num_val"] == kept[1]).all()
    for b, q, steps in tuned[["batch_size", "sample_rate", "steps"]].itertuples(index=False):
        assert (q, steps) == (sample_rate(TINY_TRAIN_EXAMPLES, b), total_steps(TINY_TRAIN_EXAMPLES, b, 5))
    # one release: the best noisy score's configuration, trained once on every training row, no DP score
    best = tuned.loc[tuned["noisy_val_accuracy"].idxmax()]
    (trained,) = trials[trials["cell_id"] == plan.cell.cell_id + RELEASE_SUFFIX].itertuples()
    assert (trained.num_train, trained.num_val, trained.status) == (TINY_TRAIN_EXAMPLES, TINY_EVAL_EXAMPLES, "ok")
    assert (
        np.isnan(trained.noisy_val_accuracy)
        and trained.noise_multiplier == plan.tuning.release_noise_multipliers[trained.batch_size]
    )
    assert len(release) == 1 and (release["tuning_fraction"].iloc[0], release["transfer"].iloc[0]) == (
        0.5,
        "sample_rate",
    )
    for column in ("clip_bound", "batch_size", "base_learning_rate"):
        assert release[column].iloc[0] == best[column] == getattr(trained, column)
    # the released score: the best run's noisy count over X₁'s public nominal validation size q₁·N_val
    nominal = 0.5 * TINY_EVAL_EXAMPLES
    released = release["noisy_val_accuracy"].iloc[0]
    assert released == round(best["noisy_val_accuracy"] * best["num_val"]) / nominal  # k over a public number
    assert release["test_accuracy"].iloc[0] == trained.test_accuracy
    # every run that took a step is charged in the ledger, the release included
    charged = charged_runs(str(inside), row.search_id).set_index("trial_id")
    ran = trials[trials["steps_taken"] > 0].set_index("trial_id")
    assert set(charged.index) == set(ran.index) and len(ran) == len(tuned) + 1
    for column in ("sample_rate", "steps", "noise_multiplier"):
        assert (charged.loc[ran.index, column].to_numpy() == ran[column].to_numpy()).all(), column
    out = completed.stdout
    assert (
        "Koskela & Kulkarni" in out and "variant 2" in out and "tuned on (q₁)" in out and "configurations:" not in out
    )
    assert not (root / "trials").exists() and not (root / TUNING_ROWS_FILE).exists()
    assert_nothing_of_the_hidden_runs_outside(
        root, out, (tmp_path / "private_subsample-tmp").resolve(), os.cpu_count() or 1
    )
    assert_owner_only(root)  # the release, trained in a Ray task, and its checkpoints too
