"""ε spent by DP-SGD: the PRV accountant of Gopi, Lee and Wutschitz (NeurIPS 2021, arXiv 2106.02848).

The mechanism is T = ``steps`` Poisson-subsampled Gaussian steps at rate q = ``sample_rate`` with
noise multiplier σ = ``noise_multiplier`` (see ``dptune.privacy``). ``prv_accountant`` returns
(lower, estimate, upper) bounds on ε; every ε this module reports is the *upper* bound, so that a
reported ε is a guarantee. Accuracy settings (the same as Opacus' ``PRVAccountant`` defaults):
``eps_error = EPSILON_ERROR = 0.01`` and ``delta_error = δ/1000``. The library's ``PRVAccountant``
steps (truncate the PRV to [−L, L], discretise it on a mesh with its mean matched, compose by FFT,
read ε at δ) run here from the library's own parts, its formulas recomputed where they were slow
(below), with one correction: the mean of the truncated PRV is integrated from the support's lower
end log(1 − q) (``_TruncatedSubsampledGaussianPRV``). The library's quadrature misses that end for
q a little above 0.1 and σ ≲ 1 (large ε, few steps: e.g. ε = 8, q = 32/300, T = 27) and then
refuses to discretise ("Discrete mean differs from continuous mean significantly") whatever the
domain size; a coarser mesh only hides the error (it then shifts the PRV right, overstating ε).

Speed (each ε is a PRV discretisation + FFT composition, and a calibration evaluates many):
 - the accountant's grid is enlarged to a length with prime factors ≤ 11 (``scipy.fft.next_fast_len``;
   the length it picks itself can have a large prime factor, which made pocketfft 2–3× slower),
   and the safe domain size (an RDP computation) is reused between nearby σ: it is computed at σ
   rounded *down* to a 1/16-octave grid, which gives a domain at least as large as σ needs;
 - prv_accountant's slow parts run here as numpy float64 or scalar ``math``, with the same
   formulas: the RDP curve of the safe domain size (pure Python there; ``_subsampled_gaussian_rdp``,
   the domain never narrower than the library's), the CDF that the mean's adaptive quadrature
   evaluates thousands of times per calibration (``_subsampled_gaussian_cdf``, 1 µs a call
   against 0.8 ms), and the cells' probabilities (long double there;
   ``_subsampled_gaussian_cdf_and_sf``, ~15× faster).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

import numpy as np

from dptune.privacy.cache import cached
from dptune.privacy.checks import (
    COARSE_EPSILON_ERROR,
    DELTA_ERROR_FRACTION,
    EPSILON_ERROR,
    checked_delta,
    checked_noise_multiplier,
    checked_sample_rate,
    checked_steps,
)

# prv_accountant (which imports scipy.signal, ~1.5 s) and scipy are imported where ε is computed,
# so that a process that only reads cached values (the planner's second run, a trial) never pays that.
if TYPE_CHECKING:
    from prv_accountant.domain import Domain
    from prv_accountant.privacy_random_variables import PrivacyRandomVariableTruncated

_SIGMA_GRID_PER_OCTAVE = 16

#: prv_accountant's RDP orders (``other_accountants.RDP``, used by ``compute_safe_domain_size``): 1.1, 1.2,
#: …, 10.9, then 12, …, 63. The integers among the first (2.0, …, 10.0) take the finite-sum path.
_SAFE_DOMAIN_ORDERS = np.array([1.0 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=float)
#: Relative enlargement of the safe half-width: the vectorised sums below differ from the library's
#: sequential log-space sums by rounding only (≤ 1e-12 in ε(α), so ≤ T·1e-12 in L: ~1e-9 of L, tested),
#: so that the domain is never narrower than the library's; it costs at most a grid point or two.
_SAFE_WIDTH_ROUNDING_MARGIN = 1e-6
#: A fractional order's series stops at the first term (of both parts) below e^{−30}, as the library's.
_RDP_SERIES_CUTOFF = -30.0
_MAX_RDP_SERIES_TERMS = 1 << 22


def _fractional_order_log_a(orders: np.ndarray, noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """log A_α for fractional orders α (0 < q < 1): prv_accountant's ``_compute_log_a_frac`` (TF Privacy;
    Mironov, Talwar, Zhang 2019, Sec. 3.3), vectorised over α and the series' terms i.

    A_α = Σᵢ C(α, i)·[q^i (1 − q)^{α−i} e^{(i²−i)/(2σ²)} Φ((z₀ − i)/σ) + q^{α−i} (1 − q)^i e^{(j²−j)/(2σ²)}
    Φ((j − z₀)/σ)], j = α − i, z₀ = σ² log(1/q − 1) + ½, the terms signed as C(α, i); each order's sum
    runs over exactly the library's terms (up to the first i whose two parts are both < e^{−30}), terms
    computed for a doubling number of i until every order has stopped.
    """
    from scipy.special import binom, log_ndtr, logsumexp

    sigma, q = noise_multiplier, sample_rate
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_a = np.empty_like(orders)
    pending = np.arange(len(orders))
    terms = 64
    while pending.size:
        if terms > _MAX_RDP_SERIES_TERMS:
            raise RuntimeError(f"RDP series of σ = {sigma:g}, q = {q:g} did not converge in {terms // 2} terms")
        alpha = orders[pending, None]
        i = np.arange(terms, dtype=float)[None, :]
        j = alpha - i
        coef = binom(alpha, i)
        log_coef = np.log(np.abs(coef))
        log_s0 = (
            log_coef + i * math.log(q) + j * math.log(1 - q) + (i * i - i) / (2 * sigma**2) + log_ndtr((z0 - i) / sigma)
        )
        log_s1 = (
            log_coef + j * math.log(q) + i * math.log(1 - q) + (j * j - j) / (2 * sigma**2) + log_ndtr((j - z0) / sigma)
        )
        small = np.maximum(log_s0, log_s1) < _RDP_SERIES_CUTOFF
        done = small.any(axis=1)
        kept = i <= np.argmax(small, axis=1)[:, None]  # up to and including the first small term
        weights = np.where(kept, np.sign(coef), 0.0)
        parts = [logsumexp(np.where(kept, log_s, -np.inf), b=weights, axis=1) for log_s in (log_s0, log_s1)]
        log_a[pending[done]] = np.logaddexp(*parts)[done]
        pending = pending[~done]
        terms *= 2
    return log_a


def _subsampled_gaussian_rdp(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """RDP ε(α) of one Poisson-subsampled Gaussian step at each order α of ``_SAFE_DOMAIN_ORDERS``.

    prv_accountant's ``PoissonSubsampledGaussianMechanism.rdp`` (log A_α/(α − 1); α/(2σ²) for q = 1),
    vectorised with numpy (~10 ms a curve, where the library's pure-Python series takes ~0.1 s and
    ``compute_safe_domain_size`` computes it twice): integer α by the finite sum
    log Σ_{i≤α} C(α, i) q^i (1 − q)^{α−i} e^{(i²−i)/(2σ²)}, fractional α by
    ``_fractional_order_log_a``. Equal to the library's to rounding (tested).
    """
    from scipy.special import gammaln, logsumexp

    orders, sigma, q = _SAFE_DOMAIN_ORDERS, noise_multiplier, sample_rate
    if q == 1.0:
        return orders / (2 * sigma**2)
    integer = orders == np.round(orders)
    alpha = orders[integer][:, None]
    i = np.arange(int(alpha.max()) + 1, dtype=float)[None, :]
    in_sum = i <= alpha
    log_terms = (
        gammaln(alpha + 1)
        - gammaln(i + 1)
        - gammaln(np.where(in_sum, alpha - i, 0.0) + 1)
        + i * math.log(q)
        + (alpha - i) * math.log(1 - q)
        + (i * i - i) / (2 * sigma**2)
    )
    log_a = np.empty_like(orders)
    log_a[integer] = logsumexp(np.where(in_sum, log_terms, -np.inf), axis=1)
    log_a[~integer] = _fractional_order_log_a(orders[~integer], sigma, q)
    return log_a / (orders - 1)


def _rdp_to_epsilon(rdp: np.ndarray, delta: float) -> float:
    """prv_accountant's ``RDP.compute_epsilon``: min over α of ε(α) + log(1/(δα))/(α − 1) + log(1 − 1/α)."""
    orders = _SAFE_DOMAIN_ORDERS
    return float(np.nanmin(rdp - np.log(delta * orders) / (orders - 1) + np.log1p(-1 / orders)))


