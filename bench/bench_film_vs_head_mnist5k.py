"""FiLM against a head-only probe on the embedded image workload, at the same ε, on the same split.

Runs the search of ``search_spaces/mnist5k_efficientnet_film.yaml`` (MNIST-5k on EfficientNet-Lite0,
FiLM on the frozen-statistics BatchNorm layers + head) and the same space with ``task.peft=head``
(a DP linear probe on the frozen backbone's cached features). Both use the space's random sampler
with the same seed, so each cell tries the same (C, B, η₀) draws for both methods: a paired
comparison. Per cell (ε): the best trial on validation and its test accuracy, every trial's
status and ε spent, and the wall time of each search (embedded Ray, as a user runs it). Then
builds the report of the FiLM search (``python -m dptune.report``) to check its figures.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_film_vs_head_mnist5k.py --out build/bench/film_vs_head

Writes ``<out>.json`` (every trial) and ``<out>.md`` (the table for ``bench/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from dptune.records import read_table

SPACE = "search_spaces/mnist5k_efficientnet_film.yaml"
COLUMNS = [
    "epsilon",
    "status",
    "clip_bound",
    "batch_size",
    "base_learning_rate",
    "val_accuracy",
    "test_accuracy",
    "epsilon_spent",
    "wall_time_s",
    "engine",
]


def run(command: list[str]) -> float:
    """Run ``command`` (output passed through); return its wall time in seconds."""
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def search(storage: Path, peft: str, extra: list[str]) -> tuple[float, list[dict]]:
    """Wall time and trial rows of the image space's search with ``peft``."""
    seconds = run(
        [
            sys.executable,
            "-m",
            "dptune.search",
            "--space",
            SPACE,
            "--storage",
            str(storage),
            "--name",
            peft,
            "--set",
            f"task.peft={peft}",
            "--no-report",
            *extra,
        ]
    )
    trials = read_table(str(storage / peft), "trials")
    return seconds, trials[COLUMNS].to_dict("records")


def best_per_epsilon(rows: list[dict]) -> dict[float, dict]:
    """The best ``ok`` trial of each ε on validation accuracy."""
    best: dict[float, dict] = {}
    for row in rows:
        incumbent = best.get(row["epsilon"])
        if row["status"] == "ok" and (incumbent is None or row["val_accuracy"] > incumbent["val_accuracy"]):
            best[row["epsilon"]] = row
    return best


def markdown(results: dict) -> str:
    lines = [
        "| ε | method | best val acc | its test acc | its (C, B, η₀) | trials ok | max ε spent | search wall time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for epsilon in sorted({row["epsilon"] for row in results["film"]["trials"]}):
        for method in ("film", "head"):
            rows = [row for row in results[method]["trials"] if row["epsilon"] == epsilon]
            best = best_per_epsilon(rows).get(epsilon)
            ok = sum(row["status"] == "ok" for row in rows)
            spent = max(row["epsilon_spent"] for row in rows)
            setting = (
                "—"
                if best is None
                else f"({best['clip_bound']:.3g}, {best['batch_size']}, {best['base_learning_rate']:.3g})"
            )
            val, test = ("—", "—") if best is None else (f"{best['val_accuracy']:.4f}", f"{best['test_accuracy']:.4f}")
            lines.append(
                f"| {epsilon:g} | {method} | {val} | {test} | {setting} | {ok}/{len(rows)} | {spent:.4f} | "
                f"{results[method]['wall_s']:.0f} s |"
            )
    lines.append(f"\nreport of the FiLM search built in {results['report_wall_s']:.0f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="build/bench/film_vs_head_mnist5k", help="output path without suffix")
    parser.add_argument("--storage", default="build/bench/film_vs_head_results", help="where the two searches write")
    parser.add_argument("--max-train-examples", type=int, help="cap the training set (a quick check)")
    args = parser.parse_args()
    storage = Path(args.storage)
    extra = (
        ["--max-train-examples", str(args.max_train_examples), "--set", "min_steps=5"]
        if args.max_train_examples
        else []
    )
    results: dict = {}
    for peft in ("film", "head"):
        wall_s, trials = search(storage, peft, extra)
        results[peft] = {"wall_s": wall_s, "trials": trials}
    results["report_wall_s"] = run(
        [sys.executable, "-m", "dptune.report", str(storage / "film"), "--out", str(storage / "report-film")]
    )
    results["report_figures"] = sorted(p.name for p in (storage / "report-film").glob("*.png"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=float))
    table = markdown(results)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
