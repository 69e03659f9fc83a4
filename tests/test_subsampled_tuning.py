"""Tuning on a private subsample (Koskela & Kulkarni 2023, variant 1): the accounting, checked
against independent computations (the exact subsampled Gaussian RDP of dp_accounting, and exact
Rényi divergences of a subsampled randomized response enumerated by hand)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dptune._thirdparty import rdp_of_event
from dptune.privacy import PrivacyParameterError, TrialMechanism, calibrate_noise_multiplier
from dptune.privacy.subsampled_tuning import (
    ORDERS,
    plan_subsampled_tuning,
    poisson_subsampled_rdp,
    subsampled_tuning_cost,
)

SMALL_ORDERS = ORDERS[:40]


@pytest.mark.parametrize("noise_multiplier", [0.7, 2.0, 6.0])
@pytest.mark.parametrize("sample_rate", [0.01, 0.1, 0.5])
def test_the_subsampling_bound_holds_and_is_near_the_exact_subsampled_gaussian(noise_multiplier, sample_rate):
    """For the Gaussian mechanism the subsampled RDP is known exactly (Mironov et al. 2019, computed by
    dp_accounting): the general bound must lie above it, by at most Zhu & Wang's log(3)/(α−1)."""
    from dp_accounting.dp_event import GaussianDpEvent, PoissonSampledDpEvent

    base = SMALL_ORDERS / (2 * noise_multiplier**2)
    exact = rdp_of_event(SMALL_ORDERS, PoissonSampledDpEvent(sample_rate, GaussianDpEvent(noise_multiplier)))
    bound = poisson_subsampled_rdp(SMALL_ORDERS, base, sample_rate)
    assert np.all(bound >= exact - 1e-12)
    assert np.all(bound <= exact + math.log(3) / (SMALL_ORDERS - 1) + 1e-9)
    assert np.all(bound <= base) and bound[0] < base[0]  # amplified


def _renyi(p: np.ndarray, q: np.ndarray, alpha: int) -> float:
    """Exact Rényi divergence D_α(p‖q) of two distributions on a finite set."""
    return math.log(float(np.sum(p**alpha * q ** (1 - alpha)))) / (alpha - 1)


@pytest.mark.parametrize("base_epsilon", [0.5, 2.0, 5.0])
@pytest.mark.parametrize("sample_rate", [0.05, 0.3])
def test_the_subsampling_bound_dominates_a_brute_force_subsampled_randomized_response(base_epsilon, sample_rate):
    """Randomized response on "is the target row in the data" (ε₀-DP), run on a Poisson subsample:
    with the row, the output is the mixture γ·RR(1) + (1−γ)·RR(0); without it, RR(0). Both directions
    of the exact Rényi divergence, at every order, must stay under the bound of the base curve."""
    keep = math.exp(base_epsilon) / (1 + math.exp(base_epsilon))
    present, absent = np.array([keep, 1 - keep]), np.array([1 - keep, keep])
    mixture = sample_rate * present + (1 - sample_rate) * absent
    orders = ORDERS[:30]
    base = np.array([max(_renyi(present, absent, a), _renyi(absent, present, a)) for a in orders.astype(int)])
    bound = poisson_subsampled_rdp(orders, base, sample_rate)
    exact = np.array([max(_renyi(mixture, absent, a), _renyi(absent, mixture, a)) for a in orders.astype(int)])
    assert np.all(bound >= exact - 1e-12)
    assert np.all(exact < base)  # the case is not trivial: subsampling does amplify


def test_the_subsampling_bound_refuses_what_it_does_not_cover():
    base = SMALL_ORDERS / 2.0
    np.testing.assert_array_equal(poisson_subsampled_rdp(SMALL_ORDERS, base, 1.0), base)
    with pytest.raises(PrivacyParameterError, match="consecutive integers 2, 3"):
        poisson_subsampled_rdp(np.array([2.0, 4.0, 8.0]), np.ones(3), 0.1)
    with pytest.raises(PrivacyParameterError, match=r"sample_rate.*in \(0, 1\]"):
        poisson_subsampled_rdp(SMALL_ORDERS, base, 0.0)


N_TRAIN = 10_000
RUN = (256 / N_TRAIN, 10 * N_TRAIN // 256)  # B = 256, 10 epochs


def test_the_tuning_share_shrinks_with_the_tuning_fraction_and_the_release_is_what_it_is_alone():
    sigma = calibrate_noise_multiplier(2.0, 1e-5, *RUN)
    run = TrialMechanism(sigma, *RUN)
    costs = {
        fraction: subsampled_tuning_cost([run], [run], fraction, 10, 1e-5, score_noise_multiplier=5)
        for fraction in (1e-4, 0.1, 0.5, 1.0)
    }
    tunings = [costs[f].epsilon_tuning for f in sorted(costs)]
    assert tunings == sorted(tunings) and tunings[0] < 0.2 * tunings[-1]
    for cost in costs.values():
        assert cost.epsilon_release == pytest.approx(costs[1.0].epsilon_release)
        assert max(cost.epsilon_tuning, cost.epsilon_release) <= cost.epsilon
    # With almost nothing sampled for the tuning, the whole costs about the release alone, which
    # (RDP being looser than the PRV accountant the run was calibrated with) is at least its target.
    assert costs[1e-4].epsilon == pytest.approx(costs[1e-4].epsilon_release, abs=0.05)
    assert costs[1e-4].epsilon_release >= 2.0 - 0.1


def test_the_plan_meets_the_total_and_refuses_an_unreachable_one():
    plan = plan_subsampled_tuning(4.0, 1e-5, 0.1, 10, [RUN], [RUN], score_noise_multiplier=5)
    assert plan.cost.epsilon <= 4.0
    assert plan.tuning_noise_multipliers == plan.release_noise_multipliers  # same (q, T): same σ
    assert plan.tuning_noise_multipliers[0] == calibrate_noise_multiplier(plan.epsilon_per_run, 1e-5, *RUN)
    # The bisection stops within its tolerance of the budget: 3 % more per run overspends it.
    looser = plan_subsampled_tuning(40.0, 1e-5, 0.1, 10, [RUN], [RUN], score_noise_multiplier=5)
    assert looser.epsilon_per_run > plan.epsilon_per_run
    over = subsampled_tuning_cost(
        [TrialMechanism(calibrate_noise_multiplier(plan.epsilon_per_run * 1.03, 1e-5, *RUN), *RUN)] * 1,
        [TrialMechanism(calibrate_noise_multiplier(plan.epsilon_per_run * 1.03, 1e-5, *RUN), *RUN)],
        0.1,
        10,
        1e-5,
        score_noise_multiplier=5,
    )
    assert over.epsilon > 4.0
    with pytest.raises(PrivacyParameterError, match="epsilon_total=0.05 is unreachable"):
        plan_subsampled_tuning(0.05, 1e-5, 0.1, 10, [RUN], [RUN], score_noise_multiplier=5)
