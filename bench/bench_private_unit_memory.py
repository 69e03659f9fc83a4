"""Peak memory of each unit of an end-to-end private search, for several seeded K (issue 48).

A private search runs a public number of units (the trial slots) whatever its secret number of runs
K; this runs ``search_spaces/private.yaml`` on the embedded Ray once per K (kept in
``inside_trust_boundary/trial_count.json`` before the start, as a resume finds it), polls the
``VmHWM`` (peak resident set) of every unit process (``ray::ImplicitFunc`` /
``private_unit_trainable``) every 0.2 s, and prints and writes the units' peaks per K. Linux only.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_private_unit_memory.py --k 1 20 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPACE = REPO / "search_spaces" / "private.yaml"
#: The command-line titles of a private unit's process.
UNIT_TITLES = ("private_unit_trainable", "ImplicitFunc")


def unit_peaks_mib(command: list[str], env: dict[str, str], interval_s: float = 0.2) -> tuple[int, list[int]]:
    """Run ``command``; return its exit status and the peak RSS (MiB) of every unit process seen."""
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peaks: dict[str, int] = {}
    while process.poll() is None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                if any(name in title for name in UNIT_TITLES):
                    status = (entry / "status").read_text().splitlines()
                    peak_kib = int(next(line for line in status if line.startswith("VmHWM")).split()[1])
                    peaks[entry.name] = max(peaks.get(entry.name, 0), peak_kib)
            except (OSError, StopIteration, ValueError):
                continue  # gone meanwhile
        time.sleep(interval_s)
    return process.returncode, sorted(round(kib / 1024) for kib in peaks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 20], help="the secret run counts to seed")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-train-examples", type=int, default=300)
    parser.add_argument("--max-eval-examples", type=int, default=150)
    parser.add_argument("--out", type=Path, help="a JSON file for the results")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from dptune.search.modes import mode_of
    from dptune.search.planning.cells import TRIAL_COUNT_FILE
    from dptune.space import load_space

    space = load_space(SPACE, {"epochs": [args.epochs]}).space
    (plan,) = mode_of(space).plan(space, args.max_train_examples, progress=False)
    storage = Path(tempfile.mkdtemp(prefix="unit-memory-"))
    results = {}
    for k in args.k:
        name = f"k{k}"
        inside = storage / name / "inside_trust_boundary"
        inside.mkdir(parents=True)
        (inside / TRIAL_COUNT_FILE).write_text(json.dumps({plan.cell_key: k}))
        command = [sys.executable, "-m", "dptune.search", "--space", str(SPACE), "--storage", str(storage)]
        command += ["--name", name, "--no-report", "--set", f"epochs=[{args.epochs}]"]
        command += ["--max-train-examples", str(args.max_train_examples)]
        command += ["--max-eval-examples", str(args.max_eval_examples)]
        status, peaks = unit_peaks_mib(command, {**os.environ, "OMP_NUM_THREADS": "1"})
        if status != 0:
            raise SystemExit(f"the search with K = {k} exited {status}")
        results[k] = peaks
        print(f"K = {k}: units' peak RSS {peaks} MiB", flush=True)
    if args.out is not None:
        settings = {"epochs": args.epochs, "max_train_examples": args.max_train_examples}
        args.out.write_text(json.dumps({"units_peak_rss_mib": results, **settings}, indent=1))


if __name__ == "__main__":
    main()
