"""What a search's (ε, δ) covers, in words, for every search shape; what a run is charged."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest

from conftest import REPO_ROOT
from dptune.errors import DptuneError
from dptune.privacy.search import CompositionCost, composition_cost, select_release
from dptune.search.modes import mode_of
from dptune.space import load_space
from expected import pld_epsilon
from test_imports import import_graph

DEFAULT = REPO_ROOT / "search_spaces/default.yaml"
PRIVATE = REPO_ROOT / "search_spaces/private.yaml"
COST = CompositionCost(trials_with_steps=7, delta=1e-5, epsilon=12.5, epsilon_basic=40.0, delta_basic=7e-5)

#: Phrases and what they claim.
PER_TRIAL_MODEL = "Each trial's trained model is (ε, δ = 1e-05)-DP"
COMPOSES = "releasing every trial's model costs the PLD composition of the 7 trials that took steps: ε = 12.5"
TPE = "TPE proposes each configuration from earlier trials' exact validation accuracies"
ASHA = "ASHA stops runs on exact validation accuracies of private rows"
NOT_A_BOUND = "it is not a bound on releasing them"
NO_MODEL_COVERED = "no trial's model, and no set of them, is (ε, δ)-DP as released"
DIVERGED = "A run that diverged is charged its planned steps"
OUTSIDE = "NOT covered by (ε, δ): validation accuracies"
PUBLIC_TEST = "official test split, treated as public"
CARVED_TEST_RELEASED = "every trial's test accuracy (overall and per class) is a release about private rows"
CARVED_TEST_WITHHELD = "so the release withholds test accuracy"
RELEASE_ONLY = "Only the release is covered"
MAX_OF_NOISY = "The released score is the maximum of K noisy scores: biased upward"
BOUNDARY = "inside_trust_boundary/"
NO_GUARANTEE = "NO DP GUARANTEE"


def _space(sampler: str, asha: bool, private: bool, reproducible: bool):
    overrides: dict = {"reproducible": reproducible}
    if not private:
        overrides["sampler.name"] = sampler
        if sampler == "grid":
            overrides.update({"clip_bound": {"values": [0.1, 1.0]}, "base_learning_rate": {"values": [0.01]}})
        if asha:
            overrides.update({"scheduler": {"name": "asha"}, "replicates": 1})
    return load_space(PRIVATE if private else DEFAULT, overrides).space


def _guarantee(space, official_test: bool, cost: CompositionCost | None, bound: float | None = None) -> str:
    """The statement the space's search mode gives (``SearchMode.guarantee``)."""
    return mode_of(space).guarantee(space, official_test, cost, bound)


SHAPES = [(sampler, asha, False) for sampler, asha in itertools.product(("random", "grid", "tpe"), (False, True))]
SHAPES.append(("random", False, True))


@pytest.mark.parametrize("official_test", [True, False], ids=["public-test", "carved-test"])
@pytest.mark.parametrize("reproducible", [False, True], ids=["secret-coins", "reproducible"])
@pytest.mark.parametrize(
    ("sampler", "asha", "private"),
    SHAPES,
    ids=[f"{s}{'-asha' if a else ''}{'-private' if p else ''}" for s, a, p in SHAPES],
)
def test_guarantee_text_says_what_each_search_shape_covers(
    sampler: str, asha: bool, private: bool, reproducible: bool, official_test: bool
) -> None:
    if private and reproducible:  # public coins would make K, the proposals and the noise computable
        with pytest.raises(DptuneError, match="reproducible must be false"):
            _space(sampler, asha, private, reproducible)
        return
    space = _space(sampler, asha, private, reproducible)
    text = _guarantee(space, official_test, None if private else COST, 7.9 if private else None)
    if reproducible:  # public coins: nothing is claimed, whatever the shape
        assert text.startswith(NO_GUARANTEE) and "-DP" not in text
        return
    assert NO_GUARANTEE not in text
    if private:
        present = {
            RELEASE_ONLY,
            MAX_OF_NOISY,
            BOUNDARY,
            "(8, 1e-05)-DP (bound 7.9)",
            "fresh OS entropy",
            "wall time, which grows with K",
            "Publishing any of them voids the guarantee",
        }
        present.add(PUBLIC_TEST if official_test else CARVED_TEST_WITHHELD)
        absent = {PER_TRIAL_MODEL, COMPOSES, CARVED_TEST_RELEASED}
    else:
        adaptive = sampler == "tpe" or asha
        present = {DIVERGED, OUTSIDE, PUBLIC_TEST if official_test else CARVED_TEST_RELEASED}
        absent = {RELEASE_ONLY, MAX_OF_NOISY, PUBLIC_TEST if not official_test else CARVED_TEST_RELEASED}
        if adaptive:  # what adaptivity voids is said, and the random-search claims are not made
            present |= {NOT_A_BOUND, "Use sampler random or grid without a scheduler"}
            absent |= {PER_TRIAL_MODEL, COMPOSES}
        else:
            present |= {PER_TRIAL_MODEL, COMPOSES, f"({sampler} search from the public seed)"}
            absent |= {NOT_A_BOUND, TPE, ASHA}
        for phrase, applies in ((TPE, sampler == "tpe"), (NO_MODEL_COVERED, sampler == "tpe"), (ASHA, asha)):
            (present if applies else absent).add(phrase)
    for phrase in present:
        assert phrase in text, phrase
    for phrase in absent:
        assert phrase not in text, phrase


