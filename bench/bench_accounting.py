"""Cold-cache speed of dptune's privacy accounting on the default search (a newcomer's first ``make run``).

Two phases, in one fresh process with an empty accounting cache (``DPTUNE_CACHE_DIR`` set to a new
temporary folder, so nothing is a memo or disk hit):

1. σ calibration of the default space's 28 points: ε ∈ {1, 8} × E ∈ {5, 20} × B ∈ {32, …, 2048},
   q = B/N, T = round(E·N/B) (``plan.total_steps``), N = 10,164 (the 20 Newsgroups training split);
2. the five compositions the search reports: each cell's 80 trials (40 configurations × 2 replicates,
   spread over the 7 batch sizes: 12, 12, 12, 12, 12, 10, 10 trials; every trial runs its full T at its
   cell's calibrated σ) and the whole search's 320 trials.

Seconds include the imports each phase triggers (scipy, prv_accountant, dp_accounting), as a cold
run pays them. Output: one JSON object (seconds, σ and ε per point) to stdout and to ``--out``.

    PYTHONPATH=. nice .venv/bin/python bench/bench_accounting.py --out bench/results/accounting_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

EPSILONS = (1.0, 8.0)
EPOCHS = (5, 20)
BATCH_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
#: Trials per batch size in one cell: 40 configurations (6, 6, 6, 6, 6, 5, 5 per B) × 2 replicates.
TRIALS_PER_BATCH_SIZE = (12, 12, 12, 12, 12, 10, 10)
DELTA = 1e-5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-examples", type=int, default=10_164)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dptune-bench-accounting-") as cache:
        os.environ["DPTUNE_CACHE_DIR"] = cache
        result = measure(args.num_examples)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


def measure(num_examples: int) -> dict[str, object]:
    """Both phases in this process, against whatever ``DPTUNE_CACHE_DIR`` holds (empty: cold)."""
    from dptune import plan, privacy

    cells: dict[tuple[float, int], list[privacy.TrialMechanism]] = {}
    calibrations = []
    start = time.perf_counter()
    for epsilon in EPSILONS:
        for epochs in EPOCHS:
            cells[epsilon, epochs] = []
            for batch_size, trials in zip(BATCH_SIZES, TRIALS_PER_BATCH_SIZE, strict=True):
                rate = plan.sample_rate(num_examples, batch_size)
                steps = plan.total_steps(num_examples, batch_size, epochs)
                began = time.perf_counter()
                sigma = privacy.calibrate_noise_multiplier(epsilon, DELTA, rate, steps)
                calibrations.append(
                    {
                        "epsilon": epsilon,
                        "epochs": epochs,
                        "batch_size": batch_size,
                        "sample_rate": rate,
                        "steps": steps,
                        "noise_multiplier": sigma,
                        "seconds": round(time.perf_counter() - began, 3),
                    }
                )
                cells[epsilon, epochs] += [privacy.TrialMechanism(sigma, rate, steps)] * trials
    calibration_seconds = time.perf_counter() - start

    compositions = []
    start = time.perf_counter()
    for (epsilon, epochs), mechanisms in [*cells.items(), (("all", "all"), sum(cells.values(), []))]:
        began = time.perf_counter()
        composed = privacy.composed_epsilon(mechanisms, DELTA)
        compositions.append(
            {
                "epsilon": epsilon,
                "epochs": epochs,
                "trials": len(mechanisms),
                "epsilon_composed": composed,
                "seconds": round(time.perf_counter() - began, 3),
            }
        )
    composition_seconds = time.perf_counter() - start

    return {
        "num_examples": num_examples,
        "delta": DELTA,
        "cpu_count": os.cpu_count(),
        "calibration_seconds": round(calibration_seconds, 2),
        "composition_seconds": round(composition_seconds, 2),
        "calibrations": calibrations,
        "compositions": compositions,
    }


if __name__ == "__main__":
    main()
