"""What a cell's sampler must learn from the results folder when a search (re)starts. Ray-free.

A search's record of what it did is its results folder: the privacy ledger's start entries (every
run charged) and the ``trials`` rows (every run recorded). Tune's experiment state, with the
searcher's, is saved every few seconds and can lag both: a driver killed after a unit was charged
or recorded, and before Tune saved its state, restores a sampler that never asked that unit's
configurations. Left alone, the sampler would propose others in their place (more configurations
than planned) and the charged ones would never get their rows (a search that can never finish).

:func:`unknown_configurations` finds, per cell, every configuration the folder holds that the
restored sampler does not know: those whose every replicate is recorded (the sampler is told their
values; they count against the cell's budget) and those charged with a replicate still unrecorded
(they count against the budget and run again, as they were charged, before anything new is asked).
Invariant: across any number of kills and resumes, a cell asks at most its budget of configurations,
and every configuration that took a step is run until each replicate has its row.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dptune.records.ids import configuration_id, params_key, replicate_trial_id
from dptune.records.ledger import RunStart
from dptune.search.planning.sampler import CellSampler, Told
from dptune.search.runs.execution import TrialContext, selection_value

#: The status of a configuration the min-step rule removed (recorded, never charged).
PRUNED = "pruned_min_steps"


@dataclass
class UnknownConfigurations:
    """What a restored cell sampler does not know of its cell's results folder.

    ``told``: configurations every replicate of which is recorded, with the value their unit would
    have reported (the mean selection value over replicates) or ``pruned``; ``unrecorded``: those
    charged with at least one replicate not recorded, in the order they were charged."""

    told: list[Told] = field(default_factory=list)
    unrecorded: list[dict[str, Any]] = field(default_factory=list)


def sampled_params(params: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``params`` as the sampler proposes them: its hyperparameters only, B an int."""
    return {name: int(params[name]) if name == "batch_size" else float(params[name]) for name in names}


def unknown_configurations(
    context: TrialContext, sampler: CellSampler, started: list[RunStart], trials: pd.DataFrame
) -> UnknownConfigurations:
    """The configurations of cell ``context`` that ``started`` (the search's start entries, every cell's)
    and ``trials`` (the search's rows, every cell's) hold and ``sampler`` does not know. Linear in both."""
    names = list(sampler.spec.distributions())
    known = sampler.asked()
    prefix = f"{context.cell_key}-"
    mine = trials[trials["configuration_id"].astype(str).str.startswith(prefix)]
    recorded = set(mine["trial_id"])
    unrecorded: dict[str, dict[str, Any]] = {}

    def unknown(params: dict[str, Any], configuration: str) -> bool:
        return configuration == configuration_id(context.cell_key, params) and params_key(params) not in known

    own = re.compile(rf"{re.escape(context.cell_key)}-[0-9a-f]{{12}}")  # not another cell's (its `-auto_s` twin's)
    for start in started:
        if not own.fullmatch(start.configuration_id):
            continue
        params = sampled_params(start.params, names)
        if unknown(params, start.configuration_id) and any(
            replicate_trial_id(start.configuration_id, r) not in recorded for r in range(context.replicates)
        ):
            unrecorded.setdefault(start.configuration_id, params)
    found = UnknownConfigurations()
    for configuration, group in mine.groupby("configuration_id", sort=True):
        params = sampled_params(group.iloc[0], names)
        if configuration in unrecorded or not unknown(params, str(configuration)):
            continue
        if (group["status"] == PRUNED).any():
            if params["batch_size"] in sampler.spec.batch_sizes:  # a grid records its pruned B outside its sampler
                found.told.append(Told(params, None, "pruned"))
        elif group["replicate"].nunique() < context.replicates:  # the rest of a unit lost with its process
            unrecorded[str(configuration)] = params
        else:
            values = [
                selection_value(context.base, str(row.status), float(row.val_accuracy), float(row.noisy_val_accuracy))
                for row in group.itertuples()
            ]
            found.told.append(Told(params, sum(values) / len(values), "complete"))
    found.unrecorded = list(unrecorded.values())
    return found
