"""How long dptune's checks of a data owner's dataset take on files of real size (issue 31), against
the bare read of the same bytes in the same run.

- a CSV of 100,000 rows (real 20 Newsgroups posts, each row a post with its row number appended so
  that no two rows are equal; string labels): ``read_dataset_file`` (read the two columns, every
  check, the fingerprint) against ``pyarrow.csv.read_csv`` of the same two columns;
- an image folder of 50,000 PNGs (real MNIST-5k digits, 10 class folders, written once):
  ``read_dataset_file`` (listing, every image's header, the fingerprint) against ``os.walk`` plus
  reading every file's bytes.

Each measurement runs in a fresh process (the reader's per-process cache is cold; the files are in
the OS page cache after the first, so the second of two rounds is what is reported), with its peak
resident memory. ``python bench/bench_own_data_checks.py --folder build/bench/own-data --out FILE.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROWS, IMAGES = 100_000, 50_000

MEASURE = """
import json, os, sys, time
kind, path = sys.argv[1], sys.argv[2]
start = time.perf_counter()
if kind == "check-csv":
    from dptune.contract import DatasetFile
    from dptune.data.files import read_dataset_file
    raw = read_dataset_file(DatasetFile(path=path, input_column="text", label_column="label"))
    rows = len(raw.labels)
elif kind == "check-images":
    from dptune.contract import DatasetFile
    from dptune.data.files import read_dataset_file
    raw = read_dataset_file(DatasetFile(path=path))
    rows = len(raw.labels)
elif kind == "read-csv":
    import pyarrow.csv as pacsv
    table = pacsv.read_csv(path, parse_options=pacsv.ParseOptions(newlines_in_values=True),
                           convert_options=pacsv.ConvertOptions(include_columns=["text", "label"]))
    rows = table.num_rows
else:
    rows = 0
    for parent, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(parent, name), "rb") as handle:
                handle.read()
            rows += 1
seconds = time.perf_counter() - start
status = open("/proc/self/status").read().split("VmHWM:")[1]
peak = int(status.split()[0]) / 1024  # this process's own high-water mark (ru_maxrss survives exec)
print(json.dumps({"kind": kind, "rows": rows, "seconds": seconds, "peak_rss_mib": peak}))
"""


def make_files(folder: Path) -> tuple[Path, Path]:
    """The 100,000-row CSV and the 50,000-image folder under ``folder`` (made once)."""
    import numpy as np
    import pandas as pd
    from PIL import Image

    from dptune.data.sources import load_20newsgroups, load_mnist5k

    folder.mkdir(parents=True, exist_ok=True)
    csv, images = folder / "rows.csv", folder / "images"
    if not csv.is_file():
        raw = load_20newsgroups()
        picks = np.arange(ROWS) % len(raw.labels)
        texts = [f"{raw.inputs[i]} {n}" for n, i in enumerate(picks)]
        labels = [raw.class_names[raw.labels[i]] for i in picks]
        pd.DataFrame({"text": texts, "label": labels}).to_csv(csv, index=False)
    if not (images / ".complete").is_file():
        raw = load_mnist5k()
        for n in range(IMAGES):
            i = n % len(raw.labels)
            target = images / f"digit-{raw.labels[i]}" / f"{n}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(raw.inputs[i, 0].numpy()).save(target)
        (images / ".complete").write_text("")
    return csv, images


def measure(kind: str, path: Path) -> dict[str, float]:
    """The last of two fresh-process runs of ``kind`` on ``path``."""
    result: dict[str, float] = {}
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", MEASURE, kind, str(path)], capture_output=True, text=True, check=True
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default="build/bench/own-data", help="where the files are made (once)")
    parser.add_argument("--out", default=None, help="JSON file of the results")
    args = parser.parse_args()
    started = time.perf_counter()
    csv, images = make_files(Path(args.folder))
    made = time.perf_counter() - started
    results = {
        name: measure(name, path)
        for name, path in (("read-csv", csv), ("check-csv", csv), ("read-images", images), ("check-images", images))
    }
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "files_made_s": made,
        "csv_bytes": csv.stat().st_size,
        **results,
        "csv_check_over_read": results["check-csv"]["seconds"] / results["read-csv"]["seconds"],
        "images_check_over_read": results["check-images"]["seconds"] / results["read-images"]["seconds"],
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
