"""Private selection: release the best of a secret random number K of trials (Papernot & Steinke).

``selection_epsilon`` is the bound of releasing the best of K runs (K truncated negative binomial,
``draw_trial_count``); ``plan_private_selection`` finds the largest per-trial ε whose runs meet a
total budget that way. Used by searches with ``privacy.private_selection`` in their space.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dptune._thirdparty import rdp_of_event, rdp_repeat_and_select
from dptune.privacy.calibration import calibrate_noise_multiplier
from dptune.privacy.checks import MIN_EPSILON, PrivacyParameterError, checked_delta, checked_epsilon, require
from dptune.privacy.composition import TrialMechanism


def trial_count_gamma(mean_trials: float, shape: float) -> float:
    """γ of the truncated negative binomial with shape η = ``shape`` and mean k = ``mean_trials``.

    P(K = j) ∝ C(j + η − 1, j)·(1 − γ)^j for j ≥ 1, whose mean is η(1 − γ)/(γ(1 − γ^η)) (Papernot &
    Steinke 2022, Def. 1); η = 1 is the geometric distribution on {1, 2, ...} with γ = 1/k.
    """
    from scipy.optimize import brentq

    require(mean_trials > 1, "mean_trials", mean_trials, "> 1 (the mean of the random trial count)")
    require(0 < shape < math.inf, "shape", shape, "in (0, ∞) (1 = geometric)")
    if shape == 1:
        return 1.0 / mean_trials

    def mean_minus_target(gamma: float) -> float:
        return shape * (1 - gamma) / (gamma * -math.expm1(shape * math.log(gamma))) - mean_trials

    return float(brentq(mean_minus_target, 1e-12, 1 - 1e-12))


def draw_trial_count(mean_trials: float, shape: float, rng: np.random.Generator) -> int:
    """K ≥ 1 from the truncated negative binomial of ``trial_count_gamma`` (rejection of K = 0 from
    numpy's negative binomial, which counts failures before η successes of probability γ).

    Private selection needs K secret: pass a generator seeded from OS entropy.
    """
    gamma = trial_count_gamma(mean_trials, shape)
    while True:
        count = int(rng.negative_binomial(shape, gamma))
        if count >= 1:
            return count


def _trial_rdp(
    orders: np.ndarray, candidates: Sequence[TrialMechanism], score_noise_multiplier: float | None
) -> np.ndarray:
    """RDP curve of one trial that runs one of ``candidates`` (picked independently of the data),
    then, with ``score_noise_multiplier`` (σ_s), releases its validation score with Gaussian noise
    of std σ_s on a sensitivity-1 count.

    A mixture over candidates is RDP with the pointwise maximum of their curves (Rényi divergence is
    quasi-convex); the score adds λ/(2σ_s²) (the Gaussian mechanism's RDP).
    """
    from dp_accounting.dp_event import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent

    curves = [
        rdp_of_event(
            orders,
            SelfComposedDpEvent(PoissonSampledDpEvent(m.sample_rate, GaussianDpEvent(m.noise_multiplier)), m.steps),
        )
        for m in candidates
    ]
    rdp = np.max(curves, axis=0)
    if score_noise_multiplier is not None:
        rdp = rdp + orders / (2 * score_noise_multiplier**2)
    return rdp


def selection_epsilon(
    candidates: Sequence[TrialMechanism],
    mean_trials: float,
    delta: float,
    *,
    shape: float = 1.0,
    score_noise_multiplier: float | None = None,
) -> float:
    """ε of private selection: run a trial K times, K random with mean ``mean_trials``, release the best.

    Papernot & Steinke, "Hyperparameter tuning with Renyi differential privacy" (ICLR 2022,
    arXiv 2110.03620), Thm 2: if each run Q is (λ, ε_λ)-RDP for all λ and K is truncated negative
    binomial with shape η (``shape``, 1 = geometric) and mean k, releasing the best run is RDP with
    ε'_λ = ε_λ + (1 + η)·(1 − 1/λ̂)·ε_λ̂ + (1 + η)·log(1/γ)/λ̂ + log(k)/(λ − 1) for any λ̂
    (dp_accounting minimises over λ̂: ``_thirdparty.rdp_repeat_and_select``); converted to (ε, δ) at
    ``delta``. Q is the trial's training (``_trial_rdp`` over ``candidates``) and, with
    ``score_noise_multiplier``, its noisy validation score, so the score used to pick the best is
    part of Q's DP output.

    Holds under the theorem's assumptions only: K drawn from that distribution and kept secret,
    each trial's hyperparameters drawn independently of the data and of earlier trials (random
    search; no TPE, no ASHA), the selection score computed under DP, only the selected run
    released, and every run's coins fresh and secret.
    """
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS, compute_epsilon

    delta = checked_delta(delta)
    orders = np.array(DEFAULT_RDP_ORDERS, dtype=float)
    rdp = selection_rdp(orders, candidates, mean_trials, shape=shape, score_noise_multiplier=score_noise_multiplier)
    epsilon, _ = compute_epsilon(orders, rdp, delta)
    return float(epsilon)


def selection_rdp(
    orders: np.ndarray,
    candidates: Sequence[TrialMechanism],
    mean_trials: float,
    *,
    shape: float = 1.0,
    score_noise_multiplier: float | None = None,
) -> np.ndarray:
    """The RDP curve at ``orders`` of private selection (:func:`selection_epsilon`, before its
    conversion to (ε, δ)): Papernot & Steinke's Thm 2 over ``_trial_rdp``, minimised over λ̂ among
    ``orders``. ∞ where an order's bound does not converge."""
    require(len(candidates) > 0, "candidates", candidates, "a non-empty list of trial mechanisms")
    checked = [m.checked() for m in candidates]
    if score_noise_multiplier is not None:
        require(score_noise_multiplier > 0, "score_noise_multiplier", score_noise_multiplier, "> 0")
    trial_count_gamma(mean_trials, shape)  # checks the mean and the shape
    # dp_accounting logs a warning for each fractional RDP order whose series does not converge; it
    # then sets that order's RDP to ∞, which only drops the order from the minimum (still a bound).
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        rdp = _trial_rdp(orders, checked, score_noise_multiplier)
        return np.asarray(rdp_repeat_and_select(orders, rdp, float(mean_trials), float(shape)), dtype=float)
    finally:
        absl_logger.setLevel(level)


@dataclass(frozen=True)
class PrivateSelectionPlan:
    """Per-trial ε (and σ per candidate batch size) that makes private selection meet a total budget.

    ``epsilon_per_trial`` is the training's per-trial target; ``noise_multipliers[i]`` is σ
    calibrated (PRV) for it at candidate i; ``epsilon_selection`` ≤ ``epsilon_total`` is the
    selection bound of those σ, at δ = ``delta``.
    """

    epsilon_total: float
    delta: float
    epsilon_per_trial: float
    noise_multipliers: tuple[float, ...]
    epsilon_selection: float


#: Relative width to which the per-trial ε of a private search is searched (the bound always holds).
SELECTION_EPSILON_RTOL = 0.02


def plan_private_selection(
    epsilon_total: float,
    delta: float,
    mean_trials: float,
    sample_rates: Sequence[float],
    steps: Sequence[int],
    *,
    shape: float = 1.0,
    score_noise_multiplier: float | None = None,
) -> PrivateSelectionPlan:
    """The largest per-trial ε (within ``SELECTION_EPSILON_RTOL``) whose trials, run a random number
    of times with mean ``mean_trials`` and released best-only, meet (``epsilon_total``, δ).

    A candidate is a batch size: (q, T) pairs from ``sample_rates`` and ``steps``; a trial picks one at
    random, so the bound uses the worst RDP curve over them (``selection_epsilon``). The search is a
    bisection on log ε_trial in [MIN_EPSILON, ε_total]; σ of each candidate comes from
    ``calibrate_noise_multiplier`` at ε_trial; the planner wraps each in the trials' mechanisms
    (``dptune.plan.mechanism.wrapped``), which the runs step with and the ledger charges: no run
    recalibrates.
    Guarantee: the returned plan's ``epsilon_selection`` ≤ ``epsilon_total``. Raises
    ``PrivacyParameterError`` when even ε_trial = MIN_EPSILON exceeds the total (lower the mean
    number of trials, raise the score noise or the total).
    """
    epsilon_total = checked_epsilon(epsilon_total, "epsilon_total")
    require(
        len(sample_rates) == len(steps) and len(steps) > 0,
        "sample_rates and steps",
        (sample_rates, steps),
        "non-empty and of equal length",
    )

    def plan(epsilon_per_trial: float) -> PrivateSelectionPlan:
        sigmas = tuple(
            calibrate_noise_multiplier(epsilon_per_trial, delta, q, t) for q, t in zip(sample_rates, steps, strict=True)
        )
        candidates = [TrialMechanism(s, q, t) for s, q, t in zip(sigmas, sample_rates, steps, strict=True)]
        bound = selection_epsilon(
            candidates, mean_trials, delta, shape=shape, score_noise_multiplier=score_noise_multiplier
        )
        return PrivateSelectionPlan(epsilon_total, delta, epsilon_per_trial, sigmas, bound)

    low = plan(MIN_EPSILON)
    if low.epsilon_selection > epsilon_total:
        raise PrivacyParameterError(
            f"epsilon_total={epsilon_total:g} is unreachable with a mean of {mean_trials:g} trials: even "
            f"{MIN_EPSILON:g} per trial costs {low.epsilon_selection:.3g} by the private-selection bound; "
            "raise the total, lower sampler.trials_per_cell or raise the score noise"
        )
    high = plan(epsilon_total)
    if high.epsilon_selection <= epsilon_total:
        return high
    while high.epsilon_per_trial / low.epsilon_per_trial > 1 + SELECTION_EPSILON_RTOL:
        middle = plan(math.sqrt(low.epsilon_per_trial * high.epsilon_per_trial))
        if middle.epsilon_selection <= epsilon_total:
            low = middle
        else:
            high = middle
    return low
