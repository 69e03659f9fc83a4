"""Coverage of dptune's accuracy intervals, measured on a replicated grid of real runs (issue 54).

The grid: ``--configurations`` (C, B, η₀) drawn as the default space's random sampler draws them
(C log-uniform in [0.01, 10], B uniform over its 7 batch sizes, η₀ log-uniform in [1e-4, 1e-1],
η = η₀·√(B/256)), one cell of ``search_spaces/default.yaml`` (20 Newsgroups, cached MiniLM features,
DP linear head, DP-Adam, normalized clipping; ε = ``--epsilon``, E = ``--epochs``, δ = 1e-5), each
run ``--replicates`` times with fresh coins by the fused runner (``dptune.runners.fused.run_fused``,
no diagnostics). Every run that finishes ``ok`` is scored row by row on the 7,528-row test split
(its trained head, the runner's own logits rule): a run × row matrix of correct/wrong, cached with
the runs' validation and test accuracies (``--grid``; reruns resume from it).

The resampled world (a bootstrap world: every draw is i.i.d. from the grid's empirical law, so the
truth is known exactly):

- the population of rows is the test pool; an evaluation split of n rows is n rows drawn with
  replacement from it, a validation split and a test split independently, the same rows for every
  run of a draw (as a search scores every run on one split);
- a configuration's R replicates are R of its ``--replicates`` runs drawn with replacement; a run
  that did not finish ``ok`` is left out of the table, as ``finished_trials`` leaves it out;
- a draw is one cell of the ``--configurations`` configurations; its trials table is ranked and
  given intervals by the code that ships, ``with_intervals(rank_configurations(trials, by), by)``
  (``by`` = the draw), many draws in one call;
- truths: a configuration's accuracy is the mean of its ``ok`` runs' accuracies on the whole pool
  (the expectation over coins and rows); a model's accuracy is that run's accuracy on the pool.

Settings, each at every ``--rows`` n (both splits of n rows) with ``--draws`` draws:

- ``R = 1, no replicates``: every configuration once (the intervals' source is "split": Wilson);
  covered against the configuration's truth, and against the drawn run's own truth (the model's
  accuracy, the quantity a Wilson interval claims; ``accuracy_intervals`` without a spread, as the
  model card calls it);
- ``R = 1, others R = 2``: one configuration per draw (in turn) once, the others twice (racing's
  cells): that configuration's interval;
- ``R = 2`` and ``R = 5``: every configuration R times;
- every setting also gives the selected best (rank 1 on mean validation accuracy): its validation
  interval (selection-biased: the same rows chose it) and its test interval.

Coverage of rows pooled over a draw's configurations has a 95 % interval from the spread of the
per-draw coverage (draws are independent, configurations within a draw are not); one interval per
draw (the best, one model), Wilson's. Mean width in accuracy points.

    OMP_NUM_THREADS=2 nice .venv/bin/python bench/bench_intervals.py [--configurations 24]
        [--replicates 40] [--draws 2000] [--rows 500 1196 7528] [--threads 2]
        [--out bench/results/intervals.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from machine import machine  # noqa: E402

DEFAULT_SPACE = ROOT / "search_spaces" / "default.yaml"
CELL = "draw"  # the grouping column: one draw is one cell


def sample_configurations(count: int, batch_sizes: list[int], seed: int) -> pd.DataFrame:
    """``count`` (C, B, η₀) as the default space's random sampler draws them (log-uniform C and η₀)."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "clip_bound": 10.0 ** rng.uniform(-2.0, 1.0, count),
            "batch_size": rng.choice(batch_sizes, count),
            "base_learning_rate": 10.0 ** rng.uniform(-4.0, -1.0, count),
        }
    )


