"""Do hyperparameters tuned on a subsample transfer to the full data? The transfer rules, measured.

Tuning on a private subsample (Koskela & Kulkarni 2023; ``privacy.private_selection.tuning_subsample``)
chooses (C, B, η₀) on X₁, a share q₁ of the training rows, and trains the release on all of them with
the choice transferred by a public rule. This measures, on the default workload (20 Newsgroups,
cached MiniLM features, DP linear head, DP-Adam, normalized clipping, √B coupling η = η₀·√(B/256)),
at one per-run ε (``--epsilon``, default 4, about what each run gets under a total of 8) and E = 10:

- the full-data grid C × B × η₀ (``--clip-values`` log-spaced in [0.01, 10], B = 16…2048,
  ``--lr-values`` log-spaced in [1e-4, 1e-1]), each configuration ``--replicates`` times: a
  configuration's *truth* is its mean test accuracy; the optimum is the best truth;
- for each q₁ in ``--fractions`` (powers of two, so that B/q₁ stays on the grid), the same grid on a
  stratified q₁-share of the training rows (``task.fraction``; validation and test rows unchanged);
- per subsample replicate r, the configuration with the best validation accuracy of replicate r
  (one search's choice), transferred by each rule, and the full-data truth of what it lands on:
  ``sample_rate`` keeps q = B/N (B → B₁/q₁, C and η₀ kept, so η grows by √(1/q₁));
  ``batch_size`` keeps the expected batch (B → B₁, C and η₀ kept).

Reported per (q₁, rule): the gap (optimum − truth of the transferred choice, in points) as mean and
the range over replicates, and, for reference, the gap of the same search run on the full data
(the replicate's best validation configuration of the full grid). The subsample's validation set is
the full one, so this isolates the transfer; the private mode also subsamples validation rows,
whose noisier choice is not measured here. One subsample draw per q₁ (the space's seed): the
replicates vary the training coins, not X₁. Every run goes through the fused runner with its
own seeded coins (a benchmark, reproducible; the service draws secret coins).

    nice .venv/bin/python bench/bench_transfer_rules.py [--fractions 0.125,0.25,0.5] [--replicates 3]
        [--out bench/results/transfer_rules.json]

``--draw poisson`` measures the service's own mode instead (any q₁, default 0.1, 0.2, 0.5): per
replicate a fresh Poisson X₁ of the training *and validation* rows (``subsample.draw_tuning_rows``),
the grid's configurations run on it as tuning runs with their public schedules under each rule
(``execution.run_spec``, ``subsample.public_schedules``), the one with the best validation
accuracy on X₁'s validation rows chosen (exact, not the private mode's noisy score), and its
full-data truth read off the full grid. Under ``batch_size``, the B above q₁·N cannot be tuned.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dptune.plan import DEFAULT_MIN_STEPS

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SPACE = ROOT / "search_spaces" / "default.yaml"
BATCH_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)
RULES = ("sample_rate", "batch_size")


def run_seed(*key: object) -> int:
    """A seed per run (53 bits): distinct coins for every (fraction, C, B, η₀, replicate)."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "big") >> 11


def grid(fraction: float, batch_sizes: list[int], args: argparse.Namespace) -> pd.DataFrame:
    """The replicated grid of ``batch_sizes`` on a ``fraction`` of the training rows: one row per
    (C, B, η₀, replicate). The min-step rule applies on the full data only (the product prunes by
    the release's steps, never by a tuning run's)."""
    from dptune import search
    from dptune.data import load_workload
    from dptune.runners.fused import run_fused
    from dptune.search.planning.cells import task_workload
    from dptune.space import load_space

    space = load_space(
        DEFAULT_SPACE,
        {
            "privacy.epsilons": [args.epsilon],
            "epochs": [args.epochs],
            "task.fraction": fraction,
            "batch_size": {"values": batch_sizes},
            "min_steps": DEFAULT_MIN_STEPS if fraction == 1.0 else 1,
            "training.diagnostics": False,
            "training.compare_auto_s": False,
        },
    ).space
    num_train = len(load_workload(task_workload(space, None, None)).train)
    plan = search.mode_of(space).plan(space, num_train, progress=False)[0]
    base = search.base_trial_config(space, plan, None, None)
    clips = np.geomspace(0.01, 10.0, args.clip_values).tolist()
    lr_values = np.geomspace(1e-4, 1e-1, args.lr_values).tolist()
    points = list(itertools.product(clips, plan.feasible_batch_sizes, lr_values))
    rows = []
    for replicate in range(args.replicates):
        configs = [
            replace(
                base,
                clip_bound=c,
                batch_size=b,
                base_learning_rate=lr0,
                learning_rate=lr0 * (b / space.coupling.reference_batch_size) ** 0.5,
                seed=run_seed(fraction, c, b, lr0, replicate),
                mechanism=plan.mechanisms[b],
            )
            for c, b, lr0 in points
        ]
        started = time.perf_counter()
        results = run_fused(configs)
        print(
            f"q₁ = {fraction:g} (N = {num_train}), replicate {replicate}: {len(configs)} runs in "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )
        rows += [
            {
                "fraction": fraction,
                "num_train": num_train,
                "clip_bound": c,
                "batch_size": b,
                "base_learning_rate": lr0,
                "replicate": replicate,
                "ok": result.status == "ok",
                "val_accuracy": result.val_accuracy if result.status == "ok" else 0.0,
                "test_accuracy": result.test_accuracy if result.status == "ok" else np.nan,
            }
            for (c, b, lr0), result in zip(points, results, strict=True)
        ]
    return pd.DataFrame(rows)


