"""Fused trials against sequential ``run_trial``: configurations per minute on one cell.

One cell of the default workload (20 Newsgroups, MiniLM features, peft ``head``; ε = 1, E = 10 by
default): ``--configurations`` configurations with B drawn from ``--batch-sizes``, C log-uniform
in [0.1, 10], η₀ log-uniform in [1e-4, 1e-1] coupled as η = η₀·√(B/256), fresh coins. The fused
runner trains all of them (``run_fused``); the sequential baseline runs ``run_trial`` on one
configuration per batch size (the per-configuration cost depends on B: T = E·N/B steps) and
estimates the sequential time of all of them as Σ_k t(B_k). σ of every batch size is calibrated
(and cached) before either is timed, and the workload is loaded once, so both figures are
training, evaluation and diagnostics only. Same process, same threads, same features.

Prints one JSON object: configurations per minute fused and sequential, their ratio (wall clock,
and process CPU time, which on a shared machine is the steadier figure with ``--threads 1``), and the
fused results' mean validation accuracy per B next to the sequential one (a sanity check, not a
test). Features come from the dptune cache (``DPTUNE_CACHE_DIR`` or ``~/.cache/dptune``); a cold
cache encodes the whole dataset first (~15 min on 2 cores), or use ``--max-train-examples``.

Run (from the repository root)::

    OMP_NUM_THREADS=2 nice .venv/bin/python bench/bench_fused_step.py --out build/bench/fused_step.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dptune.contract import TrialConfig, WorkloadSpec
from dptune.plan.mechanism import with_mechanism
from dptune.runners.common import cached_workload
from dptune.runners.fused import run_fused
from dptune.runners.trial import run_trial


def configurations(args: argparse.Namespace) -> list[TrialConfig]:
    """The cell's configurations: B from the list, C and η₀ log-uniform, drawn with ``--seed``."""
    rng = np.random.default_rng(args.seed)
    base = TrialConfig(
        workload=WorkloadSpec(
            dataset="20newsgroups",
            backbone="minilm",
            peft="head",
            max_train_examples=args.max_train_examples,
            max_eval_examples=args.max_eval_examples,
        ),
        epsilon=args.epsilon,
        delta=1e-5,
        epochs=args.epochs,
        clip_bound=1.0,
        batch_size=256,
        learning_rate=1e-3,
        base_learning_rate=1e-3,
        device=args.device,
        threads=args.threads,
        diagnostics=not args.no_diagnostics,
    )
    drawn = []
    for _ in range(args.configurations):
        batch_size = int(rng.choice(args.batch_sizes))
        base_rate = float(10 ** rng.uniform(-4, -1))
        drawn.append(
            replace(
                base,
                batch_size=batch_size,
                clip_bound=float(10 ** rng.uniform(-1, 1)),
                base_learning_rate=base_rate,
                learning_rate=base_rate * math.sqrt(batch_size / 256),
            )
        )
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configurations", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-train-examples", type=int, default=None)
    parser.add_argument("--max-eval-examples", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-diagnostics", action="store_true")
    parser.add_argument("--seed", type=int, default=0, help="seed of the configuration draws (not of the coins)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()

    configs = configurations(args)
    workload = cached_workload(configs[0].workload)
    num_train = len(workload.train)
    batch_sizes = sorted({c.batch_size for c in configs})
    configs = [with_mechanism(c, num_train) for c in configs]  # σ planned (calibrated once) before anything is timed

    start, start_cpu = time.perf_counter(), time.process_time()
    fused = run_fused(configs)
    fused_s, fused_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu

    sequential: dict[int, tuple[float, float, float]] = {}  # B → (wall s, CPU s, validation accuracy) of one run_trial
    for b in batch_sizes:
        config = next(c for c in configs if c.batch_size == b)
        start, start_cpu = time.perf_counter(), time.process_time()
        result = run_trial(config)
        sequential[b] = (time.perf_counter() - start, time.process_time() - start_cpu, result.val_accuracy)
    sequential_s = sum(sequential[c.batch_size][0] for c in configs)
    sequential_cpu_s = sum(sequential[c.batch_size][1] for c in configs)

    per_b = {b: float(np.mean([r.val_accuracy for r in fused if r.config.batch_size == b])) for b in batch_sizes}
    report = {
        "configurations": len(configs),
        "batch_sizes": {b: sum(c.batch_size == b for c in configs) for b in batch_sizes},
        "num_train": num_train,
        "epsilon": args.epsilon,
        "epochs": args.epochs,
        "device": fused[0].device,
        "threads": torch.get_num_threads() if args.threads is None else args.threads,
        "statuses": {s: sum(r.status == s for r in fused) for s in {r.status for r in fused}},
        "fused_s": round(fused_s, 2),
        "fused_cpu_s": round(fused_cpu_s, 2),
        "sequential_estimated_s": round(sequential_s, 2),
        "sequential_estimated_cpu_s": round(sequential_cpu_s, 2),
        "sequential_s_per_batch_size": {b: round(t, 3) for b, (t, _, _) in sequential.items()},
        "fused_configurations_per_min": round(60 * len(configs) / fused_s, 1),
        "sequential_configurations_per_min": round(60 * len(configs) / sequential_s, 1),
        "ratio": round(sequential_s / fused_s, 2),
        "ratio_cpu_time": round(sequential_cpu_s / fused_cpu_s, 2),
        "fused_mean_val_accuracy_per_batch_size": {b: round(a, 4) for b, a in per_b.items()},
        "sequential_val_accuracy_per_batch_size": {b: round(a, 4) for b, (_, _, a) in sequential.items()},
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
