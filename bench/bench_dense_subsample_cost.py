"""The whole-search ε of a dense search run on a private subsample, against the same search on all rows.

Not end-to-end private: a dense grid releases every run (issue 23's "non-end-to-end view"). The grid
is ``bench_transfer_rules.py``'s: on the default task (N = 10,164 training rows, δ = 1e-5, E = 10),
B ∈ {16, …, 2048} × 4 clip bounds × 5 base learning rates × 3 replicates, 480 runs. Every run is
calibrated (PRV) to a per-run ε (``--epsilon``, default 4) for its full-data (q = B/N,
T = round(E·N/B)). On a subsample the runs keep that (q, T) and σ: the ``sample_rate`` rule.

- **All rows.** The RDP composition of the 480 runs, converted to (ε, δ), and, for reference, the
  PLD composition the service reports (``dptune.privacy.composition``).
- **A Poisson q₁-subsample X₁, drawn once.** The same composition is one mechanism of X₁. Zhu &
  Wang's bound (``poisson_subsampled_rdp``) amplifies it by q₁. Also shown: the whole plus one
  release trained on every row at the same per-run ε (the worst B), the price of then publishing a
  full-data model.

Accounting only, no training.

    .venv/bin/python bench/bench_dense_subsample_cost.py [--epsilon 4] [--fractions 0.125,0.25,0.5]
        [--out bench/results/dense_subsample_cost.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

N_TRAIN = 10_164
EPOCHS = 10
DELTA = 1e-5
BATCH_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)
RUNS_PER_BATCH_SIZE = 4 * 5 * 3  # clip bounds × base learning rates × replicates


def main() -> None:
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    from dptune.plan import sample_rate, total_steps
    from dptune.privacy import TrialMechanism, calibrate_noise_multiplier
    from dptune.privacy.composition import composed_epsilon
    from dptune.privacy.subsampled_tuning import ORDERS, dp_sgd_rdp, poisson_subsampled_rdp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--fractions", default="0.125,0.25,0.5")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    for batch_size in BATCH_SIZES:
        q, steps = sample_rate(N_TRAIN, batch_size), total_steps(N_TRAIN, batch_size, EPOCHS)
        runs.append(TrialMechanism(calibrate_noise_multiplier(args.epsilon, DELTA, q, steps), q, steps))
    curves = [dp_sgd_rdp(ORDERS, run) for run in runs]
    whole = RUNS_PER_BATCH_SIZE * np.sum(curves, axis=0)
    release = np.max(curves, axis=0)

    def epsilon(rdp: np.ndarray) -> float:
        return float(compute_epsilon(ORDERS, rdp, DELTA)[0])

    pld = composed_epsilon([run for run in runs for _ in range(RUNS_PER_BATCH_SIZE)], DELTA)
    rows = [{"tuned_on": "all rows", "fraction": 1.0, "epsilon_rdp": epsilon(whole), "epsilon_pld": pld}]
    for fraction in (float(f) for f in args.fractions.split(",")):
        amplified = poisson_subsampled_rdp(ORDERS, whole, fraction)
        rows.append(
            {
                "tuned_on": f"q₁ = {fraction:g}",
                "fraction": fraction,
                "epsilon_rdp": epsilon(amplified),
                "epsilon_rdp_with_release": epsilon(amplified + release),
            }
        )
    print(f"{len(runs) * RUNS_PER_BATCH_SIZE} runs at ε = {args.epsilon:g} each (δ = {DELTA:g}), whole-search ε:")
    for row in rows:
        extra = (
            f", PLD {row['epsilon_pld']:.1f}"
            if "epsilon_pld" in row
            else f", with one full-data release {row['epsilon_rdp_with_release']:.1f}"
        )
        print(f"  {row['tuned_on']:<10} RDP {row['epsilon_rdp']:.1f}{extra}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
