"""Driver-side pieces of the search that need no Ray: trial counts, ids, configs, summaries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dptune.contract import TrialResult
from dptune.plan import coupled_learning_rate
from dptune.plan.mechanism import wrapped
from dptune.records import ResultsStore, trial_rows
from dptune.records.ids import configuration_id
from dptune.search import CellPlan, base_trial_config, format_summary, summary_table
from dptune.search.planning.cells import _trial_count
from dptune.search.runs.execution import TrialContext, run_spec
from dptune.space import Cell, SpaceError, parse_space

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = (ROOT / "search_spaces" / "default.yaml").read_text()


def plan_for(space, clipping: str = "normalized") -> CellPlan:  # noqa: ANN001
    return CellPlan(Cell(1.0, 5), clipping, 1000, (32, 64), (512,), wrapped({32: 1.0, 64: 1.5}, 1.0, 1e-5, 1000, 5), 0)


def test_random_trial_count_is_geometric_with_the_planned_mean() -> None:
    counts = []
    for seed in range(400):
        space = parse_space(
            DEFAULT,
            "d.yaml",
            {"sampler.name": "random", "sampler.random_trial_count": True, "sampler.trials_per_cell": 8, "seed": seed},
        ).space
        counts.append(_trial_count(space, plan_for(space)))
    counts = np.array(counts)
    assert counts.min() >= 1
    assert counts.mean() == pytest.approx(8, rel=0.15)  # mean trials_per_cell; sd of the mean ≈ 0.37
    assert (counts == 1).mean() == pytest.approx(1 / 8, abs=0.05)  # P(K = 1) = γ
    fixed = parse_space(DEFAULT, "d.yaml").space
    assert _trial_count(fixed, plan_for(fixed)) == fixed.sampler.trials_per_cell == 40


def test_random_trial_count_needs_the_random_sampler() -> None:
    with pytest.raises(SpaceError, match="random_trial_count needs sampler 'random'"):
        parse_space(DEFAULT, "d.yaml", {"sampler.name": "tpe", "sampler.random_trial_count": True})


def test_grid_trial_count_covers_feasible_points_only() -> None:
    space = parse_space(
        DEFAULT,
        "g.yaml",
        {
            "sampler.name": "grid",
            "clip_bound": {"values": [0.1, 1, 10]},
            "base_learning_rate": {"values": [1e-3, 1e-2]},
        },
    ).space
    assert _trial_count(space, plan_for(space)) == 3 * 2 * 2
    assert _trial_count(space, plan_for(space, "auto_s")) == 1 * 2 * 2  # AUTO-S has no C


def test_configuration_id_is_content_based() -> None:
    a = configuration_id("eps1-E5", {"clip_bound": 0.5, "batch_size": 64, "base_learning_rate": 1e-3})
    b = configuration_id("eps1-E5", {"base_learning_rate": 1e-3, "batch_size": 64.0, "clip_bound": 0.5})
    c = configuration_id("eps1-E5", {"clip_bound": 0.5, "batch_size": 128, "base_learning_rate": 1e-3})
    assert a == b != c and a.startswith("eps1-E5-")
    assert configuration_id("eps2-E5", {"clip_bound": 0.5, "batch_size": 64, "base_learning_rate": 1e-3}) != a


def context_for(space, plan: CellPlan, root: str = "/nowhere") -> TrialContext:  # noqa: ANN001
    return TrialContext(
        base=base_trial_config(space, plan, None, None),
        results_root=root,
        search_id="s",
        cell_id=plan.cell.cell_id,
        cell_key=plan.cell_key,
        coupling=space.coupling.rule,
        reference_batch_size=space.coupling.reference_batch_size,
    )


def test_run_spec_applies_sqrt_b_coupling_or_none() -> None:
    space = parse_space(DEFAULT, "d.yaml").space
    plan = plan_for(space)
    config = run_spec(
        context_for(space, plan), {"clip_bound": 0.3, "batch_size": 64, "base_learning_rate": 0.01}
    ).config
    assert (config.clip_bound, config.batch_size, config.base_learning_rate) == (0.3, 64, 0.01)
    assert config.learning_rate == pytest.approx(coupled_learning_rate(0.01, 64, 256)) == pytest.approx(0.005)
    assert (config.epsilon, config.epochs, config.clipping) == (1.0, 5, "normalized")
    assert config.workload.dataset == "20newsgroups"
    off = parse_space(DEFAULT, "d.yaml", {"coupling.rule": "none"}).space
    uncoupled = run_spec(
        context_for(off, plan), {"clip_bound": 0.3, "batch_size": 64, "base_learning_rate": 0.01}
    ).config
    assert uncoupled.learning_rate == 0.01


def test_summary_selects_on_validation_not_test(tmp_path: Path) -> None:
    space = parse_space(DEFAULT, "d.yaml").space
    plan = plan_for(space)
    context = context_for(space, plan, str(tmp_path))
    store = ResultsStore(str(tmp_path))
    for val, test, b in ((0.60, 0.90, 32), (0.70, 0.50, 64)):  # the best on test is not the best on val
        params = {"clip_bound": 1.0, "batch_size": b, "base_learning_rate": 1e-3}
        result = TrialResult(config=run_spec(context, params).config, status="ok", val_accuracy=val, test_accuracy=test)
        store.write_trial(
            trial_rows(
                result,
                search_id="s",
                trial_id=configuration_id(plan.cell_key, params),
                cell_id=plan.cell.cell_id,
                reference_batch_size=256,
                versions={},
                finished_at=pd.Timestamp.now(tz="UTC"),
            ),
            configuration_id(plan.cell_key, params),
        )
    best = summary_table(str(tmp_path))
    assert best["batch_size"].tolist() == [64] and best["test_accuracy"].tolist() == [0.5]
    assert "0.7" in format_summary(best)
