"""The results datasets the analysis and report tests read.

The tests read the datasets of the ``result_datasets`` fixture (``tests/conftest.py``), the one
function to swap: today it returns ``results_paths()``, two small synthetic searches written
with ``dptune.records`` (``ResultsStore`` + ``trial_rows`` of ``TrialResult`` objects built
here); it can return the dataset of the real tiny search instead (the ``tiny_search`` fixture,
``tests/spaces/tiny.yaml``). The tests need, from whatever it returns: ≥ 2 values of ε, a grid
with ≥ 2 values of C and of B per cell, every (C, B) in every cell (so a fixed setting exists),
``compare_auto_s: true``, ``diagnostics: true`` and a ``min_steps`` that prunes at least one B.

The synthetic searches are a grid over C × B × η₀ per (ε, E) on two tasks of different
difficulty. Their numbers are generated, not trained, but keep the structure of real results:
per-example gradient norms are log-normal per class, larger for hard classes and under tighter
privacy (paper Fig. 3); class accuracy follows the retention weight w_y(C) (Eq. 3) and a
signal-to-noise term B·√T/(σ·C); σ comes from the small-q Gaussian approximation
σ ≈ q·√(2T·ln(1.25/δ))/ε (fixture only: a real search records PRV-calibrated σ); configurations
with T < min_steps are recorded as ``pruned_min_steps``; one trial diverged, one failed and
one was stopped early. Every configuration runs once (R = 1).

``write_replicated_search`` writes a search with replicates (records schema 3: R trials per
configuration sharing a ``configuration_id``) whose accuracies are given outright, for tests
that check the replicate statistics against hand computations.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import math
import shutil
import tempfile
import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import yaml

from dptune.contract import ClassDiagnostics, Diagnostics, EpochMetrics, TrialConfig, TrialResult, WorkloadSpec
from dptune.records import SCHEMA_VERSION, SCHEMAS, ResultsStore, read_table, replicate_trial_id, trial_rows
from dptune.records.store import compacted_name

MIN_STEPS = 20
DELTA = 1e-5
REFERENCE_BATCH_SIZE = 256
NOW = pd.Timestamp("2026-11-30T12:00:00Z")


@dataclass(frozen=True)
class SyntheticTask:
    """One task of the synthetic searches and how hard it is."""

    name: str  # the search's name
    dataset: str
    backbone: str
    num_train: int
    feature_dimension: int
    class_names: tuple[str, ...]
    base_norm: float  # median ‖g_i‖ of the easiest class before training
    peak_accuracy: float
    compare_auto_s: bool


TASKS = (
    SyntheticTask(
        "digits", "mnist5k", "efficientnet_lite0", 2000, 1280, ("zero", "one", "two", "three"), 0.4, 0.97, False
    ),
    SyntheticTask(
        "news",
        "20newsgroups",
        "minilm",
        3000,
        384,
        ("alt.atheism", "comp.graphics", "rec.autos", "sci.med", "sci.space", "talk.politics.misc"),
        1.0,
        0.85,
        True,
    ),
)
EPSILONS = (1.0, 8.0)
EPOCHS = (2, 6)
CLIP_BOUNDS = (0.1, 1.0, 10.0)
BATCH_SIZES = (64, 256, 1024)
BASE_LEARNING_RATES = (1e-3, 1e-2)
PROBE_PER_CLASS = 12
UNFINISHED_CELL = "eps=1|epochs=6"  # the cell of the diverged, failed and stopped trials


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _noise_multiplier(sample_rate: float, steps: int, epsilon: float) -> float:
    return sample_rate * math.sqrt(2 * steps * math.log(1.25 / DELTA)) / epsilon


def _steps(task: SyntheticTask, batch_size: int, epochs: int) -> int:
    return epochs * max(1, round(task.num_train / batch_size))


def _probe(task: SyntheticTask, epsilon: float, epoch: int, key: object) -> tuple[np.ndarray, np.ndarray]:
    """Per-example gradient norms and labels: harder classes and tighter privacy shift them right."""
    classes = len(task.class_names)
    labels = np.repeat(np.arange(classes), PROBE_PER_CLASS)
    hardness = labels / (classes - 1)
    shift = 1.0 if epoch == 0 else 1.0 + 2.0 / epsilon
    medians = task.base_norm * (1.0 + 2.0 * hardness) * shift
    norms = medians * np.exp(_rng(task.name, epsilon, epoch, key).normal(0.0, 0.35, labels.size))
    return norms, labels


def _retention(norms: np.ndarray, labels: np.ndarray, clip_bound: float) -> dict[int, float]:
    """w_y(C) with plain Python (an implementation independent of dptune.analysis)."""
    weights: dict[int, list[float]] = {}
    for norm, label in zip(norms.tolist(), labels.tolist(), strict=True):
        weights.setdefault(label, []).append(min(1.0, clip_bound / norm))
    return {label: sum(values) / len(values) for label, values in weights.items()}


def _class_accuracy(
    task: SyntheticTask,
    norms: np.ndarray,
    labels: np.ndarray,
    clip_bound: float,
    batch_size: int,
    steps: int,
    sigma: float,
    base_lr: float,
) -> dict[int, float]:
    classes = len(task.class_names)
    chance = 1.0 / classes
    weights = _retention(norms, labels, clip_bound)
    strongest = max(weights.values())
    mean_signal = np.mean([min(norm, clip_bound) for norm in norms])
    snr = mean_signal * batch_size * math.sqrt(steps) / (sigma * clip_bound * 300.0)
    progress = (1.0 - math.exp(-snr)) * (1.0 - math.exp(-steps / 15.0))
    lr_fit = math.exp(-0.5 * math.log10(base_lr / 3e-3) ** 2)
    accuracy = {}
    for label in range(classes):
        peak = task.peak_accuracy - 0.25 * label / (classes - 1)
        relative = (weights[label] / strongest) ** 0.7
        accuracy[label] = chance + (peak - chance) * progress * lr_fit * relative
    return accuracy


def _diagnostics(task: SyntheticTask, config: TrialConfig, sigma: float, key: object) -> list[Diagnostics]:
    classes = len(task.class_names)
    dimension = task.feature_dimension * classes + classes
    records = []
    for epoch in (0, config.epochs):
        norms, labels = _probe(task, config.epsilon, epoch, key)
        clip = config.clip_bound

        def split(bound: float, norms: np.ndarray = norms) -> tuple[float, float]:
            bias = 0.5 * float(np.mean(np.maximum(norms - bound, 0.0))) ** 2
            variance = sigma**2 * bound**2 * dimension / config.batch_size**2
            return bias, variance

        candidates = np.sort(norms)
        optimal = float(candidates[np.argmin([sum(split(c)) for c in candidates])])
        bias, variance = split(clip)
        weights = _retention(norms, labels, clip)
        per_class = []
        for label in range(classes):
            own = norms[labels == label]
            quantiles = dict(
                zip(
                    ("q05", "q25", "q50", "q75", "q95"),
                    np.quantile(own, [0.05, 0.25, 0.5, 0.75, 0.95]).tolist(),
                    strict=True,
                )
            )
            per_class.append(
                ClassDiagnostics(label, int(own.size), quantiles, float(np.mean(own > clip)), weights[label])
            )
        records.append(
            Diagnostics(
                epoch=epoch,
                clip_bound=clip,
                noise_multiplier=sigma,
                dimension=dimension,
                grad_norms=norms.tolist(),
                labels=labels.tolist(),
                mse_bias=bias,
                mse_variance=variance,
                optimal_clip_bound=optimal,
                classes=per_class,
            )
        )
    return records


def _result(
    task: SyntheticTask, epsilon: float, epochs: int, clip_bound: float, batch_size: int, base_lr: float, clipping: str
) -> TrialResult:
    lr = base_lr * math.sqrt(batch_size / REFERENCE_BATCH_SIZE)
    config = TrialConfig(
        workload=WorkloadSpec(dataset=task.dataset, backbone=task.backbone, peft="head"),
        epsilon=epsilon,
        delta=DELTA,
        epochs=epochs,
        clip_bound=clip_bound,
        batch_size=batch_size,
        learning_rate=lr,
        base_learning_rate=base_lr,
        clipping=clipping,
        diagnostic_examples=64,
    )
    rate = batch_size / task.num_train
    steps = _steps(task, batch_size, epochs)
    if steps < MIN_STEPS:
        return TrialResult(
            config=config,
            status="pruned_min_steps",
            reason=f"T = {steps} steps < min_steps = {MIN_STEPS}",
            sample_rate=rate,
            steps=steps,
            num_train=task.num_train,
            epsilon_spent=0.0,
        )
    sigma = _noise_multiplier(rate, steps, epsilon)
    key = (clip_bound, batch_size, base_lr, clipping)
    norms, labels = _probe(task, epsilon, epochs, key)
    effective_clip = clip_bound if clipping != "auto_s" else 0.01 * float(norms.min())
    classes = _class_accuracy(task, norms, labels, effective_clip, batch_size, steps, sigma, base_lr)
    test = float(np.mean(list(classes.values())))
    val = float(np.clip(test + _rng(task.name, epsilon, epochs, key).normal(0.0, 0.01), 0.0, 1.0))
    val = round(val * 300) / 300  # a 300-example validation split: accuracies are multiples of 1/300
    per_epoch = [
        EpochMetrics(
            epoch=e,
            steps=e * steps // epochs,
            train_loss=2.0 * (1.0 - val) + 0.5 / e,
            val_loss=2.1 * (1.0 - val) + 0.5 / e,
            val_accuracy=val * (0.9 + 0.1 * e / epochs),
            wall_time_s=0.8,
            examples_per_s=task.num_train / 0.8,
            test_accuracy=test if e == epochs else None,
        )
        for e in range(1, epochs + 1)
    ]
    return TrialResult(
        config=config,
        status="ok",
        noise_multiplier=sigma,
        sample_rate=rate,
        steps=steps,
        epsilon_spent=epsilon * 0.999,
        num_train=task.num_train,
        num_val=300,
        num_test=600,
        num_classes=len(task.class_names),
        trainable_parameters=task.feature_dimension * len(task.class_names),
        val_accuracy=val,
        test_accuracy=test,
        train_loss=per_epoch[-1].train_loss,
        wall_time_s=0.8 * epochs,
        examples_per_s=task.num_train / 0.8,
        device="cpu",
        engine="film",
        epochs=per_epoch,
        class_accuracy=classes,
        class_val_accuracy={
            label: float(np.clip(accuracy + _rng(task.name, epsilon, epochs, key, label).normal(0.0, 0.02), 0.0, 1.0))
            for label, accuracy in classes.items()
        },
        class_names=dict(enumerate(task.class_names)),
        diagnostics=_diagnostics(task, config, sigma, key),
    )


def _failed(task: SyntheticTask, status: str, reason: str, val_accuracy: float) -> TrialResult:
    """A trial outside the grid that did not finish (ε = 1, E = 6, B = 64)."""
    config = TrialConfig(
        workload=WorkloadSpec(dataset=task.dataset, backbone=task.backbone, peft="head"),
        epsilon=1.0,
        delta=DELTA,
        epochs=6,
        clip_bound=3.0,
        batch_size=64,
        learning_rate=0.05,
        base_learning_rate=0.1,
    )
    rate = 64 / task.num_train
    steps = _steps(task, 64, 6)
    return TrialResult(
        config=config,
        status=status,
        reason=reason,
        sample_rate=rate,
        steps=steps,
        noise_multiplier=_noise_multiplier(rate, steps, 1.0),
        num_train=task.num_train,
        val_accuracy=val_accuracy,
    )


def write_search(task: SyntheticTask, root: Path) -> str:
    """Write one synthetic grid search of ``task`` under ``root/<name>``; return its location."""
    location = str(root / task.name)
    store = ResultsStore(location)
    search_id = f"{task.name}-synthetic"
    spec = {
        "name": task.name,
        "task": {"dataset": task.dataset, "backbone": task.backbone, "peft": "head"},
        "privacy": {"epsilons": list(EPSILONS), "delta": DELTA},
        "epochs": list(EPOCHS),
        "clip_bound": {"values": list(CLIP_BOUNDS)},
        "batch_size": {"values": list(BATCH_SIZES)},
        "base_learning_rate": {"values": list(BASE_LEARNING_RATES)},
        "min_steps": MIN_STEPS,
        "training": {"clipping": "normalized", "compare_auto_s": task.compare_auto_s},
        "sampler": {"name": "grid"},
    }
    rows = []
    variants = ["normalized", "auto_s"] if task.compare_auto_s else ["normalized"]
    for epsilon, epochs in itertools.product(EPSILONS, EPOCHS):
        cell_id = f"eps={epsilon:g}|epochs={epochs}"
        for clipping in variants:
            clips = CLIP_BOUNDS if clipping != "auto_s" else (1.0,)
            planned = 3 * (cell_id == UNFINISHED_CELL and clipping == "normalized")
            for index, (clip, batch, lr) in enumerate(itertools.product(clips, BATCH_SIZES, BASE_LEARNING_RATES)):
                result = _result(task, epsilon, epochs, clip, batch, lr, clipping)
                planned += result.status != "pruned_min_steps"
                trial_id = f"eps{epsilon:g}-E{epochs}-{clipping}-{index:03d}"
                store.write_trial(
                    trial_rows(
                        result,
                        search_id=search_id,
                        trial_id=trial_id,
                        cell_id=cell_id,
                        reference_batch_size=REFERENCE_BATCH_SIZE,
                        versions={"dptune": "0.1.0"},
                        finished_at=NOW,
                    ),
                    trial_id,
                )
            rows.append(
                {
                    "search_id": search_id,
                    "name": task.name,
                    "cell_id": cell_id,
                    "epsilon": epsilon,
                    "epochs": epochs,
                    "delta": DELTA,
                    "dataset": task.dataset,
                    "backbone": task.backbone,
                    "peft": "head",
                    "num_train": task.num_train,
                    "trials_planned": planned,
                    "configurations_pruned": sum(_steps(task, b, epochs) < MIN_STEPS for b in BATCH_SIZES),
                    "epsilon_per_trial": epsilon,
                    "epsilon_composition": epsilon * planned,
                    "delta_composition": DELTA * planned,
                    "epsilon_selection": 3 * epsilon,
                    "delta_selection": 2 * DELTA,
                    "spec_yaml": yaml.safe_dump(spec),
                    "spec_hash": "synthetic",
                    "schema_version": SCHEMA_VERSION,
                    "dptune_version": "0.1.0",
                    "created_at": NOW,
                }
            )
    unfinished = [
        ("diverged", "loss became NaN at epoch 3", float("nan")),
        ("error", "RuntimeError: worker died", float("nan")),
        ("stopped_early", "stopped by the ASHA scheduler", 0.3),
    ]
    for status, reason, val in unfinished:
        trial_id = f"eps1-E6-{status}"
        store.write_trial(
            trial_rows(
                _failed(task, status, reason, val),
                search_id=search_id,
                trial_id=trial_id,
                cell_id=UNFINISHED_CELL,
                reference_batch_size=REFERENCE_BATCH_SIZE,
                versions={"dptune": "0.1.0"},
                finished_at=NOW,
            ),
            trial_id,
        )
    store.write_part("search", search_id, rows)
    return location


@functools.cache
def results_paths() -> tuple[str, ...]:
    """The result datasets every analysis and report test reads (built once per test session)."""
    root = Path(tempfile.mkdtemp(prefix="dptune-results-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return tuple(write_search(task, root) for task in TASKS)


def copy_results(
    paths: Sequence[str],
    root: Path,
    keep: Callable[[pd.DataFrame], pd.Series] | None = None,
    tables: Collection[str] = ("trials", "epochs", "classes", "diagnostics", "search"),
) -> list[str]:
    """Copy datasets under ``root``, keeping only ``tables`` and the trials where ``keep(trials)`` holds.

    Derives partial results (a running search, no diagnostics, one ε...) from whatever
    ``results_paths`` returns, synthetic or real.
    """
    copies = []
    for path in paths:
        source, target = Path(path), root / Path(path).name
        trials = read_table(path, "trials")
        kept = set(trials.loc[keep(trials) if keep else trials.index, "trial_id"])
        for table in tables:
            if not (source / table).is_dir():
                continue
            if table == "search":
                shutil.copytree(source / table, target / table)
                continue
            frame = read_table(path, table)
            data = pa.Table.from_pandas(
                frame[frame["trial_id"].isin(kept)], schema=SCHEMAS[table], preserve_index=False
            )
            ResultsStore(str(target)).write_file(table, compacted_name(0), data)
        copies.append(str(target))
    return copies


@dataclass(frozen=True)
class Replicated:
    """One configuration of a replicated synthetic search: its (C, B, η₀) and the validation and
    test accuracies (fractions) of each of its R replicates, in replicate order."""

    clip_bound: float
    batch_size: int
    base_learning_rate: float
    val: tuple[float, ...]
    test: tuple[float, ...]


def _scored_result(
    task: SyntheticTask, epsilon: float, epochs: int, config: Replicated, replicate: int, num_val: int, num_test: int
) -> TrialResult:
    """A finished trial whose accuracies are given, not modelled (train loss 1 − val accuracy)."""
    lr = config.base_learning_rate * math.sqrt(config.batch_size / REFERENCE_BATCH_SIZE)
    trial = TrialConfig(
        workload=WorkloadSpec(dataset=task.dataset, backbone=task.backbone, peft="head"),
        epsilon=epsilon,
        delta=DELTA,
        epochs=epochs,
        clip_bound=config.clip_bound,
        batch_size=config.batch_size,
        learning_rate=lr,
        base_learning_rate=config.base_learning_rate,
        clipping="normalized",
    )
    rate = config.batch_size / task.num_train
    steps = _steps(task, config.batch_size, epochs)
    val, test = config.val[replicate], config.test[replicate]
    return TrialResult(
        config=trial,
        status="ok",
        noise_multiplier=_noise_multiplier(rate, steps, epsilon),
        sample_rate=rate,
        steps=steps,
        epsilon_spent=epsilon * 0.999,
        num_train=task.num_train,
        num_val=num_val,
        num_test=num_test,
        num_classes=len(task.class_names),
        val_accuracy=val,
        test_accuracy=test,
        train_loss=1.0 - val,
        device="cpu",
        engine="film",
    )


def write_replicated_search(
    root: Path,
    name: str,
    cells: dict[tuple[float, int], Sequence[Replicated]],
    num_val: int = 300,
    num_test: int = 600,
    task: SyntheticTask = TASKS[1],
) -> str:
    """Write a search of ``task`` whose cells (ε, E) hold the given configurations, every replicate a
    trial (schema 3: ``configuration_id`` shared, ``replicate`` 0-based), under ``root/<name>``."""
    location = str(root / name)
    store = ResultsStore(location)
    search_id = f"{name}-replicated"
    replicates = max(len(c.val) for configs in cells.values() for c in configs)
    spec = {
        "name": name,
        "task": {"dataset": task.dataset, "backbone": task.backbone, "peft": "head"},
        "privacy": {"epsilons": sorted({e for e, _ in cells}), "delta": DELTA},
        "epochs": sorted({n for _, n in cells}),
        "clip_bound": {"values": sorted({c.clip_bound for configs in cells.values() for c in configs})},
        "batch_size": {"values": sorted({c.batch_size for configs in cells.values() for c in configs})},
        "min_steps": 1,
        "replicates": replicates,
        "sampler": {"name": "grid"},
    }
    rows = []
    for (epsilon, epochs), configs in cells.items():
        cell_id = f"eps={epsilon:g}|epochs={epochs}"
        for index, config in enumerate(configs):
            configuration_id = f"eps{epsilon:g}-E{epochs}-{index:03d}"
            for replicate in range(len(config.val)):
                trial_id = replicate_trial_id(configuration_id, replicate)
                result = _scored_result(task, epsilon, epochs, config, replicate, num_val, num_test)
                store.write_trial(
                    trial_rows(
                        result,
                        search_id=search_id,
                        trial_id=trial_id,
                        cell_id=cell_id,
                        reference_batch_size=REFERENCE_BATCH_SIZE,
                        versions={"dptune": "0.1.0"},
                        finished_at=NOW,
                        configuration_id=configuration_id,
                        replicate=replicate,
                    ),
                    trial_id,
                )
        planned = sum(len(c.val) for c in configs)
        rows.append(
            {
                "search_id": search_id,
                "name": name,
                "cell_id": cell_id,
                "clipping": "normalized",
                "epsilon": epsilon,
                "epochs": epochs,
                "delta": DELTA,
                "dataset": task.dataset,
                "backbone": task.backbone,
                "peft": "head",
                "num_train": task.num_train,
                "trials_planned": planned,
                "configurations_pruned": 0,
                "spec_yaml": yaml.safe_dump(spec),
                "spec_hash": "synthetic",
                "schema_version": SCHEMA_VERSION,
                "dptune_version": "0.1.0",
                "created_at": NOW,
            }
        )
    store.write_part("search", search_id, rows)
    return location
