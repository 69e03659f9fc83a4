"""σ for an (ε, δ) target: a root search over the PRV accountant's certified ε.

``calibrate_noise_multiplier`` returns the σ the accountant certifies for the target:
``epsilon_spent(σ, q, T, δ) ≤ ε_target`` always holds, and σ is within ``NOISE_MULTIPLIER_RTOL``
(relative) of the smallest σ that passes, bracketed by a failing σ/(1 + rtol) or closer. Because
the certified ε carries ``EPSILON_ERROR`` and the accountant's discretisation, the true ε of the
returned σ lies in about [ε_target − 2·EPSILON_ERROR, ε_target].

Speed (each point of the search is a PRV discretisation + FFT composition, ``dptune.privacy.prv``):
 1. a Gaussian-DP central-limit guess (Dong, Roth, Su 2019; μ = q·√(T(e^{1/σ²} − 1))), exact for
    q = 1, to start from, instead of doubling from a fixed bracket;
 2. a coarse root search at ``eps_error = 0.1`` (a 10× smaller grid) to locate σ and the slope
    d log ε / d log σ;
 3. certified evaluations at ``EPSILON_ERROR`` aimed ±rtol/2 around the secant estimate, so that a
    good estimate closes the bracket in two evaluations (bisection takes over if steps stall).
With the PRV module's own speed-ups, the 28 calibrations of the default space went from 59 s to
12 s with a cold cache on 2 shared cores (``bench/bench_accounting.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from dptune.privacy.cache import cached
from dptune.privacy.checks import (
    COARSE_EPSILON_ERROR,
    EPSILON_ERROR,
    MAX_NOISE_MULTIPLIER,
    MIN_NOISE_MULTIPLIER,
    NOISE_MULTIPLIER_RTOL,
    PrivacyParameterError,
    checked_delta,
    checked_epsilon,
    checked_sample_rate,
    checked_steps,
)
from dptune.privacy.prv import certified_epsilon, prv_epsilon

_MAX_CERTIFIED_EVALUATIONS = 40
_MAX_COARSE_EVALUATIONS = 12
_LOG2 = math.log(2.0)


def _gaussian_dp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP (Dong, Roth, Su 2019, Cor. 2.13): Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)."""
    from scipy.stats import norm

    return float(norm.cdf(-epsilon / mu + mu / 2) - np.exp(epsilon + norm.logcdf(-epsilon / mu - mu / 2)))


def _gaussian_dp_guess(epsilon: float, delta: float, sample_rate: float, steps: int) -> tuple[float, float]:
    """σ from the Gaussian-DP view, and the slope d log ε / d log σ there.

    μ = √T/σ is exact for q = 1; for q < 1 the central-limit approximation μ = q·√(T(e^{1/σ²} − 1))
    (Bu et al. 2020) is used, which undershoots σ a little. The slope is
    (d log ε / d log μ)·(d log μ / d log σ), the first factor from the μ-GDP curve at δ.
    """
    from scipy.optimize import brentq

    mu = float(brentq(lambda m: _gaussian_dp_delta(epsilon, m) - delta, 1e-8, 1e3))
    if sample_rate == 1.0:
        sigma, dlogmu_dlogsigma = math.sqrt(steps) / mu, -1.0
    else:
        sigma = 1.0 / math.sqrt(math.log1p(mu**2 / (sample_rate**2 * steps)))
        dlogmu_dlogsigma = -1.0 / (sigma**2 * -math.expm1(-1.0 / sigma**2))
    mu_up = mu * 1.01
    epsilon_up = float(brentq(lambda e: _gaussian_dp_delta(e, mu_up) - delta, epsilon, epsilon + 10 * (1 + epsilon)))
    dlogeps_dlogmu = math.log(epsilon_up / epsilon) / math.log(1.01)
    return sigma, dlogeps_dlogmu * dlogmu_dlogsigma


def _coarse_root(
    log_excess: Callable[[float], float], x: float, slope: float, x_min: float, x_max: float
) -> tuple[float, float]:
    """Secant iterations on a decreasing g(x), x = log σ, from x and an initial slope; returns
    (root estimate, slope)."""
    y = log_excess(x)
    for _ in range(_MAX_COARSE_EVALUATIONS):
        step = float(np.clip(-y / slope, -_LOG2, _LOG2))
        x_next = float(np.clip(x + step, x_min, x_max))
        if abs(x_next - x) < NOISE_MULTIPLIER_RTOL:
            break
        y_next = log_excess(x_next)
        secant = (y_next - y) / (x_next - x)
        if secant < 0:
            slope = secant
        x, y = x_next, y_next
    return float(np.clip(x - y / slope, x_min, x_max)), slope


