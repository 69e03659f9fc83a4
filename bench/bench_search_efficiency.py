"""Search efficiency: how many trials each sampler needs to come within 1 point of a cell's best.

Ground truth: a replicated full grid of one cell of the default space (20 Newsgroups, cached
MiniLM features, DP linear head, DP-Adam, normalized clipping; ε = 1, E = 10 unless told),
C × B × η₀ (``--clip-values`` log-spaced values in [0.01, 10], the 7 batch sizes of the space,
``--lr-values`` log-spaced values in [1e-4, 1e-1]), read twice: with √B coupling
(η = η₀·√(B/256)) and without (η = η₀); the runs the two readings share (B = 256) run once.
Every (C, B, η) runs ``--replicates`` times with its own coins (a seed per configuration and
replicate, so the grid is reproducible), all through the fused runner ``dptune.runners.fused.run_fused``,
without diagnostics. The grid is cached as Parquet (``--grid``), one row per (coupling, C, B,
η₀, replicate), so the simulation reruns in seconds.

Simulation: each sampler runs against the grid as a lookup table. A query of (C, B, η₀) returns
one replicate's validation accuracy, drawn at random (0 for a run that did not finish ``ok``,
as the service tells its sampler); a configuration's true value is its mean test accuracy over
the replicates; after n trials the sampler's choice is the configuration of its best validation
query, and it succeeds when the choice's true value is within ``--tolerance`` (1 point) of the
best true value of the whole grid (both readings). Samplers: Optuna's ``RandomSampler`` and
``TPESampler`` (``n_startup_trials`` 8, as the service's cell sampler) over
categorical distributions of the grid values, each with and without √B coupling and with and
without the min-step rule (T ≥ T_min of the space). With the rule, a proposal whose B gives
T < T_min is told to Optuna as pruned and does not count (the service records it, never runs
it); without it, it runs and counts. Also: the same samplers telling the mean of all replicates
(each configuration then costs R trials), TPE asked ``--asked-together`` configurations at a
time before any is told (the service's batches, with ``constant_liar`` as the service sets it;
√B coupling, min-step rule), the full grid with one replicate per configuration,
and the full grid's best by mean validation accuracy over the replicates. Reported per sampler
over ``--seeds`` sampler seeds: trials until the first success (median and IQR; ``inf`` =
none within ``--max-trials``) and the success probability at 8, 16, 24 and 48 trials. Also the
validation split's selection noise: the binomial sd of an accuracy at the best configuration's
level on the validation split, and the replicate-to-replicate sd of validation accuracy.

    nice python bench/bench_search_efficiency.py [--epsilon 1] [--epochs 10] [--replicates 3]
        [--seeds 20] [--max-trials 64] [--asked-together 8 32] [--grid FILE.parquet] [--rebuild]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_SPACE = ROOT / "search_spaces" / "default.yaml"
COUPLINGS = ("sqrt", "none")
CHECKPOINTS = (8, 16, 24, 48)
TPE_STARTUP_TRIALS = 8


def reading(coupling: str) -> str:
    """How a grid reading is named in the tables."""
    return "√B coupling" if coupling == "sqrt" else "no coupling"


# ----------------------------------------------------------------------------------------------
# Ground truth: the replicated grid


def run_seed(clip_bound: float, batch_size: int, learning_rate: float, replicate: int) -> int:
    """A seed per run (53 bits, exact in float64): distinct coins for every configuration and replicate."""
    digest = hashlib.sha256(f"{clip_bound!r}:{batch_size}:{learning_rate!r}:{replicate}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 11


def build_grid(args: argparse.Namespace) -> pd.DataFrame:
    """Run the replicated grid with the fused runner; one row per (coupling, C, B, η₀, replicate).

    Writes ``args.grid`` after each replicate, and resumes from the replicates already there."""
    from dptune import search
    from dptune.data import WorkloadSpec, load_workload
    from dptune.plan import coupled_learning_rate
    from dptune.plan.mechanism import with_mechanism
    from dptune.runners.fused import run_fused
    from dptune.space import load_space

    loaded = load_space(
        DEFAULT_SPACE,
        {
            "privacy.epsilons": [args.epsilon],
            "epochs": [args.epochs],
            "training.diagnostics": False,
            "training.compare_auto_s": False,
        },
    )
    space = loaded.space
    task = space.task
    num_train = len(
        load_workload(
            WorkloadSpec(
                dataset=task.dataset,
                backbone=task.backbone,
                peft=task.peft,
                seed=space.seed,
                fraction=task.fraction,
                max_tokens=task.max_tokens,
                validation_fraction=task.validation_fraction,
            )
        ).train
    )
    plan = search.mode_of(space).plan(space, num_train, progress=False)[0]
    base = search.base_trial_config(space, plan, None, None)
    if args.threads is not None:
        base = replace(base, threads=args.threads)
    reference = space.coupling.reference_batch_size
    clip_values = np.geomspace(0.01, 10.0, args.clip_values).tolist()
    lr_values = np.geomspace(1e-4, 1e-1, args.lr_values).tolist()
    batch_sizes = sorted(plan.feasible_batch_sizes + plan.pruned_batch_sizes)
    points = [
        {
            "coupling": coupling,
            "clip_bound": c,
            "batch_size": b,
            "base_learning_rate": lr0,
            "learning_rate": coupled_learning_rate(lr0, b, reference) if coupling == "sqrt" else lr0,
        }
        for coupling, c, b, lr0 in itertools.product(COUPLINGS, clip_values, batch_sizes, lr_values)
    ]
    runs = sorted({(p["clip_bound"], p["batch_size"], p["learning_rate"]) for p in points})
    done = pd.read_parquet(args.grid) if args.grid.exists() and not args.rebuild else pd.DataFrame()
    frames = [done] if len(done) else []
    for replicate in range(args.replicates):
        if len(done) and replicate in set(done["replicate"]):
            continue
        configs = [
            with_mechanism(  # σ from the planner (a pruned B too: the grid runs it), cached per (ε, δ, q, T)
                replace(
                    base,
                    clip_bound=c,
                    batch_size=b,
                    learning_rate=lr,
                    base_learning_rate=lr,
                    seed=run_seed(c, b, lr, replicate),
                ),
                num_train,
            )
            for c, b, lr in runs
        ]
        started = time.perf_counter()
        results = run_fused(configs)
        elapsed = time.perf_counter() - started
        print(
            f"replicate {replicate}: {len(configs)} runs in {elapsed:.0f} s "
            f"({len(configs) / elapsed * 60:.0f} runs/min, fused)",
            flush=True,
        )
        by_run = {run: result for run, result in zip(runs, results, strict=True)}
        rows = []
        for point in points:
            result = by_run[(point["clip_bound"], point["batch_size"], point["learning_rate"])]
            rows.append(
                {
                    **point,
                    "replicate": replicate,
                    "seed": result.config.seed,
                    "status": result.status,
                    "val_accuracy": result.val_accuracy,
                    "test_accuracy": result.test_accuracy,
                    "steps": result.steps,
                    "noise_multiplier": result.noise_multiplier,
                    "epsilon_spent": result.epsilon_spent,
                    "num_val": result.num_val,
                    "pruned_by_min_steps": point["batch_size"] in plan.pruned_batch_sizes,
                    "epsilon": args.epsilon,
                    "epochs": args.epochs,
                    "min_steps": space.min_steps,
                    "fused_seconds_of_replicate": elapsed,
                    "runs_in_replicate": len(configs),
                }
            )
        frames.append(pd.DataFrame(rows))
        args.grid.parent.mkdir(parents=True, exist_ok=True)
        pd.concat(frames, ignore_index=True).to_parquet(args.grid, index=False)
    return pd.concat(frames, ignore_index=True)


# ----------------------------------------------------------------------------------------------
# The grid as a lookup table


@dataclass(frozen=True)
class Lookup:
    """The grid of one coupling as arrays indexed ``[c, b, l]`` (C, B, η₀ positions) and ``r``.

    ``val[c, b, l, r]``: what a query of replicate r returns (0 for a run not ``ok``);
    ``truth[c, b, l]``: mean test accuracy over the replicates that finished ``ok`` (−inf if none).
    """

    clip_values: tuple[float, ...]
    batch_sizes: tuple[int, ...]
    lr_values: tuple[float, ...]
    pruned_batch_sizes: frozenset[int]
    val: np.ndarray
    truth: np.ndarray

    @classmethod
    def of(cls, grid: pd.DataFrame, coupling: str) -> Lookup:
        rows = grid[grid["coupling"] == coupling].sort_values(
            ["clip_bound", "batch_size", "base_learning_rate", "replicate"]
        )
        axes = [tuple(sorted(rows[name].unique())) for name in ("clip_bound", "batch_size", "base_learning_rate")]
        shape = (*map(len, axes), rows["replicate"].nunique())
        if len(rows) != math.prod(shape):
            raise SystemExit(f"the {coupling} grid is incomplete: {len(rows)} rows, expected {math.prod(shape)}")
        ok = (rows["status"] == "ok").to_numpy().reshape(shape)
        val = np.where(ok, rows["val_accuracy"].to_numpy().reshape(shape), 0.0)
        test = np.where(ok, rows["test_accuracy"].to_numpy().reshape(shape), np.nan)
        with np.errstate(invalid="ignore"):
            truth = np.where(ok.any(axis=3), np.nanmean(test, axis=3), -np.inf)
        pruned = frozenset(int(b) for b in rows.loc[rows["pruned_by_min_steps"], "batch_size"].unique())
        return cls(axes[0], tuple(int(b) for b in axes[1]), axes[2], pruned, val, truth)


@dataclass(frozen=True)
class SamplerSpec:
    """One simulated sampler: Optuna sampler ``kind``, the grid reading, the min-step rule, how
    many replicates each query's told value averages (each costs one trial), and how many
    configurations are asked together before any is told (the service's batches; TPE then runs
    with ``constant_liar``, as the service's)."""

    kind: str  # "random" | "tpe"
    coupling: str  # "sqrt" | "none"
    min_step_pruning: bool
    replicates_per_query: int = 1
    asked_together: int = 1

    @property
    def name(self) -> str:
        pruning = "min-step pruning" if self.min_step_pruning else "no pruning"
        mean = f", mean of {self.replicates_per_query} replicates" if self.replicates_per_query > 1 else ""
        batch = f", asked {self.asked_together} at a time" if self.asked_together > 1 else ""
        return f"{self.kind}, {reading(self.coupling)}, {pruning}{mean}{batch}"


def simulate(spec: SamplerSpec, lookup: Lookup, seed: int, max_trials: int) -> np.ndarray:
    """One run of a sampler: ``truth of its choice after n trials`` for n = 1..max_trials."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    sampler = (
        optuna.samplers.RandomSampler(seed=seed)
        if spec.kind == "random"
        else optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=TPE_STARTUP_TRIALS, constant_liar=spec.asked_together > 1
        )
    )
    study = optuna.create_study(direction="maximize", sampler=sampler)
    distributions = {
        "clip_bound": CategoricalDistribution(list(range(len(lookup.clip_values)))),
        "batch_size": CategoricalDistribution(list(range(len(lookup.batch_sizes)))),
        "base_learning_rate": CategoricalDistribution(list(range(len(lookup.lr_values)))),
    }
    replicate_draws = np.random.default_rng(seed)
    choice_truth = np.full(max_trials, np.nan)
    best_val, best_truth, used, proposals = -np.inf, np.nan, 0, 0
    while used < max_trials:
        queries = min(spec.asked_together, math.ceil((max_trials - used) / spec.replicates_per_query))
        asked = []
        while len(asked) < queries:
            proposals += 1
            if proposals > 100 * max_trials:
                raise SystemExit(f"{spec.name}: the sampler proposed only pruned batch sizes")
            trial = study.ask(distributions)
            if spec.min_step_pruning and lookup.batch_sizes[trial.params["batch_size"]] in lookup.pruned_batch_sizes:
                study.tell(trial, state=TrialState.PRUNED)
            else:
                asked.append(trial)
        for trial in asked:
            c, b, lr = (trial.params[name] for name in ("clip_bound", "batch_size", "base_learning_rate"))
            replicates = replicate_draws.choice(lookup.val.shape[3], size=spec.replicates_per_query, replace=False)
            value = float(lookup.val[c, b, lr, replicates].mean())
            study.tell(trial, value)
            if value > best_val:
                best_val, best_truth = value, float(lookup.truth[c, b, lr])
            cost = min(spec.replicates_per_query, max_trials - used)
            choice_truth[used : used + cost] = best_truth
            used += cost
    return choice_truth


def first_success(curve: np.ndarray, target: float) -> float:
    """Trials until the choice first comes within the tolerance (``target``), inf if never."""
    hits = np.flatnonzero(curve >= target)
    return float(hits[0] + 1) if len(hits) else math.inf


def summarise(name: str, curves: list[np.ndarray], target: float) -> dict[str, Any]:
    """Trials-to-success median and IQR, and success probability at each checkpoint, over seeds."""
    needed = np.array([first_success(curve, target) for curve in curves])
    quartiles = np.percentile(needed, [25, 50, 75], method="lower")
    return {
        "sampler": name,
        "seeds": len(curves),
        "trials_needed_median": float(quartiles[1]),
        "trials_needed_iqr": [float(quartiles[0]), float(quartiles[2])],
        "never_within_budget": int(np.isinf(needed).sum()),
        **{
            f"success_at_{n}": round(float(np.mean([curve[n - 1] >= target for curve in curves])), 3)
            for n in CHECKPOINTS
            if n <= len(curves[0])
        },
    }


def full_grid_rows(lookups: dict[str, Lookup], target: float, seeds: int) -> list[dict[str, Any]]:
    """The full grid read with one replicate per configuration (over replicate draws), and by the
    mean of all replicates (deterministic)."""
    rows = []
    for coupling, lookup in lookups.items():
        size = lookup.truth.size
        draws = np.random.default_rng(0)
        hits = []
        for _ in range(seeds):
            picked = draws.integers(lookup.val.shape[3], size=lookup.truth.shape)
            val = np.take_along_axis(lookup.val, picked[..., None], axis=3)[..., 0]
            hits.append(lookup.truth.flat[int(np.argmax(val))] >= target)
        mean_choice = lookup.truth.flat[int(np.argmax(lookup.val.mean(axis=3)))]
        rows.append(
            {
                "sampler": f"full grid, {reading(coupling)}, one replicate each",
                "trials": size,
                "success_probability": round(float(np.mean(hits)), 3),
                "seeds": seeds,
            }
        )
        rows.append(
            {
                "sampler": f"full grid, {reading(coupling)}, mean of {lookup.val.shape[3]} replicates",
                "trials": size * lookup.val.shape[3],
                "success_probability": float(mean_choice >= target),
                "choice_true_test_accuracy": round(float(mean_choice), 4),
            }
        )
    return rows


def selection_noise(grid: pd.DataFrame) -> dict[str, Any]:
    """Binomial sd of validation accuracy at the best configuration's level, and replicate sds."""
    ok = grid[grid["status"] == "ok"].drop_duplicates(["clip_bound", "batch_size", "learning_rate", "replicate"])
    per_run = ok.groupby(["clip_bound", "batch_size", "learning_rate"])
    means, sds = per_run["val_accuracy"].mean(), per_run["val_accuracy"].std(ddof=1)
    test_sds = per_run["test_accuracy"].std(ddof=1)
    num_val = int(ok["num_val"].iloc[0])
    best = means.idxmax()
    top = means.nlargest(10).index
    return {
        "num_val": num_val,
        "best_mean_val_accuracy": round(float(means[best]), 4),
        "binomial_sd_at_best": round(math.sqrt(means[best] * (1 - means[best]) / num_val), 4),
        "replicate_sd_val_at_best": round(float(sds[best]), 4),
        "replicate_sd_val_median_top10": round(float(sds[top].median()), 4),
        "replicate_sd_val_median_all": round(float(sds.median()), 4),
        "replicate_sd_test_median_top10": round(float(test_sds[top].median()), 4),
        "configurations_with_replicates": int(len(means)),
    }


def evaluate(grid: pd.DataFrame, args: argparse.Namespace) -> dict[str, Any]:
    """Every simulated sampler over ``args.seeds`` seeds, the full-grid readings and the noise."""
    lookups = {coupling: Lookup.of(grid, coupling) for coupling in COUPLINGS}
    best_truth = max(float(lookup.truth.max()) for lookup in lookups.values())
    target = best_truth - args.tolerance
    specs = [
        SamplerSpec(kind, coupling, pruning)
        for kind, coupling, pruning in itertools.product(("random", "tpe"), COUPLINGS, (True, False))
    ]
    replicates = int(grid["replicate"].nunique())
    specs += [SamplerSpec(kind, "sqrt", True, replicates) for kind in ("random", "tpe")] if replicates > 1 else []
    specs += [SamplerSpec("tpe", "sqrt", True, asked_together=n) for n in args.asked_together]
    pruned = sorted(lookups["sqrt"].pruned_batch_sizes)
    rows = []
    for spec in specs:
        started = time.perf_counter()
        curves = [simulate(spec, lookups[spec.coupling], seed, args.max_trials) for seed in range(args.seeds)]
        rows.append({**summarise(spec.name, curves, target), "seconds": round(time.perf_counter() - started, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return {
        "cell": {
            "epsilon": float(grid["epsilon"].iloc[0]),
            "epochs": int(grid["epochs"].iloc[0]),
            "min_steps": int(grid["min_steps"].iloc[0]),
            "pruned_batch_sizes": pruned,
        },
        "grid": {
            "clip_values": list(lookups["sqrt"].clip_values),
            "batch_sizes": list(lookups["sqrt"].batch_sizes),
            "base_learning_rates": list(lookups["sqrt"].lr_values),
            "replicates": replicates,
            "rows": len(grid),
            "runs": int(len(grid.drop_duplicates(["clip_bound", "batch_size", "learning_rate", "replicate"]))),
        },
        "best_true_test_accuracy": {
            coupling: round(float(lookup.truth.max()), 4) for coupling, lookup in lookups.items()
        },
        "tolerance": args.tolerance,
        "target_true_test_accuracy": round(target, 4),
        "samplers": rows,
        "full_grid": full_grid_rows(lookups, target, args.seeds),
        "selection_noise": selection_noise(grid),
        "note_pruning": (
            "no batch size is pruned at this cell (T ≥ min_steps for every B): the variants with and "
            "without min-step pruning are the same search"
        )
        if not pruned
        else "",
    }


def format_markdown(figures: dict[str, Any]) -> str:
    """The samplers' table, the full-grid readings and the selection noise as Markdown."""
    checkpoints = [n for n in CHECKPOINTS if f"success_at_{n}" in figures["samplers"][0]]
    lines = [
        "| sampler | trials needed, median [IQR] | never (of seeds) | "
        + " | ".join(f"P(success) at {n}" for n in checkpoints)
        + " |",
        "|---|---|---|" + "---|" * len(checkpoints),
    ]
    for row in figures["samplers"]:
        low, high = row["trials_needed_iqr"]
        lines.append(
            f"| {row['sampler']} | {row['trials_needed_median']:g} [{low:g}, {high:g}] | "
            f"{row['never_within_budget']}/{row['seeds']} | "
            + " | ".join(f"{row[f'success_at_{n}']:.2f}" for n in checkpoints)
            + " |"
        )
    lines += ["", "| full grid | trials | P(success) |", "|---|---|---|"]
    lines += [
        f"| {row['sampler']} | {row['trials']} | {row['success_probability']:.2f} |" for row in figures["full_grid"]
    ]
    noise = figures["selection_noise"]
    lines += [
        "",
        f"Best true test accuracy: {figures['best_true_test_accuracy']}; target "
        f"{figures['target_true_test_accuracy']} (tolerance {figures['tolerance']}). Validation split: "
        f"{noise['num_val']} rows; binomial sd at the best mean val accuracy {noise['best_mean_val_accuracy']}: "
        f"{noise['binomial_sd_at_best']}; replicate sd of val accuracy at the best "
        f"{noise['replicate_sd_val_at_best']}, median over the top 10 {noise['replicate_sd_val_median_top10']}, "
        f"over all {noise['replicate_sd_val_median_all']}.",
    ]
    if figures["note_pruning"]:
        lines.append(figures["note_pruning"])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--clip-values", type=int, default=6, help="log-spaced C values in [0.01, 10]")
    parser.add_argument("--lr-values", type=int, default=6, help="log-spaced η₀ values in [1e-4, 1e-1]")
    parser.add_argument("--replicates", type=int, default=3, help="runs per (C, B, η) with their own coins")
    parser.add_argument("--threads", type=int, help="torch threads of the fused runner (default: the space's)")
    parser.add_argument(
        "--grid",
        type=Path,
        help="the grid's Parquet cache (default: bench/results/search_efficiency_grid_eps<ε>_E<E>.parquet)",
    )
    parser.add_argument("--rebuild", action="store_true", help="recompute the grid even if the cache exists")
    parser.add_argument("--seeds", type=int, default=20, help="sampler seeds per sampler")
    parser.add_argument("--max-trials", type=int, default=64, help="trials per simulated search")
    parser.add_argument(
        "--asked-together",
        type=int,
        nargs="*",
        default=[8, 32],
        help="also TPE asked this many configurations at a time (the service's batches)",
    )
    parser.add_argument("--tolerance", type=float, default=0.01, help="success: within this of the best (accuracy)")
    parser.add_argument(
        "--out", type=Path, help="JSON figures (default: bench/results/search_efficiency_eps<ε>_E<E>.json)"
    )
    args = parser.parse_args()
    for name in ("clip_values", "lr_values", "replicates", "seeds", "max_trials"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if any(n < 2 for n in args.asked_together):
        parser.error(f"--asked-together: batches of at least 2, got {args.asked_together}")
    stem = f"eps{args.epsilon:g}_E{args.epochs}".replace(".", "p")
    args.grid = args.grid or RESULTS / f"search_efficiency_grid_{stem}.parquet"
    args.out = args.out or RESULTS / f"search_efficiency_{stem}.json"
    cached = args.grid.exists() and not args.rebuild
    grid = pd.read_parquet(args.grid) if cached else pd.DataFrame()
    if not cached or grid["replicate"].nunique() < args.replicates:
        grid = build_grid(args)
    figures = evaluate(grid, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2))
    markdown = format_markdown(figures)
    args.out.with_suffix(".md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
