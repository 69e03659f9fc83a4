"""The privacy cost of running many trials on the same data: their adaptive composition.

``composed_epsilon`` composes every trial's mechanism (heterogeneous (σ, q, T)) with dp_accounting's
privacy-loss-distribution accountant with pessimistic discretisation, an upper bound: its cost grows
with ε rather than with the total steps, which the PRV mesh shrinks with. ``TrialMechanism`` is
one trial as every accountant of this package sees it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache, reduce
from importlib.metadata import version
from typing import TYPE_CHECKING

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
        return TrialMechanism(
            checked_noise_multiplier(self.noise_multiplier),
            checked_sample_rate(self.sample_rate),
            checked_steps(self.steps),
        )


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
    delta = checked_delta(delta)
    merged = _merged(mechanisms)
    require(len(merged) > 0, "mechanisms", mechanisms, "a non-empty list of trials that took steps")
    mechanisms_json = json.dumps([[m.noise_multiplier, m.sample_rate, m.steps] for m in merged])
    inputs: dict[str, float | int | str] = {
        "mechanisms": mechanisms_json,
        "delta": delta,
        "dp_accounting": version("dp-accounting"),
        "pld_interval": SEARCH_PLD_INTERVAL,
    }
    return cached("composed_epsilon", inputs, lambda: _composed_epsilon(merged, delta))


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


def _composed_epsilon(merged: list[TrialMechanism], delta: float) -> float:
    composed = reduce(
        lambda left, right: left.compose(right),
        [_self_composed_pld(m.noise_multiplier, m.sample_rate, m.steps) for m in merged],
    )
    return float(composed.get_epsilon_for_delta(delta))
