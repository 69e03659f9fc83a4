"""Tuning on a private subsample, then one release trained on the full data: one (ε, δ) for both.

The accounting of Koskela & Kulkarni, "Practical differentially private hyperparameter tuning with
subsampling" (NeurIPS 2023), their variant 1. The bound holds for this procedure, and only under these
assumptions, each checked against the search mode that runs it (``privacy.private_selection.
tuning_subsample``: ``dptune.search.planning.subsample`` and ``dptune.search.modes.SubsampleTuning``) and used
by ``bench/bench_subsampled_tuning.py``:

1. **Subsample.** Every row of the private pool (training and validation rows alike) is kept
   independently with probability q₁ (``tuning_fraction``), from secret coins: X₁.
2. **Tune on X₁.** Papernot–Steinke private selection (``selection``): a secret random number K of
   random-search runs, each DP-SGD on X₁'s training rows plus a Gaussian-noised count of X₁'s
   correct validation predictions; the best run's configuration is the tuning's output. Each run's
   Poisson rate must be fixed from public numbers (for example q = B₁ / (q₁·N), N the public training
   size), never from |X₁|, so that its RDP curve as a function of X₁ is the accountant's.
3. **Amplify.** The tuning T, a mechanism of X₁ with RDP ε_T(α), applied to a Poisson subsample of
   rate q₁ is RDP with :func:`poisson_subsampled_rdp` (Zhu & Wang, ICML 2019, Thm 6).
4. **Release.** The selected configuration, transferred to the full data by a public rule, trains
   once on every training row: DP-SGD whose RDP is at most the worst over the candidates it could
   be (the choice is the tuning's output: adaptive composition, Mironov 2017, Prop. 1).

Total: ε(α) ≤ ε_{T∘S}(α) + max_i ε_release,i(α) at integer α ∈ [2, ``MAX_ORDER``], converted to
(ε, δ) by dp_accounting's conversion. ``plan_subsampled_tuning`` finds the per-run ε (every run,
tuning and release, calibrated to the same (ε_run, δ) by the PRV accountant) whose total meets a
budget. Only variant 1 is analysed here: training the release on the rows left out of X₁ (their
variant 2) is not covered.

Torch-free and Ray-free, like the rest of ``dptune.privacy``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dptune._thirdparty import rdp_of_event
from dptune.privacy.calibration import calibrate_noise_multiplier
from dptune.privacy.checks import MIN_EPSILON, PrivacyParameterError, checked_delta, checked_epsilon, require
from dptune.privacy.composition import TrialMechanism
from dptune.privacy.selection import SELECTION_EPSILON_RTOL, selection_rdp

#: The largest RDP order of the analysis; orders are the integers 2..MAX_ORDER (Zhu & Wang's bound
#: needs the base curve at every integer up to the order). At δ = 1e-5 the best order of a total
#: ε ≥ 0.5 lies well below it.
MAX_ORDER = 128
ORDERS = np.arange(2, MAX_ORDER + 1, dtype=float)


def poisson_subsampled_rdp(orders: np.ndarray, rdp: np.ndarray, sample_rate: float) -> np.ndarray:
    """RDP at integer ``orders`` α of a mechanism with RDP ``rdp`` (its curve at the same orders) run
    on a Poisson subsample of rate γ = ``sample_rate`` (add/remove adjacency).

    Zhu & Wang (ICML 2019), Thm 6, the general upper bound:
    ε'(α) ≤ 1/(α−1) · log[(1−γ)^{α−1}(αγ − γ + 1) + C(α,2)γ²(1−γ)^{α−2}e^{ε(2)}
                           + 3·Σ_{l=3}^{α} C(α,l)γ^l(1−γ)^{α−l}e^{(l−1)ε(l)}],
    and ε'(α) ≤ ε(α) (subsampling never hurts: Rényi divergence is jointly quasi-convex). ``orders``
    must be the consecutive integers 2, 3, ..., α_max; γ = 1 returns ``rdp``. ∞ entries propagate.
    """
    from scipy.special import gammaln, logsumexp

    orders = np.asarray(orders, dtype=float)
    rdp = np.asarray(rdp, dtype=float)
    require(
        len(orders) > 0 and np.array_equal(orders, np.arange(2, 2 + len(orders))),
        "orders",
        orders,
        "the consecutive integers 2, 3, ..., α_max",
    )
    require(rdp.shape == orders.shape and bool(np.all(rdp >= 0)), "rdp", rdp, "≥ 0 at every order")
    require(0 < sample_rate <= 1, "sample_rate", sample_rate, "in (0, 1]")
    if sample_rate == 1:
        return rdp.copy()
    log_rate, log_rest = math.log(sample_rate), math.log1p(-sample_rate)
    bounds = np.empty_like(rdp)
    for index, alpha in enumerate(orders.astype(int)):
        ells = np.arange(2, alpha + 1)
        log_binomial = gammaln(alpha + 1) - gammaln(ells + 1) - gammaln(alpha - ells + 1)
        terms = log_binomial + ells * log_rate + (alpha - ells) * log_rest + (ells - 1) * rdp[ells - 2]
        terms[1:] += math.log(3)  # l ≥ 3
        first = (alpha - 1) * log_rest + math.log1p((alpha - 1) * sample_rate)
        log_moment = logsumexp(np.concatenate(([first], terms)))
        bounds[index] = min(log_moment / (alpha - 1), rdp[index])
    return bounds


def dp_sgd_rdp(orders: np.ndarray, mechanism: TrialMechanism) -> np.ndarray:
    """RDP at ``orders`` of one DP-SGD run: ``steps`` Poisson-subsampled Gaussian steps (dp_accounting)."""
    from dp_accounting.dp_event import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent

    checked = mechanism.checked()
    event = SelfComposedDpEvent(
        PoissonSampledDpEvent(checked.sample_rate, GaussianDpEvent(checked.noise_multiplier)), checked.steps
    )
    return np.asarray(rdp_of_event(orders, event), dtype=float)


@dataclass(frozen=True)
class SubsampledTuningCost:
    """(ε, δ) of tuning on a q₁-subsample and releasing one model trained on the full data.

    ``epsilon`` covers both (the total); ``epsilon_tuning`` is the amplified tuning alone and
    ``epsilon_release`` the release's training alone (the worst candidate), each at ``delta``.
    """

    delta: float
    epsilon: float
    epsilon_tuning: float
    epsilon_release: float


def subsampled_tuning_cost(
    tuning_candidates: Sequence[TrialMechanism],
    release_candidates: Sequence[TrialMechanism],
    tuning_fraction: float,
    mean_trials: float,
    delta: float,
    *,
    shape: float = 1.0,
    score_noise_multiplier: float | None = None,
) -> SubsampledTuningCost:
    """The (ε, δ) of the whole procedure of this module's docstring.

    ``tuning_candidates``: the mechanisms a tuning run may be (one per batch size; a run picks one
    independently of the data); ``release_candidates``: what the release's training may be, one per
    configuration the tuning can select (after the transfer rule). ``tuning_fraction`` is q₁;
    ``mean_trials``, ``shape`` and ``score_noise_multiplier`` those of Papernot–Steinke selection.
    """
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    delta = checked_delta(delta)
    require(0 < tuning_fraction <= 1, "tuning_fraction", tuning_fraction, "in (0, 1]")
    require(len(release_candidates) > 0, "release_candidates", release_candidates, "non-empty")
    tuning = poisson_subsampled_rdp(
        ORDERS,
        selection_rdp(
            ORDERS, tuning_candidates, mean_trials, shape=shape, score_noise_multiplier=score_noise_multiplier
        ),
        tuning_fraction,
    )
    release = np.max([dp_sgd_rdp(ORDERS, m) for m in release_candidates], axis=0)

    def epsilon(rdp: np.ndarray) -> float:
        return float(compute_epsilon(ORDERS, rdp, delta)[0])

    return SubsampledTuningCost(delta, epsilon(tuning + release), epsilon(tuning), epsilon(release))


@dataclass(frozen=True)
class SubsampledTuningPlan:
    """The per-run ε (and σ of every run) that makes tuning on a subsample meet a total budget.

    Every tuning run and the release are calibrated (PRV) to the same ``epsilon_per_run`` at
    ``delta``: ``tuning_noise_multipliers[i]`` for tuning candidate i, ``release_noise_multipliers[j]``
    for release candidate j. ``cost.epsilon`` ≤ ``epsilon_total`` is the whole's bound.
    """

    epsilon_total: float
    delta: float
    tuning_fraction: float
    epsilon_per_run: float
    tuning_noise_multipliers: tuple[float, ...]
    release_noise_multipliers: tuple[float, ...]
    cost: SubsampledTuningCost


def plan_subsampled_tuning(
    epsilon_total: float,
    delta: float,
    tuning_fraction: float,
    mean_trials: float,
    tuning_runs: Sequence[tuple[float, int]],
    release_runs: Sequence[tuple[float, int]],
    *,
    shape: float = 1.0,
    score_noise_multiplier: float | None = None,
) -> SubsampledTuningPlan:
    """The largest per-run ε (within ``SELECTION_EPSILON_RTOL``) whose whole meets (``epsilon_total``, δ).

    ``tuning_runs`` and ``release_runs`` are the (sample rate, steps) of each candidate; σ of each
    comes from ``calibrate_noise_multiplier`` at the per-run ε; the planner wraps each in its runs'
    mechanisms (``dptune.search.planning.subsample.plan_tuning``), which the runs step with and the ledger
    charges: no run recalibrates. Bisection on log ε_run in [MIN_EPSILON, ε_total]. Guarantee: the returned plan's
    ``cost.epsilon`` ≤ ``epsilon_total``. Raises ``PrivacyParameterError`` when even MIN_EPSILON per
    run exceeds the total.
    """
    epsilon_total = checked_epsilon(epsilon_total, "epsilon_total")
    require(len(tuning_runs) > 0 and len(release_runs) > 0, "runs", (tuning_runs, release_runs), "non-empty")

    def plan(epsilon_per_run: float) -> SubsampledTuningPlan:
        def sigmas(runs: Sequence[tuple[float, int]]) -> tuple[float, ...]:
            return tuple(calibrate_noise_multiplier(epsilon_per_run, delta, q, t) for q, t in runs)

        tuning_sigmas, release_sigmas = sigmas(tuning_runs), sigmas(release_runs)
        cost = subsampled_tuning_cost(
            [TrialMechanism(s, q, t) for s, (q, t) in zip(tuning_sigmas, tuning_runs, strict=True)],
            [TrialMechanism(s, q, t) for s, (q, t) in zip(release_sigmas, release_runs, strict=True)],
            tuning_fraction,
            mean_trials,
            delta,
            shape=shape,
            score_noise_multiplier=score_noise_multiplier,
        )
        return SubsampledTuningPlan(
            epsilon_total, delta, tuning_fraction, epsilon_per_run, tuning_sigmas, release_sigmas, cost
        )

    low = plan(MIN_EPSILON)
    if low.cost.epsilon > epsilon_total:
        raise PrivacyParameterError(
            f"epsilon_total={epsilon_total:g} is unreachable: even {MIN_EPSILON:g} per run costs "
            f"{low.cost.epsilon:.3g} (tuning {low.cost.epsilon_tuning:.3g}, release {low.cost.epsilon_release:.3g}); "
            "raise the total, lower the tuning fraction or the mean number of trials, or raise the score noise"
        )
    high = plan(epsilon_total)
    if high.cost.epsilon <= epsilon_total:
        return high
    while high.epsilon_per_run / low.epsilon_per_run > 1 + SELECTION_EPSILON_RTOL:
        middle = plan(math.sqrt(low.epsilon_per_run * high.epsilon_per_run))
        if middle.cost.epsilon <= epsilon_total:
            low = middle
        else:
            high = middle
    return low
