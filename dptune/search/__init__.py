"""The search service: joint (C, B, η₀) search per (ε, epochs) cell on Ray Tune + Optuna.

``python -m dptune.search --space search_spaces/default.yaml`` on a laptop (embedded local Ray),
``ray job submit -- python -m dptune.search ...`` on a cluster (joins it through RAY_ADDRESS).

Flow: validate the space and the flags (no compute; :mod:`~dptune.search.cli`, into
:class:`~dptune.search.options.SearchOptions`) → every check
that needs no data (:mod:`~dptune.search.preflight`), then the results folder's lease
(:mod:`~dptune.records.lease`) → load the workload once in the driver (fills the feature cache) →
plan each cell (steps, σ, min-step pruning; :mod:`~dptune.search.planning.cells`) → one Ray Tune run for
all cells (:mod:`~dptune.search.driver`, :mod:`~dptune.search.scheduling.tune_adapters`), each cell with its
own Optuna sampler (:mod:`~dptune.search.planning.sampler`), budget and (optionally) ASHA scheduler, cells
side by side → each unit's runs train once and write their own Parquet rows and ledger entries as
they end (:mod:`~dptune.search.runs.execution`) → the search table (with the privacy cost of tuning)
and the summary (:mod:`~dptune.search.finish.outcome`) → report → with ``tracking.mlflow``, the finished search
in MLflow (:mod:`~dptune.search.finish.tracking`). Ray appears only in the driver and the Tune adapters.

The command line answers a mistake before anything heavy is imported: this package imports only
:mod:`~dptune.search.cli` and its options; every other name below loads its module on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from dptune.search.cli import main, parse_args
from dptune.search.options import SearchOptions

#: The public names of the heavier modules, loaded on first access.
_LAZY: Mapping[str, str] = MappingProxyType(
    {
        **dict.fromkeys(
            (
                "CellPlan",
                "MAX_UNIT_CONFIGURATIONS",
                "TRIAL_COUNT_FILE",
                "base_trial_config",
                "cell_spec",
                "check_runner",
                "format_cell_plans",
                "format_private_plan",
                "format_subsample_plan",
                "kept_trial_counts",
                "plan_cells_per_cell",
                "plan_private_cell",
                "plan_subsample_cell",
                "record_pruned_grid",
                "unit_size",
            ),
            "planning.cells",
        ),
        **dict.fromkeys(
            (
                "FAILED_STATUSES",
                "RELEASE_COLUMNS",
                "RUN_COUNT_COLUMNS",
                "SUMMARY_HEADER",
                "format_failed_cells",
                "format_outcome",
                "format_privacy",
                "format_summary",
                "cell_search_rows",
                "release_choices",
                "release_rows",
                "selection_search_row",
                "summary_table",
            ),
            "finish.outcome",
        ),
        **dict.fromkeys(("plans_that_ran", "run_search"), "driver"),
        "mode_of": "modes",
        "init_ray": "scheduling.ray_session",
        "check_every_run_recorded": "finish.outcome",
        "run_cells": "scheduling.tune_run",
        "trial_slots": "scheduling.tuners",
        **dict.fromkeys(("build_report_at", "conclude", "report_location", "search_finished"), "finished"),
    }
)

__all__ = ("SearchOptions", "main", "parse_args", *_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'dptune.search' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dptune.search.{_LAZY[name]}"), name)
