"""Privacy accounting for DP-SGD / DP-Adam: ε spent, σ calibration, and the privacy cost of tuning.

The mechanism is the Poisson-subsampled Gaussian mechanism composed ``steps`` (T) times: each step
includes every example independently with probability ``sample_rate`` (q = B/N), clips each
per-example gradient to norm ≤ C and adds N(0, σ²C²I) to the sum. ``noise_multiplier`` is σ (noise
std in units of the clip bound C). Privacy is (ε, δ)-DP under add/remove-one adjacency.

Accountant of ε spent and of σ calibration: the PRV accountant of Gopi, Lee and Wutschitz (NeurIPS
2021, arXiv 2106.02848) from ``prv_accountant``. It returns (lower, estimate, upper) bounds on ε;
every ε this module reports is the *upper* bound, so that a reported ε is a guarantee. Accuracy
settings (the same as Opacus' ``PRVAccountant`` defaults): ``eps_error = EPSILON_ERROR = 0.01`` and
``delta_error = δ/1000``. The library's ``PRVAccountant`` steps (truncate the PRV to [−L, L],
discretise it on a mesh with its mean matched, compose by FFT, read ε at δ) run here from the
library's own parts, its formulas recomputed where they were slow (below), with one correction:
the mean of the truncated PRV is integrated from the support's lower end log(1 − q)
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
    rounded *down* to a 1/16-octave grid, which gives a domain at least as large as σ needs;
 5. prv_accountant's slow parts run here as numpy float64 or scalar ``math``, with the same
    formulas: the RDP curve of the safe domain size (pure Python there; ``_subsampled_gaussian_rdp``,
    the domain never narrower than the library's), the CDF that the mean's adaptive quadrature
    evaluates thousands of times per calibration (``_subsampled_gaussian_cdf``, 1 µs a call
    against 0.8 ms), and the cells' probabilities (long double there;
    ``_subsampled_gaussian_cdf_and_sf``, ~15× faster). The 28 calibrations of the default space
    went from 59 s to 12 s with a cold cache on 2 shared cores (``bench/bench_accounting.py``).

The privacy cost of a search (``composed_epsilon``: every trial's mechanism composed, heterogeneous)
is dp_accounting's privacy-loss-distribution accountant with pessimistic discretisation, also an
upper bound: its cost grows with ε rather than with the total steps, which the PRV mesh shrinks with.

Results are memoised in-process and cached on disk (``dptune.paths.cache_dir("accounting")``), keyed
by the exact inputs, the accuracy settings and the accountant's version: a repeated calibration is
a dict lookup or one small file read.

Disk cache format: one small JSON file per key, written to a temporary file in the same folder and
moved into place with ``os.replace``. That rename is atomic on POSIX, so concurrent writers (Ray
trials, several drivers) never leave a partial file and never block each other; the last writer of
an identical value wins. The folder is private to the user (0700, files 0600) and every entry
carries an HMAC-SHA256 under a per-user secret key kept beside it: a reader that finds an
unreadable, foreign or tampered entry treats it as a miss and recomputes it, so a σ that was not
computed here can never set a trial's noise. Chosen over SQLite with WAL because
it needs no locks, works on network file systems where SQLite's locking is unreliable, and each
entry can be read or removed by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
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
from functools import cached_property, lru_cache, reduce
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dptune._thirdparty import rdp_of_event, rdp_repeat_and_select
from dptune.errors import DptuneError
from dptune.paths import cache_dir

# prv_accountant (which imports scipy.signal, ~1.5 s) and scipy are imported where σ or ε is computed,
# so that a process that only reads cached values (the planner's second run, a trial) never pays that.
if TYPE_CHECKING:
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
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
#: 2: the truncated PRV's mean sees log(1 − q); 3: vectorised RDP domain (≥ the library's), ``math`` CDF.
METHOD_VERSION = "prv-coarse-secant-3"

_CACHE_FOLDER = "accounting"
_SIGMA_GRID_PER_OCTAVE = 16
_MAX_CERTIFIED_EVALUATIONS = 40
_MAX_COARSE_EVALUATIONS = 12
_LOG2 = math.log(2.0)


class PrivacyParameterError(DptuneError, ValueError):
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


def _cache_folder() -> Path:
    """The accounting cache folder, private to this user (mode 0700): a σ read from it sets the
    noise of every trial, so nobody else may write it."""
    folder = cache_dir(_CACHE_FOLDER)
    os.chmod(folder, 0o700)
    return folder


@lru_cache(maxsize=1)
def _cache_key_secret() -> bytes:
    """A per-user secret (32 random bytes in a 0600 file of the cache folder) that signs entries.

    An entry whose HMAC does not verify (edited, copied from elsewhere, written by another user,
    truncated) is recomputed, never trusted: a tampered σ cannot weaken a trial's guarantee.
    """
    path = _cache_folder() / ".hmac-key"
    try:
        secret = path.read_bytes()
        if len(secret) == 32 and path.stat().st_uid == os.getuid() and not path.stat().st_mode & 0o077:
            return secret
    except OSError:
        pass
    path.unlink(missing_ok=True)  # unusable (wrong size, owner or mode): replaced
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".hmac-key.", suffix=".tmp")  # mode 0600
    with os.fdopen(fd, "wb") as handle:
        handle.write(os.urandom(32))
    with contextlib.suppress(FileExistsError):  # a link is created whole or not at all: the first writer wins
        os.link(temporary, path)
    os.unlink(temporary)
    return path.read_bytes()


def _signature(key: dict[str, object], value: float) -> str:
    message = json.dumps({"key": key, "value": value}, sort_keys=True).encode()
    return hmac.new(_cache_key_secret(), message, hashlib.sha256).hexdigest()


def _cache_path(key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]
    return _cache_folder() / f"{key['kind']}-{digest}.json"


def _read_cached(path: Path, key: dict[str, object]) -> float | None:
    try:
        record = json.loads(path.read_text())
        value = record["value"]
        if record["key"] == key and isinstance(value, float) and math.isfinite(value) and hmac.compare_digest(
                str(record["hmac"]), _signature(key, value)):
            return value
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing, partial (crash), foreign or tampered file: a miss; it is rewritten below
    return None


def _write_cached(path: Path, key: dict[str, object], value: float) -> None:
    """Write atomically: temporary file (mode 0600) in the same folder, then ``os.replace``."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump({"key": key, "value": value, "hmac": _signature(key, value)}, handle, sort_keys=True)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _cached(kind: str, inputs: dict[str, float | int | str], compute: Callable[[], float]) -> float:
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
    _cache_key_secret.cache_clear()
    _certified_epsilon.cache_clear()
    _safe_half_width.cache_clear()
    _self_composed_pld.cache_clear()


