"""Privacy accounting for DP-SGD / DP-Adam: ε spent, σ calibration, and the privacy cost of tuning.

The mechanism is the Poisson-subsampled Gaussian mechanism composed ``steps`` (T) times: each step
includes every example independently with probability ``sample_rate`` (q = B/N), clips each
per-example gradient to norm ≤ C and adds N(0, σ²C²I) to the sum. ``noise_multiplier`` is σ (noise
std in units of the clip bound C). Privacy is (ε, δ)-DP under add/remove-one adjacency. Every ε
reported is an upper bound, so that a reported ε is a guarantee.

The modules, each with its own invariants:

- ``checks``: the accuracy settings, the ranges accepted, ``PrivacyParameterError``;
- ``cache``: the in-process memo and the signed, atomic on-disk cache every result goes through;
- ``prv``: ``epsilon_spent``, the PRV accountant (Gopi, Lee, Wutschitz 2021) with its fast formulas;
- ``calibration``: ``calibrate_noise_multiplier``, σ certified for an (ε, δ) target;
- ``composition``: ``compose``/``composed_epsilon``, many trials on the same data (PLD accountant,
  finite and seconds-fast at 10⁵ runs; RDP where the PLD cannot represent it);
- ``selection``: private selection, the best of a secret random number of trials (Papernot & Steinke);
- ``subsampled_tuning``: tuning on a Poisson subsample, then a release trained on the full data
  (Koskela & Kulkarni 2023, variant 1): Zhu & Wang's subsampled-RDP bound and the plan of one total ε
  (import it as ``dptune.privacy.subsampled_tuning``);
- ``search``: a search's cost from its records (the composition of its runs, the steps each is
  charged, the run a private search releases), numbers only: what its (ε, δ) covers, in words, is the
  search's own (``dptune.search.finish.statement``). It reads pandas tables; import it as
  ``dptune.privacy.search``, it is not re-exported here.

Nothing here imports above ``dptune.privacy`` but ``dptune.paths`` (the cache folder), ``dptune.errors``
and ``dptune._thirdparty``: not the space, the search, the records or the runners.

Torch-free and Ray-free. prv_accountant, dp_accounting and scipy are imported where σ or ε is
computed, so that a process that only reads cached values (the planner's second run, a trial)
never pays for them.
"""

from __future__ import annotations

from dptune.privacy import cache, composition, prv
from dptune.privacy.calibration import calibrate_noise_multiplier
from dptune.privacy.checks import (
    COARSE_EPSILON_ERROR,
    DELTA_ERROR_FRACTION,
    EPSILON_ERROR,
    MAX_EPSILON,
    MAX_NOISE_MULTIPLIER,
    MIN_EPSILON,
    MIN_NOISE_MULTIPLIER,
    NOISE_MULTIPLIER_RTOL,
    PrivacyParameterError,
    check_delta,
)
from dptune.privacy.composition import SEARCH_PLD_INTERVAL, Composition, TrialMechanism, compose, composed_epsilon
from dptune.privacy.prv import epsilon_spent
from dptune.privacy.selection import (
    SELECTION_EPSILON_RTOL,
    PrivateSelectionPlan,
    draw_trial_count,
    plan_private_selection,
    selection_epsilon,
    trial_count_gamma,
)

__all__ = [
    "COARSE_EPSILON_ERROR",
    "DELTA_ERROR_FRACTION",
    "EPSILON_ERROR",
    "MAX_EPSILON",
    "MAX_NOISE_MULTIPLIER",
    "MIN_EPSILON",
    "MIN_NOISE_MULTIPLIER",
    "NOISE_MULTIPLIER_RTOL",
    "SEARCH_PLD_INTERVAL",
    "SELECTION_EPSILON_RTOL",
    "PrivacyParameterError",
    "Composition",
    "PrivateSelectionPlan",
    "TrialMechanism",
    "calibrate_noise_multiplier",
    "check_delta",
    "clear_memory_cache",
    "compose",
    "composed_epsilon",
    "draw_trial_count",
    "epsilon_spent",
    "plan_private_selection",
    "selection_epsilon",
    "trial_count_gamma",
]


def clear_memory_cache() -> None:
    """Forget in-process results (the on-disk cache stays); for tests and long-lived processes."""
    cache.forget()
    prv.certified_epsilon.cache_clear()
    prv._safe_half_width.cache_clear()
    composition._self_composed_pld.cache_clear()
