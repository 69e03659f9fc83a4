"""The privacy cost of a search, from its records: numbers only (what it covers, in words, is the
search's: ``dptune.search.finish.statement``).

Every trial records the ε it spent for the steps it actually took (``steps_taken``: a trial stopped
early or failed counts what it ran; a pruned one, nothing). Trials of every cell and clipping
variant train on the same private data, so what the search as a whole costs is their composition:
``composition_cost`` composes every trial that took a step with the privacy-loss-distribution (PLD)
accountant (``privacy.compose``, an upper bound) over its own (σ, q, steps taken), at the
space's δ, beside basic composition (Σ εᵢ, k·δ) as a cross-check. That figure holds for releasing
every trial's model, and only because every trial draws fresh, independent, secret coins
(``TrialConfig.seed = None``).

An end-to-end private search (``privacy.private_selection``) releases one trial, chosen by a DP
score: ``select_release`` picks it, and its (ε_total, δ) is the Papernot–Steinke bound that the
planner met (``privacy.plan_private_selection``).

Reads pandas tables of the ``trials`` (or ledger) columns it names; imports nothing above
``dptune.privacy``. Torch-free and Ray-free: the search driver, the report and a notebook use it alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

from dptune.privacy.composition import Accountant, TrialMechanism, compose


@dataclass(frozen=True)
class CompositionCost:
    """(ε, δ) of releasing every trial of a set that took a step.

    ``epsilon`` is the composition at ``delta`` (an upper bound) by ``accountant``: the PLD
    (``privacy.compose``), RDP where the PLD cannot represent it, or "PRV" for a single trial whose
    own ε spent is the tighter; ``epsilon_basic`` and ``delta_basic`` are basic composition
    (Σ εᵢ spent, k·δ), looser, kept as a cross-check.
    """

    trials_with_steps: int
    delta: float
    epsilon: float
    epsilon_basic: float
    delta_basic: float
    accountant: Accountant | Literal["PRV"] = "PLD"


def charged_steps(trials: pd.DataFrame) -> pd.Series:
    """The steps each run is charged: those it took, or its planned ``steps`` when it diverged.

    A run that diverged stopped on its own exact (non-private) loss, so the length of its noisy
    run depends on private data in a way the accountant does not see; it is charged as if every
    planned step ran (as a run whose process was lost already is), which covers any stopping
    rule applied to the full run's DP outputs. The stop decision itself stays outside (ε, δ).
    """
    taken = trials["steps_taken"].fillna(0).astype("int64")
    planned = trials["steps"].fillna(0).astype("int64")
    return taken.where(trials["status"] != "diverged", planned.where(planned > taken, taken))


def trial_mechanisms(trials: pd.DataFrame) -> list[TrialMechanism]:
    """The trials as the accountant sees them: (σ, q, steps charged); pass only trials that took a step."""
    return [
        TrialMechanism(float(sigma), float(rate), int(steps))
        for sigma, rate, steps in zip(
            trials["noise_multiplier"], trials["sample_rate"], charged_steps(trials), strict=True
        )
    ]


def composition_cost(trials: pd.DataFrame, delta: float) -> CompositionCost:
    """What releasing every trial in ``trials`` (rows of the ``trials`` table) costs, at ``delta``.

    Every trial that took a step counts, at its :func:`charged_steps`. No trial with a step: zero.
    One trial: its own ε spent (the PRV accountant's) when that is the tighter of the two upper bounds.
    """
    took = trials[trials["steps_taken"].fillna(0) > 0]
    # in a fixed order and summed exactly (math.fsum): the same trials give the same bits, whatever order
    # their part files were read in
    mechanisms = sorted(trial_mechanisms(took), key=lambda m: (m.noise_multiplier, m.sample_rate, m.steps))
    spent = math.fsum(float(value) for value in took["epsilon_spent"])
    if not mechanisms:
        return CompositionCost(0, delta, 0.0, 0.0, 0.0)
    composed = compose(mechanisms, delta)
    basic = (spent, len(mechanisms) * delta)
    if len(mechanisms) == 1 and spent < composed.epsilon:
        return CompositionCost(1, delta, spent, *basic, accountant="PRV")
    return CompositionCost(len(mechanisms), delta, composed.epsilon, *basic, accountant=composed.accountant)


def select_release(trials: pd.DataFrame, runs: int) -> pd.Series | None:
    """The run a private search releases: the highest noisy validation score among ``runs`` of its
    recorded runs (the secret K) that finished (a diverged run is decided from its parameters, a DP
    output). None if none did.

    Papernot & Steinke's bound holds for the best of K i.i.d. runs. A search interrupted between a
    proposal and Ray Tune's next checkpoint may record more than K runs (the resumed sampler, whose
    proposals are secret and never stored, proposes anew); then a uniformly random K of them, drawn
    from fresh OS entropy (independent of the data), are the candidates: still K i.i.d. runs.
    """
    trials = trials[trials["status"] != "pruned_min_steps"]  # proposals the min-step rule removed: never run
    if len(trials) > runs:
        keep = np.random.default_rng().choice(len(trials), size=runs, replace=False)
        trials = trials.iloc[np.sort(keep)]
    scored = trials[
        (trials["status"] == "ok") & trials["noisy_val_accuracy"].map(lambda v: v is not None and math.isfinite(v))
    ]
    if scored.empty:
        return None
    return scored.loc[scored["noisy_val_accuracy"].idxmax()]
