"""The accountant's accuracy settings, the ranges it accepts, and the checks every entry point runs.

Every public function of ``dptune.privacy`` checks its inputs here before any work and raises
``PrivacyParameterError`` (a ``DptuneError`` and a ``ValueError``) that names the value and the
range allowed. ``require`` and the ``checked_*`` functions are for the package's own modules.
"""

from __future__ import annotations

import math
import numbers
import warnings

from dptune.errors import DptuneError

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


class PrivacyParameterError(DptuneError, ValueError):
    """A privacy parameter is out of range, or the target cannot be met; raised before any work."""


def _real(name: str, value: object) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise PrivacyParameterError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise PrivacyParameterError(f"{name} must be finite, got {value!r}")
    return number


def require(ok: bool, name: str, value: object, allowed: str) -> None:
    """Raise ``PrivacyParameterError`` naming ``name``, its ``value`` and what is ``allowed`` unless ``ok``."""
    if not ok:
        raise PrivacyParameterError(f"{name} must be {allowed}, got {value!r}")


def checked_epsilon(epsilon: object, name: str = "epsilon") -> float:
    """The ε target, in [MIN_EPSILON, MAX_EPSILON]; else ``PrivacyParameterError``."""
    number = _real(name, epsilon)
    require(
        MIN_EPSILON <= number <= MAX_EPSILON,
        name,
        epsilon,
        f"in [{MIN_EPSILON:g}, {MAX_EPSILON:g}] (the accountant certifies ε to within {EPSILON_ERROR:g})",
    )
    return number


def checked_delta(delta: object, name: str = "delta") -> float:
    """The δ, in (0, 1); else ``PrivacyParameterError``."""
    number = _real(name, delta)
    require(0 < number < 1, name, delta, "in (0, 1) (typically 1e-5, below 1/N)")
    return number


def checked_sample_rate(sample_rate: object) -> float:
    """The q = B/N, in (0, 1]; else ``PrivacyParameterError``."""
    number = _real("sample_rate", sample_rate)
    require(0 < number <= 1, "sample_rate", sample_rate, "in (0, 1] (q = B/N; 1 is full batch)")
    return number


def checked_steps(steps: object) -> int:
    """The T, an integer ≥ 1; else ``PrivacyParameterError``."""
    ok = isinstance(steps, numbers.Integral) and not isinstance(steps, bool) and int(steps) >= 1
    require(ok, "steps", steps, "an integer ≥ 1 (number of DP-SGD steps T)")
    return int(steps)  # type: ignore[call-overload]


def checked_noise_multiplier(noise_multiplier: object) -> float:
    """The σ, in [MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER]; else ``PrivacyParameterError``."""
    number = _real("noise_multiplier", noise_multiplier)
    require(
        MIN_NOISE_MULTIPLIER <= number <= MAX_NOISE_MULTIPLIER,
        "noise_multiplier",
        noise_multiplier,
        f"in [{MIN_NOISE_MULTIPLIER:g}, {MAX_NOISE_MULTIPLIER:g}] (σ, noise std in units of the clip bound)",
    )
    return number


def check_delta(delta: float, num_examples: int) -> None:
    """Warn (``UserWarning``) when δ > 1/N: such a δ allows leaking one example outright.

    δ must be in (0, 1) and ``num_examples`` (N) ≥ 1, else ``PrivacyParameterError``. The usual
    rule is δ ≪ 1/N; the paper uses δ = 1e-5.
    """
    delta = checked_delta(delta)
    require(
        isinstance(num_examples, numbers.Integral) and num_examples >= 1, "num_examples", num_examples, "an integer ≥ 1"
    )
    if delta > 1.0 / num_examples:
        warnings.warn(
            f"delta={delta:g} is larger than 1/num_examples = 1/{num_examples} = {1.0 / num_examples:.3g}: "
            "(ε, δ)-DP then permits revealing some example entirely; use δ ≪ 1/N (the paper uses 1e-5)",
            UserWarning,
            stacklevel=2,
        )


def bound_text(value: float, digits: int = 3) -> str:
    """An upper bound (ε, δ) as text of ``digits`` significant digits, rounded up: a shown bound is never
    below the bound computed (``f"{15.34:.3g}"`` would show 15.3). A value that equals its nearest
    ``digits``-digit decimal up to float error (relative 1e-9: δ = 1e-5 given as a float) shows as that."""
    from decimal import ROUND_CEILING, Decimal

    nearest = f"{value:.{digits}g}"
    if not math.isfinite(value) or value <= 0 or float(nearest) >= value * (1 - 1e-9):
        return nearest
    exact = Decimal(value)
    return (
        f"{float(exact.quantize(Decimal(1).scaleb(exact.adjusted() - digits + 1), rounding=ROUND_CEILING)):.{digits}g}"
    )


def group_privacy(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """(ε_k, δ_k) that an (ε, δ)-DP mechanism gives a group of ``group_size`` = k units (the rows of one
    person), by the group-privacy lemma (chaining k neighbours; Dwork & Roth 2014, Thm 2.2, with δ as in
    Vadhan 2017, Lemma 2.2): ε_k = k·ε and δ_k = δ·Σ_{j<k} e^{jε} = δ·(e^{kε} − 1)/(e^ε − 1)
    ≤ k·e^{(k−1)ε}·δ. δ_k ≥ 1 (returned as is, ∞ past float range) leaves no guarantee."""
    if group_size < 1:
        raise ValueError(f"group_size must be ≥ 1, got {group_size}")
    if group_size * epsilon > 700:
        return group_size * epsilon, math.inf
    return group_size * epsilon, delta * math.expm1(group_size * epsilon) / math.expm1(epsilon)
