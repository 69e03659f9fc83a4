"""How the whole-search composition grows with the runs: ε and seconds at 500 … 100,000 runs.

The runs are the one-epoch cells of a dense search of 20 Newsgroups (N = 10,164, δ = 1e-5): ε ∈ {1, 8}
× B ∈ {32, …, 512} (q = B/N, T = ⌈N/B⌉), σ calibrated per point by dptune, the runs spread evenly over
the ten points, every run its full T. Per size, in one process with an empty accounting cache:

- the whole search's ``privacy.compose`` (seconds, ε, accountant) and each cell's (ε = 1, ε = 8);
- dp_accounting's own reading of the same PLD (``PrivacyLossDistribution.get_epsilon_for_delta``,
  what dptune printed before: ∞ once its float64 ratio overflows);
- the RDP bound of dp_accounting's ``RdpAccountant`` on its default orders, for comparison.

    PYTHONPATH=. nice .venv/bin/python bench/bench_composition_scale.py --out bench/results/composition_scale.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

NUM_EXAMPLES = 10_164
EPSILONS = (1.0, 8.0)
BATCH_SIZES = (32, 64, 128, 256, 512)
DELTA = 1e-5
RUNS = (500, 2_000, 8_000, 32_000, 100_000)


def measure(runs: int, points: list[tuple[float, float, float, int]]) -> dict[str, object]:
    """One size: ``runs`` spread over ``points`` (ε, σ, q, T)."""
    from dptune.privacy import composition

    per_point = runs // len(points)
    mechanisms = [composition.TrialMechanism(s, q, t) for _, s, q, t in points for _ in range(per_point)]
    start = time.perf_counter()
    whole = composition.compose(mechanisms, DELTA)
    seconds = time.perf_counter() - start
    cells = {
        str(epsilon): composition.composed_epsilon(
            [composition.TrialMechanism(s, q, t) for e, s, q, t in points if e == epsilon for _ in range(per_point)],
            DELTA,
        )
        for epsilon in EPSILONS
    }
    groups = composition.grouped(mechanisms)
    pld = composition._self_composed_pld(groups[0].noise_multiplier, groups[0].sample_rate, groups[0].steps)
    for group in groups[1:]:
        pld = pld.compose(composition._self_composed_pld(group.noise_multiplier, group.sample_rate, group.steps))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        library = float(pld.get_epsilon_for_delta(DELTA))
    start = time.perf_counter()
    rdp = composition._rdp_epsilon(groups, DELTA)
    return {
        "runs": per_point * len(points),
        "epsilon": whole.epsilon,
        "accountant": whole.accountant,
        "seconds": round(seconds, 2),
        "cells": cells,
        "sum_of_cells": math.fsum(cells.values()),
        "library_reading": library,
        "rdp": rdp,
        "rdp_seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dptune-bench-composition-") as cache:
        os.environ["DPTUNE_CACHE_DIR"] = cache
        from dptune.privacy import calibrate_noise_multiplier

        points = []
        for epsilon in EPSILONS:
            for batch_size in BATCH_SIZES:
                q, steps = batch_size / NUM_EXAMPLES, math.ceil(NUM_EXAMPLES / batch_size)
                points.append((epsilon, calibrate_noise_multiplier(epsilon, DELTA, q, steps), q, steps))
        rows = []
        for runs in RUNS:
            rows.append(measure(runs, points))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"delta": DELTA, "points": points, "sizes": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