def build_grid(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Run (or resume) the replicated grid; arrays indexed [configuration, replicate(, row)].

    ``ok`` (bool), ``val_accuracy``, ``test_accuracy``, ``train_loss`` (NaN where not ok),
    ``correct`` (bool, test rows), the configurations' ``clip_bound``/``batch_size``/
    ``base_learning_rate``/``learning_rate``, and ``num_val``. Written to ``args.grid`` after
    every replicate."""
    import torch

    from dptune import search
    from dptune.data import load_workload
    from dptune.plan import coupled_learning_rate
    from dptune.plan.mechanism import with_mechanism
    from dptune.runners.fused import run_fused
    from dptune.runners.heads import augment
    from dptune.search.planning.cells import task_workload
    from dptune.space import load_space

    overrides = {"privacy.epsilons": [args.epsilon], "epochs": [args.epochs], "training.diagnostics": False}
    space = load_space(DEFAULT_SPACE, overrides).space
    workload = load_workload(task_workload(space, None, None))
    plan = search.mode_of(space).plan(space, len(workload.train), progress=False)[0]
    base = replace(search.base_trial_config(space, plan, None, None), threads=args.threads)
    table = sample_configurations(args.configurations, list(plan.feasible_batch_sizes), args.seed)
    reference = space.coupling.reference_batch_size
    table["learning_rate"] = [
        coupled_learning_rate(lr0, int(b), reference)
        for lr0, b in zip(table["base_learning_rate"], table["batch_size"], strict=True)
    ]
    test_features, test_labels = workload.test.tensors
    rows = augment(test_features)
    k, r = args.configurations, args.replicates
    grid: dict[str, np.ndarray] = {
        "ok": np.zeros((k, r), bool),
        "val_accuracy": np.full((k, r), np.nan),
        "test_accuracy": np.full((k, r), np.nan),
        "train_loss": np.full((k, r), np.nan),
        "correct": np.zeros((k, r, len(test_labels)), bool),
        "done": np.zeros(r, bool),
        **{column: table[column].to_numpy() for column in table},
        "num_val": np.array(len(workload.val)),
    }
    if args.grid.exists():
        with np.load(args.grid) as cached:
            if cached["ok"].shape == grid["ok"].shape:
                grid = {name: cached[name] for name in cached.files if name != "correct_bits"}
                grid["correct"] = np.unpackbits(cached["correct_bits"], axis=2, count=len(test_labels)).astype(bool)
    for replicate in np.flatnonzero(~grid["done"]):
        configs = [
            with_mechanism(
                replace(
                    base,
                    clip_bound=float(row.clip_bound),
                    batch_size=int(row.batch_size),
                    learning_rate=float(row.learning_rate),
                    base_learning_rate=float(row.base_learning_rate),
                    seed=args.seed * 1_000_003 + int(replicate) * k + i,
                ),
                len(workload.train),
            )
            for i, row in enumerate(table.itertuples())
        ]
        started = time.perf_counter()
        for i, result in enumerate(run_fused(configs, workload=workload)):
            if result.status != "ok" or result.trained is None:
                continue
            weight, bias = (torch.from_numpy(result.trained.parameters[p]) for p in ("weight", "bias"))
            right = ((rows @ torch.cat([weight, bias[:, None]], dim=1).T).argmax(1) == test_labels).numpy()
            assert abs(right.mean() - result.test_accuracy) < 1e-9, "row scores disagree with the runner's"
            grid["ok"][i, replicate] = True
            grid["correct"][i, replicate] = right
            grid["val_accuracy"][i, replicate] = result.val_accuracy
            grid["test_accuracy"][i, replicate] = result.test_accuracy
            grid["train_loss"][i, replicate] = result.train_loss
        grid["done"][replicate] = True
        print(f"replicate {replicate}: {k} runs in {time.perf_counter() - started:.1f} s", flush=True)
        stored = {name: value for name, value in grid.items() if name != "correct"}
        np.savez_compressed(args.grid, correct_bits=np.packbits(grid["correct"], axis=2), **stored)
    return grid


def split_accuracies(correct: np.ndarray, rows: int, draws: int, rng: np.random.Generator) -> np.ndarray:
    """(draws, configurations, replicates): each run's accuracy on each draw's split of ``rows`` rows
    drawn with replacement from the pool (one split per draw, shared by every run)."""
    k, r, pool = correct.shape
    counts = rng.multinomial(rows, np.full(pool, 1.0 / pool), size=draws).astype(np.float32)
    scored = correct.reshape(k * r, pool).astype(np.float32) @ counts.T / rows
    return scored.T.reshape(draws, k, r).astype(float)


def trials_frame(
    grid: dict[str, np.ndarray], picks: np.ndarray, counts: np.ndarray, val: np.ndarray, test: np.ndarray, rows: int
) -> pd.DataFrame:
    """The trials table of every draw: configuration k of draw d holds ``counts[d, k]`` replicates,
    runs ``picks[d, k, :counts[d, k]]`` of the grid, scored ``val[d, k, run]``/``test[d, k, run]``
    on the draw's splits of ``rows`` rows; runs not ``ok`` left out (``finished_trials``)."""
    draws, k, most = picks.shape
    d, c, j = np.meshgrid(np.arange(draws), np.arange(k), np.arange(most), indexing="ij")
    keep = (j < counts[:, :, None]) & grid["ok"][c, picks]
    d, c, j = d[keep], c[keep], j[keep]
    run = picks[d, c, j]
    return pd.DataFrame(
        {
            CELL: d,
            "configuration_id": np.char.add("c", c.astype(str)),
            "replicate": j,
            "search_id": "bench",
            "trial_id": j,
            "clip_bound": grid["clip_bound"][c],
            "batch_size": grid["batch_size"][c],
            "base_learning_rate": grid["base_learning_rate"][c],
            "learning_rate": grid["learning_rate"][c],
            "val_accuracy": val[d, c, run],
            "test_accuracy": test[d, c, run],
            "train_loss": grid["train_loss"][c, run],
            "num_val": rows,
            "num_test": rows,
        }
    )


def coverage_row(name: str, replicates: str, rows: int, checks: pd.DataFrame) -> dict[str, Any]:
    """One line of the table from ``checks`` (one row per interval: ``draw``, ``configuration``,
    ``inside``, ``width``).

    One interval per draw: Wilson's 95 % interval of the coverage; several: the mean of the
    per-draw coverage ± 1.96 of its standard error over draws (draws are independent), and the
    lowest and highest coverage of one configuration over the draws."""
    from dptune.analysis.intervals import accuracy_interval

    per_draw = checks.groupby("draw")["inside"].mean()
    draws, share = len(per_draw), float(checks["inside"].mean())
    if len(checks) == draws:
        low, high = accuracy_interval(share, draws) or (np.nan, np.nan)
    else:
        half = 1.96 * per_draw.std(ddof=1) / np.sqrt(draws)
        low, high = share - half, share + half
    line: dict[str, Any] = {
        "setting": name,
        "R": replicates,
        "n": rows,
        "draws": draws,
        "intervals": len(checks),
        "coverage": round(share, 4),
        "coverage_low": round(float(low), 4),
        "coverage_high": round(float(high), 4),
        "mean_width_points": round(100 * float(checks["width"].mean()), 2),
    }
    if len(checks) > draws:
        each = checks.groupby("configuration")["inside"].mean()
        line["configuration_low"], line["configuration_high"] = round(each.min(), 4), round(each.max(), 4)
    return line


def checks_of(table: pd.DataFrame, measure: str) -> pd.DataFrame:
    """Whether each row's ``measure`` (val/test) interval holds its ``truth``, and its width."""
    low, high = table[f"{measure}_low"], table[f"{measure}_high"]
    inside = (low <= table["truth"]) & (table["truth"] <= high)
    return pd.DataFrame(
        {"draw": table[CELL], "configuration": table["configuration_id"], "inside": inside, "width": high - low}
    )


def measure(grid: dict[str, np.ndarray], rows: int, draws: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Every setting at splits of ``rows`` rows (module docstring); lines of the coverage table."""
    from dptune.analysis import rank_configurations, with_intervals
    from dptune.analysis.intervals import accuracy_intervals

    ok = grid["ok"]
    k, r = ok.shape
    pool = grid["correct"].mean(axis=2)  # (k, r): each run's accuracy on the whole pool
    truth = np.nanmean(np.where(ok, pool, np.nan), axis=1)  # (k,): the configuration's accuracy
    val = split_accuracies(grid["correct"], rows, draws, rng)
    test = split_accuracies(grid["correct"], rows, draws, rng)
    lines = []
    settings = {"1, no replicates": (1, None), "1, others R = 2": (2, 1), "2": (2, None), "5": (5, None)}
    for label, (most, lone) in settings.items():
        picks = rng.integers(0, r, size=(draws, k, most))
        counts = np.full((draws, k), most)
        if lone is not None:
            counts[np.arange(draws), np.arange(draws) % k] = lone
        table = with_intervals(rank_configurations(trials_frame(grid, picks, counts, val, test, rows), [CELL]), [CELL])
        table["truth"] = truth[table["configuration_id"].str[1:].astype(int)]
        if lone is None:
            every = coverage_row("configuration, every one (test)", label, rows, checks_of(table, "test"))
        else:
            alone = table[table["replicates"] == lone]
            every = coverage_row("configuration, the one run once (test)", label, rows, checks_of(alone, "test"))
        best = table[table["rank"] == 1]
        setting = [
            every,
            coverage_row("selected best (validation)", label, rows, checks_of(best, "val")),
            coverage_row("selected best (test)", label, rows, checks_of(best, "test")),
        ]
        for line in setting:
            line["interval_source"] = ", ".join(sorted(set(table["interval_source"])))
        lines += setting
        if most == 1:
            d, c = np.nonzero(ok[np.arange(k)[None, :], picks[:, :, 0]])
            run = picks[d, c, 0]
            low, high, _ = accuracy_intervals(test[d, c, run], rows)
            inside = (low <= pool[c, run]) & (pool[c, run] <= high)
            checks = pd.DataFrame({"draw": d, "configuration": c, "inside": inside, "width": high - low})
            lines.append(coverage_row("model, one run (test, Wilson)", "1", rows, checks))
    return lines


def grid_summary(grid: dict[str, np.ndarray]) -> dict[str, Any]:
    """The grid's configurations: truth (mean pool accuracy), run-to-run SD and ok share, in points."""
    ok = grid["ok"]
    accuracy = np.where(ok, grid["test_accuracy"], np.nan)
    return {
        "runs": int(ok.size),
        "ok_runs": int(ok.sum()),
        "configurations": [
            {
                "clip_bound": round(float(grid["clip_bound"][i]), 4),
                "batch_size": int(grid["batch_size"][i]),
                "base_learning_rate": round(float(grid["base_learning_rate"][i]), 6),
                "ok_share": round(float(ok[i].mean()), 3),
                "test_accuracy_points": round(100 * float(np.nanmean(accuracy[i])), 2),
                "run_sd_points": round(100 * float(np.nanstd(accuracy[i], ddof=1)), 2),
                "val_run_sd_points": round(100 * float(np.nanstd(grid["val_accuracy"][i], ddof=1)), 2),
            }
            for i in range(len(ok))
        ],
    }


def markdown(lines: list[dict[str, Any]]) -> str:
    """The coverage table as Markdown (coverage in %, width in accuracy points)."""
    out = [
        "| quantity | R | n | intervals | source | coverage % [95 % interval] | one configuration's, lowest–highest |"
        " mean width (points) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for line in lines:
        spread = (
            f"{100 * line['configuration_low']:.1f}–{100 * line['configuration_high']:.1f}"
            if "configuration_low" in line
            else ""
        )
        out.append(
            f"| {line['setting']} | {line['R']} | {line['n']:,} | {line['intervals']:,} | "
            f"{line.get('interval_source', 'split')} | {100 * line['coverage']:.1f} "
            f"[{100 * line['coverage_low']:.1f}, {100 * line['coverage_high']:.1f}] | {spread} | "
            f"{line['mean_width_points']:.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    from dptune.paths import cache_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configurations", type=int, default=24)
    parser.add_argument("--replicates", type=int, default=40)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--rows", type=int, nargs="+", default=[500, 1196, 7528])
    parser.add_argument("--seed", type=int, default=54)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grid", type=Path, default=None, help="the cached grid (.npz); default in dptune's cache")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "intervals.json")
    args = parser.parse_args()
    if args.grid is None:
        name = f"intervals_grid_eps{args.epsilon:g}_E{args.epochs}_K{args.configurations}_R{args.replicates}.npz"
        args.grid = cache_dir("bench") / name
    started = time.perf_counter()
    grid = build_grid(args)
    grid_s = time.perf_counter() - started
    rng = np.random.default_rng(args.seed)
    lines = [line for rows in args.rows for line in measure(grid, rows, args.draws, rng)]
    print(markdown(lines))
    result = {
        "machine": machine(),
        "command": " ".join(sys.argv),
        "epsilon": args.epsilon,
        "epochs": args.epochs,
        "pool_rows": int(grid["correct"].shape[2]),
        "num_val": int(grid["num_val"]),
        "grid_seconds": round(grid_s, 1),
        "resampling_seconds": round(time.perf_counter() - started - grid_s, 1),
        "grid": grid_summary(grid),
        "coverage": lines,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
