"""Racing against fixed replicates on the paper's questions (issue 54): ``search_spaces/racing_20ng.yaml``
(20 Newsgroups, MiniLM features, ε ∈ {1, 2, 4, 8}, E ∈ {5, 20}, 40 configurations per cell, 2 replicates
then racing rounds) run as it is, and the same space with no racing at fixed replicate counts R, one search
at a time through ``python -m dptune.search`` (embedded Ray, no report). Per search: runs trained (per
cell and in all), wall seconds of the command, the racing rounds and why each cell's race ended (from
its console), and ``dptune.analysis.paper_trend_checks`` over its ranked configurations (the report's
comparisons with the paper: optimal C and B on the harder and easier side with their intervals over the
confidence set of the best, and the verdict).

Every search samples the same configurations (the space's public seed) with fresh coins, so searches
are independent: a fixed search does not hold the racing search's runs. Results accumulate in ``--out``
(one entry per search label; a label run again replaces its entry), so searches can be added one at a
time; ``--table`` prints the Markdown tables of what ``--out`` holds.

    OMP_NUM_THREADS=2 nice .venv/bin/python bench/bench_racing.py --searches racing 2 \\
        --storage /tmp/dptune-bench-racing --out bench/results/racing.json
    .venv/bin/python bench/bench_racing.py --table --out bench/results/racing.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from machine import machine

SPACE = "search_spaces/racing_20ng.yaml"
#: A racing cell's console line: ``[cell key] racing ended after N round(s): why``.
ENDED = re.compile(r"\[(?P<cell>[^\]]+)\] racing ended after (?P<rounds>\d+) round\(s\): (?P<why>.+)")


def command(label: str, storage: str) -> list[str]:
    """The search command of ``label``: ``racing…`` (the space as shipped; ``racing2`` a second draw) or
    ``R<count>``, a fixed replicate count (racing off, ``replicates: count``), results under ``storage``/``label``."""
    argv = [sys.executable, "-m", "dptune.search", "--space", SPACE, "--storage", storage, "--name", label]
    if not label.startswith("racing"):
        argv += ["--set", "racing=null", "--set", f"replicates={int(label.removeprefix('R'))}"]
    return [*argv, "--no-report"]


def _checks(tuned: Any) -> list[dict[str, Any]]:
    """``paper_trend_checks`` rows of the finished runs ``tuned`` (every column, NaN as None)."""
    import math

    from dptune import analysis as an

    checks = an.paper_trend_checks(an.rank_configurations(tuned))
    return [
        {key: (None if isinstance(value, float) and math.isnan(value) else value) for key, value in row.items()}
        for row in checks.to_dict("records")
    ]


def analyse(root: str) -> dict[str, Any]:
    """Runs trained per cell and replicate counts of a finished search at ``root``, its
    ``paper_trend_checks`` rows, and ``prefixes``: the same checks on each configuration's first k
    replicates (k = 2, … below the most any configuration has), a fixed k-replicate search on the
    same coins (the racing search's k = 2 is its first pass)."""
    from dptune import analysis as an
    from dptune.records import read_table

    trials = read_table(root, "trials")
    tuned = an.load_results([root]).tuned
    ranked = an.rank_configurations(tuned)
    per_cell = {
        str(cell): {
            "runs": int(len(group)),
            "runs_ok": int((group["status"] == "ok").sum()),
            "configurations": int(group["configuration_id"].nunique()),
            "most_replicates": int(group["replicate"].max()) + 1,
            "set_of_best": int(ranked[ranked["cell_id"] == cell]["within_noise"].sum()),
        }
        for cell, group in trials.groupby("cell_id", sort=True)
    }
    fixed = int(trials.groupby("configuration_id")["replicate"].max().min()) + 1
    prefixes = {
        str(k): {"runs": int((trials["replicate"] < k).sum()), "checks": _checks(tuned[tuned["replicate"] < k])}
        for k in range(2, fixed if fixed > 2 else 3)
        if (trials["replicate"] >= k).any()
    }
    return {"runs": int(len(trials)), "cells": per_cell, "checks": _checks(tuned), "prefixes": prefixes}


def run_search(label: str, storage: str) -> dict[str, Any]:
    """Run search ``label`` (``command``) to its end, its console kept in ``<storage>/<label>.log``;
    return its wall seconds, racing endings and ``analyse``."""
    argv = command(label, storage)
    log = Path(storage) / f"{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log.open("w") as handle:
        done = subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, text=True, check=False)
    wall = time.perf_counter() - started
    text = log.read_text()
    if done.returncode != 0:
        raise SystemExit(f"search {label} failed (exit {done.returncode}); its console: {log}\n{text[-4000:]}")
    endings = {m["cell"]: {"rounds": int(m["rounds"]), "why": m["why"].strip()} for m in ENDED.finditer(text)}
    entry = {"label": label, "command": " ".join(argv[1:]), "wall_s": wall, "racing": endings}
    return entry | analyse(f"{storage}/{label}")


