"""Does a DP search give the same accuracies with the FiLM engine as with Opacus?

Runs the same grid search on the embedded task three times through ``python -m dptune.search``:
engine ``film`` (seed 0), engine ``opacus`` (seed 0) and engine ``opacus`` (seed 1). Both
engines compute the same clipped sum and take their noise from the trial's seeded generator;
seed 1 shows how much accuracy moves between two noise draws of one engine (seed noise). The
agreement holds when the FiLM-vs-Opacus differences are no larger than the seed-to-seed ones.

    python bench/bench_engine_agreement.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
GRID = [
    "--set",
    "sampler.name=grid",
    "--set",
    "clip_bound={values: [0.1, 1.0]}",
    "--set",
    "batch_size={values: [256, 1024]}",
    "--set",
    "base_learning_rate={values: [0.003, 0.03]}",
    "--set",
    "privacy.epsilons=[1, 8]",
    "--set",
    "epochs=[10]",
    "--set",
    "training.compare_auto_s=false",
]


def run(storage: str, name: str, engine: str, seed: int) -> pd.DataFrame:
    """One search; its finished trials keyed by (ε, C, B, η₀)."""
    from dptune.records import read_table

    subprocess.run(
        [
            sys.executable,
            "-m",
            "dptune.search",
            "--storage",
            storage,
            "--name",
            name,
            "--no-report",
            *GRID,
            "--set",
            f"training.engine={engine}",
            "--set",
            f"seed={seed}",
        ],
        cwd=ROOT,
        check=True,
    )
    trials = read_table(f"{storage}/{name}", "trials")
    ok = trials[trials["status"] == "ok"]
    return ok.set_index(["epsilon", "clip_bound", "batch_size", "base_learning_rate"])[
        ["engine", "val_accuracy", "test_accuracy"]
    ].sort_index()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    storage = tempfile.mkdtemp(prefix="bench-engines-")
    film, opacus, opacus_seed1 = (
        run(storage, "film", "film", 0),
        run(storage, "opacus", "opacus", 0),
        run(storage, "opacus-seed1", "opacus", 1),
    )
    assert set(film["engine"]) == {"film"} and set(opacus["engine"]) == {"opacus"}
    table = pd.DataFrame(
        {
            "film_test": film["test_accuracy"],
            "opacus_test": opacus["test_accuracy"],
            "opacus_seed1_test": opacus_seed1["test_accuracy"],
        }
    )
    table["film_minus_opacus"] = table["film_test"] - table["opacus_test"]
    table["seed1_minus_seed0"] = table["opacus_seed1_test"] - table["opacus_test"]
    summary = {
        "configurations": len(table),
        "mean_abs_film_minus_opacus": round(float(table["film_minus_opacus"].abs().mean()), 4),
        "mean_abs_seed1_minus_seed0": round(float(table["seed1_minus_seed0"].abs().mean()), 4),
        "max_abs_film_minus_opacus": round(float(table["film_minus_opacus"].abs().max()), 4),
        "max_abs_seed1_minus_seed0": round(float(table["seed1_minus_seed0"].abs().max()), 4),
        "best_val_config_film": list(film["val_accuracy"].groupby(level=0).idxmax()),
        "best_val_config_opacus": list(opacus["val_accuracy"].groupby(level=0).idxmax()),
    }
    print(table.to_string(float_format=lambda v: f"{v:.4f}"))
    print(json.dumps(summary, indent=2, default=str))
    if args.out:
        args.out.write_text(
            json.dumps({"summary": summary, "table": table.reset_index().to_dict("records")}, indent=2, default=str)
        )


if __name__ == "__main__":
    main()
