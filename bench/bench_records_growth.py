"""Growth of the results dataset's reads with the number of runs: synthetic trials with the real schema.

Writes N trials as a search does (``ResultsStore.write_trial``: the four per-trial tables, and a 20×385
float32 head per run with ``write_weights``), in units of ``--unit`` runs, then times, each read cold
(no cache of this process): ``completed_trial_ids`` (what every unit and the driver ask), a full read of
the ``trials`` table, the footer check of ``--resume`` (``unreadable_parts``), and counts the files. With
``--compact`` (the code that compacts), each unit's files are compacted at its end and everything at the
finishing step, as a search does; without it, the layout is one file per run and table (to time an
older checkout, run this file with that checkout first on ``PYTHONPATH``). Prints one JSON line per N.

    python bench/bench_records_growth.py --runs 500 2000 8000 --compact
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dptune.contract import (
    ClassDiagnostics,
    Diagnostics,
    EpochMetrics,
    TrainedModel,
    TrialConfig,
    TrialResult,
    WorkloadSpec,
)
from dptune.records import ResultsStore, store, trial_rows
from dptune.records.weights import write_weights

CLASSES, EPOCHS, PROBE = 20, 3, 256


def template() -> dict[str, list[dict[str, Any]]]:
    """One trial's rows as a search writes them (20 classes, 3 epochs, one diagnostic epoch of 256 probes)."""
    config = TrialConfig(
        workload=WorkloadSpec(dataset="20newsgroups", backbone="minilm", peft="head"),
        epsilon=1.0,
        delta=1e-5,
        epochs=EPOCHS,
        clip_bound=0.5,
        batch_size=64,
        learning_rate=2e-3,
        base_learning_rate=1e-3,
    )
    rng = np.random.default_rng(0)
    quantiles = {q: 0.5 for q in ("q05", "q25", "q50", "q75", "q95")}
    diagnostics = Diagnostics(
        epoch=EPOCHS,
        clip_bound=0.5,
        noise_multiplier=1.1,
        dimension=7700,
        grad_norms=rng.random(PROBE).tolist(),
        labels=rng.integers(0, CLASSES, PROBE).tolist(),
        mse_bias=0.1,
        mse_variance=0.2,
        optimal_clip_bound=0.8,
        classes=[ClassDiagnostics(c, PROBE // CLASSES, quantiles, 0.1, 0.9) for c in range(CLASSES)],
    )
    result = TrialResult(
        config=config,
        status="ok",
        noise_multiplier=1.1,
        sample_rate=0.01,
        steps=300,
        epsilon_spent=0.99,
        num_train=6400,
        num_val=700,
        num_test=800,
        num_classes=CLASSES,
        val_accuracy=0.5,
        test_accuracy=0.45,
        epochs=[EpochMetrics(e, 100 * e, 1.0 / e, 1.1 / e, 0.5, 1.0, 500.0) for e in range(1, EPOCHS + 1)],
        class_accuracy={c: 0.5 for c in range(CLASSES)},
        class_names={c: f"class-{c}" for c in range(CLASSES)},
        diagnostics=[diagnostics],
    )
    return trial_rows(
        result,
        search_id="bench",
        trial_id="t",
        cell_id="eps=1|epochs=3",
        reference_batch_size=256,
        versions={"dptune": "bench"},
        finished_at=pd.Timestamp("2026-01-01T00:00:00Z"),
    )


def write(root: str, runs: int, unit: int, compact: Callable[[str, list[str] | None], None] | None) -> float:
    """Write ``runs`` trials in units of ``unit`` (compacting each unit's files at its end, and everything
    at the end, with ``compact``); returns the seconds it took."""
    rows, results = template(), ResultsStore(root, cache=None)
    head = TrainedModel({"weight": np.ones((CLASSES, 384), np.float32), "bias": np.ones(CLASSES, np.float32)}, {})
    started = time.perf_counter()
    for first in range(0, runs, unit):
        ids = [f"eps1-E3-{n:012x}-r0" for n in range(first, min(runs, first + unit))]
        for n, trial_id in enumerate(ids):
            trial = {
                t: [{**row, "trial_id": trial_id, "val_accuracy": n / runs} for row in rs] for t, rs in rows.items()
            }
            write_weights(root, trial_id, head)
            results.write_trial(trial, trial_id)
        if compact is not None:
            compact(root, ids)
    if compact is not None:
        compact(root, None)
    return time.perf_counter() - started


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``action`` took, cold (this process's caches of the dataset emptied first), and its value."""
    store.TABLE_CACHE.clear()
    getattr(store, "_INDEX", {}).clear()
    started = time.perf_counter()
    value = action()
    return time.perf_counter() - started, value


def measure(runs: int, unit: int, compact: bool) -> dict[str, Any]:
    """One N: write, time the reads, count the files."""
    compactor = None
    if compact:
        from dptune.records import compact_records

        compactor = compact_records
    root = tempfile.mkdtemp(prefix="records-growth-")
    try:
        written = write(root, runs, unit, compactor)
        results = ResultsStore(root, cache=None)
        ids_s, ids = timed(results.completed_trial_ids)
        read_s, trials = timed(lambda: results.read("trials"))
        check_s, bad = timed(results.unreadable_parts)
        assert len(ids) == runs and len(trials) == runs and trials["trial_id"].is_unique and not bad
        files = [path for path in Path(root).rglob("*") if path.is_file()]
        return {
            "runs": runs,
            "compacted": compact,
            "write_s": round(written, 2),
            "completed_trial_ids_s": round(ids_s, 4),
            "read_trials_s": round(read_s, 4),
            "footer_check_s": round(check_s, 4),
            "files": len(files),
            "megabytes": round(sum(path.stat().st_size for path in files) / 2**20, 1),
        }
    finally:
        shutil.rmtree(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[500, 2000, 8000])
    parser.add_argument("--unit", type=int, default=250, help="runs per unit (a search of 8,000 runs had 32 units)")
    parser.add_argument("--compact", action="store_true", help="compact as a search does (the code that compacts)")
    args = parser.parse_args()
    for runs in args.runs:
        print(json.dumps(measure(runs, args.unit, args.compact)), flush=True)


if __name__ == "__main__":
    main()
