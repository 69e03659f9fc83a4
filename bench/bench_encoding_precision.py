"""Each encoding precision against torch fp32 for the MiniLM features of 20 Newsgroups: speed and accuracy.

The precisions are ``dptune.data.features.PRECISIONS`` (``--precisions`` picks some; torch fp32, the
reference, is always one): torch bf16 casts the encoder's weights to bf16 (until 2026-12-01: a bf16
autocast of the fp32 encoder, which the figures in ``bench/RESULTS.md`` before that date measured);
``openvino-fp32``/``openvino-bf16`` run it on OpenVINO's CPU runtime at that inference precision.

1. Speed: ``--docs`` documents of the training split (a seeded sample), truncated to
   ``--max-tokens``, encoded by ``dptune.data.features.encode_texts`` in each precision, each
   after a warm-up of one batch; documents per second of wall time and of process CPU time (the
   fairer figure on a shared machine), and the cosine similarity of each document's features to
   its fp32 ones (minimum and median).
2. Accuracy: the same DP linear-probe configurations (``run_trial``, peft ``head``, the default
   search's ε and epoch budgets, DP-Adam with normalized clipping, explicit seed) trained on the
   features of each precision of the same split (``--train-examples``/``--eval-examples`` caps,
   encoded through the feature cache with ``DPTUNE_ENCODE_PRECISION`` forced); per cell the test
   and validation accuracy of the configuration selected on validation, and per precision the
   largest difference to fp32 over all configurations.

5. With ``--replicates R --token-limits 64,96`` (issue 33, item 2): the same replicated probe on
   features of the first precision of ``--precisions`` truncated at each of those token limits,
   against ``--max-tokens`` (the default search's 128), instead of the precisions against fp32
   (add ``--skip-accuracy`` to leave out part 2).

4. With ``--replicates R`` (issue 33's downstream rule): the DP probe at ε = 1 and 8, E = 10 (the
   dense benchmark's cells; C ∈ {0.1, 1}, B ∈ {64, 256}, η₀ = 0.01), each configuration trained with
   R explicit seeds on the features of every precision by the fused runner, the same seed on each
   precision (the same coins: the pair differs only by the features). Per precision and ε: the mean
   paired difference of test accuracy to fp32 with its 95 % t interval over the 4·R pairs, next to
   the runs' own noise, the standard deviation of fp32's test accuracy across seeds (pooled over
   the configurations); a precision's effect is "inside the noise" when its whole interval lies
   within ± that deviation.

Prints a markdown summary; ``--out FILE.json`` also writes every figure.

3. With ``--batch-tokens 4096,16384``: docs/s at each tokens-per-batch budget of CPU encoding, in
   each precision (``--rounds`` interleaved rounds; medians), on another seeded sample.

    OMP_NUM_THREADS=2 nice .venv/bin/python bench/bench_encoding_precision.py --out build/bench/precision.json
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_encoding_precision.py --precisions openvino-bf16
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_encoding_precision.py --skip-accuracy --batch-tokens 4096,8192,16384
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_encoding_precision.py --skip-accuracy --replicates 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from dptune.contract import TrialConfig, WorkloadSpec
from dptune.data import features as feature_cache
from dptune.data.features import PRECISION_ENV, PRECISIONS, TEXT_BATCH_TOKENS, cpu_flags, encode_texts
from dptune.data.sources import load_20newsgroups
from dptune.models import BACKBONES, build_feature_extractor, load_tokenizer
from dptune.plan.mechanism import with_mechanism
from dptune.runners.trial import run_trial

#: The default search's cells (search_spaces/default.yaml) and a spread of (C, B, η₀) in its ranges.
EPSILONS = (1.0, 8.0)
EPOCHS = (5, 20)
CLIP_BOUNDS = (0.1, 1.0)
BATCH_SIZES = (64, 256)
BASE_LEARNING_RATES = (0.01,)
REFERENCE_BATCH_SIZE = 256


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two ``(rows, dim)`` arrays."""
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def encoding_speed(docs: int, max_tokens: int, seed: int, precisions: tuple[str, ...]) -> dict:
    """Docs/s of each precision's encoding of ``docs`` training documents, and its agreement with fp32."""
    raw = load_20newsgroups()
    rng = np.random.default_rng(seed)
    rows = rng.choice(raw.num_official_train, size=docs, replace=False)
    texts = [raw.inputs[row] for row in rows]
    extractor = build_feature_extractor("minilm")
    tokenizer = load_tokenizer("minilm")
    dim = BACKBONES["minilm"].feature_dim
    figures: dict = {"docs": docs, "max_tokens": max_tokens, "threads": torch.get_num_threads()}
    features = {}
    for precision in precisions:
        encode_texts(extractor, tokenizer, texts[:64], max_tokens, dim, precision)  # warm-up
        wall, cpu = time.perf_counter(), time.process_time()
        features[precision] = encode_texts(extractor, tokenizer, texts, max_tokens, dim, precision)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        similarity = cosine(features["fp32"], features[precision])
        figures[precision] = {
            "wall_s": wall,
            "cpu_s": cpu,
            "docs_per_s": docs / wall,
            "docs_per_cpu_s": docs / cpu,
            "speedup_wall": docs / wall / figures["fp32"]["docs_per_s"] if precision != "fp32" else 1.0,
            "cosine_min": float(similarity.min()),
            "cosine_median": float(np.median(similarity)),
        }
    return figures


