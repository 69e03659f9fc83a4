"""Privacy accounting for DP-SGD / DP-Adam: ε spent, σ calibration, and the privacy cost of tuning.

The mechanism is the Poisson-subsampled Gaussian mechanism composed ``steps`` (T) times: each step
includes every example independently with probability ``sample_rate`` (q = B/N), clips each
per-example gradient to norm ≤ C and adds N(0, σ²C²I) to the sum. ``noise_multiplier`` is σ (noise
std in units of the clip bound C). Privacy is (ε, δ)-DP under add/remove-one adjacency.

Accountant: the PRV accountant of Gopi, Lee and Wutschitz (NeurIPS 2021, arXiv 2106.02848) from
``prv_accountant``. It returns (lower, estimate, upper) bounds on ε; every ε this module reports is
the *upper* bound, so that a reported ε is a guarantee. Accuracy settings (the same as Opacus'
``PRVAccountant`` defaults): ``eps_error = EPSILON_ERROR = 0.01`` and ``delta_error = δ/1000``.
The library's ``PRVAccountant`` steps (truncate the PRV to [−L, L], discretise it on a mesh with its
mean matched, compose by FFT, read ε at δ) run here from the library's own parts, with one
correction: the mean of the truncated PRV is integrated from the support's lower end log(1 − q)
(``_TruncatedSubsampledGaussianPRV``). The library's quadrature misses that end for q a little
above 0.1 and σ ≲ 1 (large ε, few steps: e.g. ε = 8, q = 32/300, T = 27) and then refuses to discretise
("Discrete mean differs from continuous mean significantly") whatever the domain size; a coarser
mesh only hides the error (it then shifts the PRV right, overstating ε).

Calibration (``calibrate_noise_multiplier``) returns the σ the accountant certifies for the target:
``epsilon_spent(σ, q, T, δ) ≤ ε_target`` always holds, and σ is within ``NOISE_MULTIPLIER_RTOL``
(relative) of the smallest σ that passes, bracketed by a failing σ/(1 + rtol) or closer. Because
the certified ε carries ``EPSILON_ERROR`` and the accountant's discretisation, the true ε of the
returned σ lies in about [ε_target − 2·EPSILON_ERROR, ε_target].

Speed (a calibration is a root search over σ, each point a PRV discretisation + FFT composition):
 1. a Gaussian-DP central-limit guess (Dong, Roth, Su 2019; μ = q·√(T(e^{1/σ²} − 1))), exact for
    q = 1, to start from, instead of doubling from a fixed bracket;
 2. a coarse root search at ``eps_error = 0.1`` (a 10× smaller grid) to locate σ and the slope
    d log ε / d log σ;
 3. certified evaluations at ``EPSILON_ERROR`` aimed ±rtol/2 around the secant estimate, so that a
    good estimate closes the bracket in two evaluations (bisection takes over if steps stall);
 4. the accountant's grid is enlarged to a length with prime factors ≤ 11 (``scipy.fft.next_fast_len``;
    the length it picks itself can have a large prime factor, which made pocketfft 2–3× slower),
    and the safe domain size (an RDP computation) is reused between nearby σ: it is computed at σ
    rounded *down* to a 1/16-octave grid, which gives a domain at least as large as σ needs.
Results are memoised in-process and cached on disk (``dptune.paths.cache_dir("accounting")``), keyed
by the exact inputs, the accuracy settings and the accountant's version: a repeated calibration is
a dict lookup or one small file read.

Disk cache format: one small JSON file per key, written to a temporary file in the same folder and
moved into place with ``os.replace``. That rename is atomic on POSIX, so concurrent writers (Ray
trials, several drivers, several users of a shared cache) never leave a partial file and never
block each other; the last writer of an identical value wins. A reader that finds an unreadable
file (e.g. after a crash) treats it as a miss and rewrites it. Chosen over SQLite with WAL because
it needs no locks, works on network file systems where SQLite's locking is unreliable, and each
entry can be read or removed by hand.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import numbers
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dptune.errors import DptuneError
from dptune.paths import cache_dir

# prv_accountant (which imports scipy.signal, ~1.5 s) and scipy are imported where σ or ε is computed,
# so that a process that only reads cached values (the planner's second run, a trial) never pays that.
if TYPE_CHECKING:
    from prv_accountant.domain import Domain
    from prv_accountant.privacy_random_variables import PrivacyRandomVariableTruncated

#: Additive error allowed in ε by the certified (upper) bound; Opacus' PRVAccountant default.
EPSILON_ERROR = 0.01
#: eps_error of the coarse search that locates σ before the certified evaluations.
COARSE_EPSILON_ERROR = 0.1
#: delta_error = δ · DELTA_ERROR_FRACTION (as in Opacus and prv_accountant's own calibration).
DELTA_ERROR_FRACTION = 1e-3
#: Relative tolerance of a calibrated σ: σ_returned ≤ (1 + rtol) · σ_smallest_certified.
NOISE_MULTIPLIER_RTOL = 1e-3
#: Range σ is searched in. Above the maximum the target is unreachable; below the minimum the
#: target ε is so large that it gives no meaningful privacy (and the PRV grid becomes huge).
MIN_NOISE_MULTIPLIER = 0.1
MAX_NOISE_MULTIPLIER = 1e4
#: Range of ε targets accepted. The certified ε is at least EPSILON_ERROR, so a target must lie
#: well above it; 8 is the loosest budget in the paper, far below the maximum.
MIN_EPSILON = 0.05
MAX_EPSILON = 50.0
#: Bump when the calibration procedure changes: it is part of every cache key.
METHOD_VERSION = "prv-coarse-secant-2"  # 2: the truncated PRV's mean sees log(1 − q)

_CACHE_FOLDER = "accounting"
_SIGMA_GRID_PER_OCTAVE = 16
_MAX_CERTIFIED_EVALUATIONS = 40
_MAX_COARSE_EVALUATIONS = 12
_LOG2 = math.log(2.0)


class PrivacyParameterError(DptuneError):
    """A privacy parameter is out of range, or the target cannot be met; raised before any work."""


# --------------------------------------------------------------------------- input checks


def _real(name: str, value: object) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise PrivacyParameterError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise PrivacyParameterError(f"{name} must be finite, got {value!r}")
    return number


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise PrivacyParameterError(f"{name} must be {allowed}, got {value!r}")


def _check_epsilon(epsilon: object, name: str = "epsilon") -> float:
    number = _real(name, epsilon)
    _require(MIN_EPSILON <= number <= MAX_EPSILON, name, epsilon,
             f"in [{MIN_EPSILON:g}, {MAX_EPSILON:g}] (the accountant certifies ε to within {EPSILON_ERROR:g})")
    return number


def _check_delta(delta: object, name: str = "delta") -> float:
    number = _real(name, delta)
    _require(0 < number < 1, name, delta, "in (0, 1) (typically 1e-5, below 1/N)")
    return number


def _check_sample_rate(sample_rate: object) -> float:
    number = _real("sample_rate", sample_rate)
    _require(0 < number <= 1, "sample_rate", sample_rate, "in (0, 1] (q = B/N; 1 is full batch)")
    return number


def _check_steps(steps: object) -> int:
    ok = isinstance(steps, numbers.Integral) and not isinstance(steps, bool) and int(steps) >= 1
    _require(ok, "steps", steps, "an integer ≥ 1 (number of DP-SGD steps T)")
    return int(steps)  # type: ignore[call-overload]


def _check_noise_multiplier(noise_multiplier: object) -> float:
    number = _real("noise_multiplier", noise_multiplier)
    _require(MIN_NOISE_MULTIPLIER <= number <= MAX_NOISE_MULTIPLIER, "noise_multiplier", noise_multiplier,
             f"in [{MIN_NOISE_MULTIPLIER:g}, {MAX_NOISE_MULTIPLIER:g}] (σ, noise std in units of the clip bound)")
    return number


def check_delta(delta: float, num_examples: int) -> None:
    """Warn (``UserWarning``) when δ > 1/N: such a δ allows leaking one example outright.

    δ must be in (0, 1) and ``num_examples`` (N) ≥ 1, else ``PrivacyParameterError``. The usual
    rule is δ ≪ 1/N; the paper uses δ = 1e-5.
    """
    delta = _check_delta(delta)
    _require(isinstance(num_examples, numbers.Integral) and num_examples >= 1, "num_examples", num_examples,
             "an integer ≥ 1")
    if delta > 1.0 / num_examples:
        warnings.warn(
            f"delta={delta:g} is larger than 1/num_examples = 1/{num_examples} = {1.0 / num_examples:.3g}: "
            "(ε, δ)-DP then permits revealing some example entirely; use δ ≪ 1/N (the paper uses 1e-5)",
            UserWarning,
            stacklevel=2,
        )


# --------------------------------------------------------------------------- memo and disk cache

_memo: dict[tuple[object, ...], float] = {}


@lru_cache(maxsize=1)
def _accountant_identity() -> dict[str, object]:
    return {
        "prv_accountant": version("prv-accountant"),
        "method": METHOD_VERSION,
        "epsilon_error": EPSILON_ERROR,
        "delta_error_fraction": DELTA_ERROR_FRACTION,
        "noise_multiplier_rtol": NOISE_MULTIPLIER_RTOL,
    }


def _cache_path(key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]
    return cache_dir(_CACHE_FOLDER) / f"{key['kind']}-{digest}.json"


def _read_cached(path: Path, key: dict[str, object]) -> float | None:
    try:
        record = json.loads(path.read_text())
        if record["key"] == key:
            return float(record["value"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing, partial (crash) or foreign file: a miss; it is rewritten below
    return None


def _write_cached(path: Path, key: dict[str, object], value: float) -> None:
    """Write atomically: temporary file in the same folder, then ``os.replace``."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; a cache may be shared
        with os.fdopen(fd, "w") as handle:
            json.dump({"key": key, "value": value}, handle, sort_keys=True)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _cached(kind: str, inputs: dict[str, float | int], compute: Callable[[], float]) -> float:
    """``compute()`` once per exact inputs: in-process memo, then the on-disk cache, then compute."""
    memo_key = (kind, *inputs.values())
    if memo_key in _memo:
        return _memo[memo_key]
    key: dict[str, object] = {"kind": kind, **inputs, **_accountant_identity()}
    path = _cache_path(key)
    value = _read_cached(path, key)
    if value is None:
        value = compute()
        _write_cached(path, key, value)
    _memo[memo_key] = value
    return value


