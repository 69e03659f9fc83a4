"""How a resume's reconciliation grows with the search: ``search.reconcile.unknown_configurations`` on
synthetic ledgers and ``trials`` tables of 500, 2,000 and 8,000 runs (2 replicates each; one row in
seven missing, so some configurations are charged without their rows), against a fresh sampler that
knows none of them: seconds (best of 3) and microseconds per run. No Ray, no training (issue 49).
Then a racing round's decision (``search.scheduling.racing.next_round``, issue 54) on the same ledger
with every row recorded and scores spread over 20 points: its seconds and µs per run.

    .venv/bin/python bench/bench_reconcile_scale.py [--runs 500 2000 8000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from dptune.records import replicate_trial_id  # noqa: E402
from dptune.records.ids import configuration_id  # noqa: E402
from dptune.records.ledger import RunStart  # noqa: E402
from dptune.search.planning.sampler import CellSampler  # noqa: E402
from dptune.search.scheduling.racing import next_round  # noqa: E402
from dptune.search.scheduling.reconcile import unknown_configurations  # noqa: E402
from dptune.space.spec import RacingSpec  # noqa: E402
from test_tune_adapters import GRID, context  # noqa: E402  (the tests' real cell context and spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[500, 2000, 8000])
    args = parser.parse_args()
    cell = context(Path(tempfile.mkdtemp()))
    spec = replace(
        GRID, sampler="random", ranges={**GRID.ranges, "base_learning_rate": {"low": 1e-3, "high": 0.1, "log": True}}
    )
    for runs in args.runs:
        started: list[RunStart] = []
        rows: list[dict[str, object]] = []
        for index in range(runs // 2):
            params = {"batch_size": 32, "base_learning_rate": 1e-3 + index * 1e-6, "clip_bound": 0.1}
            configuration = configuration_id(cell.cell_key, params)
            for replicate in (0, 1):
                trial = replicate_trial_id(configuration, replicate)
                started.append(
                    RunStart(
                        trial, configuration, replicate, "s", cell.cell_id, "normalized", params, 1.0, 0.1, 10, 1e-5, 8
                    )
                )
                if replicate == 0 or len(rows) % 7:
                    rows.append(
                        {
                            "configuration_id": configuration,
                            "trial_id": trial,
                            "replicate": replicate,
                            "status": "ok",
                            "val_accuracy": 0.5,
                            "noisy_val_accuracy": 0.5,
                            **params,
                        }
                    )
        trials = pd.DataFrame(rows)
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            unknown_configurations(cell, CellSampler(spec), started, trials)
            seconds.append(time.perf_counter() - start)
        print(f"{runs} runs: {min(seconds):.3f} s, {min(seconds) / runs * 1e6:.0f} µs per run", flush=True)
        whole = pd.DataFrame(
            {
                "configuration_id": [start.configuration_id for start in started],
                "trial_id": [start.trial_id for start in started],
                "replicate": [start.replicate for start in started],
                **{name: [start.params[name] for start in started] for name in started[0].params},
                "search_id": "s",
                "cell_id": cell.cell_id,
                "clipping": "normalized",
                "status": "ok",
                "val_accuracy": [0.6 + 0.2 * (index % 97) / 97 for index in range(len(started))],
                "train_loss": 1.0,
                "num_val": 1000,
                "num_test": 1000,
            }
        ).assign(test_accuracy=lambda frame: frame["val_accuracy"])
        names = list(spec.distributions())
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            next_round(cell, RacingSpec(budget=10_000), names, whole, started, None)
            seconds.append(time.perf_counter() - start)
        print(f"{runs} runs: a racing round {min(seconds):.3f} s, {min(seconds) / runs * 1e6:.0f} µs per run")


if __name__ == "__main__":
    main()
