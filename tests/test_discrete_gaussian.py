"""The DP selection score's noise is an exact discrete Gaussian on the integer validation count.

A float32 Gaussian added to the count leaks it through the noise's low bits (Mironov 2012): the
released c + noise is c plus a float32 value, so a candidate count c' with s·N − c' off the float32
grid is ruled out. With integer noise every candidate passes that test.
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from dptune.dp.coins import score_generator, trial_coins
from dptune.dp.discrete_gaussian import UniformIntegers, discrete_gaussian_samples, sample_discrete_gaussian
from dptune.runners.common import Evaluation, noisy_count, noisy_score
from dptune.runners.fused import run_fused
from dptune.runners.trial import run_trial
from trial_configs import HEAD_TRIAL, planned

DRAWS = 100_000
#: The issue's setting: σ_s = 5 counts on N_val = 1000 validation rows, 700 of them correct.
SCORE_SIGMA, NUM_VAL, CORRECT = 5.0, 1000, 700


def _generator(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def _draws(sigma: float, seed: int, count: int) -> np.ndarray:
    return np.array(discrete_gaussian_samples(Fraction(sigma) ** 2, UniformIntegers(_generator(seed)), count))


def _pmf(sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """Support −R..R (R far in the tail) and exp(−x²/2σ²) / Σ_y exp(−y²/2σ²) on it."""
    support = np.arange(-60 * math.ceil(sigma), 60 * math.ceil(sigma) + 1)
    weights = np.exp(-(support**2) / (2 * sigma**2))
    return support, weights / weights.sum()


def _stream(generator: np.random.Generator, count: int = 200) -> list[int]:
    return [sample_discrete_gaussian(SCORE_SIGMA, generator) for _ in range(count)]


def test_draws_are_python_ints_reproducible_by_seed_and_differ_between_seeds() -> None:
    first = _stream(_generator(3))
    assert all(type(x) is int for x in first)
    assert _stream(_generator(3)) == first
    assert _stream(_generator(4)) != first
    assert _draws(SCORE_SIGMA, 5, 500).tolist() == _draws(SCORE_SIGMA, 5, 500).tolist()
    assert _draws(SCORE_SIGMA, 5, 500).tolist() != _draws(SCORE_SIGMA, 6, 500).tolist()


def test_sigma_must_be_positive() -> None:
    with pytest.raises(ValueError, match="σ² > 0"):
        discrete_gaussian_samples(Fraction(0), UniformIntegers(_generator(0)), 1)


@pytest.mark.parametrize("sigma", [SCORE_SIGMA, 0.8])
def test_draws_follow_the_discrete_gaussian(sigma: float) -> None:
    draws = _draws(sigma, 1, DRAWS)
    support, pmf = _pmf(sigma)
    reach = math.ceil(3 * sigma)  # bins −reach..reach, both tails pooled into one
    inside = np.abs(support) <= reach
    observed = np.append(
        [np.count_nonzero(draws == x) for x in support[inside]], np.count_nonzero(np.abs(draws) > reach)
    )
    expected = DRAWS * np.append(pmf[inside], pmf[~inside].sum())
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    variance = float((pmf * support**2).sum())
    # below σ² (CKS Proposition 19); at σ = 5 the gap, ~σ⁴·exp(−2π²σ²), is below float64 resolution
    assert variance <= sigma**2 and (sigma > 1 or variance < sigma**2)
    assert abs(draws.mean()) < 4 * math.sqrt(variance / DRAWS)
    fourth = float((pmf * support**4).sum())
    standard_error = math.sqrt((fourth - variance**2) / DRAWS)
    assert abs(draws.var() - variance) < 4 * standard_error
    assert draws.var() < sigma**2 + 4 * standard_error


def _consistent(score: float, candidate: int) -> bool:
    """Mironov's test: could ``score`` be ``(candidate + z) / N_val`` for a float32 noise value z?
    (z is the float32 nearest score·N_val − candidate, or one of its two float32 neighbours.)"""
    nearest = np.float32(score * NUM_VAL - candidate)
    grid = (nearest, np.nextafter(nearest, np.float32(-np.inf)), np.nextafter(nearest, np.float32(np.inf)))
    return any((candidate + float(z)) / NUM_VAL == score for z in grid)


def _ruled_out(score: float, count: int) -> bool:
    """Whether the float32 test rules out a neighbour (c − 1 or c + 1) of the true count c."""
    return not (_consistent(score, count - 1) and _consistent(score, count + 1))


def test_the_released_score_leaks_nothing_through_float_bits() -> None:
    val = Evaluation(
        loss=0.0,
        accuracy=CORRECT / NUM_VAL,
        correct_per_class=np.array([CORRECT // 2, CORRECT - CORRECT // 2]),
        examples_per_class=np.array([NUM_VAL // 2, NUM_VAL - NUM_VAL // 2]),
    )
    generator, old_generator = score_generator(np.random.SeedSequence(11)), torch.Generator().manual_seed(11)
    draws, old_leaks = 5000, 0
    for _ in range(draws):
        score = noisy_score(val, SCORE_SIGMA, generator)
        released = round(score * NUM_VAL)
        assert released / NUM_VAL == score  # the score is an integer over N_val, exactly
        assert _consistent(score, CORRECT) and not _ruled_out(score, CORRECT)
        # the old construction: float32 Gaussian noise on the count, stored at float64
        noise = float(torch.normal(0.0, SCORE_SIGMA, size=(), generator=old_generator))
        old_score = (CORRECT + noise) / NUM_VAL
        assert _consistent(old_score, CORRECT)  # the truth always passes
        old_leaks += _ruled_out(old_score, CORRECT)
    assert old_leaks > 0.15 * draws  # the test sees the old leak (26.9 % of draws in issue 30)
    count = noisy_count(val, SCORE_SIGMA, score_generator(np.random.SeedSequence(12)))
    score = noisy_score(val, SCORE_SIGMA, score_generator(np.random.SeedSequence(12)))
    assert type(count) is int and count / NUM_VAL == score


def test_the_score_stream_is_the_trials_own() -> None:
    """Same seed, same score noise; another seed, or another stream of the same seed, other noise."""
    coins, again = trial_coins(2**100 + 5), trial_coins(2**100 + 5)
    scores = _stream(score_generator(coins.score))
    assert _stream(score_generator(again.score)) == scores
    assert _stream(score_generator(coins.sampling)) != scores
    assert _stream(score_generator(trial_coins(2**100 + 6).score)) != scores


SCORED = replace(HEAD_TRIAL, score_noise_multiplier=SCORE_SIGMA)


def test_both_runners_release_an_integer_count_over_num_val(dptune_cache_dir: Path) -> None:
    results = [*run_fused([planned(SCORED), planned(replace(SCORED, seed=2))]), run_trial(planned(SCORED))]
    for result in results:
        assert result.status == "ok" and result.num_val > 0
        score = result.noisy_val_accuracy
        assert math.isfinite(score) and round(score * result.num_val) / result.num_val == score