def _optimum(row: dict[str, Any], side: str) -> str:
    """``ε = 1 0.28 [0.038, 1.1]``: one side's (``harder``/``easier``) optimum of a check with its interval."""
    shown = "{:.0f}" if row["quantity"] == "B" else "{:.2g}"
    value, low, high = (shown.format(row[f"{side}_{part}"]) for part in ("value", "low", "high"))
    return f"{row[side]} {value} [{low}, {high}]"


def _columns(searches: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each search, then each of its prefixes (``analyse``), as a column: name → runs and checks."""
    columns = {}
    for label, entry in searches.items():
        columns[label] = entry
        for k, prefix in entry.get("prefixes", {}).items():
            what = "first pass" if label.startswith("racing") else f"first {k} replicates"
            columns[f"{label} ({what})"] = prefix
    return columns


#: A verdict in the verdict table: established ones in bold, the others with the direction observed.
SHORT = {"agrees": "**agrees**", "disagrees": "**disagrees**", "no change": "**no change**", "not established": "open"}


def tables(results: dict[str, Any]) -> str:
    """Markdown: runs and wall time per search; the verdict of each comparison per search and per
    prefix of a search (rows) with its runs; the two optima with their intervals per search."""
    searches = results["searches"]
    lines = [
        "| search | runs | most replicates of one configuration | wall s | per cell (ε, E): runs / set of the best |",
        "|---|---|---|---|---|",
    ]
    for label, entry in searches.items():
        cells = entry["cells"]
        shown = "; ".join(
            f"{cell.replace('eps=', '').replace('|epochs=', ', ')}: {c['runs']} / {c['set_of_best']}"
            for cell, c in cells.items()
        )
        most = max(c["most_replicates"] for c in cells.values())
        lines.append(f"| {label} | {entry['runs']:,} | {most} | {entry['wall_s']:.0f} | {shown} |")
    checks = next(iter(searches.values()))["checks"]
    names = [f"{c['condition']}, {c['group']}: {c['quantity']} (paper: {c['paper']})" for c in checks]
    lines += ["", "| search | runs | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for label, column in _columns(searches).items():
        verdicts = [
            SHORT[row["verdict"]] + ("" if row["verdict"] != "not established" else f" ({row['observed']})")
            for row in column["checks"]
        ]
        lines.append(f"| {label} | {column['runs']:,} | " + " | ".join(verdicts) + " |")
    lines += ["", "| comparison | " + " | ".join(searches) + " |", "|---|" + "---|" * len(searches)]
    for index, name in enumerate(names):
        optima = [
            f"{_optimum(row, 'harder')} vs {_optimum(row, 'easier')}"
            for row in (entry["checks"][index] for entry in searches.values())
        ]
        lines.append(f"| {name} | " + " | ".join(optima) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--searches", nargs="*", default=[], help="racing (racing2, … more draws), or fixed replicate counts (2 4 8 …)"
    )
    parser.add_argument("--storage", default="/tmp/dptune-bench-racing", help="results folders of the searches")
    parser.add_argument("--out", default="bench/results/racing.json")
    parser.add_argument("--table", action="store_true", help="print the Markdown tables of --out")
    parser.add_argument(
        "--reanalyse", action="store_true", help="recompute the analysis of every search of --out from --storage"
    )
    args = parser.parse_args()
    out = Path(args.out)
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"space": SPACE, "searches": {}}
    for search in args.searches:
        label = search if search.startswith("racing") else f"R{int(search.removeprefix('R'))}"
        entry = run_search(label, args.storage)
        results["searches"][label] = entry | {"machine": machine()}
        out.write_text(json.dumps(results, indent=1) + "\n")
        verdicts = ", ".join(row["verdict"] for row in entry["checks"])
        print(f"{label}: {entry['runs']} runs, {entry['wall_s']:.0f} s; {verdicts}", flush=True)
    if args.reanalyse:
        for label, entry in results["searches"].items():
            entry.update(analyse(f"{args.storage}/{label}"))
        out.write_text(json.dumps(results, indent=1) + "\n")
    if args.table:
        print(tables(results))


if __name__ == "__main__":
    main()
