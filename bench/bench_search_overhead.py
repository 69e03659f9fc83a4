"""Overhead of the search service against the trials' own compute, on the embedded task.

The service's cost has two parts, measured apart in one process:

- per search (fixed): Tune's set-up and fresh trial processes (imports torch, Opacus, dptune);
  all cells of a search share one Tune run, so this is paid once per search;
- per trial (marginal): scheduling, reporting each epoch, accounting look-ups and writing the
  Parquet rows, in a reused trial process.

Method: after warming this process's imports and caches, run the same cell twice through
``dptune.search.run_cells`` (Ray started beforehand, ``max_concurrent_trials = 1``), once with
``--small`` and once with ``--large`` grid points, and run the large grid's configurations
directly with ``run_trial`` (the baseline: the trials' own compute, sequential, same process).
Then marginal overhead per trial = ((S_large − S_small) − (B_large − B_small)) / (large − small)
and fixed overhead per Tune run = S_small − B_small − small · marginal, where S is the service's
wall time and B the baseline's for the same configurations.

    python bench/bench_search_overhead.py [--max-train-examples N] [--epochs E] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEARNING_RATES = [1e-3, 3e-3, 1e-2, 3e-2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-train-examples", type=int, default=None, help="cap N (default: the full task)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--small", type=int, default=2, choices=range(1, 9), help="grid points of the small run")
    parser.add_argument("--large", type=int, default=8, choices=range(2, 9), help="grid points of the large run")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.large <= args.small:
        parser.error("--large must exceed --small")

    from dptune import search
    from dptune.data import WorkloadSpec, load_workload
    from dptune.runners.trial import run_trial
    from dptune.search.modes import mode_of
    from dptune.search.runs.execution import TrialContext, run_spec
    from dptune.space import load_space

    def cell_run(points: int, storage: str) -> tuple[float, list]:
        """Wall time of one cell run of ``points`` grid points, and the trial configs it ran."""
        overrides = {
            "privacy.epsilons": [args.epsilon],
            "epochs": [args.epochs],
            "sampler.name": "grid",
            "clip_bound": {"values": [0.1, 1.0]},
            "batch_size": {"values": [256]},
            "base_learning_rate": {"values": LEARNING_RATES[: (points + 1) // 2]},
            "resources.cpus": os.cpu_count(),
            "resources.max_concurrent_trials": 1,
            "training.compare_auto_s": False,
        }
        space = load_space(ROOT / "search_spaces/default.yaml", overrides).space
        plan = mode_of(space).plan(space, num_train, progress=False)[0]
        plan = replace(plan, configurations=points)
        context = TrialContext(
            base=search.base_trial_config(space, plan, args.max_train_examples, None),
            results_root=storage,
            search_id="bench",
            cell_id=plan.cell.cell_id,
            cell_key=plan.cell_key,
            coupling=space.coupling.rule,
            reference_batch_size=space.coupling.reference_batch_size,
            mechanisms=plan.mechanisms,
        )
        started = time.perf_counter()
        search.run_cells(space, [plan], [context], resume=False, mode=mode_of(space))
        elapsed = time.perf_counter() - started
        from dptune.records import read_table

        ran = read_table(storage, "trials")
        configs = [
            run_spec(
                context,
                {"clip_bound": r.clip_bound, "batch_size": r.batch_size, "base_learning_rate": r.base_learning_rate},
            ).config
            for r in ran.itertuples()
        ]
        return elapsed, configs

    def baseline(configs: list) -> float:
        started = time.perf_counter()
        for config in configs:
            run_trial(config)
        return time.perf_counter() - started

    workload = load_workload(
        WorkloadSpec(
            dataset="20newsgroups",
            backbone="minilm",
            peft="head",
            max_train_examples=args.max_train_examples,
            max_tokens=128,
        )
    )
    num_train = len(workload.train)
    started = time.perf_counter()
    print(search.init_ray(None), file=sys.stderr)
    ray_start_s = time.perf_counter() - started

    service_small, configs_small = cell_run(args.small, tempfile.mkdtemp(prefix="bench-small-"))
    service_large, configs_large = cell_run(args.large, tempfile.mkdtemp(prefix="bench-large-"))
    run_trial(configs_large[0])  # warm-up of this process's trial path
    baseline_small, baseline_large = baseline(configs_small), baseline(configs_large)

    marginal = ((service_large - service_small) - (baseline_large - baseline_small)) / (args.large - args.small)
    fixed = service_small - baseline_small - args.small * marginal
    figures = {
        "num_train": num_train,
        "epochs": args.epochs,
        "trials_small": len(configs_small),
        "trials_large": len(configs_large),
        "ray_start_s": round(ray_start_s, 2),
        "service_small_s": round(service_small, 2),
        "service_large_s": round(service_large, 2),
        "baseline_small_s": round(baseline_small, 2),
        "baseline_large_s": round(baseline_large, 2),
        "trial_compute_mean_s": round(baseline_large / len(configs_large), 2),
        "overhead_per_trial_s": round(marginal, 2),
        "overhead_per_tune_run_s": round(fixed, 2),
        "overhead_ratio_per_trial": round(marginal / (baseline_large / len(configs_large)), 3),
        "overhead_ratio_large_run": round(service_large / baseline_large - 1, 3),
    }
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