def batch_budget_speed(
    docs: int, max_tokens: int, seed: int, budgets: list[int], rounds: int, precisions: tuple[str, ...]
) -> dict:
    """Docs/s of CPU encoding (each precision) at each tokens-per-batch budget: ``rounds`` rounds, the
    budgets interleaved within a round (a drifting machine affects them alike); median over rounds."""
    raw = load_20newsgroups()
    rows = np.random.default_rng(seed + 1).choice(raw.num_official_train, size=docs, replace=False)
    texts = [raw.inputs[row] for row in rows]
    extractor, tokenizer = build_feature_extractor("minilm"), load_tokenizer("minilm")
    dim = BACKBONES["minilm"].feature_dim
    default = TEXT_BATCH_TOKENS["cpu"]
    rates: dict[str, dict[int, list[float]]] = {p: {b: [] for b in budgets} for p in precisions}
    try:
        for precision in precisions:
            encode_texts(extractor, tokenizer, texts[:64], max_tokens, dim, precision)  # warm-up
            for _ in range(rounds):
                for budget in budgets:
                    feature_cache.TEXT_BATCH_TOKENS["cpu"] = budget
                    wall = time.perf_counter()
                    encode_texts(extractor, tokenizer, texts, max_tokens, dim, precision)
                    rates[precision][budget].append(docs / (time.perf_counter() - wall))
    finally:
        feature_cache.TEXT_BATCH_TOKENS["cpu"] = default
    return {
        p: {str(b): {"median_docs_per_s": float(np.median(r)), "docs_per_s": r} for b, r in by_budget.items()}
        for p, by_budget in rates.items()
    }


def probe_config(
    train_examples: int,
    eval_examples: int,
    max_tokens: int,
    epsilon: float,
    epochs: int,
    clip_bound: float,
    batch_size: int,
    base_learning_rate: float,
    seed: int,
) -> TrialConfig:
    """One DP probe of the capped 20 Newsgroups split: DP-Adam, normalized clipping, η = η₀·√(B/256),
    explicit ``seed``, no diagnostics; with the mechanism the planner calibrates for it on the split's N."""
    from dptune.runners.common import cached_workload

    config = TrialConfig(
        workload=WorkloadSpec(
            dataset="20newsgroups",
            backbone="minilm",
            peft="head",
            max_tokens=max_tokens,
            max_train_examples=train_examples,
            max_eval_examples=eval_examples,
        ),
        epsilon=epsilon,
        delta=1e-5,
        epochs=epochs,
        clip_bound=clip_bound,
        batch_size=batch_size,
        learning_rate=base_learning_rate * (batch_size / REFERENCE_BATCH_SIZE) ** 0.5,
        base_learning_rate=base_learning_rate,
        optimizer="adam",
        clipping="normalized",
        seed=seed,
        threads=torch.get_num_threads(),
        diagnostics=False,
    )
    return with_mechanism(config, len(cached_workload(config.workload).train))


