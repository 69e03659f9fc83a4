"""Overhead of the search service per trial, against the trial's own compute, on the embedded task.

Baseline and service run the *same* configurations in the same process, one trial at a time:

1. baseline: ``run_trial(config)`` called directly, sequentially (after one warm-up trial, so
   both sides start with warm imports and a warm feature cache);
2. service: the same grid through ``dptune.search`` (Ray Tune + Optuna, records written),
   ``max_concurrent_trials = 1``, Ray started beforehand (its start-up is reported apart).

overhead per trial = (service wall − baseline wall) / trials; the ratio that matters is
service wall / baseline wall − 1 (target: under 10%).

    python bench/bench_search_overhead.py [--max-train-examples N] [--epochs E] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-train-examples", type=int, default=None, help="cap N (default: the full task)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()

    from dptune import search
    from dptune.records import read_table
    from dptune.trial import run_trial

    storage = tempfile.mkdtemp(prefix="bench-overhead-")
    overrides = {
        "privacy.epsilons": [args.epsilon], "epochs": [args.epochs], "sampler.name": "grid",
        "clip_bound": {"values": [0.1, 1.0]}, "batch_size": {"values": [64, 256]},
        "base_learning_rate": {"values": [3e-3]}, "resources.cpus": os.cpu_count(),
        "resources.max_concurrent_trials": 1, "training.compare_auto_s": False,
    }
    options = search.SearchOptions(
        space_path=ROOT / "search_spaces/default.yaml", storage=storage, name="overhead", address=None,
        resume=False, dry_run=False, report=False, overrides=overrides,
        max_train_examples=args.max_train_examples, max_eval_examples=None)

    started = time.perf_counter()
    print(search.init_ray(None), file=sys.stderr)
    ray_start_s = time.perf_counter() - started

    cell_started = time.perf_counter()
    root = search.run_search(options)
    service_s = time.perf_counter() - cell_started
    trials = read_table(root, "trials")
    ran = trials[trials["status"] == "ok"]
    configs = []
    for text in ran["config"]:
        fields = json.loads(text)
        fields["classes"] = tuple(fields["classes"]) if fields["classes"] else None
        configs.append(search.TrialConfig(**fields))

    run_trial(configs[0])  # warm-up: imports, caches, the first Opacus/engine set-up
    baseline_started = time.perf_counter()
    for config in configs:
        run_trial(config)
    baseline_s = time.perf_counter() - baseline_started

    figures = {
        "trials": len(configs), "num_train": int(ran["num_train"].iloc[0]), "epochs": args.epochs,
        "baseline_wall_s": round(baseline_s, 2), "service_wall_s": round(service_s, 2),
        "ray_start_s": round(ray_start_s, 2),
        "overhead_per_trial_s": round((service_s - baseline_s) / len(configs), 2),
        "overhead_ratio": round(service_s / baseline_s - 1, 3),
        "trial_wall_recorded_s": round(float(ran["wall_time_s"].sum()), 2),
    }
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
