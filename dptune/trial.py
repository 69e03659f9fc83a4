"""One DP fine-tuning trial: ``run_trial(config, report)``, the one place a DP fine-tune happens.

Plain Python, no Ray: Ray Tune calls it through ``dptune.search``; tests call it directly.
The types here are plain data with no torch import; the training itself lives in
:mod:`dptune.dp.trainer`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from dptune.dp.clipping import ClippingRule
from dptune.errors import DptuneError

TrialStatus = Literal["ok", "diverged", "error", "pruned_min_steps", "stopped_early"]


@dataclass(frozen=True)
class TrialConfig:
    """Everything that defines a trial. Plain data: it round-trips through a dict (Tune config).

    Units: ``epsilon`` and ``delta`` of (ε, δ)-DP under add/remove adjacency; ``epochs`` is the
    compute budget E (passes over the training set in expectation); ``clip_bound`` is C in
    gradient-norm units; ``batch_size`` is the *expected* logical batch B = q·N under Poisson
    sampling; ``learning_rate`` is the η the optimizer uses, ``base_learning_rate`` the η₀ it was
    coupled from (η = η₀·√(B/B_ref), or η = η₀ when coupling is off).

    Randomness: ``split_seed`` is public and fixes the data split, subset caps and diagnostics probe.
    ``seed`` roots the trial's *coins* (model initialisation, Poisson sampling, gradient noise,
    score noise): ``None`` (the default) draws them from fresh OS entropy, so
    no two trials share noise or batches and nothing stored regenerates them — what the (ε, δ)
    guarantee and any composition across trials assume. An integer makes the trial reproducible
    (research and tests), and then the guarantee does not hold for its released results.
    ``score_noise_multiplier`` (σ_s, a count's std) asks for a DP selection score: the number of
    correct validation predictions plus N(0, σ_s²) (sensitivity 1 under add/remove of a row).
    """

    dataset: str
    backbone: str
    peft: str
    epsilon: float
    delta: float
    epochs: int
    clip_bound: float
    batch_size: int
    learning_rate: float
    base_learning_rate: float
    optimizer: Literal["adam", "sgd"] = "adam"
    clipping: ClippingRule = "normalized"
    seed: int | None = None
    split_seed: int = 0
    score_noise_multiplier: float | None = None
    # difficulty knobs and data sizing
    fraction: float = 1.0
    examples_per_class: int | None = None
    classes: tuple[int, ...] | None = None
    max_tokens: int | None = None
    validation_fraction: float = 0.1
    max_train_examples: int | None = None  # caps for quick runs and tests (seeded, stratified)
    max_eval_examples: int | None = None
    # execution
    device: str = "auto"
    max_physical_batch_size: int = 256
    threads: int | None = None
    engine: Literal["auto", "opacus", "film"] = "auto"
    # diagnostics: a fixed probe of ≤ diagnostic_examples training examples at a few epochs
    diagnostics: bool = True
    diagnostic_examples: int = 256


@dataclass
class EpochMetrics:
    """Metrics after epoch ``epoch`` (1-based). ``test_accuracy`` is only set after the last one."""

    epoch: int
    steps: int  # optimizer steps done so far (cumulative)
    train_loss: float
    val_loss: float
    val_accuracy: float
    wall_time_s: float  # seconds spent in this epoch (training + evaluation)
    examples_per_s: float  # training examples processed per second in this epoch
    test_accuracy: float | None = None


@dataclass
class ClassDiagnostics:
    """Per-class clipping diagnostics on the probe at one epoch (paper §4–5)."""

    label: int
    examples: int
    grad_norm_quantiles: dict[str, float]  # keys "q05","q25","q50","q75","q95"
    clipped_fraction: float  # share of probe examples of this class with ‖g_i‖ > C
    retention_weight: float  # w_y(C) = mean over class y of min(1, C/‖g_i‖)


@dataclass
class Diagnostics:
    """The paper's diagnostics on the probe subset at one epoch (0 = before training).

    ``optimal_clip_bound`` is C* of Theorem 5.2 for the trial's σ and d; ``mse_bias`` and
    ``mse_variance`` split the per-step MSE of the clipped-noised mean gradient at the trial's C
    for a step of ``expected_batch_size`` examples (normalisation: see ``dptune.dp.diagnostics``).
    ``wall_time_s`` is what computing this record cost.

    Not private: the record is computed from the probe examples' exact gradients and released
    without noise, so it is outside the trial's (ε, δ) guarantee (a research diagnostic, as in the
    paper). A deployment whose results leave the data owner's trust boundary sets
    ``TrialConfig.diagnostics = False``.
    """

    epoch: int
    clip_bound: float
    noise_multiplier: float
    dimension: int  # d, number of trainable parameters
    grad_norms: list[float]  # ‖g_i‖ of each probe example (≤ diagnostic_examples values)
    labels: list[int]  # label of each probe example, aligned with grad_norms
    mse_bias: float
    mse_variance: float
    optimal_clip_bound: float
    classes: list[ClassDiagnostics] = field(default_factory=list)
    expected_batch_size: float = float("nan")  # B = q·N of the step the MSE refers to
    wall_time_s: float = 0.0


@dataclass
class TrialResult:
    """What a trial produced. ``status`` other than ``ok`` carries a human ``reason``."""

    config: TrialConfig
    status: TrialStatus
    reason: str = ""
    noise_multiplier: float = float("nan")  # σ
    sample_rate: float = float("nan")  # q = B/N
    steps: int = 0  # T planned = plan.total_steps(N, B, E), what σ is calibrated for
    steps_taken: int = 0  # steps actually run (< steps when stopped or failed); what ε spent counts
    epsilon_spent: float = float("nan")  # ε of steps_taken steps at (σ, q, δ); ≤ epsilon
    num_train: int = 0
    num_val: int = 0
    num_test: int = 0
    num_classes: int = 0
    trainable_parameters: int = 0
    val_accuracy: float = float("nan")  # after the last epoch (selection metric; exact, not private)
    noisy_val_accuracy: float = float("nan")  # (correct + N(0, σ_s²)) / num_val with score noise; else NaN
    test_accuracy: float = float("nan")  # after the last epoch (never used for selection)
    train_loss: float = float("nan")
    wall_time_s: float = 0.0  # training + evaluation + diagnostics (data loading and σ excluded)
    examples_per_s: float = 0.0
    diagnostics_wall_time_s: float = 0.0  # part of wall_time_s spent on diagnostics
    device: str = "cpu"
    engine: str = ""
    epochs: list[EpochMetrics] = field(default_factory=list)
    class_accuracy: dict[int, float] = field(default_factory=dict)  # test accuracy per class
    class_val_accuracy: dict[int, float] = field(default_factory=dict)  # validation accuracy per class
    class_names: dict[int, str] = field(default_factory=dict)
    diagnostics: list[Diagnostics] = field(default_factory=list)


Reporter = Callable[[EpochMetrics], None]


class TrialConfigError(DptuneError):
    """A :class:`TrialConfig` cannot run; raised before any training, naming the allowed values."""


class TrialFailed(RuntimeError):
    """A trial failed after training began; carries what it spent, so the search can account it.

    ``steps_taken`` Poisson steps at (``noise_multiplier``, ``sample_rate``) ran before the error
    (the ``__cause__``); ``epsilon_spent`` is their ε at the trial's δ.
    """

    def __init__(self, message: str, *, noise_multiplier: float, sample_rate: float, steps: int, steps_taken: int,
                 epsilon_spent: float) -> None:
        super().__init__(message)
        self.noise_multiplier = noise_multiplier
        self.sample_rate = sample_rate
        self.steps = steps
        self.steps_taken = steps_taken
        self.epsilon_spent = epsilon_spent


def run_trial(config: TrialConfig, report: Reporter | None = None) -> TrialResult:
    """Fine-tune ``config.backbone`` on ``config.dataset`` with DP; call ``report`` per epoch.

    Raises ``ValueError`` (:class:`TrialConfigError`, ``WorkloadError``, ``ModelError``,
    ``PrivacyParameterError``) for bad input, always before training; any error once training
    has begun is raised as :class:`TrialFailed` (with the steps taken). A run whose loss turns
    non-finite returns status ``"diverged"``. Implementation: :mod:`dptune.dp.trainer` (imported
    here on first use so that readers of these types, e.g. ``dptune.records``, stay torch-free).
    """
    leave_deleted_working_directory()
    from dptune.dp.trainer import run

    return run(config, report)


def check_trial_can_run(config: TrialConfig) -> None:
    """Raise ``ValueError`` (the same errors :func:`run_trial` raises) if ``config`` cannot run,
    from the config, the registries and the model's structure alone: no data is read and no
    weight is loaded.

    Checked: names and values (:class:`TrialConfigError`); dataset × backbone × PEFT and the
    workload knobs (``WorkloadError``); that DP can train the model (``ModelError``, e.g.
    BatchNorm that would use batch statistics) and that the requested engine can run it. The
    model is built with random weights on PyTorch's ``meta`` device (no memory, no compute).
    ``dptune.search`` calls this once in the driver, before Ray starts.
    """
    leave_deleted_working_directory()
    import torch

    from dptune.data import DATASETS
    from dptune.data.workload import check_spec
    from dptune.dp.engine import select_engine
    from dptune.dp.trainer import check_config, workload_spec
    from dptune.models import build_model, check_dp_compatible

    check_config(config)
    check_spec(workload_spec(config))
    classes = len(config.classes) if config.classes is not None else DATASETS[config.dataset].num_classes
    with torch.device("meta"):
        model = build_model(
            config.backbone, config.peft, classes, feature_input=config.peft == "head", pretrained=False
        )
    check_dp_compatible(model)
    try:
        select_engine(config.engine, model, config.peft)
    except ValueError as error:
        raise TrialConfigError(str(error)) from error


def leave_deleted_working_directory() -> None:
    """Move to the temp folder if this process's working directory no longer exists.

    oneMKL inside ``libtorch_cpu.so`` aborts the whole process at ``import torch`` ("Intel oneMKL
    FATAL ERROR: Cannot load .../libtorch_cpu.so") when the working directory has been deleted,
    and Ray Tune's ``Trainable`` fails on ``os.getcwd()``. Ray's worker processes inherit the
    working directory of the ``ray start`` that launched their node, so a worker node started
    from a temporary folder that is later removed kills every trial scheduled on it.
    ``dptune.search`` installs this as Ray's ``worker_process_setup_hook``; ``run_trial`` calls it
    too. It must run before torch is first imported.
    """
    try:
        os.getcwd()
    except FileNotFoundError:
        os.chdir(tempfile.gettempdir())
