"""The plan of tuning on a private subsample: the transfer rule's schedules, the spec's refusals, and
a total ε recomputed independently from the plan's σ."""

from __future__ import annotations

from pathlib import Path

import pytest

from dptune.errors import SearchError
from dptune.privacy import calibrate_noise_multiplier
from dptune.privacy.composition import TrialMechanism
from dptune.privacy.selection import SELECTION_EPSILON_RTOL
from dptune.privacy.subsampled_tuning import subsampled_tuning_cost
from dptune.search.cells import format_plan, plan_cells
from dptune.search.subsample import tunable_batch_sizes, tuning_schedule
from dptune.space import SpaceError, load_space

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
    (plan,) = plan_cells(loaded.space, 2000, progress=False)
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
    text = format_plan(loaded, [plan])
    assert "tuning on a secret subsample: q₁ = 0.2 of the training and validation rows, transfer 'batch_size'" in text
    assert f"the RDP bound of the whole: ε = {tuning.epsilon_total:.4g}" in text
    assert f"     64   0.16         62   {tuning.noise_multipliers[64]:.4f}" in text
    assert "not tuned, larger than the subsample's q₁·N rows: B = [512]" in text and "pruned" not in text


@pytest.mark.usefixtures("dptune_cache_dir")
def test_keeping_the_sample_rate_gives_tuning_runs_the_releases_noise() -> None:
    (plan,) = plan_cells(subsample_space(0.1, "sample_rate", [128]).space, 2000, progress=False)
    assert plan.tuning is not None and plan.tuning.noise_multipliers == plan.noise_multipliers
    assert plan.tuning.schedules == {128: (128 / 2000, round(10 * 2000 / 128))}