@lru_cache(maxsize=1024)
def _safe_half_width(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """prv_accountant's safe half-width L of the PRV domain (Gopi et al. Remark 5.6, via RDP), never smaller.

    ``compute_safe_domain_size`` for one mechanism self-composed T = ``steps`` times: L = max(ε_RDP of
    the T steps at delta_error/4, ε_RDP of one step at delta_error/(8T), eps_error) + 3, enlarged by
    the relative ``_SAFE_WIDTH_ROUNDING_MARGIN``; the RDP curve is computed once, vectorised
    (``_subsampled_gaussian_rdp``), where the library computes it twice in pure Python. Computed with
    the coarse eps_error, which gives the larger domain, so that it serves both the coarse and the
    certified evaluations.
    """
    delta_error = delta * DELTA_ERROR_FRACTION
    rdp = _subsampled_gaussian_rdp(noise_multiplier, sample_rate)
    width = max(
        _rdp_to_epsilon(steps * rdp, delta_error / 4),
        _rdp_to_epsilon(rdp, delta_error / 8 / steps),
        COARSE_EPSILON_ERROR,
    )
    return (width + 3) * (1 + _SAFE_WIDTH_ROUNDING_MARGIN)


def _grid_floor(noise_multiplier: float) -> float:
    """σ rounded down to a 1/16-octave grid: a smaller σ needs a larger domain, so L(grid_floor(σ))
    is safe for σ, and nearby σ share one (cached) domain computation."""
    return 2.0 ** (math.floor(math.log2(noise_multiplier) * _SIGMA_GRID_PER_OCTAVE) / _SIGMA_GRID_PER_OCTAVE)


def _fft_friendly_domain(half_width: float, steps: int, eps_error: float, delta_error: float) -> Domain:
    """The accountant's grid over [−L', L'] ⊇ [−L, L] (L = ``half_width``), enlarged so that its length
    is even with prime factors ≤ 11 (pocketfft's fast radices, ``scipy.fft.next_fast_len``).

    Mesh = eps_error / √(T/2 · log(12/delta_error)) (Gopi et al. Thm 5.5, as ``PRVAccountant``).
    ``Domain.create_aligned(−L', L', mesh)`` has 2·⌈L'/mesh⌉ + 2 points for an L' that is not a
    multiple of the mesh: L' = (a − ½)·mesh with a = m/2 − 1 gives exactly m points, and
    a ≥ ⌈L/mesh + ½⌉ gives L' ≥ L.
    """
    from prv_accountant.domain import Domain
    from scipy.fft import next_fast_len

    mesh = eps_error / np.sqrt(steps / 2 * np.log(12 / delta_error))
    points_needed = 2 * math.ceil(half_width / mesh + 0.5) + 2
    points = 2 * next_fast_len(points_needed // 2)
    enlarged = (points // 2 - 1.5) * mesh
    return Domain.create_aligned(-enlarged, enlarged, mesh)


#: Breakpoints of prv_accountant's own quadrature for the mean of a truncated PRV.
_MEAN_BREAKPOINTS = (-1e-1, -1e-2, -1e-3, -1e-4, -1e-5, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
#: The extra breakpoint sits this far above the support's lower end log(1 − q), where the CDF is
#: still computable (at the end itself its formula takes the log of a rounding residue, which can be
#: negative: NaN). The mean's error from it is at most this width, far below the half-mesh the
#: discretiser allows (3e-4 at T = 27, 5e-7 even at T = 10⁷, with eps_error = 0.01).
_SUPPORT_EDGE_OFFSET = 1e-9


def _subsampled_gaussian_cdf(t: float, noise_multiplier: float, sample_rate: float) -> float:
    """P(Y ≤ t) for the PRV Y of one Poisson-subsampled Gaussian step, at a float t, with ``math``.

    Y = log(1 − q + q·e^{(2X − 1)/(2σ²)}) with X ~ q·N(1, σ²) + (1 − q)·N(0, σ²), increasing in X, so
    with z = log((e^t − (1 − q))/q): F(t) = q·Φ((σ²z − ½)/σ) + (1 − q)·Φ((σ²z + ½)/σ) for t > log(1 − q),
    0 below. That is prv_accountant's ``PoissonSubsampledGaussianMechanism.cdf`` (1 − ½q·erfc(a) −
    ½(1 − q)·erfc(b), in long double, on arrays), rearranged with 1 − ½erfc(a) = ½erfc(−a) so that no
    1 − (≈ 1) cancels near the lower end; z is log1p/expm1 arithmetic (no overflow of e^t). At the
    support's end, where e^t − (1 − q) rounds to ≤ 0, F is its limit 0 (the library's formula: NaN).
    About 1 µs a call against 0.8 ms for the library's on a scalar (``scipy.integrate.quad`` calls it
    tens of thousands of times per calibration).
    """
    if sample_rate == 1.0:
        z = t
    elif t > 0:
        z = t + math.log1p(-(1.0 - sample_rate) * math.exp(-t)) - math.log(sample_rate)
    else:
        excess = math.expm1(t) + sample_rate  # e^t − (1 − q)
        if excess <= 0:
            return 0.0
        z = math.log(excess) - math.log(sample_rate)
    scale = 2.0 * math.sqrt(2.0) * noise_multiplier
    u = 2.0 * noise_multiplier**2 * z
    return 0.5 * sample_rate * math.erfc((1.0 - u) / scale) + 0.5 * (1.0 - sample_rate) * math.erfc(-(1.0 + u) / scale)


def _subsampled_gaussian_cdf_and_sf(
    t: np.ndarray, noise_multiplier: float, sample_rate: float
) -> tuple[np.ndarray, np.ndarray]:
    """(F(t), 1 − F(t)) of ``_subsampled_gaussian_cdf`` for a float64 array t, vectorised.

    The survival function is its own sum of erfc terms (½q·erfc(a) + ½(1 − q)·erfc(b)), accurate to
    rounding relative to itself where F ≈ 1, so that differences of either stay accurate in both tails.
    """
    from scipy.special import erfc

    scale = 2.0 * math.sqrt(2.0) * noise_multiplier
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if sample_rate == 1.0:
            z = t
        else:
            excess = np.expm1(t) + sample_rate  # e^t − (1 − q) for t ≤ 0, without cancelling e^t against 1
            z = np.where(
                t > 0, t + np.log1p(-(1.0 - sample_rate) * np.exp(-t)), np.where(excess > 0, np.log(excess), -np.inf)
            ) - math.log(sample_rate)
        u = 2.0 * noise_multiplier**2 * z
        cdf = 0.5 * sample_rate * erfc((1.0 - u) / scale) + 0.5 * (1.0 - sample_rate) * erfc(-(1.0 + u) / scale)
        sf = 0.5 * sample_rate * erfc((u - 1.0) / scale) + 0.5 * (1.0 - sample_rate) * erfc((u + 1.0) / scale)
    return cdf, sf


@dataclass(frozen=True)
class _TruncatedSubsampledGaussianPRV:
    """The PRV of one Poisson-subsampled Gaussian step (σ = ``noise_multiplier``, q = ``sample_rate``)
    truncated to the accountant's domain, with a fast mean that sees the PRV's support.

    ``truncated`` is prv_accountant's ``PrivacyRandomVariableTruncated``: its bounds and its mass come
    from it unchanged; its cell probabilities and CDF are computed here with the same formula in
    float64 (:meth:`probability`, :meth:`cdf`), which made a calibration several times faster. The
    library's ``mean()`` (E[Y] = Σ over panels [l, r] of r·F(r) − l·F(l) − ∫ₗʳ F dt, panels split at
    t_min, ±0.1, ±0.01, …, ±1e-5, t_max) misses the support's lower end log(1 − q): the privacy
    loss of the subsampled Gaussian is Y = log(1 − q + q·e^{(2x−1)/(2σ²)}) > log(1 − q), and for q
    a little above 0.1 and σ ≲ 1 much of the CDF's rise lies in the sliver [log(1 − q), −0.1] of the
    first panel [−L, −0.1] (L ≈ 10–30), between the nodes of the Gauss–Kronrod rule, which then
    returns ∫F = 0 with a zero error estimate (likewise, smaller, for q a little above 0.01). The
    mean comes out too large by ∫_{log(1−q)}^{−0.1} F (8.5e-4 at q = 0.107, σ = 0.735), more than the
    half-mesh (3.0e-4 at T = 27, eps_error = 0.01) that ``CellCentred.discretise`` allows: "Discrete
    mean differs from continuous mean significantly" (below that threshold the discretised PRV is
    silently shifted right: ε overstated). Here the same formula runs with one more breakpoint, just
    above log(1 − q), so that the rule's nodes cover the rise, and the integrand is :meth:`cdf`
    (the library's truncated CDF for a float, ~1000× faster on a scalar).
    """

    truncated: PrivacyRandomVariableTruncated
    noise_multiplier: float
    sample_rate: float

    @property
    def pm_inf(self) -> float:
        return self.truncated.pm_inf

    @property
    def support_min(self) -> float:
        """log(1 − q), the PRV's lower end; −∞ for q = 1 (the Gaussian mechanism)."""
        return math.log1p(-self.sample_rate) if self.sample_rate < 1 else -math.inf

    @cached_property
    def _remaining_mass(self) -> float:
        return float(self.truncated.remaining_mass)

    def probability(self, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        """P(lower < Y ≤ upper) of the truncated PRV, elementwise (lower ≤ upper), as the library's
        ``truncated.probability``: bounds clipped to [t_min, t_max], divided by the mass in between.

        Computed in float64 by ``_subsampled_gaussian_cdf_and_sf`` (the library's, in long double,
        was 75% of a calibration's time), as F(upper) − F(lower) below the median and
        S(lower) − S(upper) above it, so that a cell's probability keeps its relative accuracy in
        both tails; returned as long double, the type the library's composition continues in. Agrees
        with the library's cell by cell to 1e-9 relative or 2.5e-16 absolute, its own rounding (it
        rounds erfc's argument to float64 too; tested).
        """
        t_min, t_max = self.truncated.t_min, self.truncated.t_max
        lower_cdf, lower_sf = _subsampled_gaussian_cdf_and_sf(
            np.clip(np.asarray(lower, dtype=float), t_min, t_max), self.noise_multiplier, self.sample_rate
        )
        upper_cdf, upper_sf = _subsampled_gaussian_cdf_and_sf(
            np.clip(np.asarray(upper, dtype=float), t_min, t_max), self.noise_multiplier, self.sample_rate
        )
        mass = np.where(lower_cdf > 0.5, lower_sf - upper_sf, upper_cdf - lower_cdf)
        return (mass / self._remaining_mass).astype(np.longdouble)

    def cdf(self, t: float) -> float:
        """``truncated.cdf(t)`` for a float t: 0 below t_min, 1 from t_max, in between F(t) over the
        mass F(t_max) − F(t_min) (``_subsampled_gaussian_cdf``; the library's to 1e-12, tested)."""
        if t < self.truncated.t_min:
            return 0.0
        if t >= self.truncated.t_max:
            return 1.0
        return _subsampled_gaussian_cdf(t, self.noise_multiplier, self.sample_rate) / self._remaining_mass

    def mean(self) -> float:
        from scipy.integrate import quad

        cdf, t_min, t_max = self.cdf, self.truncated.t_min, self.truncated.t_max
        inner = (self.support_min + _SUPPORT_EDGE_OFFSET, *_MEAN_BREAKPOINTS)
        points = sorted({t_min, t_max, *(point for point in inner if t_min < point < t_max)})
        mean = 0.0
        for left, right in itertools.pairwise(points):
            integral, _ = quad(cdf, left, right, limit=500)
            mean += float(right * cdf(right) - left * cdf(left) - integral)
        return mean


def _truncated_prv(
    noise_multiplier: float, sample_rate: float, t_min: float, t_max: float
) -> _TruncatedSubsampledGaussianPRV:
    """The PRV of one step at σ = ``noise_multiplier``, q = ``sample_rate``, truncated to [t_min, t_max]."""
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant.privacy_random_variables import PrivacyRandomVariableTruncated

    mechanism = PoissonSubsampledGaussianMechanism(sampling_probability=sample_rate, noise_multiplier=noise_multiplier)
    return _TruncatedSubsampledGaussianPRV(
        PrivacyRandomVariableTruncated(mechanism, t_min, t_max), noise_multiplier, sample_rate
    )


def prv_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, eps_error: float) -> float:
    """Upper bound on ε of T-fold Poisson-subsampled Gaussian by the PRV accountant (Gopi et al. 2021).

    prv_accountant's ``PRVAccountant`` pipeline, step by step, from the library's parts: the PRV
    truncated to the domain [−L', L'] (``_fft_friendly_domain``), discretised cell-centred with its mean
    matched (``CellCentred``, with the mean of ``_TruncatedSubsampledGaussianPRV``), self-composed T
    times by FFT (``Fourier``), and ε read off at δ with ``eps_error`` and ``delta_error`` = δ/1000.
    """
    from prv_accountant.composers import Fourier
    from prv_accountant.discretisers import CellCentred

    delta_error = delta * DELTA_ERROR_FRACTION
    domain = _fft_friendly_domain(
        _safe_half_width(_grid_floor(noise_multiplier), sample_rate, steps, delta), steps, eps_error, delta_error
    )
    truncated = _truncated_prv(noise_multiplier, sample_rate, domain.t_min(), domain.t_max())
    composed = Fourier([CellCentred().discretise(truncated, domain)]).compute_composition([steps])
    _, _, epsilon_upper = composed.compute_epsilon(delta, delta_error, eps_error)
    return float(epsilon_upper)


@lru_cache(maxsize=4096)
def certified_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    return prv_epsilon(noise_multiplier, sample_rate, steps, delta, EPSILON_ERROR)


def epsilon_spent(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε of T = ``steps`` Poisson-subsampled Gaussian steps at σ = ``noise_multiplier``, q = ``sample_rate``.

    The PRV accountant's upper bound (eps_error = ``EPSILON_ERROR``, delta_error = δ/1000), for
    (ε, δ)-DP under add/remove adjacency. Memoised and cached on disk.
    """
    noise_multiplier, sample_rate = checked_noise_multiplier(noise_multiplier), checked_sample_rate(sample_rate)
    steps, delta = checked_steps(steps), checked_delta(delta)
    inputs = {"noise_multiplier": noise_multiplier, "sample_rate": sample_rate, "steps": steps, "delta": delta}
    return cached("epsilon", inputs, lambda: certified_epsilon(noise_multiplier, sample_rate, steps, delta))
