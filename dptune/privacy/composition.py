"""The privacy cost of running many trials on the same data: their adaptive composition.

``compose`` composes every trial's mechanism (heterogeneous (σ, q, T)) with dp_accounting's
privacy-loss-distribution accountant with pessimistic discretisation, an upper bound: its cost grows
with ε rather than with the total steps, which the PRV mesh shrinks with. It stays finite and fast at
any number of runs: trials are grouped by their step mechanism (σ, q) and each group is
self-composed once (``grouped``), and ε is read from the composed distribution in log space
(``_epsilon_for_delta``). ``TrialMechanism`` is one trial as every accountant of this package sees it.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache, reduce
from importlib.metadata import version
from typing import TYPE_CHECKING, Literal

import numpy as np

from dptune import _thirdparty
from dptune.privacy.cache import cached
from dptune.privacy.checks import (
    checked_delta,
    checked_noise_multiplier,
    checked_sample_rate,
    checked_steps,
    require,
)

# dp_accounting is imported where ε is computed: a trial that reads cached values never pays for it.
if TYPE_CHECKING:
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

#: Width of the privacy-loss grid of the search's composition (dp_accounting's
#: ``value_discretization_interval``). The PLD is discretised pessimistically, so the ε is an upper
#: bound at any width; a finer grid only tightens it. Measured on compositions of 8,000 to 100,000
#: runs (bench/RESULTS.md), this width is both the tightest and the fastest of 1e-3 … 1e-1 (a coarser
#: one overstated ε by 1–30 % and took longer); the composed grid had 2.9 million points at ε ≈ 11,700.
SEARCH_PLD_INTERVAL = 1e-3
#: At most this many distinct step mechanisms (σ, q) are composed; more (a search whose batch sizes or
#: budgets vary continuously) are first rounded pessimistically onto a grid (``grouped``).
MAX_DISTINCT_MECHANISMS = 64
#: The finest grid of that rounding, in points per octave of σ and of q (1/64 octave: ≤ 1.1 %).
MECHANISM_GRID_PER_OCTAVE = 64
#: Below this δ the composition's ε is RDP's: the FFT that composes the PLD rounds each grid point's
#: mass by ~1e-16 (some come out negative), which adds up to ~1e-11 over a composed grid and is no
#: longer small against δ.
PLD_MIN_DELTA = 1e-9
#: The accountants a composition's ε can come from.
Accountant = Literal["PLD", "RDP"]


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
        return TrialMechanism(
            checked_noise_multiplier(self.noise_multiplier),
            checked_sample_rate(self.sample_rate),
            checked_steps(self.steps),
        )


@dataclass(frozen=True)
class Composition:
    """ε of a set of trials at a δ, and the ``accountant`` that gave it: the PLD, or RDP where the
    PLD cannot represent the composition (its truncated mass alone exceeds δ)."""

    epsilon: float
    accountant: Accountant


def _merged(mechanisms: Sequence[TrialMechanism]) -> list[TrialMechanism]:
    """Trials with equal (σ, q) composed into one mechanism: T₁ + T₂ steps of one step mechanism."""
    steps: dict[tuple[float, float], int] = {}
    for mechanism in mechanisms:
        key = (mechanism.noise_multiplier, mechanism.sample_rate)
        steps[key] = steps.get(key, 0) + mechanism.steps
    return [TrialMechanism(sigma, rate, total) for (sigma, rate), total in sorted(steps.items())]


def _rounded_pessimistically(mechanism: TrialMechanism, per_octave: float, sample_rate_too: bool) -> TrialMechanism:
    """``mechanism`` with σ rounded down to a grid of ``per_octave`` points per octave, and q rounded up to
    it (q ≤ 1) if ``sample_rate_too``.

    Both only weaken the guarantee, so the composition of the rounded mechanisms is an upper bound: a
    smaller σ adds less noise, and the q-subsampled step's output distribution is the mixture
    (1 − q/q′)·N(0, σ²) + (q/q′)·P_{q′} of the q′-step's, so by joint convexity each of its hockey-stick
    divergences (at every ε, both directions) is at most the q′-step's; an order of every step's
    trade-off functions survives composition (Dong, Roth and Su, JRSS-B 2022)."""
    sigma = 2.0 ** (math.floor(math.log2(mechanism.noise_multiplier) * per_octave) / per_octave)
    rate = mechanism.sample_rate
    if sample_rate_too:
        rate = max(rate, min(1.0, 2.0 ** (math.ceil(math.log2(rate) * per_octave) / per_octave)))
    return TrialMechanism(min(sigma, mechanism.noise_multiplier), rate, mechanism.steps)


def grouped(mechanisms: Sequence[TrialMechanism]) -> list[TrialMechanism]:
    """The trials as at most ``MAX_DISTINCT_MECHANISMS`` step mechanisms, each with its total steps.

    Trials with equal (σ, q) are merged (T₁ + T₂ steps of one mechanism: exact). When more distinct
    (σ, q) remain, they are rounded pessimistically (``_rounded_pessimistically``: still an upper
    bound) onto the finest grid that leaves at most ``MAX_DISTINCT_MECHANISMS``: σ alone first (a
    search's q are its few batch sizes over N; its σ differ by cell), from ``MECHANISM_GRID_PER_OCTAVE``
    points per octave down by halves to one, then σ and q together. So composing 10⁵ trials costs as
    much as composing a few dozen. Sorted by (σ, q); checked.
    """
    merged = _merged([mechanism.checked() for mechanism in mechanisms])
    finest = MECHANISM_GRID_PER_OCTAVE
    sigma_only = ((finest / 2**k, False) for k in range(int(math.log2(finest)) + 1))
    both = ((finest / 2**k, True) for k in itertools.count())
    groups = merged
    for per_octave, sample_rate_too in itertools.chain(sigma_only, both):
        if len(groups) <= MAX_DISTINCT_MECHANISMS:
            break
        groups = _merged([_rounded_pessimistically(m, per_octave, sample_rate_too) for m in merged])
    return groups


def compose(mechanisms: Sequence[TrialMechanism], delta: float) -> Composition:
    """ε of running every mechanism in ``mechanisms`` on the same data (adaptive composition), at δ.

    An upper bound by dp_accounting's privacy-loss-distribution accountant (Doroshenko, Ghazi, Kamath,
    Kumar, Manurangsi 2022): each step mechanism of ``grouped`` is discretised by pessimistic
    connect-the-dots on a loss grid of ``SEARCH_PLD_INTERVAL``, for both directions of add/remove
    adjacency, self-composed by FFT (``_self_composed_pld``), the results are convolved, and ε is read
    at δ as the larger of the two directions (``_epsilon_for_delta``). Pessimistic throughout: the
    discretisation overestimates δ(ε) for every ε, the mass beyond the truncated loss range counts as
    an infinite loss, and so does the tail mass each self-composition and convolution truncates
    (≤ 1e-15 each). Where that infinite-loss mass alone exceeds δ (the PLD's ε is ∞), or δ is below
    ``PLD_MIN_DELTA``, the bound is dp_accounting's RDP accountant's instead (``_rdp_epsilon``),
    finite at any δ. This is the
    whole-search cost when every trial's coins are fresh and independent: it holds for releasing
    *every* trial's model, and is far below basic composition Σεᵢ. Raises ``PrivacyParameterError``
    for an empty list or bad parameters. Memoised and cached on disk like σ.
    """
    delta = checked_delta(delta)
    groups = grouped(mechanisms)
    require(len(groups) > 0, "mechanisms", mechanisms, "a non-empty list of trials that took steps")
    inputs: dict[str, float | int | str] = {
        "mechanisms": json.dumps([[m.noise_multiplier, m.sample_rate, m.steps] for m in groups]),
        "delta": delta,
        "dp_accounting": version("dp-accounting"),
        "pld_interval": SEARCH_PLD_INTERVAL,
    }
    epsilon = cached("composed_epsilon_pld", inputs, lambda: _pld_epsilon(groups, delta))
    if math.isfinite(epsilon):
        return Composition(epsilon, "PLD")
    return Composition(cached("composed_epsilon_rdp", inputs, lambda: _rdp_epsilon(groups, delta)), "RDP")


def composed_epsilon(mechanisms: Sequence[TrialMechanism], delta: float) -> float:
    """The ε of :func:`compose`."""
    return compose(mechanisms, delta).epsilon


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
        noise_multiplier,
        pessimistic_estimate=True,
        value_discretization_interval=SEARCH_PLD_INTERVAL,
        sampling_prob=sample_rate,
        use_connect_dots=True,
    ).self_compose(steps)


def _pld_epsilon(groups: list[TrialMechanism], delta: float) -> float:
    if delta < PLD_MIN_DELTA:
        return math.inf
    composed = reduce(
        lambda left, right: left.compose(right),
        [_self_composed_pld(m.noise_multiplier, m.sample_rate, m.steps) for m in groups],
    )
    return max(_epsilon_for_delta(*pmf, delta) for pmf in _thirdparty.pld_pmfs(composed))


def _epsilon_for_delta(
    interval: float, lowest_index: int, probabilities: np.ndarray, infinity_mass: float, delta: float
) -> float:
    """The smallest ε ≥ 0 whose hockey-stick divergence δ(ε) = m_∞ + Σ_{ℓ>ε} p_ℓ (1 − e^{ε−ℓ}) is at
    most ``delta``, for the losses ℓ = (``lowest_index`` + i)·``interval`` with masses
    ``probabilities`` and ``infinity_mass`` m_∞ at ℓ = ∞; ∞ if m_∞ > δ.

    dp_accounting's ``_get_epsilon_for_delta`` (the same walk from the largest loss down: stop at the
    first loss ℓ where log((U − δ)/L) ≥ ℓ, with U = m_∞ + Σ p and L = Σ p e^{−ℓ} over the larger losses,
    and answer log((U − δ)/L)), vectorised, with L kept as its logarithm (a running logsumexp): the
    library's float64 ratio (U − δ)/L overflows once ε passes ~700 (L underflows to a subnormal) and
    then answers ε = ∞ for a finite composition. The FFT's negative rounding residues (~−1e-16) count
    as zero mass. Equal to the library's where nothing overflows (to ~1e-10 relative, tested).
    """
    if infinity_mass > delta:
        return math.inf
    masses = np.flip(np.maximum(np.asarray(probabilities, dtype=float), 0.0))
    losses = (lowest_index + len(masses) - 1 - np.arange(len(masses))) * interval
    upper = infinity_mass + np.concatenate(([0.0], np.cumsum(masses)))
    with np.errstate(divide="ignore", invalid="ignore"):
        log_lower = np.concatenate(([-np.inf], np.logaddexp.accumulate(np.log(masses) - losses)))
        candidate = np.log(upper - delta) - log_lower
    stops = (upper[:-1] > delta) & np.isfinite(log_lower[:-1]) & (candidate[:-1] >= losses)
    stop = int(np.argmax(stops)) if stops.any() else len(masses)
    if upper[stop] <= delta or not np.isfinite(log_lower[stop]) or not candidate[stop] > 0:
        return 0.0
    return float(candidate[stop])


def _rdp_epsilon(groups: list[TrialMechanism], delta: float) -> float:
    """ε at δ of the groups' composition by dp_accounting's RDP accountant (Mironov 2017; Mironov,
    Talwar and Zhang 2019 for the subsampled Gaussian), on its default orders: an upper bound."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    for group in groups:
        step = dp_event.PoissonSampledDpEvent(group.sample_rate, dp_event.GaussianDpEvent(group.noise_multiplier))
        accountant.compose(step, group.steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(accountant.get_epsilon(delta))