def choices(runs: pd.DataFrame) -> pd.DataFrame:
    """Per replicate, the configuration with the best validation accuracy (one search's choice)."""
    best = runs.loc[runs.groupby("replicate")["val_accuracy"].idxmax()]  # first of ties
    return best[["replicate", "clip_bound", "batch_size", "base_learning_rate"]]


def transferred(choice: pd.Series, fraction: float, rule: str) -> tuple[float, int, float]:
    """The full-data configuration a subsample choice stands for under ``rule``."""
    batch = int(choice["batch_size"])
    full_batch = round(batch / fraction) if rule == "sample_rate" else batch
    return float(choice["clip_bound"]), full_batch, float(choice["base_learning_rate"])


def evaluate(full: pd.DataFrame, subsamples: dict[float, pd.DataFrame]) -> list[dict[str, Any]]:
    """The gap table: per (q₁, rule) and for the full-data search, gaps to the optimum in points."""
    truth = full.groupby(["clip_bound", "batch_size", "base_learning_rate"])["test_accuracy"].mean()
    optimum = float(truth.max())

    def gaps(targets: list[tuple[float, int, float]]) -> list[float]:
        return [100 * (optimum - float(truth.get(target, np.nan))) for target in targets]

    def row(name: str, fraction: float, values: list[float], targets: list[tuple[float, int, float]]) -> dict:
        finite = [v for v in values if np.isfinite(v)]
        return {
            "tuning": name,
            "fraction": fraction,
            "gap_mean_points": float(np.mean(finite)) if finite else None,
            "gap_min_points": float(np.min(finite)) if finite else None,
            "gap_max_points": float(np.max(finite)) if finite else None,
            "off_grid": len(values) - len(finite),
            "choices": [list(t) for t in targets],
        }

    rows = []
    full_targets = [(c.clip_bound, int(c.batch_size), c.base_learning_rate) for c in choices(full).itertuples()]
    rows.append(row("full data (reference)", 1.0, gaps(full_targets), full_targets))
    for fraction, runs in subsamples.items():
        for rule in RULES:  # each rule tunes over the runs that stand for a full-data B
            own = {round(fraction * b) for b in BATCH_SIZES} if rule == "sample_rate" else set(BATCH_SIZES)
            mine = runs[runs["batch_size"].isin(own)]
            targets = [transferred(choice, fraction, rule) for _, choice in choices(mine).iterrows()]
            rows.append(row(f"q₁ = {fraction:g}, rule '{rule}'", fraction, gaps(targets), targets))
    best = truth.idxmax()
    print(f"full-data optimum: {100 * optimum:.2f} % at C = {best[0]:g}, B = {best[1]}, η₀ = {best[2]:g}")
    return rows


