"""What a search's (ε, δ) covers and what it does not, in words: one statement per search shape.

The search owns its statements; the numbers they quote come from :mod:`dptune.privacy.search` (a
per-cell search's composition, ``CompositionCost``) and the private-selection planners. Each shape
has its function, which the search mode of that shape calls:

- :func:`statement_of_cells`: the per-cell search (random, grid or TPE proposals, with or without
  ASHA), whose trials compose; with ``reproducible: true``, :func:`statement_of_public_coins`;
- :func:`statement_of_private_selection`: end-to-end private selection (Papernot & Steinke);
- :func:`statement_of_subsample_tuning`: tuning on a secret subsample, then a release trained on every
  row (Koskela & Kulkarni, variant 1).

The search's mode picks the statement of its shape (``dptune.search.modes``, ``SearchMode.guarantee``);
a statement of a space with public coins (``reproducible: true``) is :func:`statement_of_public_coins`,
whatever its shape. Every statement ends with what the test split is
(:func:`statement_of_test_split`); :func:`test_withheld` says why a private release withholds its test
accuracy. Never more than the code does. Torch-free and Ray-free.
"""

from __future__ import annotations

from dptune.contract import DatasetFile
from dptune.privacy.checks import bound_text, group_privacy
from dptune.privacy.search import CompositionCost
from dptune.records import TRUST_BOUNDARY
from dptune.space import SearchSpace

#: What no mode of dptune covers unless it is made DP itself.
OUTSIDE = (
    "validation accuracies and losses and the choice of the best trial (computed exactly on "
    "validation rows carved from the private training set), training losses, diagnostics (exact "
    "gradient norms and labels of training examples), per-epoch metrics, and wall times and "
    "throughput (which reveal realised batch sizes)"
)

#: How a data owner scores the released model on labelled rows of their own, inside their boundary.
OWNER_EVALUATION = "python -m dptune.predict --model <model folder> --input FILE --label-column LABEL"

#: The statement of a search whose coins are public (``reproducible: true``), whatever its shape.
PUBLIC_COINS = (
    "NO DP GUARANTEE for released results: reproducible: true derives every trial's noise and "
    "Poisson batches from the public seed and the trial's id, so anyone holding them can regenerate "
    "the noise. The ε figures describe the mechanism as if its coins were secret (research use only)."
)


def statement_of_public_coins() -> str:
    """A search with public coins (``reproducible: true``): nothing is claimed (:data:`PUBLIC_COINS`)."""
    return PUBLIC_COINS


def statement_of_cells(
    space: SearchSpace, official_test_split: bool, cost: CompositionCost | None = None, num_units: int | None = None
) -> str:
    """A per-cell search: what each trial's DP-SGD bounds, whether its trials compose (random or grid
    proposals without a scheduler) or what adaptivity voids (TPE, ASHA), what no mode covers, the
    test split and the privacy unit. ``cost``: the whole search's composition, quoted where it took
    steps; ``num_units``: N, the training split's units (people or rows)."""
    if space.reproducible:
        return statement_of_public_coins()
    whole = _composition_text(cost)
    adaptive = space.sampler.name == "tpe" or space.scheduler is not None or space.racing is not None
    parts = _adaptive_parts(space, whole) if adaptive else [_composing_part(space, whole)]
    parts.append("A run that diverged is charged its planned steps: its stop read an exact loss.")
    parts.append(f"NOT covered by (ε, δ): {OUTSIDE}.")
    parts.append(_dataset_test_split(space, official_test_split, num_units, private_selection=False))
    parts.append(
        "Releasing the best trial's model with its validation score is therefore not (ε, δ)-DP; use "
        "privacy.private_selection for an end-to-end guarantee."
    )
    return " ".join(parts)


def _composition_text(cost: CompositionCost | None) -> str:
    """The whole search's composition in words, or "" when there is none (or no trial took a step)."""
    if cost is None or not cost.trials_with_steps:
        return ""
    return (
        f"{cost.accountant} composition of the {cost.trials_with_steps} trials that took steps: "
        f"ε = {bound_text(cost.epsilon)} "
        f"at δ = {cost.delta:g} (basic composition: ({bound_text(cost.epsilon_basic)}, "
        f"{bound_text(cost.delta_basic, 2)}))"
    )


def _composing_part(space: SearchSpace, whole: str) -> str:
    """Proposals drawn independently of the data and no stopping rule: each trial's model is DP and the
    trials compose (at ``whole``, the composition's text, when known)."""
    return (
        f"Each trial's trained model is (ε, δ = {space.privacy.delta:g})-DP at its cell's ε (PRV accountant, Poisson "
        f"sampling, fresh secret coins per trial). Configurations are drawn independently of the data "
        f"({space.sampler.name} search from the public seed), so the trials compose: "
        + (
            f"releasing every trial's model costs the {whole}."
            if whole
            else "releasing every trial's model costs their composition."
        )
    )