# --------------------------------------------------------------------------- the PRV accountant


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
        log_s0 = (log_coef + i * math.log(q) + j * math.log(1 - q) + (i * i - i) / (2 * sigma**2)
                  + log_ndtr((z0 - i) / sigma))
        log_s1 = (log_coef + j * math.log(q) + i * math.log(1 - q) + (j * j - j) / (2 * sigma**2)
                  + log_ndtr((j - z0) / sigma))
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
    log_terms = (gammaln(alpha + 1) - gammaln(i + 1) - gammaln(np.where(in_sum, alpha - i, 0.0) + 1)
                 + i * math.log(q) + (alpha - i) * math.log(1 - q) + (i * i - i) / (2 * sigma**2))
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
    width = max(_rdp_to_epsilon(steps * rdp, delta_error / 4), _rdp_to_epsilon(rdp, delta_error / 8 / steps),
                COARSE_EPSILON_ERROR)
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


def _subsampled_gaussian_cdf_and_sf(t: np.ndarray, noise_multiplier: float,
                                    sample_rate: float) -> tuple[np.ndarray, np.ndarray]:
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
            z = np.where(t > 0, t + np.log1p(-(1.0 - sample_rate) * np.exp(-t)),
                         np.where(excess > 0, np.log(excess), -np.inf)) - math.log(sample_rate)
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
        lower_cdf, lower_sf = _subsampled_gaussian_cdf_and_sf(np.clip(np.asarray(lower, dtype=float), t_min, t_max),
                                                              self.noise_multiplier, self.sample_rate)
        upper_cdf, upper_sf = _subsampled_gaussian_cdf_and_sf(np.clip(np.asarray(upper, dtype=float), t_min, t_max),
                                                              self.noise_multiplier, self.sample_rate)
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