def poisson_choices(fraction: float, rule: str, args: argparse.Namespace) -> list[tuple[float, int, float]]:
    """Per replicate, the full-data configuration a search on a fresh Poisson X₁ chooses under ``rule``
    (``--draw poisson``, see the docstring)."""
    import tempfile

    from dptune import search
    from dptune.data import load_workload
    from dptune.plan.mechanism import mechanism
    from dptune.runners.fused import run_fused
    from dptune.search.planning.cells import task_workload
    from dptune.search.planning.subsample import (
        TuningPlan,
        draw_tuning_rows,
        on_tuning_rows,
        public_schedules,
        tuning_schedule,
    )
    from dptune.search.runs.execution import TrialContext, run_spec
    from dptune.space import load_space

    overrides = {"privacy.epsilons": [args.epsilon], "epochs": [args.epochs], "training.diagnostics": False}
    space = load_space(DEFAULT_SPACE, overrides).space  # the default space's B = 32…2048
    workload = load_workload(task_workload(space, None, None))
    num_train = len(workload.train)
    plan = search.mode_of(space).plan(space, num_train, progress=False)[0]
    tunable = [b for b in plan.feasible_batch_sizes if rule == "sample_rate" or b <= fraction * num_train]
    schedules = {b: tuning_schedule(num_train, b, args.epochs, fraction, rule) for b in tunable}
    nan = float("nan")
    tuning = TuningPlan(fraction, rule, args.epsilon, schedules, {}, {}, nan, nan, nan)
    public = public_schedules(tuning, num_train, args.epochs)
    delta = space.privacy.delta
    tuning_mechanisms = {b: mechanism(args.epsilon, delta, num_train, b, args.epochs, s) for b, s in public.items()}
    clips = np.geomspace(0.01, 10.0, args.clip_values).tolist()
    lr_values = np.geomspace(1e-4, 1e-1, args.lr_values).tolist()
    points = list(itertools.product(clips, tunable, lr_values))
    chosen = []
    for replicate in range(args.replicates):
        with tempfile.TemporaryDirectory(prefix="bench-transfer-") as scratch:
            rows = draw_tuning_rows(scratch, num_train, len(workload.val), fraction)
            context = TrialContext(
                base=on_tuning_rows(search.base_trial_config(space, plan, None, None), rows),
                results_root=scratch,
                search_id="bench",
                cell_id=plan.cell.cell_id,
                cell_key=plan.cell_key,
                coupling=space.coupling.rule,
                reference_batch_size=space.coupling.reference_batch_size,
                mechanisms=tuning_mechanisms,
                schedules=public,
            )
            configs = [
                replace(
                    run_spec(context, {"clip_bound": c, "batch_size": b, "base_learning_rate": lr0}).config,
                    seed=run_seed("poisson", fraction, rule, c, b, lr0, replicate),
                )
                for c, b, lr0 in points
            ]
            started = time.perf_counter()
            results = run_fused(configs)
        values = [r.val_accuracy if r.status == "ok" else 0.0 for r in results]
        best = points[int(np.argmax(values))]
        print(
            f"q₁ = {fraction:g}, rule '{rule}', replicate {replicate}: {len(configs)} runs on X₁ "
            f"({results[0].num_train} training, {results[0].num_val} validation rows) in "
            f"{time.perf_counter() - started:.0f} s; chose C = {best[0]:g}, B = {best[1]}, η₀ = {best[2]:g}",
            flush=True,
        )
        chosen.append((float(best[0]), int(best[1]), float(best[2])))
    return chosen


def evaluate_poisson(full: pd.DataFrame, chosen: dict[tuple[float, str], list[tuple[float, int, float]]]) -> list[dict]:
    """The gap table of ``--draw poisson``: per (q₁, rule), the gaps of the choices to the full grid's
    optimum, each replicate's, their mean with a 95 % t interval, and their range."""
    from scipy import stats

    truth = full.groupby(["clip_bound", "batch_size", "base_learning_rate"])["test_accuracy"].mean()
    optimum = float(truth.max())
    rows = []
    for (fraction, rule), targets in chosen.items():
        gaps = [100 * (optimum - float(truth.get(target, np.nan))) for target in targets]
        finite = np.array([g for g in gaps if np.isfinite(g)])
        half = stats.t.ppf(0.975, len(finite) - 1) * finite.std(ddof=1) / np.sqrt(len(finite))
        rows.append(
            {
                "tuning": f"q₁ = {fraction:g} (Poisson X₁), rule '{rule}'",
                "fraction": fraction,
                "gaps_points": gaps,
                "gap_low_points": float(finite.mean() - half),
                "gap_high_points": float(finite.mean() + half),
                "gap_mean_points": float(np.nanmean(gaps)),
                "gap_min_points": float(np.nanmin(gaps)),
                "gap_max_points": float(np.nanmax(gaps)),
                "off_grid": int(np.isnan(gaps).sum()),
                "choices": [list(t) for t in targets],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fractions", help="q₁ values (default 0.125,0.25,0.5; with --draw poisson 0.1,0.2,0.5)")
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--clip-values", type=int, default=4)
    parser.add_argument("--lr-values", type=int, default=5)
    parser.add_argument("--replicates", type=int, default=3)
    parser.add_argument("--draw", choices=("stratified", "poisson"), default="stratified")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = time.perf_counter()
    full = grid(1.0, list(BATCH_SIZES), args)
    if args.draw == "poisson":
        fractions = [float(x) for x in (args.fractions or "0.1,0.2,0.5").split(",")]
        chosen = {(f, rule): poisson_choices(f, rule, args) for f in fractions for rule in RULES}
        rows = evaluate(full, {}) + evaluate_poisson(full, chosen)
    else:
        subsamples = {}
        for fraction in (float(x) for x in (args.fractions or "0.125,0.25,0.5").split(",")):
            kept = [round(fraction * b) for b in BATCH_SIZES]  # the 'sample_rate' rule's tuning runs
            subsamples[fraction] = grid(fraction, sorted(set(kept) | set(BATCH_SIZES)), args)
        rows = evaluate(full, subsamples)
    for r in rows:
        interval = f" [{r['gap_low_points']:.2f}, {r['gap_high_points']:.2f}]" if "gap_low_points" in r else ""
        print(
            f"{r['tuning']:<34} gap {r['gap_mean_points']:6.2f}{interval} points (range {r['gap_min_points']:.2f}–"
            f"{r['gap_max_points']:.2f}; off the grid: {r['off_grid']})"
        )
    figures = {"args": vars(args) | {"out": str(args.out)}, "rows": rows, "seconds": time.perf_counter() - started}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
