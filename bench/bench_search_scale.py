"""Real searches of 500, 2,000 and 8,000 runs, phase by phase: how each phase grows per ×4 runs.

The search: the embedded default workload (20 Newsgroups, MiniLM features, DP linear head, fused
runner) with one epoch per run, ε ∈ {1, 8}, B ∈ {32, …, 512} (ten (σ, q) points), diagnostics off, R = 2
replicates and ``runs / 4`` configurations per cell. Per size, each command in its own process under
``/usr/bin/time -v`` (wall seconds and the peak resident memory of the driver process itself):

1. the search (``python -m dptune.search``, report included), its log's lines timestamped;
2. ``--resume`` of the finished search (nothing runs again; the report is rebuilt);
3. the report alone (``python -m dptune.report``).

Then the results folder's file count and bytes, the whole-search ε the search printed (``search``
table), and the same composition recomputed independently from the ledger's charged runs: dp_accounting's
PLD read by Brent's method on δ(ε) in log space (tests/expected.py's ``pld_root_epsilon``), not dptune's reader.

    PYTHONPATH=. nice .venv/bin/python bench/bench_search_scale.py --runs 500 2000 8000 \\
        --out bench/results/search_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = (
    "epochs=[1]",
    "privacy.epsilons=[1,8]",
    "batch_size.values=[32,64,128,256,512]",
    "training.diagnostics=false",
    "replicates=2",
)


def timed(command: list[str], log: Path) -> dict[str, float]:
    """Run ``command`` under ``/usr/bin/time -v``; its output (each line prefixed with seconds since start)
    goes to ``log``. Returns wall seconds and peak RSS (GiB) of the command's own process."""
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(
            ["/usr/bin/time", "-v", *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
        )
        assert process.stdout is not None
        for line in process.stdout:
            out.write(f"[{time.perf_counter() - start:8.1f}] {line}")
    if process.wait() != 0:
        raise SystemExit(f"{' '.join(command)} failed; see {log}")
    peak_kib = int(re.findall(r"Maximum resident set size \(kbytes\): (\d+)", log.read_text())[-1])
    return {"seconds": round(time.perf_counter() - start, 1), "peak_rss_gib": round(peak_kib / 2**20, 2)}


def folder_size(root: Path) -> dict[str, int]:
    """Files and bytes under ``root``."""
    files = [path for path in root.rglob("*") if path.is_file()]
    return {"files": len(files), "bytes": sum(path.stat().st_size for path in files)}


def independent_epsilon(results: Path, search_id: str, delta: float) -> float:
    """The whole search's ε recomputed from the ledger's charged runs by an independent reader."""
    sys.path.insert(0, str(ROOT / "tests"))
    from collections import Counter

    from dptune.privacy.search import charged_steps
    from dptune.records import ledger, runs_root
    from expected import pld_root_epsilon

    charged = ledger.charged_runs(runs_root(str(results), private=False), search_id)
    took = charged[charged["steps_taken"].fillna(0) > 0]
    totals: Counter[tuple[float, float]] = Counter()
    for sigma, rate, steps in zip(took["noise_multiplier"], took["sample_rate"], charged_steps(took), strict=True):
        totals[(float(sigma), float(rate))] += int(steps)
    return pld_root_epsilon([(sigma, rate, steps) for (sigma, rate), steps in totals.items()], delta)


def measure(runs: int, storage: Path) -> dict[str, object]:
    """One size: search, resume, report, folder, ε."""
    from dptune.records import read_table

    name = f"scale{runs}"
    python = [sys.executable]
    search = [*python, "-m", "dptune.search", "--storage", str(storage), "--name", name]
    search += ["--trials-per-cell", str(runs // 4)] + [arg for item in OVERRIDES for arg in ("--set", item)]
    logs = storage / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    row: dict[str, object] = {"runs": runs}
    row["search"] = timed(search, logs / f"{name}-search.log")
    row["resume"] = timed([*search, "--resume"], logs / f"{name}-resume.log")
    results = storage / name
    report = [*python, "-m", "dptune.report", str(results), "--out", str(storage / "reports" / name)]
    row["report"] = timed(report, logs / f"{name}-report.log")
    row["folder"] = folder_size(results)
    searched = read_table(str(results), "search")
    search_id, delta = str(searched["search_id"].iloc[0]), float(searched["delta"].iloc[0])
    row["epsilon_search"] = float(searched["epsilon_search"].iloc[0])
    row["epsilon_independent"] = independent_epsilon(results, search_id, delta)
    row["trials_recorded"] = len(read_table(str(results), "trials", columns=["trial_id"]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, nargs="+", default=[500, 2000, 8000])
    parser.add_argument("--storage", type=Path, help="where the searches go (default: a temporary folder)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    storage = args.storage or Path(tempfile.mkdtemp(prefix="dptune-search-scale-"))
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    rows = []
    for runs in args.runs:
        rows.append(measure(runs, storage))
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"storage": str(storage), "sizes": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