def probe_accuracies(
    train_examples: int, eval_examples: int, max_tokens: int, seed: int, precisions: tuple[str, ...]
) -> list[dict]:
    """One row per (precision, ε, E, C, B, η₀): validation and test accuracy of the DP probe."""
    from dptune.runners import common

    rows = []
    for precision in precisions:
        os.environ[PRECISION_ENV] = precision
        common.cached_workload.cache_clear()  # the memo is keyed by spec, not by precision
        for epsilon, epochs, clip, batch, base_lr in itertools.product(
            EPSILONS, EPOCHS, CLIP_BOUNDS, BATCH_SIZES, BASE_LEARNING_RATES
        ):
            result = run_trial(
                probe_config(train_examples, eval_examples, max_tokens, epsilon, epochs, clip, batch, base_lr, seed)
            )
            rows.append(
                {
                    "precision": precision,
                    "epsilon": epsilon,
                    "epochs": epochs,
                    "clip_bound": clip,
                    "batch_size": batch,
                    "base_learning_rate": base_lr,
                    "status": result.status,
                    "val_accuracy": result.val_accuracy,
                    "test_accuracy": result.test_accuracy,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    os.environ.pop(PRECISION_ENV)
    return rows


#: The downstream rule's cells (issue 33): ε = 1 and 8 at E = 10.
AGREEMENT_EPSILONS = (1.0, 8.0)
AGREEMENT_EPOCHS = 10


def replicated_probes(
    train_examples: int, eval_examples: int, max_tokens: int, replicates: int, precisions: tuple[str, ...]
) -> list[dict]:
    """One row per (precision, ε, C, B, seed): test and validation accuracy of the DP probe (fused
    runner, seeds 0..R-1, the same on every precision)."""
    from dptune.runners import common
    from dptune.runners.fused import run_fused

    rows = []
    for precision in precisions:
        os.environ[PRECISION_ENV] = precision
        common.cached_workload.cache_clear()  # the memo is keyed by spec, not by precision
        for epsilon in AGREEMENT_EPSILONS:
            configs = [
                probe_config(
                    train_examples, eval_examples, max_tokens, epsilon, AGREEMENT_EPOCHS, clip, batch, base_lr, seed
                )
                for clip, batch, base_lr in itertools.product(CLIP_BOUNDS, BATCH_SIZES, BASE_LEARNING_RATES)
                for seed in range(replicates)
            ]
            for config, result in zip(configs, run_fused(configs), strict=True):
                rows.append(
                    {
                        "precision": precision,
                        "epsilon": epsilon,
                        "clip_bound": config.clip_bound,
                        "batch_size": config.batch_size,
                        "seed": config.seed,
                        "status": result.status,
                        "val_accuracy": result.val_accuracy,
                        "test_accuracy": result.test_accuracy,
                    }
                )
    os.environ.pop(PRECISION_ENV)
    return rows


def agreement(rows: list[dict], precisions: tuple[str, ...]) -> dict:
    """Per precision and ε: the paired test-accuracy difference to the first of ``precisions`` (the
    reference, fp32; points), its 95 % t interval, and the runs' own noise (the reference's pooled
    standard deviation across seeds, points)."""
    import pandas as pd
    from scipy import stats

    frame = pd.DataFrame(rows)
    frame["test"] = 100 * frame["test_accuracy"]
    table = frame.pivot_table(index=["epsilon", "clip_bound", "batch_size", "seed"], columns="precision", values="test")
    figures: dict = {}
    for epsilon, cell in table.groupby(level="epsilon"):
        reference = cell[precisions[0]]
        noise = float(np.sqrt(reference.groupby(level=["clip_bound", "batch_size"]).var(ddof=1).mean()))
        figures[f"eps={epsilon:g}"] = {"noise_sd_points": noise, "pairs": len(cell)}
        for p in precisions[1:]:
            difference = (cell[p] - reference).to_numpy()
            mean = float(difference.mean())
            half = float(stats.t.ppf(0.975, len(difference) - 1) * difference.std(ddof=1) / np.sqrt(len(difference)))
            figures[f"eps={epsilon:g}"][p] = {
                "mean_difference_points": mean,
                "interval_points": [mean - half, mean + half],
                "inside_noise": bool(-noise <= mean - half and mean + half <= noise),
            }
    return figures


def print_agreement(figures: dict, labels: tuple[str, ...]) -> None:
    """A markdown table of :func:`agreement`'s figures: per ε the runs' noise and each label's
    difference to the first label with its interval, inside or outside the noise."""
    print(
        f"| ε (E = {AGREEMENT_EPOCHS}) | runs' noise (SD, points) | "
        + " | ".join(f"{label} − {labels[0]}, test points [95 % interval]" for label in labels[1:])
        + " |\n|---|---|"
        + "---|" * (len(labels) - 1)
    )
    for cell, found in figures.items():
        print(
            f"| {cell} | {found['noise_sd_points']:.2f} | "
            + " | ".join(
                f"{found[label]['mean_difference_points']:+.2f} [{found[label]['interval_points'][0]:+.2f}, "
                f"{found[label]['interval_points'][1]:+.2f}]"
                + (" inside" if found[label]["inside_noise"] else " OUTSIDE")
                for label in labels[1:]
            )
            + " |"
        )


def compare(rows: list[dict], precisions: tuple[str, ...]) -> dict:
    """Per cell, the best-on-validation trial of each precision; per precision the largest gap to fp32
    over configurations."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    config = ["epsilon", "epochs", "clip_bound", "batch_size", "base_learning_rate"]
    paired = frame.pivot_table(index=config, columns="precision", values=["val_accuracy", "test_accuracy"])
    best = {}
    for (epsilon, epochs), cell in frame.groupby(["epsilon", "epochs"]):
        picks = {
            p: cell[cell["precision"] == p].sort_values("val_accuracy", ascending=False).iloc[0] for p in precisions
        }
        best[f"eps={epsilon:g}|epochs={epochs}"] = {
            p: {
                k: pick[k].item() if isinstance(pick[k], np.generic) else pick[k]
                for k in ("val_accuracy", "test_accuracy", "clip_bound", "batch_size", "base_learning_rate")
            }
            for p, pick in picks.items()
        }
    return {
        "best_per_cell": best,
        "max_abs_gap_points": {
            p: {
                split: float(100 * (paired[f"{split}_accuracy"][p] - paired[f"{split}_accuracy"]["fp32"]).abs().max())
                for split in ("test", "val")
            }
            for p in precisions[1:]
        },
        "configurations": len(paired),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=1024, help="documents timed per precision")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--train-examples", type=int, default=3000, help="training cap of the accuracy part")
    parser.add_argument("--eval-examples", type=int, default=1500, help="validation and test caps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-accuracy", action="store_true", help="time the encoding only")
    parser.add_argument(
        "--batch-tokens",
        default="",
        help="also time CPU encoding at these tokens-per-batch budgets, comma-separated (e.g. 4096,16384)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the --batch-tokens comparison")
    parser.add_argument(
        "--replicates", type=int, default=0, help="seeds per configuration of the replicated downstream comparison"
    )
    parser.add_argument(
        "--token-limits",
        default="",
        help="with --replicates: compare these max_tokens (comma-separated) with --max-tokens instead",
    )
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    parser.add_argument(
        "--precisions",
        default=",".join(PRECISIONS[1:]),
        help=f"precisions compared with fp32, comma-separated, of {list(PRECISIONS[1:])} (default: all)",
    )
    args = parser.parse_args()
    precisions = ("fp32", *(p for p in args.precisions.split(",") if p and p != "fp32"))
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown:
        parser.error(f"--precisions: unknown {unknown}; expected some of {list(PRECISIONS[1:])}")
    flags = sorted(cpu_flags() & {"amx_bf16", "avx512_bf16"})
    speed = encoding_speed(args.docs, args.max_tokens, args.seed, precisions)
    figures: dict = {"cpu_bf16_flags": flags, "speed": speed}
    print(
        f"\nCPU bf16 flags: {flags or 'none'}; {speed['threads']} threads; {args.docs} docs, {args.max_tokens} tokens"
    )
    print("| precision | docs/s (wall) | docs/s (process CPU) | vs fp32 (wall) | cosine to fp32 min / median |")
    print("|---|---|---|---|---|")
    for p in precisions:
        row = speed[p]
        print(
            f"| {p} | {row['docs_per_s']:.1f} | {row['docs_per_cpu_s']:.1f} | {row['speedup_wall']:.2f}x "
            f"| {row['cosine_min']:.6f} / {row['cosine_median']:.6f} |"
        )
    if args.batch_tokens:
        budgets = [int(b) for b in args.batch_tokens.split(",")]
        figures["batch_tokens"] = batch_budget_speed(
            args.docs, args.max_tokens, args.seed, budgets, args.rounds, precisions
        )
        print(f"\n| tokens per batch | {' | '.join(f'{p} docs/s (median of {args.rounds})' for p in precisions)} |")
        print("|---|" + "---|" * len(precisions))
        for budget in budgets:
            print(
                f"| {budget} | "
                + " | ".join(f"{figures['batch_tokens'][p][str(budget)]['median_docs_per_s']:.1f}" for p in precisions)
                + " |"
            )
    if not args.skip_accuracy:
        accuracy = compare(
            probe_accuracies(args.train_examples, args.eval_examples, args.max_tokens, args.seed, precisions),
            precisions,
        )
        figures["accuracy"] = accuracy
        print(f"\n| cell | {' | '.join(f'{p} val / test' for p in precisions)} |\n|---|" + "---|" * len(precisions))
        for cell, picks in accuracy["best_per_cell"].items():
            print(
                f"| {cell} | "
                + " | ".join(
                    f"{100 * picks[p]['val_accuracy']:.2f} / {100 * picks[p]['test_accuracy']:.2f}" for p in precisions
                )
                + " |"
            )
        for p, gaps in accuracy["max_abs_gap_points"].items():
            print(
                f"largest |{p} − fp32| over {accuracy['configurations']} configurations: "
                f"test {gaps['test']:.2f} points, val {gaps['val']:.2f} points"
            )
    if args.replicates and args.token_limits:
        precision = precisions[1] if len(precisions) > 1 else "fp32"
        limits = (args.max_tokens, *(int(m) for m in args.token_limits.split(",")))
        labels = tuple(f"{m} tokens" for m in limits)
        rows = [
            {**row, "precision": label}
            for limit, label in zip(limits, labels, strict=True)
            for row in replicated_probes(args.train_examples, args.eval_examples, limit, args.replicates, (precision,))
        ]
        figures["token_limits"] = {"precision": precision, "rows": rows, "agreement": agreement(rows, labels)}
        print(f"\n{precision} features")
        print_agreement(figures["token_limits"]["agreement"], labels)
    elif args.replicates:
        rows = replicated_probes(args.train_examples, args.eval_examples, args.max_tokens, args.replicates, precisions)
        figures["replicated"] = {"rows": rows, "agreement": agreement(rows, precisions)}
        print()
        print_agreement(figures["replicated"]["agreement"], precisions)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
