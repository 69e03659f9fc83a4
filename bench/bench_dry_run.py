"""What a dry run costs against what it used to: planning a workload from its rows (``planned_workload``,
what ``python -m dptune.search --dry-run`` does now) against loading it (``load_workload``, which encodes
every kept row with MiniLM: what a dry run did before), each on its own cold feature cache, at growing
caps of 20 Newsgroups. Checks that both give the same privacy units per split (the plan's N), and prints
the dry run's encoding estimate beside the encoding's measured time. One JSON line per cap, then a table.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_dry_run.py --caps 500 2000 4000
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

from machine import machine

from dptune.contract import WorkloadSpec


def measure(cap: int) -> dict[str, Any]:
    """Both loads of 20 Newsgroups capped at ``cap`` training rows (``cap // 2`` validation and test rows),
    each in a fresh cache folder."""
    from dptune.data.workload import load_workload, planned_workload

    spec = WorkloadSpec(
        "20newsgroups", "minilm", "head", max_tokens=128, max_train_examples=cap, max_eval_examples=cap // 2
    )
    row: dict[str, Any] = {"cap": cap}
    for arm, load in (("dry_run", planned_workload), ("encoding_load", load_workload)):
        with tempfile.TemporaryDirectory(prefix="dptune-bench-dry-") as cache:
            os.environ["DPTUNE_CACHE_DIR"] = cache
            started = time.perf_counter()
            loaded = load(spec)
            row[f"{arm}_s"] = time.perf_counter() - started
        workload, encoding = loaded if isinstance(loaded, tuple) else (loaded, None)
        row[f"{arm}_units"] = [workload.units(split) for split in ("train", "val", "test")]
        if encoding is not None:
            row["estimate"] = encoding.describe()
    assert row["dry_run_units"] == row["encoding_load_units"], row
    row["ratio"] = row["encoding_load_s"] / row["dry_run_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", type=int, nargs="+", default=[500, 2000, 4000])
    args = parser.parse_args()
    rows = [measure(cap) for cap in args.caps]
    print(json.dumps({"machine": machine(), "rows": rows}))
    print("| training rows cap | dry run s | encoding load s | ratio | units (train, val, test) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['cap']:,} | {row['dry_run_s']:.1f} | {row['encoding_load_s']:.1f} | {row['ratio']:.0f}× | "
            f"{tuple(row['dry_run_units'])} |"
        )


if __name__ == "__main__":
    main()