def _certified_bracket(
    log_excess: Callable[[float], float],
    x: float,
    slope: float,
    tolerance: float,
    x_min: float,
    x_max: float,
    describe: Callable[[str], str],
) -> float:
    """Bracket the root of a decreasing g(x) to width ``tolerance``; return the passing end x_hi.

    Invariant: g(x_lo) > 0 ≥ g(x_hi). Each step is a secant estimate shifted tolerance/2 towards the
    end of the bracket that is missing or far, and exactly ``tolerance`` from an end when the
    estimate lies within ``tolerance`` of it, so that an accurate start closes in two evaluations.
    Bisection takes over when the bracket stops halving. Outside [x_min, x_max]: error.
    """
    lo = hi = None
    previous: tuple[float, float] | None = None
    widths: list[float] = []
    for _ in range(_MAX_CERTIFIED_EVALUATIONS):
        y = log_excess(x)
        if previous is not None and (y - previous[1]) / (x - previous[0]) < 0:
            slope = (y - previous[1]) / (x - previous[0])
        previous = (x, y)
        if y > 0:
            lo = x if lo is None else max(lo, x)
        else:
            hi = x if hi is None else min(hi, x)
        if lo is not None and hi is not None:
            if hi - lo <= tolerance * (1 + 1e-9):
                return hi
            widths.append(hi - lo)
        elif hi is None and x >= x_max:
            raise PrivacyParameterError(describe(f"unreachable: it needs noise_multiplier > {math.exp(x_max):g}"))
        elif lo is None and x <= x_min:
            raise PrivacyParameterError(
                describe(f"too large: noise_multiplier = {math.exp(x_min):g} already meets it (no meaningful privacy)")
            )
        estimate = x - y / slope
        if hi is not None and estimate >= hi - tolerance and (lo is None or hi - tolerance > lo):
            x = hi - tolerance  # closes the bracket if the estimate is right
        elif lo is not None and estimate <= lo + tolerance and (hi is None or lo + tolerance < hi):
            x = lo + tolerance
        elif lo is None:
            x = max(estimate - tolerance / 2, x - _LOG2, x_min)
        else:
            x = min(estimate + tolerance / 2, x + _LOG2, x_max)
        stalled = len(widths) >= 3 and widths[-1] > widths[-3] / 2
        if lo is not None and hi is not None and (stalled or not lo < x < hi):
            x = (lo + hi) / 2
    raise RuntimeError(describe(f"σ search did not converge in {_MAX_CERTIFIED_EVALUATIONS} evaluations"))


def _calibrate(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    def describe(problem: str) -> str:
        return (
            f"epsilon={epsilon:g} at delta={delta:g}, sample_rate={sample_rate:g}, steps={steps} is {problem}; "
            f"noise_multiplier is searched in [{MIN_NOISE_MULTIPLIER:g}, {MAX_NOISE_MULTIPLIER:g}]"
        )

    guess, slope = _gaussian_dp_guess(epsilon, delta, sample_rate, steps)
    if guess > 1.1 * MAX_NOISE_MULTIPLIER:  # Gaussian DP is exact for q = 1 and accurate at large σ
        raise PrivacyParameterError(describe(f"unreachable: it needs noise_multiplier ≈ {guess:.3g}"))
    x_min, x_max = math.log(MIN_NOISE_MULTIPLIER), math.log(MAX_NOISE_MULTIPLIER)
    log_target = math.log(epsilon)
    shift = COARSE_EPSILON_ERROR - EPSILON_ERROR  # coarse upper bound → estimate of the certified one

    def coarse(x: float) -> float:
        return (
            math.log(max(prv_epsilon(math.exp(x), sample_rate, steps, delta, COARSE_EPSILON_ERROR) - shift, 1e-12))
            - log_target
        )

    def certified(x: float) -> float:
        return math.log(certified_epsilon(math.exp(x), sample_rate, steps, delta)) - log_target

    start = float(np.clip(math.log(guess), x_min, x_max))
    root, slope = _coarse_root(coarse, start, min(slope, -0.1), x_min, x_max)
    tolerance = math.log1p(NOISE_MULTIPLIER_RTOL)
    first = min(root + tolerance / 2, x_max)
    return math.exp(_certified_bracket(certified, first, slope, tolerance, x_min, x_max, describe))


def calibrate_noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """σ for T = ``steps`` Poisson-subsampled Gaussian steps at q = ``sample_rate`` to be (ε, δ)-DP.

    Guarantee: ``epsilon_spent(σ, q, T, δ) ≤ epsilon`` (the PRV accountant's upper bound), and σ is at
    most ``NOISE_MULTIPLIER_RTOL`` (relative) above the smallest σ with that property (a σ that
    fails lies within that distance). Raises ``PrivacyParameterError`` before any work for ε outside
    [MIN_EPSILON, MAX_EPSILON], δ outside (0, 1), q outside (0, 1], T not an integer ≥ 1, and when the target
    needs σ outside [MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER]. Memoised and cached on disk.
    """
    epsilon, delta = checked_epsilon(epsilon), checked_delta(delta)
    sample_rate, steps = checked_sample_rate(sample_rate), checked_steps(steps)
    inputs = {"epsilon": epsilon, "delta": delta, "sample_rate": sample_rate, "steps": steps}
    return cached("noise_multiplier", inputs, lambda: _calibrate(epsilon, delta, sample_rate, steps))