def _truncated_prv(noise_multiplier: float, sample_rate: float, t_min: float,
                   t_max: float) -> _TruncatedSubsampledGaussianPRV:
    """The PRV of one step at σ = ``noise_multiplier``, q = ``sample_rate``, truncated to [t_min, t_max]."""
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant.privacy_random_variables import PrivacyRandomVariableTruncated

    mechanism = PoissonSubsampledGaussianMechanism(sampling_probability=sample_rate, noise_multiplier=noise_multiplier)
    return _TruncatedSubsampledGaussianPRV(PrivacyRandomVariableTruncated(mechanism, t_min, t_max),
                                           noise_multiplier, sample_rate)


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


# --------------------------------------------------------------------------- privacy cost of a search

#: Width of the privacy-loss grid of the search's composition (dp_accounting's
#: ``value_discretization_interval``). The PLD is discretised pessimistically, so the ε is an upper
#: bound at any width; a finer grid only tightens it (the default search's cells: 0.06–0.10 below
#: the PRV accountant's upper bound at eps_error = 0.1), at a cost that grows as ε / width.
SEARCH_PLD_INTERVAL = 1e-3


@dataclass(frozen=True)
class TrialMechanism:
    """One trial as the accountant sees it: ``steps`` (T) Poisson-subsampled Gaussian steps at rate
    ``sample_rate`` (q) with noise multiplier ``noise_multiplier`` (σ, noise std in units of C).

    ``steps`` is what the trial actually took (a stopped or failed trial counts the steps it ran;
    a trial that took no step costs nothing and is left out).
    """

    noise_multiplier: float
    sample_rate: float
    steps: int

    def checked(self) -> TrialMechanism:
        return TrialMechanism(_check_noise_multiplier(self.noise_multiplier), _check_sample_rate(self.sample_rate),
                              _check_steps(self.steps))


def _merged(mechanisms: Sequence[TrialMechanism]) -> list[TrialMechanism]:
    """Trials with equal (σ, q) composed into one mechanism: T₁ + T₂ steps of one step mechanism."""
    steps: dict[tuple[float, float], int] = {}
    for mechanism in mechanisms:
        checked = mechanism.checked()
        key = (checked.noise_multiplier, checked.sample_rate)
        steps[key] = steps.get(key, 0) + checked.steps
    return [TrialMechanism(sigma, rate, total) for (sigma, rate), total in sorted(steps.items())]


