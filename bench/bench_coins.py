"""Cost of the full-state coins (``dptune.dp.coins``, issue 19 item 4) against ``manual_seed`` coins.

Both measured in one process, interleaved (old, new, old, new, … ``--repeats`` rounds; medians):

1. per trial, building the coins: old = ``SeedSequence(None).generate_state(4, uint64)``, then
   ``torch.manual_seed(init)`` and three ``torch.Generator().manual_seed(word)`` (Poisson
   sampling, Gaussian noise, score noise); new = ``trial_coins(None)`` (four spawned children),
   ``torch.manual_seed(init_seed(...))``, two ``cpu_generator`` and one CPU ``DeviceCoins``;
2. per step, the draws of a trial of the default workload: N uniforms of Opacus' Poisson mask
   (N = 10,164, the 20 Newsgroups training split) and d standard normals of the noise
   (d = 385 · 20 = 7,700, the MiniLM linear head), from generators built each way, with the
   (no-op on the CPU) ``DeviceCoins.refresh`` in the new loop;
3. the host-side part of the CUDA refresh the new code adds per step (two 64-bit words from the
   PCG64 stream; the CUDA ``manual_seed``/``set_offset`` calls themselves are not measured here).

Output: one JSON object to stdout and ``--out`` (µs, ratios new/old, the machine's ``lscpu``
model name and core count).

    OMP_NUM_THREADS=1 PYTHONPATH=. nice .venv/bin/python bench/bench_coins.py --out bench/results/coins_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dptune.dp.coins import DeviceCoins, cpu_generator, init_seed, trial_coins

NUM_TRAIN = 10_164
PARAMETERS = 385 * 20
CPU = torch.device("cpu")


def build_old() -> tuple[torch.Generator, torch.Generator, torch.Generator]:
    words = np.random.SeedSequence(None).generate_state(4, dtype=np.uint64)
    torch.manual_seed(int(words[0]))
    return tuple(torch.Generator().manual_seed(int(w)) for w in words[1:])  # type: ignore[return-value]


def build_new() -> tuple[torch.Generator, DeviceCoins, torch.Generator]:
    coins = trial_coins(None)
    torch.manual_seed(init_seed(coins.init))
    return cpu_generator(coins.sampling), DeviceCoins(coins.noise, CPU), cpu_generator(coins.score)


def per_call_us(function: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls * 1e6


def lscpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--trials", type=int, default=300, help="constructions timed per round")
    parser.add_argument("--steps", type=int, default=300, help="steps of draws timed per round")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)

    sampling_old, noise_old, _ = build_old()
    sampling_new, noise_new, _ = build_new()

    def step_old() -> None:
        torch.rand(NUM_TRAIN, generator=sampling_old)
        torch.randn(PARAMETERS, generator=noise_old)

    def step_new() -> None:
        torch.rand(NUM_TRAIN, generator=sampling_new)
        noise_new.refresh()
        torch.randn(PARAMETERS, generator=noise_new.generator)

    stream = np.random.Generator(np.random.PCG64(np.random.SeedSequence()))

    def refresh_host() -> None:
        key, offset = (int(x) for x in stream.integers(0, 2**64, size=2, dtype=np.uint64))
        _ = offset - offset % 4, key

    rounds: dict[str, list[float]] = {
        k: [] for k in ("build_old", "build_new", "step_old", "step_new", "cuda_refresh_host")
    }
    for _ in range(args.repeats):
        rounds["build_old"].append(per_call_us(build_old, args.trials))
        rounds["build_new"].append(per_call_us(build_new, args.trials))
        rounds["step_old"].append(per_call_us(step_old, args.steps))
        rounds["step_new"].append(per_call_us(step_new, args.steps))
        rounds["cuda_refresh_host"].append(per_call_us(refresh_host, args.steps * 10))
    median = {k: statistics.median(v) for k, v in rounds.items()}
    result = {
        "machine": lscpu_model(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "threads": 1,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "num_train": NUM_TRAIN,
        "parameters": PARAMETERS,
        "repeats": args.repeats,
        "median_us": {k: round(v, 2) for k, v in median.items()},
        "ratio_build_new_over_old": round(median["build_new"] / median["build_old"], 3),
        "ratio_step_new_over_old": round(median["step_new"] / median["step_old"], 3),
        "rounds_us": {k: [round(x, 2) for x in v] for k, v in rounds.items()},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
