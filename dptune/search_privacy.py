"""The privacy cost of a search, from its records, and what its (ε, δ) covers, in words.

Every trial records the ε it spent for the steps it actually took (``steps_taken``: a trial stopped
early or failed counts what it ran; a pruned one, nothing). Trials of every cell and clipping
variant train on the same private data, so what the search as a whole costs is their composition:
``composition_cost`` composes every trial that took a step with the privacy-loss-distribution (PLD)
accountant (``privacy.composed_epsilon``, an upper bound) over its own (σ, q, steps taken), at the
space's δ, beside basic composition (Σ εᵢ, k·δ) as a cross-check. That figure holds for releasing
every trial's model, and only because every trial draws fresh, independent, secret coins
(``TrialConfig.seed = None``).

An end-to-end private search (``privacy.private_selection``) releases one trial, chosen by a DP
score: ``select_release`` picks it, and its (ε_total, δ) is the Papernot–Steinke bound that the
planner met (``privacy.plan_private_selection``).

Torch-free and Ray-free: the search driver, the report and a notebook use it alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from dptune.privacy import TrialMechanism, composed_epsilon
from dptune.space import SearchSpace


@dataclass(frozen=True)
class CompositionCost:
    """(ε, δ) of releasing every trial of a set that took a step.

    ``epsilon`` is the PLD composition at ``delta`` (an upper bound); ``epsilon_basic`` and
    ``delta_basic`` are basic composition (Σ εᵢ spent, k·δ), looser, kept as a cross-check.
    """

    trials_with_steps: int
    delta: float
    epsilon: float
    epsilon_basic: float
    delta_basic: float


def trial_mechanisms(trials: pd.DataFrame) -> list[TrialMechanism]:
    """The trials as the accountant sees them: (σ, q, steps taken); pass only trials that took a step."""
    return [TrialMechanism(float(sigma), float(rate), int(steps))
            for sigma, rate, steps in zip(trials["noise_multiplier"], trials["sample_rate"], trials["steps_taken"],
                                          strict=True)]


def composition_cost(trials: pd.DataFrame, delta: float) -> CompositionCost:
    """What releasing every trial in ``trials`` (rows of the ``trials`` table) costs, at ``delta``.

    No trial with a step: zero. One trial: its own ε spent (the PRV accountant's) when that is the
    tighter of the two upper bounds.
    """
    took = trials[trials["steps_taken"].fillna(0) > 0]
    mechanisms = trial_mechanisms(took)
    spent = float(took["epsilon_spent"].sum())
    if not mechanisms:
        return CompositionCost(0, delta, 0.0, 0.0, 0.0)
    epsilon = composed_epsilon(mechanisms, delta)
    if len(mechanisms) == 1:
        epsilon = min(epsilon, spent)
    return CompositionCost(len(mechanisms), delta, epsilon, spent, len(mechanisms) * delta)


#: What no mode of dptune covers unless it is made DP itself.
_OUTSIDE = ("validation accuracies and losses and the choice of the best trial (computed exactly on "
            "validation rows carved from the private training set), training losses, diagnostics (exact "
            "gradient norms and labels of training examples), per-epoch metrics, and wall times and "
            "throughput (which reveal realised batch sizes)")


def guarantee(space: SearchSpace, cost: CompositionCost | None = None,
              epsilon_selection: float | None = None) -> str:
    """What the search's (ε, δ) covers and what it does not, in words; never more than the code does.

    ``cost`` is the whole search's composition (per-trial budgets); ``epsilon_selection`` the
    private-selection bound (end-to-end private searches).
    """
    delta = space.privacy.delta
    if space.reproducible:
        return ("NO DP GUARANTEE for released results: reproducible: true derives every trial's noise and "
                "Poisson batches from the public seed and the trial's id, so anyone holding them can regenerate "
                "the noise. The ε figures describe the mechanism as if its coins were secret (research use only).")
    selection = space.privacy.private_selection
    if selection is not None:
        bound = "" if epsilon_selection is None else f" (bound {epsilon_selection:.3g})"
        return (f"Only the release table is covered: the selected configuration, its model and its noisy "
                f"validation score are ({selection.epsilon:g}, {delta:g})-DP{bound} by Papernot & Steinke "
                f"(ICLR 2022, Thm 2) — a secret random number of random-search trials (truncated negative binomial, "
                f"η = {selection.trial_count_shape:g}, mean {space.sampler.trials_per_cell}), each trial DP-SGD "
                f"(PRV-calibrated σ, Poisson sampling, fresh secret coins) plus a Gaussian-noised validation count "
                f"(σ_s = {selection.score_noise_multiplier:g}), only the best released. Test accuracy is computed on "
                f"the test split, treated as public. The per-trial records (trials, epochs, classes tables) are NOT "
                f"released and NOT covered: they hold {_OUTSIDE}.")
    whole = ("" if cost is None or not cost.trials_with_steps else
             f" Releasing every trial's model costs ε = {cost.epsilon:.3g} at δ = {cost.delta:g} for the whole "
             f"search (PLD composition of the {cost.trials_with_steps} trials that took "
             f"steps; basic composition gives ({cost.epsilon_basic:.3g}, {cost.delta_basic:.2g})).")
    return (f"Each trial's trained model is (ε, δ = {delta:g})-DP at its cell's ε (PRV accountant, Poisson "
            f"sampling, fresh secret coins per trial).{whole} NOT covered by (ε, δ): {_OUTSIDE}. Releasing the "
            "best trial's model with its validation score is therefore not (ε, δ)-DP; use "
            "privacy.private_selection for an end-to-end guarantee.")


def select_release(trials: pd.DataFrame) -> pd.Series | None:
    """The trial a private search releases: the highest noisy validation score among trials that
    finished (a diverged trial is decided from its parameters, a DP output). None if none did."""
    scored = trials[(trials["status"] == "ok") & trials["noisy_val_accuracy"].map(
        lambda v: v is not None and math.isfinite(v))]
    if scored.empty:
        return None
    return scored.loc[scored["noisy_val_accuracy"].idxmax()]