def composed_epsilon(mechanisms: Sequence[TrialMechanism], delta: float) -> float:
    """ε of running every mechanism in ``mechanisms`` on the same data (adaptive composition), at δ.

    An upper bound by dp_accounting's privacy-loss-distribution accountant (Doroshenko, Ghazi, Kamath,
    Kumar, Manurangsi 2022): each distinct (σ, q) (trials with equal (σ, q) merged: T₁ + T₂ steps) is
    discretised by pessimistic connect-the-dots on a loss grid of ``SEARCH_PLD_INTERVAL``, for both
    directions of add/remove adjacency, self-composed by FFT (``_self_composed_pld``), the results
    are convolved, and ε is read at δ as the larger of the two directions. Pessimistic throughout:
    the discretisation overestimates δ(ε) for every ε, the mass beyond the truncated loss range
    counts as an infinite loss, and so does the tail mass each self-composition and convolution
    truncates (≤ 1e-15 each). This is the whole-search cost when every trial's coins are fresh and independent: it
    holds for releasing *every* trial's model, and is far below basic composition Σεᵢ. Its cost
    grows with ε, not with the steps (a whole default search: seconds, where the PRV accountant's
    mesh, which shrinks with the total steps, took a minute). Raises ``PrivacyParameterError`` for
    an empty list or bad parameters. Memoised and cached on disk like σ.
    """
    delta = _check_delta(delta)
    merged = _merged(mechanisms)
    _require(len(merged) > 0, "mechanisms", mechanisms, "a non-empty list of trials that took steps")
    inputs = {"mechanisms": json.dumps([[m.noise_multiplier, m.sample_rate, m.steps] for m in merged]),
              "delta": delta, "dp_accounting": version("dp-accounting"), "pld_interval": SEARCH_PLD_INTERVAL}
    return _cached("composed_epsilon", inputs, lambda: _composed_epsilon(merged, delta))


@lru_cache(maxsize=32)
def _self_composed_pld(noise_multiplier: float, sample_rate: float, steps: int) -> PrivacyLossDistribution:
    """PLD of T = ``steps`` Poisson-subsampled Gaussian steps at σ = ``noise_multiplier``, q =
    ``sample_rate``: dp_accounting's ``from_gaussian_mechanism`` (add/remove adjacency, pessimistic
    connect-the-dots, grid ``SEARCH_PLD_INTERVAL``) self-composed T times, as ``PLDAccountant`` does.

    Memoised in-process (32 entries, ~1 MB each at the default search's ε): a search's cells and the
    search as a whole compose the same mechanisms.
    """
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution.from_gaussian_mechanism(
        noise_multiplier, pessimistic_estimate=True, value_discretization_interval=SEARCH_PLD_INTERVAL,
        sampling_prob=sample_rate, use_connect_dots=True).self_compose(steps)


def _composed_epsilon(merged: list[TrialMechanism], delta: float) -> float:
    composed = reduce(lambda left, right: left.compose(right), [
        _self_composed_pld(m.noise_multiplier, m.sample_rate, m.steps) for m in merged])
    return float(composed.get_epsilon_for_delta(delta))


# --------------------------------------------------------------------------- private selection


def trial_count_gamma(mean_trials: float, shape: float) -> float:
    """γ of the truncated negative binomial with shape η = ``shape`` and mean k = ``mean_trials``.

    P(K = j) ∝ C(j + η − 1, j)·(1 − γ)^j for j ≥ 1, whose mean is η(1 − γ)/(γ(1 − γ^η)) (Papernot &
    Steinke 2022, Def. 1); η = 1 is the geometric distribution on {1, 2, ...} with γ = 1/k.
    """
    from scipy.optimize import brentq

    _require(mean_trials > 1, "mean_trials", mean_trials, "> 1 (the mean of the random trial count)")
    _require(0 < shape < math.inf, "shape", shape, "in (0, ∞) (1 = geometric)")
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


def _trial_rdp(orders: np.ndarray, candidates: Sequence[TrialMechanism],
               score_noise_multiplier: float | None) -> np.ndarray:
    """RDP curve of one trial that runs one of ``candidates`` (picked independently of the data),
    then, with ``score_noise_multiplier`` (σ_s), releases its validation score with Gaussian noise
    of std σ_s on a sensitivity-1 count.

    A mixture over candidates is RDP with the pointwise maximum of their curves (Rényi divergence is
    quasi-convex); the score adds λ/(2σ_s²) (the Gaussian mechanism's RDP).
    """
    from dp_accounting.dp_event import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent

    curves = [rdp_of_event(orders, SelfComposedDpEvent(
        PoissonSampledDpEvent(m.sample_rate, GaussianDpEvent(m.noise_multiplier)), m.steps)) for m in candidates]
    rdp = np.max(curves, axis=0)
    if score_noise_multiplier is not None:
        rdp = rdp + orders / (2 * score_noise_multiplier**2)
    return rdp