def clear_memory_cache() -> None:
    """Forget in-process results (the on-disk cache stays); for tests and long-lived processes."""
    _memo.clear()
    _certified_epsilon.cache_clear()
    _safe_half_width.cache_clear()


# --------------------------------------------------------------------------- the PRV accountant


@lru_cache(maxsize=1024)
def _safe_half_width(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """prv_accountant's safe half-width L of the PRV domain (Gopi et al. Remark 5.6, via RDP).

    Computed with the coarse eps_error, which gives the larger domain (L = max(L_RDP, eps_error) + 3),
    so that it serves both the coarse and the certified evaluations.
    """
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant.accountant import compute_safe_domain_size

    mechanism = PoissonSubsampledGaussianMechanism(sampling_probability=sample_rate, noise_multiplier=noise_multiplier)
    return float(compute_safe_domain_size([mechanism], [steps], eps_error=COARSE_EPSILON_ERROR,
                                          delta_error=delta * DELTA_ERROR_FRACTION))


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


@dataclass(frozen=True)
class _TruncatedSubsampledGaussianPRV:
    """The PRV of one Poisson-subsampled Gaussian step truncated to the accountant's domain, with a
    mean that sees the PRV's support.

    ``truncated`` is prv_accountant's ``PrivacyRandomVariableTruncated``; probabilities come from it
    unchanged. Its ``mean()`` (E[Y] = Σ over panels [l, r] of r·F(r) − l·F(l) − ∫ₗʳ F dt, panels split
    at t_min, ±0.1, ±0.01, …, ±1e-5, t_max) misses the support's lower end log(1 − q): the privacy
    loss of the subsampled Gaussian is Y = log(1 − q + q·e^{(2x−1)/(2σ²)}) > log(1 − q), and for q
    a little above 0.1 and σ ≲ 1 much of the CDF's rise lies in the sliver [log(1 − q), −0.1] of the
    first panel [−L, −0.1] (L ≈ 10–30), between the nodes of the Gauss–Kronrod rule, which then
    returns ∫F = 0 with a zero error estimate (likewise, smaller, for q a little above 0.01). The
    mean comes out too large by ∫_{log(1−q)}^{−0.1} F (8.5e-4 at q = 0.107, σ = 0.735), more than the
    half-mesh (3.0e-4 at T = 27, eps_error = 0.01) that ``CellCentred.discretise`` allows: "Discrete
    mean differs from continuous mean significantly" (below that threshold the discretised PRV is
    silently shifted right: ε overstated). Here the same formula runs with one more breakpoint, just
    above log(1 − q), so that the rule's nodes cover the rise.
    """

    truncated: PrivacyRandomVariableTruncated
    support_min: float  # log(1 − q); −∞ for q = 1 (the Gaussian mechanism)

    @property
    def pm_inf(self) -> float:
        return self.truncated.pm_inf

    def probability(self, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        return self.truncated.probability(lower, upper)

    def mean(self) -> float:
        from scipy.integrate import quad

        cdf, t_min, t_max = self.truncated.cdf, self.truncated.t_min, self.truncated.t_max
        inner = (self.support_min + _SUPPORT_EDGE_OFFSET, *_MEAN_BREAKPOINTS)
        points = sorted({t_min, t_max, *(point for point in inner if t_min < point < t_max)})
        mean = 0.0
        for left, right in itertools.pairwise(points):
            integral, _ = quad(cdf, left, right, limit=500)
            mean += float(right * cdf(right) - left * cdf(left) - integral)
        return mean


def _truncated_prv(noise_multiplier: float, sample_rate: float, t_min: float,
                   t_max: float) -> _TruncatedSubsampledGaussianPRV:
    """The PRV of one step at σ = ``noise_multiplier``, q = ``sample_rate``, truncated to [t_min, t_max]."""
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant.privacy_random_variables import PrivacyRandomVariableTruncated

    mechanism = PoissonSubsampledGaussianMechanism(sampling_probability=sample_rate, noise_multiplier=noise_multiplier)
    return _TruncatedSubsampledGaussianPRV(PrivacyRandomVariableTruncated(mechanism, t_min, t_max),
                                           support_min=math.log1p(-sample_rate) if sample_rate < 1 else -math.inf)


def _prv_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, eps_error: float) -> float:
    """Upper bound on ε of T-fold Poisson-subsampled Gaussian by the PRV accountant (Gopi et al. 2021).

    prv_accountant's ``PRVAccountant`` pipeline, step by step, from the library's parts: the PRV
    truncated to the domain [−L', L'] (``_fft_friendly_domain``), discretised cell-centred with its mean
    matched (``CellCentred``, with the mean of ``_TruncatedSubsampledGaussianPRV``), self-composed T
    times by FFT (``Fourier``), and ε read off at δ with ``eps_error`` and ``delta_error`` = δ/1000.
    """
    from prv_accountant.composers import Fourier
    from prv_accountant.discretisers import CellCentred

    delta_error = delta * DELTA_ERROR_FRACTION
    domain = _fft_friendly_domain(_safe_half_width(_grid_floor(noise_multiplier), sample_rate, steps, delta), steps,
                                  eps_error, delta_error)
    truncated = _truncated_prv(noise_multiplier, sample_rate, domain.t_min(), domain.t_max())
    composed = Fourier([CellCentred().discretise(truncated, domain)]).compute_composition([steps])
    _, _, epsilon_upper = composed.compute_epsilon(delta, delta_error, eps_error)
    return float(epsilon_upper)


@lru_cache(maxsize=4096)
def _certified_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    return _prv_epsilon(noise_multiplier, sample_rate, steps, delta, EPSILON_ERROR)


def epsilon_spent(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε of T = ``steps`` Poisson-subsampled Gaussian steps at σ = ``noise_multiplier``, q = ``sample_rate``.

    The PRV accountant's upper bound (eps_error = ``EPSILON_ERROR``, delta_error = δ/1000), for
    (ε, δ)-DP under add/remove adjacency. Memoised and cached on disk.
    """
    inputs = {
        "noise_multiplier": _check_noise_multiplier(noise_multiplier),
        "sample_rate": _check_sample_rate(sample_rate),
        "steps": _check_steps(steps),
        "delta": _check_delta(delta),
    }
    return _cached("epsilon", inputs, lambda: _certified_epsilon(*inputs.values()))


# --------------------------------------------------------------------------- calibration


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


def _coarse_root(log_excess: Callable[[float], float], x: float, slope: float, x_min: float,
                 x_max: float) -> tuple[float, float]:
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


def _certified_bracket(log_excess: Callable[[float], float], x: float, slope: float, tolerance: float,
                       x_min: float, x_max: float, describe: Callable[[str], str]) -> float:
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
            raise PrivacyParameterError(describe(
                f"too large: noise_multiplier = {math.exp(x_min):g} already meets it (no meaningful privacy)"))
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
        return (f"epsilon={epsilon:g} at delta={delta:g}, sample_rate={sample_rate:g}, steps={steps} is {problem}; "
                f"noise_multiplier is searched in [{MIN_NOISE_MULTIPLIER:g}, {MAX_NOISE_MULTIPLIER:g}]")

    guess, slope = _gaussian_dp_guess(epsilon, delta, sample_rate, steps)
    if guess > 1.1 * MAX_NOISE_MULTIPLIER:  # Gaussian DP is exact for q = 1 and accurate at large σ
        raise PrivacyParameterError(describe(f"unreachable: it needs noise_multiplier ≈ {guess:.3g}"))
    x_min, x_max = math.log(MIN_NOISE_MULTIPLIER), math.log(MAX_NOISE_MULTIPLIER)
    log_target = math.log(epsilon)
    shift = COARSE_EPSILON_ERROR - EPSILON_ERROR  # coarse upper bound → estimate of the certified one

    def coarse(x: float) -> float:
        return math.log(max(_prv_epsilon(math.exp(x), sample_rate, steps, delta, COARSE_EPSILON_ERROR) - shift,
                            1e-12)) - log_target

    def certified(x: float) -> float:
        return math.log(_certified_epsilon(math.exp(x), sample_rate, steps, delta)) - log_target

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
    inputs = {
        "epsilon": _check_epsilon(epsilon),
        "delta": _check_delta(delta),
        "sample_rate": _check_sample_rate(sample_rate),
        "steps": _check_steps(steps),
    }
    return _cached("noise_multiplier", inputs, lambda: _calibrate(*inputs.values()))


# --------------------------------------------------------------------------- privacy cost of tuning


@dataclass(frozen=True)
class TuningCost:
    """(ε, δ) of a whole hyperparameter search that releases its best trial.

    ``epsilon_composition``/``delta_composition``: basic composition of k trials, (k·ε, k·δ).
    ``epsilon_selection``/``delta_selection``: Papernot & Steinke (2022) private selection with a
    random number of trials of mean k (distribution ``distribution``), by dp_accounting's RDP
    accountant, reported at δ = ``delta_selection`` (the per-trial δ).
    """

    trials: int
    epsilon_per_trial: float
    delta_per_trial: float
    epsilon_composition: float
    delta_composition: float
    epsilon_selection: float
    delta_selection: float
    distribution: str
    shape: float


def _trial_count_distribution(shape: float) -> str:
    if shape == math.inf:
        return "poisson"
    if shape == 1:
        return "geometric"
    if shape == 0:
        return "logarithmic"
    return f"truncated negative binomial (η={shape:g})"


def _as_tuple(value: object) -> tuple[object, ...]:
    return tuple(value) if isinstance(value, Sequence) else (value,)


def tuning_privacy_cost(epsilon_per_trial: float, delta_per_trial: float, trials: int, *,
                        sample_rate: float | Sequence[float], steps: int | Sequence[int],
                        noise_multiplier: float | Sequence[float] | None = None,
                        shape: float = 1.0) -> TuningCost:
    """Privacy cost of running a search of ``trials`` trials, each (ε, δ)-DP, and releasing the best.

    Basic composition (no assumptions on how trials are chosen, every trial may be released):
    ε_total = k·ε, δ_total = k·δ.

    Private selection (Papernot & Steinke, "Hyperparameter tuning with Renyi differential privacy",
    ICLR 2022, arXiv 2110.03620): run the training mechanism Q a *random* number K of times, with
    K ~ truncated negative binomial of shape η and mean k (``shape``: 1 = geometric, the default;
    0 = logarithmic; ``math.inf`` = Poisson, Thm 6; otherwise Thm 2), and release only the best run.
    (Geometric is the default: at k = 10–50 trials its bound is within ~15% of the logarithmic
    distribution's, which puts far more mass on a single trial, while the Poisson bound grows with
    k·δ̂: for ε = 1 per trial and k = 50, about 2.9 against 6.3.) If Q is
    (λ, ε_λ)-RDP for all λ, the selection is RDP with, for the Poisson case,
    ε'_λ = ε_λ + k·δ̂ + log(k)/(λ − 1), where δ̂ is Q's δ at ε̂ = log(1 + 1/(λ − 1)); for the
    truncated negative binomial (γ set by the mean k)
    ε'_λ = ε_λ + (1 + η)·min_λ̂[(1 − 1/λ̂)·ε_λ̂ − log(γ)/λ̂] + log(k)/(λ − 1).
    Q's RDP is that of T-fold Poisson-subsampled Gaussian (dp_accounting's
    ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T)``) and the bound is
    computed by dp_accounting's ``RdpAccountant`` on ``RepeatAndSelectDpEvent`` and converted to
    (ε, δ) at δ = ``delta_per_trial``. RDP is looser than PRV for one trial, so ε_selection ≥ the
    PRV ε of one trial.

    Assumptions of the selection bound: the number of trials is drawn from that distribution
    (not fixed), each trial's hyperparameters are drawn independently of the data and of earlier
    trials (random search; an adaptive sampler such as TPE is *not* covered), the score used to
    pick the best is part of what Q outputs (computed under DP or on data outside the
    guarantee), and only the selected trial is released.

    Several candidate configurations (e.g. a search over B): pass sequences of equal length for
    ``sample_rate``, ``steps`` and ``noise_multiplier``. A trial that picks one of them at random is
    RDP with the pointwise maximum over the candidates' RDP curves (Rényi divergence is quasi-convex),
    which is what is fed to the selection bound; the maximum of the per-candidate selection ε would
    *under*-state the cost. ``noise_multiplier`` defaults to ``calibrate_noise_multiplier`` of each
    candidate at (ε, δ).
    """
    from dp_accounting.dp_event import (GaussianDpEvent, PoissonSampledDpEvent, RepeatAndSelectDpEvent,
                                        SelfComposedDpEvent)
    from dp_accounting.rdp import RdpAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import _compute_rdp_repeat_and_select, compute_epsilon

    epsilon_per_trial = _check_epsilon(epsilon_per_trial, "epsilon_per_trial")
    delta_per_trial = _check_delta(delta_per_trial, "delta_per_trial")
    _require(isinstance(trials, numbers.Integral) and not isinstance(trials, bool) and trials >= 1, "trials", trials,
             "an integer ≥ 1 (planned number of trials = mean of the random trial count)")
    _require(shape >= 0, "shape", shape, "≥ 0 (0 logarithmic, 1 geometric, math.inf Poisson)")
    rates = [_check_sample_rate(q) for q in _as_tuple(sample_rate)]
    step_counts = [_check_steps(t) for t in _as_tuple(steps)]
    _require(len(rates) == len(step_counts), "sample_rate and steps", (sample_rate, steps), "of equal length")
    if noise_multiplier is None:
        sigmas = [calibrate_noise_multiplier(epsilon_per_trial, delta_per_trial, q, t)
                  for q, t in zip(rates, step_counts)]
    else:
        sigmas = [_check_noise_multiplier(s) for s in _as_tuple(noise_multiplier)]
    _require(len(sigmas) == len(rates), "noise_multiplier", noise_multiplier, "one per (sample_rate, steps) candidate")

    trial_events = [SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(s)), t)
                    for s, q, t in zip(sigmas, rates, step_counts)]
    # dp_accounting logs a warning for each fractional RDP order whose series does not converge;
    # it then sets that order's RDP to ∞, which only drops the order from the minimum over
    # orders (the bound stays valid, at worst looser). Keep those lines out of the user's terminal.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        if len(trial_events) == 1:
            accountant = RdpAccountant().compose(RepeatAndSelectDpEvent(trial_events[0], float(trials), float(shape)))
            epsilon_selection = accountant.get_epsilon(delta_per_trial)
        else:
            orders = RdpAccountant()._orders  # dp_accounting's default orders
            per_trial_rdp = np.max([RdpAccountant(orders).compose(event)._rdp for event in trial_events], axis=0)
            selection_rdp = _compute_rdp_repeat_and_select(orders, per_trial_rdp, float(trials), float(shape))
            epsilon_selection = compute_epsilon(orders, selection_rdp, delta_per_trial)[0]
    finally:
        absl_logger.setLevel(level)
    return TuningCost(
        trials=int(trials),
        epsilon_per_trial=epsilon_per_trial,
        delta_per_trial=delta_per_trial,
        epsilon_composition=trials * epsilon_per_trial,
        delta_composition=trials * delta_per_trial,
        epsilon_selection=float(epsilon_selection),
        delta_selection=delta_per_trial,
        distribution=_trial_count_distribution(shape),
        shape=float(shape),
    )