def _adaptive_parts(space: SearchSpace, whole: str) -> list[str]:
    """TPE proposals, ASHA stopping or racing: what each trial's DP-SGD still bounds, what the adaptivity voids,
    what the composition ``whole`` (its text, when known) counts, and the shapes that do compose."""
    parts = [
        f"Each trial's noisy training steps are DP-SGD at its cell's ε (δ = {space.privacy.delta:g}; PRV accountant, "
        "Poisson sampling, fresh secret coins per trial), which bounds a trial's model only when its "
        "configuration and length are fixed independently of the data."
    ]
    if space.sampler.name == "tpe":
        parts.append(
            "Here TPE proposes each configuration from earlier trials' exact validation accuracies "
            "(not DP), so which configurations ran depends on private rows: no trial's model, and no "
            "set of them, is (ε, δ)-DP as released."
        )
    if space.scheduler is not None:
        parts.append(
            "ASHA stops runs on exact validation accuracies of private rows (not DP): which runs "
            "stopped, when, and all that reveals it (steps taken, statuses, which models exist) is "
            "outside (ε, δ); a stopped run is charged the steps it took, and releasing the surviving "
            "models is not (ε, δ)-DP."
        )
    if space.racing is not None:
        parts.append(
            "Racing chose which configurations got more replicates, and how many, from earlier runs' exact "
            "validation accuracies (not DP): which runs exist and their number depend on private rows, so no "
            "trial's model, and no set of them, is (ε, δ)-DP as released."
        )
    if whole:
        parts.append(
            f"The {whole} counts the noisy steps of every trial; it is not a bound on releasing them, "
            "because of the adaptivity above."
        )
    parts.append(
        "Use sampler random or grid without a scheduler or racing for a composition bound over released trials, "
        "or privacy.private_selection for an end-to-end one."
    )
    return parts


def statement_of_private_selection(
    space: SearchSpace, official_test_split: bool, epsilon_selection: float | None = None, num_units: int | None = None
) -> str:
    """An end-to-end private search (Papernot & Steinke): only the release is covered, at the space's
    total (ε, δ) (``epsilon_selection``: the bound the plan met, quoted when known); what stays inside
    the trust boundary; the privacy unit (``num_units``: N, when known)."""
    if space.reproducible:
        return statement_of_public_coins()
    selection = space.privacy.private_selection
    assert selection is not None, "a private-selection statement needs privacy.private_selection"
    bound = "" if epsilon_selection is None else f" (bound {epsilon_selection:.3g})"
    return (
        f"Only the release is covered: the selected configuration, its model and its noisy validation "
        f"score are ({selection.epsilon:g}, {space.privacy.delta:g})-DP{bound} by Papernot & Steinke (ICLR 2022, "
        f"Thm 2) — a secret random number K of random-search runs (truncated negative binomial, "
        f"η = {selection.trial_count_shape:g}, mean {space.sampler.trials_per_cell}) whose configurations "
        f"are drawn from fresh OS entropy, each run DP-SGD (PRV-calibrated σ, Poisson sampling, fresh "
        f"secret coins) plus a Gaussian-noised validation count (σ_s = {selection.score_noise_multiplier:g}), "
        f"only the best released. The released score is the maximum of K noisy scores: biased upward, not "
        f"an estimate of the model's accuracy. "
        + _dataset_test_split(space, official_test_split, num_units, private_selection=True)
        + _kept_inside("K, the per-run records (trials, epochs, classes tables; Ray Tune's state)")
    )


def statement_of_subsample_tuning(
    space: SearchSpace, official_test_split: bool, epsilon_selection: float | None = None, num_units: int | None = None
) -> str:
    """Tuning on a secret subsample, then a release trained on every row (Koskela & Kulkarni, variant 1):
    only the release is covered, at the space's total (ε, δ) (``epsilon_selection``: the plan's RDP
    total, quoted when known); what stays inside the trust boundary; the privacy unit (``num_units``)."""
    if space.reproducible:
        return statement_of_public_coins()
    selection = space.privacy.private_selection
    assert selection is not None and selection.tuning_subsample is not None, "needs privacy.private_selection"
    subsample = selection.tuning_subsample
    bound = "" if epsilon_selection is None else f" (RDP total {epsilon_selection:.3g})"
    unit = "row" if space.privacy.person_unit is None else "person (with all their rows)"
    return (
        f"Only the release is covered: the model trained once on every training row with the configuration "
        f"tuned on a secret subsample and transferred by the public rule '{subsample.transfer}' (C and η₀ "
        f"kept, η = η₀·√(B/B_ref)), that configuration, and the tuning's best noisy validation score are "
        f"({selection.epsilon:g}, {space.privacy.delta:g})-DP{bound} by Koskela & Kulkarni (NeurIPS 2023, "
        f"variant 1): the subsample X₁ keeps each training and validation {unit} with probability "
        f"q₁ = {subsample.fraction:g} (fresh OS entropy, drawn once per search); on it, a secret random number "
        f"K of random-search runs (truncated negative binomial, η = {selection.trial_count_shape:g}, mean "
        f"{space.sampler.trials_per_cell}), each DP-SGD with q and T fixed from public numbers (never from "
        f"|X₁|) plus a Gaussian-noised validation count (σ_s = {selection.score_noise_multiplier:g}), only the "
        f"best kept (Papernot & Steinke, ICLR 2022); that tuning amplified by the subsampling (Zhu & Wang, "
        f"ICML 2019, Thm 6) and composed in RDP with the release's DP-SGD at the worst of the candidate batch "
        f"sizes. The released score is the maximum of K noisy scores on X₁: biased upward, not an estimate "
        f"of the model's accuracy. "
        + _dataset_test_split(space, official_test_split, num_units, private_selection=True)
        + _kept_inside(
            "X₁, K, the per-run records of the tuning runs and of the release's training (trials, epochs, "
            "classes tables; Ray Tune's state)"
        )
        + " Training the release on the rows left out of X₁ (the paper's variant 2) is not what runs, and not "
        "covered."
    )