def selection_epsilon(candidates: Sequence[TrialMechanism], mean_trials: float, delta: float, *,
                      shape: float = 1.0, score_noise_multiplier: float | None = None) -> float:
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

    delta = _check_delta(delta)
    _require(len(candidates) > 0, "candidates", candidates, "a non-empty list of trial mechanisms")
    checked = [m.checked() for m in candidates]
    if score_noise_multiplier is not None:
        _require(score_noise_multiplier > 0, "score_noise_multiplier", score_noise_multiplier, "> 0")
    trial_count_gamma(mean_trials, shape)  # checks the mean and the shape
    orders = np.array(DEFAULT_RDP_ORDERS, dtype=float)
    # dp_accounting logs a warning for each fractional RDP order whose series does not converge; it
    # then sets that order's RDP to ∞, which only drops the order from the minimum (still a bound).
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        rdp = _trial_rdp(orders, checked, score_noise_multiplier)
        selected = rdp_repeat_and_select(orders, rdp, float(mean_trials), float(shape))
        epsilon, _ = compute_epsilon(orders, selected, delta)
    finally:
        absl_logger.setLevel(level)
    return float(epsilon)


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


def plan_private_selection(epsilon_total: float, delta: float, mean_trials: float,
                           sample_rates: Sequence[float], steps: Sequence[int], *, shape: float = 1.0,
                           score_noise_multiplier: float | None = None) -> PrivateSelectionPlan:
    """The largest per-trial ε (within ``SELECTION_EPSILON_RTOL``) whose trials, run a random number
    of times with mean ``mean_trials`` and released best-only, meet (``epsilon_total``, δ).

    A candidate is a batch size: (q, T) pairs from ``sample_rates`` and ``steps``; a trial picks one at
    random, so the bound uses the worst RDP curve over them (``selection_epsilon``). The search is a
    bisection on log ε_trial in [MIN_EPSILON, ε_total]; σ of each candidate comes from
    ``calibrate_noise_multiplier`` (so a trial that recalibrates from ε_trial gets the same σ).
    Guarantee: the returned plan's ``epsilon_selection`` ≤ ``epsilon_total``. Raises
    ``PrivacyParameterError`` when even ε_trial = MIN_EPSILON exceeds the total (lower the mean
    number of trials, raise the score noise or the total).
    """
    epsilon_total = _check_epsilon(epsilon_total, "epsilon_total")
    _require(len(sample_rates) == len(steps) and len(steps) > 0, "sample_rates and steps", (sample_rates, steps),
             "non-empty and of equal length")

    def plan(epsilon_per_trial: float) -> PrivateSelectionPlan:
        sigmas = tuple(calibrate_noise_multiplier(epsilon_per_trial, delta, q, t)
                       for q, t in zip(sample_rates, steps, strict=True))
        candidates = [TrialMechanism(s, q, t) for s, q, t in zip(sigmas, sample_rates, steps, strict=True)]
        bound = selection_epsilon(candidates, mean_trials, delta, shape=shape,
                                  score_noise_multiplier=score_noise_multiplier)
        return PrivateSelectionPlan(epsilon_total, delta, epsilon_per_trial, sigmas, bound)

    low = plan(MIN_EPSILON)
    if low.epsilon_selection > epsilon_total:
        raise PrivacyParameterError(
            f"epsilon_total={epsilon_total:g} is unreachable with a mean of {mean_trials:g} trials: even "
            f"{MIN_EPSILON:g} per trial costs {low.epsilon_selection:.3g} by the private-selection bound; "
            "raise the total, lower sampler.trials_per_cell or raise the score noise")
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
