"""Search spaces: a YAML spec loaded, validated into typed objects, and its (ε, E) cells.

A spec names the task, the privacy budgets, the epoch budgets, the ranges of (C, B, η₀), the
learning-rate coupling, the min-step rule, the sampler, the scheduler, resources and the seed.
Validation happens on load, before Ray starts: a wrong key, type or range is reported with the
file, the key and what is allowed (``SpaceError``). See ``search_spaces/default.yaml`` for a
commented example of every key.

- :mod:`~dptune.space.spec`: the typed spec (``SearchSpace`` and its parts), ``Cell``, ``LoadedSpace``;
- :mod:`~dptune.space.files`: reading a file safely, ``extends``, overrides, relative paths (from the
  folder of the file that writes them; an override's from the working folder), ``load_space``;
- :mod:`~dptune.space.messages`: validation errors in the user's keys ("did you mean"), no validator internals;
- :mod:`~dptune.space.tracking`: the ``tracking`` section (an MLflow server), left out of the recorded space.
"""

from dptune.space.files import load_space, parse_override, parse_overrides, parse_space, spec_differences
from dptune.space.spec import MAX_TRIALS_PER_CELL, Cell, LoadedSpace, ResourcesSpec, SearchSpace, SpaceError

__all__ = [
    "MAX_TRIALS_PER_CELL",
    "Cell",
    "LoadedSpace",
    "ResourcesSpec",
    "SearchSpace",
    "SpaceError",
    "load_space",
    "parse_override",
    "parse_overrides",
    "parse_space",
    "spec_differences",
]