def _kept_inside(hidden: str) -> str:
    """What an end-to-end private search keeps inside the trust boundary (``hidden``: its secrets and
    records) and why: their contents are not covered."""
    return (
        f" NOT covered, and kept inside the data owner's trust boundary ({TRUST_BOUNDARY}/ in the results): "
        f"{hidden}, which hold {OUTSIDE}; and the search's wall time, which grows with K. Publishing any of "
        "them voids the guarantee."
    )


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


def _dataset_test_split(
    space: SearchSpace, official_test_split: bool, num_units: int | None, *, private_selection: bool
) -> str:
    """:func:`statement_of_test_split` of the space's dataset, then its :func:`statement_of_unit`."""
    return statement_of_test_split(
        space.task.dataset_name, official_test_split, space.task.dataset_file, private_selection=private_selection
    ) + statement_of_unit(space, num_units)


def statement_of_test_split(
    dataset: str, official_test_split: bool, own: DatasetFile | None, *, private_selection: bool
) -> str:
    """What the guarantee says of test accuracy (public when the dataset ships its own test split, or a
    data owner's test file is declared ``test_public``); ``own``: a data owner's file (its test file may be
    private)."""
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
    return text


def statement_of_unit(space: SearchSpace, num_units: int | None) -> str:
    """What one (ε, δ) of the search protects: a person (``privacy.unit: {column: …}``; ``num_units``, the
    training split's people, quoted when known) or a row; with rows and a data owner's bound k on any
    person's rows (``privacy.max_rows_per_person_known``), what each of the space's ε gives such a person
    by group privacy (:func:`~dptune.privacy.checks.group_privacy`)."""
    unit, delta = space.privacy.person_unit, space.privacy.delta
    if unit is not None:
        count = (
            ""
            if num_units is None
            else f" ({num_units} people in the training split, a count treated as public as N is)"
        )
        rows = (
            "all their rows"
            if unit.max_rows is None
            else f"at most {unit.max_rows} of their rows, drawn with fresh coins"
        )
        return (
            f" The privacy unit is a person: every (ε, δ) here protects all the rows of each person identified by "
            f"{unit.column!r} together{count}. Each step samples people (q = B/N_people: B counts people); a sampled "
            f"person's gradient is the mean over {rows}, clipped to C as one vector (user-level DP-SGD: McMahan et "
            "al. 2018; Levy et al. 2021); the validation and test splits take whole people; a DP validation score "
            "counts people (⌊Σ of each validation person's accuracy⌋, sensitivity 1 per person); a tuning "
            "subsample keeps whole people. No count of a person's rows is released (the rows a step trained on "
            "show only in throughput and wall times, outside (ε, δ) as for rows)."
        )
    if space.task.dataset_file is None:
        return ""
    text = (
        f" One row of {space.task.dataset_name} is one record: (ε, δ) protects each row; a person who contributes "
        "several rows is protected per row, not as a person (privacy.unit: {column: ID} protects people)."
    )
    known = space.privacy.max_rows_per_person_known
    if known is None or known == 1:
        return text
    selection = space.privacy.private_selection
    epsilons = [selection.epsilon] if selection is not None else list(space.privacy.epsilons or [])
    implied = "; ".join(_group_text(epsilon, delta, known) for epsilon in epsilons)
    return text + (
        f" With at most {known} rows per person (the data owner's bound), group privacy gives each person only "
        f"{implied} (ε_k = kε, δ_k = δ(e^(kε) − 1)/(e^ε − 1))."
    )


def _group_text(epsilon: float, delta: float, group_size: int) -> str:
    """``ε = x → (ε_k, δ_k)`` of one row-level budget for a group of ``group_size`` rows, or "no guarantee"."""
    epsilon_k, delta_k = group_privacy(epsilon, delta, group_size)
    person = "no guarantee (δ_k ≥ 1)" if delta_k >= 1 else f"({bound_text(epsilon_k)}, {bound_text(delta_k, 2)})"
    return f"row-level ε = {epsilon:g} → {person}"
