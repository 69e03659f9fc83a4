"""The ``privacy`` section of a search space: per-trial budgets or one total for private selection (and
tuning on a subsample), δ, and the privacy unit (a row, or a person of a data owner's file)."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import Field, field_validator, model_validator

from dptune.contract import DEFAULT_MAX_ROWS_PER_PERSON, PersonUnit
from dptune.privacy import MAX_EPSILON, MIN_EPSILON
from dptune.space.base import Strict


class TuningSubsampleSpec(Strict):
    """Tune on a private subsample X₁ (Koskela & Kulkarni 2023, variant 1), then train the release on
    every training row with the chosen configuration, transferred by ``transfer``.

    Every training and validation row (person, with all their rows, under a person unit) joins X₁
    independently with probability ``fraction`` (q₁),
    from secret coins. A tuning run of a proposed full-data configuration (C, B, η₀) keeps C and η₀
    and runs on X₁ with a Poisson rate and a step count fixed from public numbers:

    - ``sample_rate``: the release's q = B/N and T = round(E·N/B) (an expected batch of q₁·B);
    - ``batch_size``: the release's expected batch B, so q = B/(q₁·N) and T = round(E·q₁·N/B)
      (B above q₁·N cannot be tuned and is pruned).
    """

    fraction: float = Field(
        gt=0, lt=1, description="q₁: the probability that a row (a person, under a person unit) joins the tuning set"
    )
    transfer: Literal["sample_rate", "batch_size"] = Field(
        "sample_rate", description="what a tuning run keeps of the full-data configuration it stands for"
    )


class PrivateSelectionSpec(Strict):
    """End-to-end private tuning: one (ε, δ) for the whole search *and* the release of its best trial.

    The search runs a secret random number of trials (truncated negative binomial with shape
    ``trial_count_shape``, 1 = geometric, mean ``sampler.trials_per_cell``), each with the per-trial ε
    that makes Papernot & Steinke's private-selection bound meet ``epsilon``, scores each trial by
    its noisy validation count (Gaussian, std ``score_noise_multiplier`` correct predictions) and
    releases only the best one. With ``tuning_subsample`` the runs tune on a secret subsample and
    the release is one more training, on every training row, of the best run's configuration.
    """

    epsilon: float = Field(
        ge=MIN_EPSILON, le=MAX_EPSILON, description="ε_total of the tuning and the released model, at privacy.delta"
    )
    score_noise_multiplier: float = Field(
        5.0, gt=0, description="σ_s: std of the Gaussian noise on the number of correct validation predictions"
    )
    trial_count_shape: float = Field(1.0, gt=0, le=100, description="η of the random trial count (1 = geometric)")
    tuning_subsample: TuningSubsampleSpec | None = Field(
        None, description="tune on a secret subsample, release a model trained on all rows (one ε for both)"
    )


class PersonUnitSpec(Strict):
    """``privacy.unit: {column: customer_id}``: the privacy unit is a person, every row with the same
    ``column`` value one person's (user-level DP, :class:`dptune.contract.PersonUnit`). ``max_rows``: at
    most this many of a sampled person's rows (drawn with fresh coins each step) form their gradient;
    none: all of them."""

    column: str = Field(min_length=1, description="the dataset file's column naming each row's person")
    max_rows: int | None = Field(
        DEFAULT_MAX_ROWS_PER_PERSON, ge=1, description="rows of a sampled person per step (null: all their rows)"
    )

    def person_unit(self) -> PersonUnit:
        """The contract's form of this unit."""
        return PersonUnit(column=self.column, max_rows=self.max_rows)


class PrivacySpec(Strict):
    """Privacy budgets: one search cell per ε (and per epoch budget); δ as in (ε, δ)-DP.

    Either ``epsilons`` (a per-trial budget per cell; the whole search's cost is reported beside) or
    ``private_selection`` (a total budget for the tuning and the released model). ``unit``: what one
    (ε, δ) protects, a ``row`` (default) or a person (:class:`PersonUnitSpec`); with ``row``,
    ``max_rows_per_person_known`` (a data owner's bound k on any person's rows) makes the card say what
    the row-level guarantee implies for a person by group privacy.
    """

    epsilons: list[Annotated[float, Field(ge=MIN_EPSILON, le=MAX_EPSILON)]] | None = Field(None, min_length=1)
    delta: float = Field(1e-5, gt=0, lt=1)
    private_selection: PrivateSelectionSpec | None = None
    unit: Literal["row"] | PersonUnitSpec = Field("row", description="row, or {column: ID_COLUMN, max_rows: m}")
    max_rows_per_person_known: int | None = Field(
        None, ge=1, description="with unit row: a known bound k on any person's rows (the card's group privacy)"
    )

    @property
    def person_unit(self) -> PersonUnit | None:
        """The person unit, or None when the unit is a row."""
        return None if isinstance(self.unit, str) else self.unit.person_unit()

    @model_validator(mode="after")
    def _group_bound_for_rows(self) -> Self:
        if self.max_rows_per_person_known is not None and not isinstance(self.unit, str):
            raise ValueError(
                "max_rows_per_person_known goes with unit: row (it converts a row-level ε to a person's by "
                "group privacy); with a person unit (ε, δ) already protects each person"
            )
        return self

    @field_validator("epsilons")
    @classmethod
    def _distinct(cls, values: list[float] | None) -> list[float] | None:
        if values is not None and len(set(values)) != len(values):
            raise ValueError("epsilons must be distinct")
        return values

    @model_validator(mode="after")
    def _one_budget(self) -> Self:
        if (self.epsilons is None) == (self.private_selection is None):
            raise ValueError(
                "give exactly one of epsilons (per-trial budgets, one cell each) or private_selection "
                "(one total budget for the tuning and the released model)"
            )
        return self
