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

import numpy as np
import pandas as pd

from dptune.contract import DatasetFile
from dptune.privacy.checks import bound_text
from dptune.privacy.composition import TrialMechanism, composed_epsilon
from dptune.records import TRUST_BOUNDARY
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
    mechanisms = trial_mechanisms(took)
    spent = float(took["epsilon_spent"].sum())
    if not mechanisms:
        return CompositionCost(0, delta, 0.0, 0.0, 0.0)
    epsilon = composed_epsilon(mechanisms, delta)
    if len(mechanisms) == 1:
        epsilon = min(epsilon, spent)
    return CompositionCost(len(mechanisms), delta, epsilon, spent, len(mechanisms) * delta)


#: What no mode of dptune covers unless it is made DP itself.
_OUTSIDE = (
    "validation accuracies and losses and the choice of the best trial (computed exactly on "
    "validation rows carved from the private training set), training losses, diagnostics (exact "
    "gradient norms and labels of training examples), per-epoch metrics, and wall times and "
    "throughput (which reveal realised batch sizes)"
)


#: How a data owner scores the released model on labelled rows of their own, inside their boundary.
OWNER_EVALUATION = "python -m dptune.predict --model <model folder> --input FILE --column COL --label-column LABEL"


def test_withheld(space: SearchSpace, official_test_split: bool) -> str | None:
    """Why an end-to-end private search's release withholds its test accuracy, naming the source of the
    test rows and how the owner scores the model themselves (``OWNER_EVALUATION``); None where the test
    split is public (shipped with the dataset, or a test file declared ``test_public``)."""
    if official_test_split:
        return None
    own = space.task.dataset_file
    if own is not None and own.test_path is not None:
        return (
            "your test file (task.dataset.test_path) is not declared test_public, so its accuracy would be a "
            f"release about private rows; score it yourself, inside your trust boundary: {OWNER_EVALUATION}"
        )
    return (
        "the test split is carved from the private pool, so its accuracy would be a release about private rows; "
        f"score a labelled file of your own, inside your trust boundary: {OWNER_EVALUATION}"
    )


def _test_split(dataset: str, official_test_split: bool, own: DatasetFile | None, *, private_selection: bool) -> str:
    """What the guarantee says of test accuracy (public when the dataset ships its own test split, or a
    data owner's test file is declared ``test_public``) and, for a data owner's file (``own``), of its rows."""
    if official_test_split:
        text = (
            f"Test accuracy is computed on {dataset}'s official test split, treated as public, and never "
            "used for selection."
        )
    else:
        where = (
            "its test rows are the test file's, not declared test_public, so private rows"
            if own is not None and own.test_path is not None
            else "its test rows are carved from the same private pool as the training rows"
        )
        text = (
            f"{dataset} has no official test split: {where}, so the release withholds test accuracy (it would "
            "not be covered)."
            if private_selection
            else f"{dataset} has no official test split: {where}, so every trial's test accuracy (overall and "
            "per class) is a release about private rows that (ε, δ) does NOT cover."
        )
    if own is None:
        return text
    return text + (
        f" One row of {dataset} is one record: (ε, δ) protects each row; a person who contributes several rows "
        "is protected per row, not as a person."
    )


