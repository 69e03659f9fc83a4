"""Trials per minute of the search service against the sequential Optuna + Opacus baseline.

Both on the embedded default task (20 Newsgroups, cached MiniLM features, linear head, seed-0
split of ``search_spaces/default.yaml``), ε ∈ {1, 8}, E = 10, δ = 1e-5, measured back to back
in one run on the same cores; each side is a subprocess timed from start to exit (imports,
data loading and, for the service, Ray start included), at this process's niceness.

- Baseline (what a user would write; issue 11): one Optuna TPE study per ε over the default
  ranges (C log-uniform in [0.01, 10], B in {32, ..., 2048}, η₀ log-uniform in [1e-4, 1e-1],
  η = η₀·√(B/256)); each trial builds a fresh ``nn.Linear`` head and ``torch.optim.Adam``,
  calls Opacus' ``PrivacyEngine(accountant="prv").make_private_with_epsilon`` once (Poisson
  sampling, σ calibrated for ε at δ over E epochs, flat clipping at C), trains E epochs on a
  ``DataLoader`` of the cached features and returns validation accuracy to the study. No
  diagnostics, no records. Figures: trials/min over the trial loop and over the whole command.
- Service: ``python -m dptune.search`` on a space this script writes (``extends`` the default
  space: ε ∈ {1, 8}, E = 10, ``--trials-per-cell`` configurations per cell, ``replicates``,
  ``resources.configurations_per_trial: auto``), with ``training.diagnostics: false`` because
  the baseline computes none, ``--no-report`` because it writes none, ``--storage`` in a
  temporary folder. Figure: configurations recorded in ``trials`` ÷ minutes of the whole command.

``--legacy`` leaves out the space keys of fused trials (``replicates``,
``resources.configurations_per_trial``) for a service that does not know them yet. ``--repo DIR``
measures the ``dptune`` of another checkout (its code, its default space; e.g. an export of a
branch): both subprocesses then import it, this script only drives them.

    nice python bench/bench_fused_throughput.py [--baseline-trials 20] [--trials-per-cell 250]
        [--sampler tpe|random] [--replicates 1] [--legacy] [--out bench/results/fused_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPACE_FILE = Path("search_spaces") / "default.yaml"  # relative to the measured checkout
EPSILONS = (1.0, 8.0)
EPOCHS = 10
DELTA = 1e-5
REFERENCE_BATCH_SIZE = 256  # B_ref of the default space's √B coupling
SEARCH_NAME = "bench-fused-throughput"


def baseline_objective(trial: Any, epsilon: float, data: dict[str, Any]) -> float:
    """One baseline trial: fresh head, Adam, one ``make_private_with_epsilon``, E epochs on a
    Poisson-sampled loader; returns validation accuracy (fraction in [0, 1])."""
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader

    clip_bound = trial.suggest_float("clip_bound", 0.01, 10.0, log=True)
    batch_size = trial.suggest_categorical("batch_size", [32, 64, 128, 256, 512, 1024, 2048])
    base_learning_rate = trial.suggest_float("base_learning_rate", 1e-4, 1e-1, log=True)
    learning_rate = base_learning_rate * math.sqrt(batch_size / REFERENCE_BATCH_SIZE)

    model = torch.nn.Linear(data["feature_dim"], data["num_classes"])
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    loader = DataLoader(data["train"], batch_size=batch_size, shuffle=True)
    model, optimizer, loader = PrivacyEngine(accountant="prv").make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        target_epsilon=epsilon,
        target_delta=DELTA,
        epochs=EPOCHS,
        max_grad_norm=clip_bound,
        poisson_sampling=True,
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    for _ in range(EPOCHS):
        for features, labels in loader:
            optimizer.zero_grad()
            loss_fn(model(features), labels).backward()
            optimizer.step()
    model.eval()
    val_features, val_labels = data["val"]
    with torch.no_grad():
        return float((model(val_features).argmax(dim=1) == val_labels).float().mean())


def run_baseline(trials: int, seed: int) -> dict[str, Any]:
    """The baseline's search (this process): one TPE study of ``trials`` trials per ε, in turn."""
    import warnings

    import optuna
    import torch
    from torch.utils.data import TensorDataset

    from dptune.data import WorkloadSpec, load_workload
    from dptune.space import load_space

    warnings.filterwarnings("ignore")  # Opacus' secure-RNG and hook notices, once per trial
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    task = load_space(Path.cwd() / SPACE_FILE).space.task
    workload = load_workload(
        WorkloadSpec(
            dataset=task.dataset,
            backbone=task.backbone,
            peft=task.peft,
            seed=0,
            fraction=task.fraction,
            max_tokens=task.max_tokens,
            validation_fraction=task.validation_fraction,
        )
    )
    train_features, train_labels = workload.train.tensors
    val_features, val_labels = workload.val.tensors
    data = {
        "train": TensorDataset(train_features, train_labels),
        "val": (val_features, val_labels),
        "feature_dim": train_features.shape[1],
        "num_classes": workload.num_classes,
    }
    started = time.perf_counter()
    best = {}
    for epsilon in EPSILONS:
        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
        study.optimize(lambda trial, epsilon=epsilon: baseline_objective(trial, epsilon, data), n_trials=trials)
        best[f"{epsilon:g}"] = {"val_accuracy": round(study.best_value, 4), **study.best_params}
    loop_s = time.perf_counter() - started
    return {
        "trials": trials * len(EPSILONS),
        "trial_loop_s": round(loop_s, 2),
        "best": best,
        "num_train": len(train_labels),
        "num_val": len(val_labels),
        "torch_threads": torch.get_num_threads(),
    }