def test_tpe_asha_and_random_search_state_different_guarantees() -> None:
    texts = {
        shape: _guarantee(_space(*shape, private=False, reproducible=False), True, COST)
        for shape in (("random", False), ("tpe", False), ("random", True))
    }
    assert len(set(texts.values())) == 3


def _trial(status: str, steps_taken: int, steps: int, epsilon_spent: float) -> dict:
    return {
        "noise_multiplier": 1.1,
        "sample_rate": 0.02,
        "steps": steps,
        "steps_taken": steps_taken,
        "epsilon_spent": epsilon_spent,
        "status": status,
    }


def test_a_diverged_run_is_charged_its_planned_steps_others_the_steps_they_took() -> None:
    trials = pd.DataFrame(
        [
            _trial("diverged", 2, 79, 2.0),
            _trial("ok", 79, 79, 2.0),
            _trial("error", 30, 79, 1.2),
            _trial("pruned_min_steps", 0, 5, 0.0),
        ]
    )
    cost = composition_cost(trials, 1e-5)
    assert cost.trials_with_steps == 3
    # independent: dp_accounting's PLD over (σ, q, T) with the diverged run at its 79 planned steps
    assert cost.epsilon == pytest.approx(
        pld_epsilon([(1.1, 0.02, 79), (1.1, 0.02, 79), (1.1, 0.02, 30)], 1e-5), rel=1e-9
    )
    assert cost.epsilon > pld_epsilon([(1.1, 0.02, 2), (1.1, 0.02, 79), (1.1, 0.02, 30)], 1e-5)


def _scored(scores: list[float]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "status": ["ok"] * len(scores),
            "noisy_val_accuracy": scores,
            "clip_bound": [0.1 * (i + 1) for i in range(len(scores))],
        }
    )


def test_the_release_is_the_best_noisy_score_of_the_k_runs() -> None:
    runs = _scored([0.5, 0.9, 0.7])
    runs.loc[1, "status"] = "diverged"  # a run that did not finish is a candidate that cannot win
    assert select_release(runs, runs=3)["noisy_val_accuracy"] == 0.7
    assert select_release(runs.assign(status="error"), runs=3) is None


def test_more_recorded_runs_than_k_release_the_best_of_a_random_k() -> None:
    runs = _scored([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    pruned = _scored([0.99] * 4).assign(status="pruned_min_steps")  # recorded proposals that never ran
    assert select_release(pd.concat([runs, pruned]), runs=6)["noisy_val_accuracy"] == 0.6
    released = {select_release(runs, runs=1)["noisy_val_accuracy"] for _ in range(60)}
    assert len(released) > 3  # one run at random each time, not always the best of all six
    assert min(select_release(runs, runs=5)["noisy_val_accuracy"] for _ in range(60)) >= 0.5


def test_privacy_is_numbers_only_and_imports_nothing_above_it() -> None:
    """dptune.privacy computes; what a search's (ε, δ) covers, in words, is the search's (search.statement)."""
    above = ("dptune.space", "dptune.search", "dptune.records", "dptune.runners", "dptune.contract")
    reached = {
        (module, target)
        for module, targets in import_graph().items()
        if module == "dptune.privacy" or module.startswith("dptune.privacy.")
        for target in targets
        if any(target == name or target.startswith(name + ".") for name in above)
    }
    assert not reached, reached