def guarantee(
    space: SearchSpace,
    official_test_split: bool,
    cost: CompositionCost | None = None,
    epsilon_selection: float | None = None,
) -> str:
    """What the search's (ε, δ) covers and what it does not, in words; never more than the code does.

    The statement follows the search's shape: coins (secret or ``reproducible``), proposals
    (random and grid are drawn independently of the data; TPE adapts to exact validation
    accuracies), stopping (ASHA stops runs on exact validation accuracies), end-to-end private
    selection, and the dataset's test split (``official_test_split``: shipped with the dataset,
    else carved from the private pool). ``cost`` is the whole search's composition (per-trial
    budgets); ``epsilon_selection`` the private-selection bound (end-to-end private searches).
    """
    delta = space.privacy.delta
    if space.reproducible:
        return (
            "NO DP GUARANTEE for released results: reproducible: true derives every trial's noise and "
            "Poisson batches from the public seed and the trial's id, so anyone holding them can regenerate "
            "the noise. The ε figures describe the mechanism as if its coins were secret (research use only)."
        )
    dataset = space.task.dataset_name
    selection = space.privacy.private_selection
    if selection is not None and selection.tuning_subsample is not None:
        subsample = selection.tuning_subsample
        bound = "" if epsilon_selection is None else f" (RDP total {epsilon_selection:.3g})"
        return (
            f"Only the release is covered: the model trained once on every training row with the configuration "
            f"tuned on a secret subsample and transferred by the public rule '{subsample.transfer}' (C and η₀ "
            f"kept, η = η₀·√(B/B_ref)), that configuration, and the tuning's best noisy validation score are "
            f"({selection.epsilon:g}, {delta:g})-DP{bound} by Koskela & Kulkarni (NeurIPS 2023, variant 1): the "
            f"subsample X₁ keeps each training and validation row with probability q₁ = {subsample.fraction:g} "
            f"(fresh OS entropy, drawn once per search); on it, a secret random number K of random-search runs "
            f"(truncated negative binomial, η = {selection.trial_count_shape:g}, mean "
            f"{space.sampler.trials_per_cell}), each DP-SGD with q and T fixed from public numbers (never from "
            f"|X₁|) plus a Gaussian-noised validation count (σ_s = {selection.score_noise_multiplier:g}), only the "
            f"best kept (Papernot & Steinke, ICLR 2022); that tuning amplified by the subsampling (Zhu & Wang, "
            f"ICML 2019, Thm 6) and composed in RDP with the release's DP-SGD at the worst of the candidate batch "
            f"sizes. The released score is the maximum of K noisy scores on X₁: biased upward, not an estimate "
            f"of the model's accuracy. "
            + _test_split(dataset, official_test_split, space.task.dataset_file, private_selection=True)
            + " NOT covered, and kept inside the data owner's trust boundary "
            f"({TRUST_BOUNDARY}/ in the results): X₁, K, the per-run records of the tuning runs and of the "
            f"release's training (trials, epochs, classes tables; Ray Tune's state), which hold {_OUTSIDE}; and "
            "the search's wall time, which grows with K. Publishing any of them voids the guarantee. Training "
            "the release on the rows left out of X₁ (the paper's variant 2) is not what runs, and not covered."
        )
    if selection is not None:
        bound = "" if epsilon_selection is None else f" (bound {epsilon_selection:.3g})"
        return (
            f"Only the release is covered: the selected configuration, its model and its noisy validation "
            f"score are ({selection.epsilon:g}, {delta:g})-DP{bound} by Papernot & Steinke (ICLR 2022, Thm 2) — "
            f"a secret random number K of random-search runs (truncated negative binomial, "
            f"η = {selection.trial_count_shape:g}, mean {space.sampler.trials_per_cell}) whose configurations "
            f"are drawn from fresh OS entropy, each run DP-SGD (PRV-calibrated σ, Poisson sampling, fresh "
            f"secret coins) plus a Gaussian-noised validation count (σ_s = {selection.score_noise_multiplier:g}), "
            f"only the best released. The released score is the maximum of K noisy scores: biased upward, not "
            f"an estimate of the model's accuracy. "
            + _test_split(dataset, official_test_split, space.task.dataset_file, private_selection=True)
            + " NOT covered, and kept inside the data owner's trust boundary "
            f"({TRUST_BOUNDARY}/ in the results): K, the per-run records (trials, epochs, classes tables; "
            f"Ray Tune's state), which hold {_OUTSIDE}; "
            "and the search's wall time, which grows with K. Publishing any of them voids the guarantee."
        )
    adaptive = space.sampler.name == "tpe"
    stopping = space.scheduler is not None
    whole = (
        ""
        if cost is None or not cost.trials_with_steps
        else (
            f"PLD composition of the {cost.trials_with_steps} trials that took steps: ε = {bound_text(cost.epsilon)} "
            f"at δ = {cost.delta:g} (basic composition: ({bound_text(cost.epsilon_basic)}, "
            f"{bound_text(cost.delta_basic, 2)}))"
        )
    )
    parts = []
    if not adaptive and not stopping:
        parts.append(
            f"Each trial's trained model is (ε, δ = {delta:g})-DP at its cell's ε (PRV accountant, Poisson "
            f"sampling, fresh secret coins per trial). Configurations are drawn independently of the data "
            f"({space.sampler.name} search from the public seed), so the trials compose: "
            + (
                f"releasing every trial's model costs the {whole}."
                if whole
                else "releasing every trial's model costs their composition."
            )
        )
    else:
        parts.append(
            f"Each trial's noisy training steps are DP-SGD at its cell's ε (δ = {delta:g}; PRV accountant, "
            "Poisson sampling, fresh secret coins per trial), which bounds a trial's model only when its "
            "configuration and length are fixed independently of the data."
        )
        if adaptive:
            parts.append(
                "Here TPE proposes each configuration from earlier trials' exact validation accuracies "
                "(not DP), so which configurations ran depends on private rows: no trial's model, and no "
                "set of them, is (ε, δ)-DP as released."
            )
        if stopping:
            parts.append(
                "ASHA stops runs on exact validation accuracies of private rows (not DP): which runs "
                "stopped, when, and all that reveals it (steps taken, statuses, which models exist) is "
                "outside (ε, δ); a stopped run is charged the steps it took, and releasing the surviving "
                "models is not (ε, δ)-DP."
            )
        if whole:
            parts.append(
                f"The {whole} counts the noisy steps of every trial; it is not a bound on releasing them, "
                "because of the adaptivity above."
            )
        parts.append(
            "Use sampler random or grid without a scheduler for a composition bound over released trials, "
            "or privacy.private_selection for an end-to-end one."
        )
    parts.append("A run that diverged is charged its planned steps: its stop read an exact loss.")
    parts.append(f"NOT covered by (ε, δ): {_OUTSIDE}.")
    parts.append(_test_split(dataset, official_test_split, space.task.dataset_file, private_selection=False))
    parts.append(
        "Releasing the best trial's model with its validation score is therefore not (ε, δ)-DP; use "
        "privacy.private_selection for an end-to-end guarantee."
    )
    return " ".join(parts)


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