def service_space(repo: Path, trials_per_cell: int, sampler: str, replicates: int, legacy: bool) -> str:
    """The service's space YAML: ``repo``'s default space at ε ∈ {1, 8}, E = 10, without diagnostics."""
    lines = [
        f"extends: {repo / SPACE_FILE}",
        f"name: {SEARCH_NAME}",
        "privacy:",
        f"  epsilons: [{', '.join(f'{e:g}' for e in EPSILONS)}]",
        f"epochs: [{EPOCHS}]",
        "sampler:",
        f"  name: {sampler}",
        f"  trials_per_cell: {trials_per_cell}",
        "training:",
        "  diagnostics: false   # the baseline computes none",
    ]
    if not legacy:
        lines += [f"replicates: {replicates}", "resources:", "  configurations_per_trial: auto"]
    return "\n".join(lines) + "\n"


def timed(command: list[str], repo: Path, log: Path, check: bool = True) -> tuple[float, int]:
    """Run ``command`` in ``repo`` (``repo`` first on PYTHONPATH; the niceness of this process), its output to ``log``;
    return its wall time in seconds and exit status. With ``check``, raises ``SystemExit`` naming
    the log if it fails."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    with log.open("w") as output:
        done = subprocess.run(command, cwd=repo, env=environment, stdout=output, stderr=subprocess.STDOUT, check=False)
    elapsed = time.perf_counter() - started
    if check and done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed with exit status {done.returncode}; see {log}")
    return elapsed, done.returncode


def measure_service(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Run the service once on the written space; its whole-command time and what it recorded
    (read with pandas, not this checkout's ``dptune.records``: the measured one may differ)."""
    import pandas as pd

    space = folder / "space.yaml"
    space.write_text(service_space(args.repo, args.trials_per_cell, args.sampler, args.replicates, args.legacy))
    storage = folder / "storage"
    log = folder / "service.log"
    command = [sys.executable, "-m", "dptune.search", "--space", str(space), "--storage", str(storage), "--no-report"]
    wall_s, exit_status = timed(command, args.repo, log, check=False)
    if exit_status != 0:  # what it recorded still counts; the figures say it failed
        print(f"warning: the service exited {exit_status}; see {log}", file=sys.stderr)
    trials = pd.read_parquet(storage / SEARCH_NAME / "trials")
    run = trials[trials["status"] != "pruned_min_steps"]
    configurations = run["configuration_id"].nunique() if "configuration_id" in run else len(run)
    search_s = re.search(r"search finished in (\d+) s", log.read_text())
    ok = run[run["status"] == "ok"]
    best = ok.loc[ok.groupby("cell_id")["val_accuracy"].idxmax()] if len(ok) else ok
    return {
        "space": space.read_text(),
        "command": " ".join(command),
        "exit_status": exit_status,
        "wall_s": round(wall_s, 2),
        "search_s": int(search_s.group(1)) if search_s else None,
        "configurations": int(configurations),
        "rows": len(run),
        "rows_ok": len(ok),
        "max_epsilon_spent_over_target": float((run["epsilon_spent"] / run["epsilon"]).max()) if len(run) else None,
        "best": {
            str(row.cell_id): {
                "val_accuracy": round(float(row.val_accuracy), 4),
                "test_accuracy": round(float(row.test_accuracy), 4),
                "clip_bound": float(row.clip_bound),
                "batch_size": int(row.batch_size),
                "base_learning_rate": float(row.base_learning_rate),
            }
            for row in best.itertuples()
        },
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Baseline, then service, back to back; the figures and their ratios."""
    folder = Path(tempfile.mkdtemp(prefix="bench-fused-throughput-"))
    baseline_json = folder / "baseline.json"
    load_before = os.getloadavg()
    baseline_wall_s, _ = timed(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--role",
            "baseline",
            "--baseline-trials",
            str(args.baseline_trials),
            "--seed",
            str(args.seed),
            "--out",
            str(baseline_json),
        ],
        args.repo,
        folder / "baseline.log",
    )
    baseline = {**json.loads(baseline_json.read_text()), "wall_s": round(baseline_wall_s, 2)}
    load_between = os.getloadavg()
    service = measure_service(args, folder)
    baseline_loop_rate = baseline["trials"] / baseline["trial_loop_s"] * 60
    baseline_command_rate = baseline["trials"] / baseline["wall_s"] * 60
    service_rate = service["configurations"] / service["wall_s"] * 60
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1_5_15": {"before": load_before, "between": load_between, "after": os.getloadavg()},
        },
        "repo": str(args.repo),
        "epsilons": list(EPSILONS),
        "epochs": EPOCHS,
        "legacy": args.legacy,
        "folder": str(folder),
        "baseline": {
            **baseline,
            "trials_per_min_trial_loop": round(baseline_loop_rate, 2),
            "trials_per_min_whole_command": round(baseline_command_rate, 2),
        },
        "service": {**service, "configurations_per_min_whole_command": round(service_rate, 2)},
        "ratio_service_command_to_baseline_loop": round(service_rate / baseline_loop_rate, 2),
        "ratio_service_command_to_baseline_command": round(service_rate / baseline_command_rate, 2),
    }


def format_table(figures: dict[str, Any]) -> str:
    """A Markdown table of the two sides and the ratio."""
    baseline, service = figures["baseline"], figures["service"]
    return "\n".join(
        [
            "| side | configurations | trial loop s | whole command s | per min (loop) | per min (whole command) |",
            "|---|---|---|---|---|---|",
            f"| baseline: Optuna TPE + Opacus, sequential | {baseline['trials']} | {baseline['trial_loop_s']} | "
            f"{baseline['wall_s']} | {baseline['trials_per_min_trial_loop']} | "
            f"{baseline['trials_per_min_whole_command']} |",
            f"| service: python -m dptune.search | {service['configurations']} | {service['search_s']} | "
            f"{service['wall_s']} | – | {service['configurations_per_min_whole_command']} |",
            *(
                [f"(the service exited {service['exit_status']}: its whole command ended in that failure)"]
                if service["exit_status"]
                else []
            ),
            "",
            f"service (whole command) ÷ baseline (trial loop): {figures['ratio_service_command_to_baseline_loop']}x; "
            f"÷ baseline (whole command): {figures['ratio_service_command_to_baseline_command']}x",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-trials", type=int, default=20, help="baseline trials per ε (default: %(default)s)")
    parser.add_argument(
        "--trials-per-cell",
        type=int,
        default=250,
        help="service configurations per ε (default: %(default)s, i.e. 500 in all)",
    )
    parser.add_argument("--sampler", choices=["tpe", "random"], default="tpe", help="service sampler (default: tpe)")
    parser.add_argument("--replicates", type=int, default=1, help="service replicates per configuration")
    parser.add_argument(
        "--legacy",
        action="store_true",
        help="leave out replicates and resources.configurations_per_trial (a service without fused trials)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the baseline's TPE seed")
    parser.add_argument(
        "--repo", type=Path, default=ROOT, help="the checkout whose dptune is measured (default: this one)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fused_throughput.json")
    parser.add_argument("--role", choices=["both", "baseline"], default="both", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.repo = args.repo.resolve()
    for name in ("baseline_trials", "trials_per_cell", "replicates"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.role == "baseline":
        args.out.write_text(json.dumps(run_baseline(args.baseline_trials, args.seed), indent=2))
        return
    figures = measure(args)
    print(json.dumps(figures, indent=2))
    print(format_table(figures))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
