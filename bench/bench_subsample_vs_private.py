"""Tuning on a private subsample against today's end-to-end private mode, at equal ε_total.

Both modes release one model for one (ε_total, δ = 1e-5) covering the tuning and the release, on the
default workload (20 Newsgroups, cached MiniLM features, DP linear head, DP-Adam, normalized
clipping, √B coupling, E = 10, 10 random-search runs on average, score noise σ_s = 5):

- ``private``: ``search_spaces/private.yaml``. A secret K of runs on every training row at the per-run
  ε of Papernot & Steinke's bound; the released model is the best noisy score's run.
- ``subsample``: ``search_spaces/private_subsample.yaml`` (q₁ = ``--fraction``, rule ``--transfer``).
  The K runs tune on a fresh Poisson X₁ of the training and validation rows with their public
  schedules; the best noisy score's configuration then trains the release on every training row, at
  the per-run ε of Koskela & Kulkarni's bound.

Each procedure runs as the service runs it, without Ray. The planner draws K from fresh OS entropy,
the cell's secret sampler proposes, ``execution.run_spec`` couples η (and gives a tuning run its
public schedule), ``draw_tuning_rows`` draws X₁, and the fused runner trains with fresh coins.
Reported per (ε_total, mode), over ``--repetitions`` independent procedures: the released model's
test accuracy (mean, 95 % t interval, range); K; the compute in trial-epochs (a run's epochs times
the share of the training rows it trains on: 1 for a full-data run, q₁ for a tuning run on X₁, so
a run on X₁ costs about q₁ of one on the full data); wall seconds; the per-run ε; and, for the
subsample mode, the planned ε of the tuning alone and of the release alone.

    nice .venv/bin/python bench/bench_subsample_vs_private.py [--epsilons 1,4,8] [--repetitions 5]
        [--fraction 0.25] [--transfer sample_rate] [--out bench/results/subsample_vs_private.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SPACES = {
    "private": ROOT / "search_spaces" / "private.yaml",
    "subsample": ROOT / "search_spaces" / "private_subsample.yaml",
}


def procedure(mode: str, epsilon_total: float, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """One end-to-end private tuning of ``mode`` at ``epsilon_total``: what it releases and what it cost."""
    from dptune.data import load_workload
    from dptune.errors import SearchError
    from dptune.runners.fused import run_fused
    from dptune.search.modes import mode_of
    from dptune.search.planning.cells import base_trial_config, cell_spec, task_workload
    from dptune.search.planning.sampler import CellSampler
    from dptune.search.planning.subsample import draw_tuning_rows, on_tuning_rows, public_schedules, release_context
    from dptune.search.runs.execution import TrialContext, run_spec
    from dptune.space import load_space

    overrides: dict[str, Any] = {"privacy.private_selection.epsilon": epsilon_total}
    if mode == "subsample":
        overrides["privacy.private_selection.tuning_subsample"] = {"fraction": args.fraction, "transfer": args.transfer}
    space = load_space(SPACES[mode], overrides).space
    started = time.perf_counter()
    workload = load_workload(task_workload(space, None, None))
    try:
        (plan,) = mode_of(space).plan(space, len(workload.train), progress=False)  # K from fresh OS entropy
    except SearchError as error:  # the total cannot pay for the mode's mean number of runs
        return {"mode": mode, "epsilon_total": epsilon_total, "unreachable": str(error)}
    base = base_trial_config(space, plan, None, None)
    schedules = None
    if plan.tuning is not None:
        rows = draw_tuning_rows(str(scratch), len(workload.train), len(workload.val), plan.tuning.fraction)
        base = on_tuning_rows(base, rows)
        schedules = public_schedules(plan.tuning, plan.num_train, plan.cell.epochs)
    context = TrialContext(
        base=base,
        results_root=str(scratch),
        search_id="bench",
        cell_id=plan.cell.cell_id,
        cell_key=plan.cell_key,
        coupling=space.coupling.rule,
        reference_batch_size=space.coupling.reference_batch_size,
        mechanisms=plan.mechanisms if plan.tuning is None else plan.tuning.mechanisms,
        schedules=schedules,
    )
    proposals = CellSampler(cell_spec(space, plan)).ask(plan.configurations, on_pruned=lambda params: None)
    runs = run_fused([run_spec(context, params).config for params in proposals])
    finished = [(r.noisy_val_accuracy, i) for i, r in enumerate(runs) if r.status == "ok"]
    share = plan.tuning.fraction if plan.tuning is not None else 1.0
    trial_epochs = share * plan.cell.epochs * len(runs)
    released = None
    if finished:
        best = runs[max(finished)[1]]
        released = best.test_accuracy
        if plan.tuning is not None:
            chosen = {
                "clip_bound": best.config.clip_bound,
                "batch_size": best.config.batch_size,
                "base_learning_rate": best.config.base_learning_rate,
            }
            (release,) = run_fused([run_spec(release_context(context, plan.tuning), chosen).config])
            released = release.test_accuracy if release.status == "ok" else None
            trial_epochs += plan.cell.epochs
    return {
        "mode": mode,
        "epsilon_total": epsilon_total,
        "runs": len(runs),
        "epsilon_per_run": plan.cell.epsilon,
        "epsilon_tuning": plan.tuning.epsilon_tuning if plan.tuning is not None else None,
        "epsilon_release": plan.tuning.epsilon_release if plan.tuning is not None else None,
        "released_test_accuracy": released,
        "trial_epochs": trial_epochs,
        "seconds": time.perf_counter() - started,
    }


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (ε_total, mode): the released test accuracy's mean, 95 % t interval and range, and the costs' means."""
    from scipy import stats

    table = []
    for key in sorted({(r["epsilon_total"], r["mode"]) for r in rows}):
        mine = [r for r in rows if (r["epsilon_total"], r["mode"]) == key]
        if any("unreachable" in r for r in mine):
            table.append({"epsilon_total": key[0], "mode": key[1], "unreachable": mine[0]["unreachable"]})
            continue
        accuracy = np.array([r["released_test_accuracy"] for r in mine if r["released_test_accuracy"] is not None])
        half = stats.t.ppf(0.975, len(accuracy) - 1) * accuracy.std(ddof=1) / np.sqrt(len(accuracy))
        table.append(
            {
                "epsilon_total": key[0],
                "mode": key[1],
                "repetitions": len(mine),
                "released": len(accuracy),
                "test_mean": float(accuracy.mean()),
                "test_low": float(accuracy.mean() - half),
                "test_high": float(accuracy.mean() + half),
                "test_min": float(accuracy.min()),
                "test_max": float(accuracy.max()),
                "runs_mean": float(np.mean([r["runs"] for r in mine])),
                "trial_epochs_mean": float(np.mean([r["trial_epochs"] for r in mine])),
                "seconds_mean": float(np.mean([r["seconds"] for r in mine])),
                "epsilon_per_run": mine[0]["epsilon_per_run"],
                "epsilon_tuning": mine[0]["epsilon_tuning"],
                "epsilon_release": mine[0]["epsilon_release"],
            }
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilons", default="1,4,8")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--transfer", default="sample_rate", choices=("sample_rate", "batch_size"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-subsample-") as scratch:
        for repetition in range(args.repetitions):  # the modes interleaved, so a drift of the machine favours none
            for epsilon_total in (float(x) for x in args.epsilons.split(",")):
                for mode in ("private", "subsample"):
                    folder = Path(scratch) / f"{mode}-{epsilon_total:g}-{repetition}"
                    row = procedure(mode, epsilon_total, args, folder)
                    rows.append(row)
                    if "unreachable" in row:
                        print(f"ε_total {epsilon_total:g}, {mode}: {row['unreachable']}", flush=True)
                        continue
                    print(
                        f"ε_total {epsilon_total:g}, {mode:<9} #{repetition}: K = {row['runs']:>2}, released test "
                        f"accuracy {row['released_test_accuracy']}, {row['trial_epochs']:.1f} trial-epochs, "
                        f"{row['seconds']:.0f} s",
                        flush=True,
                    )
    table = summarise(rows)
    for r in table:
        if "unreachable" in r:
            print(f"ε_total {r['epsilon_total']:g} {r['mode']:<9} unreachable")
            continue
        print(
            f"ε_total {r['epsilon_total']:g} {r['mode']:<9} test {100 * r['test_mean']:.2f} % "
            f"[{100 * r['test_low']:.2f}, {100 * r['test_high']:.2f}] (range {100 * r['test_min']:.2f}–"
            f"{100 * r['test_max']:.2f}), K {r['runs_mean']:.1f}, {r['trial_epochs_mean']:.1f} trial-epochs, "
            f"{r['seconds_mean']:.0f} s, ε per run {r['epsilon_per_run']:.3g}"
        )
    figures = {
        "args": vars(args) | {"out": str(args.out)},
        "rows": rows,
        "table": table,
        "seconds": time.perf_counter() - started,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
