"""What tuning on a private subsample buys in privacy: the per-run ε that one total budget allows.

For the end-to-end private search of ``search_spaces/private.yaml`` (20 Newsgroups, N = 10,164
training rows, δ = 1e-5, 10 epochs, batch sizes 32…2048, Papernot–Steinke selection with a
geometric number of runs of mean 10 and validation-count noise σ_s = 5), at each total ε:

- today's private mode (``plan_private_selection``): every candidate trains on the full data and
  the selected run is the release; its per-run ε is what each run, the release included, gets;
- tuning on a Poisson subsample of rate q₁ (``plan_subsampled_tuning``, Koskela & Kulkarni 2023,
  variant 1), the configuration transferred by keeping the sample rate q = B/N (so a tuning run and
  the release share (q, T) and σ), then one release trained on the full data: the per-run ε, and
  how the total splits into the amplified tuning and the release (each alone, at δ).

Accounting only: no training. The utility side (does a configuration tuned on X₁ transfer?) needs
the searches of issue 23 and is not measured here.

    .venv/bin/python bench/bench_subsampled_tuning.py --out bench/results/subsampled_tuning_accounting.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dptune.privacy import PrivacyParameterError, plan_private_selection
from dptune.privacy.subsampled_tuning import plan_subsampled_tuning

N_TRAIN = 10_164
EPOCHS = 10
BATCH_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
DELTA = 1e-5
MEAN_TRIALS = 10.0
SCORE_NOISE = 5.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--totals", default="1,4,8", help="total ε budgets, comma-separated")
    parser.add_argument("--fractions", default="0.1,0.2,0.5", help="tuning fractions q₁, comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = [(batch / N_TRAIN, round(EPOCHS * N_TRAIN / batch)) for batch in BATCH_SIZES]
    rows = []
    for total in (float(t) for t in args.totals.split(",")):
        modes = [("private selection on the full data (today)", 1.0)] + [
            (f"tuning on a q₁ = {f:g} subsample, release on the full data", f)
            for f in (float(f) for f in args.fractions.split(","))
        ]
        for mode, fraction in modes:
            start = time.perf_counter()
            row: dict = {"epsilon_total": total, "mode": mode, "tuning_fraction": fraction}
            try:
                if fraction == 1.0:
                    today = plan_private_selection(
                        total, DELTA, MEAN_TRIALS, *zip(*runs, strict=True), score_noise_multiplier=SCORE_NOISE
                    )
                    row |= {
                        "epsilon_per_run": today.epsilon_per_trial,
                        "epsilon_bound": today.epsilon_selection,
                        "epsilon_tuning": today.epsilon_selection,
                        "epsilon_release": None,
                    }
                else:
                    plan = plan_subsampled_tuning(
                        total, DELTA, fraction, MEAN_TRIALS, runs, runs, score_noise_multiplier=SCORE_NOISE
                    )
                    row |= {
                        "epsilon_per_run": plan.epsilon_per_run,
                        "epsilon_bound": plan.cost.epsilon,
                        "epsilon_tuning": plan.cost.epsilon_tuning,
                        "epsilon_release": plan.cost.epsilon_release,
                    }
            except PrivacyParameterError as error:
                row["unreachable"] = str(error)
            rows.append(row | {"seconds": time.perf_counter() - start})
        print(f"ε_total = {total:g} done", flush=True)
    print("\n| ε total | mode | per-run ε | bound | tuning alone | release alone |\n|---|---|---|---|---|---|")
    for row in rows:
        if "unreachable" in row:
            print(f"| {row['epsilon_total']:g} | {row['mode']} | unreachable | | | |")
            continue
        release = "–" if row["epsilon_release"] is None else f"{row['epsilon_release']:.2f}"
        print(
            f"| {row['epsilon_total']:g} | {row['mode']} | {row['epsilon_per_run']:.2f} | {row['epsilon_bound']:.2f} "
            f"| {row['epsilon_tuning']:.2f} | {release} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
