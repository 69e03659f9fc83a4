"""DP linear probe vs non-private linear probe on the embedded 20 Newsgroups + MiniLM features.

Both use the same cached MiniLM features and the same train/validation/test split
(``load_workload``, seed 0). The non-private probe is multinomial logistic regression fitted by
full-batch L-BFGS, its L2 strength chosen on validation. The DP probe is ``run_trial`` (peft
``head``, DP-Adam, normalized clipping, E = 10, δ = 1e-5) over a small (B, η) grid at the given
ε, the best chosen on validation (as the search would; the tuning's own privacy cost is not
counted here). Prints a markdown summary and one line of JSON per trial; one CPU thread.

    python bench/bench_20ng_accuracy.py --epsilon 8
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from dptune.contract import TrialConfig, TrialResult
from dptune.data import WorkloadSpec, load_workload
from dptune.plan.mechanism import with_mechanism
from dptune.runners.common import cached_workload
from dptune.runners.trial import run_trial

L2_GRID = (0.0, 1e-4, 1e-3, 1e-2)


def tensors(dataset: torch.utils.data.TensorDataset) -> tuple[torch.Tensor, torch.Tensor]:
    features, labels = dataset.tensors
    return features, labels


def logistic_regression(features: torch.Tensor, labels: torch.Tensor, num_classes: int, l2: float) -> torch.nn.Linear:
    """Multinomial logistic regression, mean cross-entropy + l2·‖W‖², full-batch L-BFGS."""
    model = torch.nn.Linear(features.shape[1], num_classes)
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=500, history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(features), labels) + l2 * model.weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return model


@torch.no_grad()
def accuracy(model: torch.nn.Module, features: torch.Tensor, labels: torch.Tensor) -> float:
    return float((model(features).argmax(1) == labels).float().mean())


def non_private_probe(seed: int) -> dict[str, float]:
    """Best-on-validation logistic regression on the trial's own split of the cached features."""
    workload = load_workload(WorkloadSpec(dataset="20newsgroups", backbone="minilm", peft="head", seed=seed))
    (xtr, ytr), (xva, yva), (xte, yte) = (tensors(d) for d in (workload.train, workload.val, workload.test))
    start = time.perf_counter()
    fits = {l2: logistic_regression(xtr, ytr, workload.num_classes, l2) for l2 in L2_GRID}
    best = max(fits, key=lambda l2: accuracy(fits[l2], xva, yva))
    return {
        "l2": best,
        "val_accuracy": accuracy(fits[best], xva, yva),
        "test_accuracy": accuracy(fits[best], xte, yte),
        "num_train": len(ytr),
        "fit_seconds_all_l2": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[0.003, 0.01, 0.03])
    parser.add_argument("--clip-bound", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = non_private_probe(args.seed)
    print(json.dumps({"non_private": baseline}))
    trials: list[TrialResult] = []
    for batch_size in args.batch_sizes:
        for learning_rate in args.learning_rates:
            config = TrialConfig(
                workload=WorkloadSpec(dataset="20newsgroups", backbone="minilm", peft="head"),
                epsilon=args.epsilon,
                delta=1e-5,
                epochs=args.epochs,
                clip_bound=args.clip_bound,
                batch_size=batch_size,
                learning_rate=learning_rate,
                base_learning_rate=learning_rate,
                seed=args.seed,
                threads=1,
            )
            result = run_trial(with_mechanism(config, len(cached_workload(config.workload).train)))
            trials.append(result)
            summary = {
                k: v
                for k, v in asdict(result).items()
                if k not in ("config", "epochs", "diagnostics", "class_accuracy", "class_names")
            }
            print(json.dumps({"batch_size": batch_size, "learning_rate": learning_rate, **summary}))
    best = max((t for t in trials if t.status == "ok"), key=lambda t: t.val_accuracy)
    print("\n| probe | B | η | val acc | test acc | wall s (1 thread) | diagnostics s | engine |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| non-private (L-BFGS, l2={baseline['l2']}) | full | - | {baseline['val_accuracy']:.4f} | "
        f"{baseline['test_accuracy']:.4f} | {baseline['fit_seconds_all_l2']:.1f} (all l2) | - | - |"
    )
    print(
        f"| DP ε={args.epsilon:g} (best of {len(trials)} on val) | {best.config.batch_size} | "
        f"{best.config.learning_rate:g} | {best.val_accuracy:.4f} | {best.test_accuracy:.4f} | "
        f"{best.wall_time_s:.1f} | {best.diagnostics_wall_time_s:.2f} | {best.engine} |"
    )
    print(
        f"\nσ = {best.noise_multiplier:.4f}, q = {best.sample_rate:.5f}, T = {best.steps}, "
        f"ε spent = {best.epsilon_spent:.4f}"
    )


if __name__ == "__main__":
    main()
