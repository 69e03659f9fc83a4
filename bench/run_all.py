"""Run the CPU benchmarks that need no GPU and no Ray cluster (``make bench``), one after another.

1. ``bench_dp_step.py --device cpu --threads 1``: one DP step vs the plain step (FiLM engine,
   Opacus hooks), written to ``build/bench/dp_step_cpu.{json,md}`` (git-ignored; ≈ 1–2 min);
2. ``bench_20ng_accuracy.py --epsilon 8``: DP vs non-private linear probe on 20 Newsgroups +
   MiniLM features (≈ 1 min with the feature cache; the first run encodes the corpus, which
   took 863 s on 2 busy cores);
3. ``bench_search_efficiency.py``: samplers simulated against the replicated grid of ε = 1,
   E = 10 (seconds from the grid's Parquet cache in ``bench/results/``; without it the fused
   runner recomputes the grid, ≈ 25 min on 2 busy cores).

The Ray-based benches (``bench_search_overhead.py``, ``bench_engine_agreement.py``,
``bench_fused_throughput.py``) and the CUDA cases of ``bench_dp_step.py`` are run by hand (see
``bench/README.md``). Exits non-zero as soon as one bench fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
COMMANDS: list[list[str]] = [
    [
        "bench_dp_step.py",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--out",
        str(BENCH.parent / "build" / "bench" / "dp_step_cpu"),
    ],
    ["bench_20ng_accuracy.py", "--epsilon", "8"],
    ["bench_search_efficiency.py"],
]


def main() -> int:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    for script, *arguments in COMMANDS:
        command = [sys.executable, str(BENCH / script), *arguments]
        print("$", " ".join(command), flush=True)
        done = subprocess.run(command, cwd=BENCH.parent, env=environment, check=False)
        if done.returncode != 0:
            print(f"{script} failed with exit status {done.returncode}", file=sys.stderr)
            return done.returncode
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
