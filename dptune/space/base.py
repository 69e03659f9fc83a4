"""The base of every section of a search space: unknown keys, NaN and infinity refused, values frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A space section: ``extra="forbid"`` (a misspelt key is an error), frozen, finite numbers only."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
