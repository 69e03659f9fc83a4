"""Fused trials: K configurations of one cell trained side by side as batched tensor operations.

``run_fused(configs)`` trains every configuration of a list that differ only in clip bound C,
batch size B, learning rate η (and η₀) and seed, on a linear head over cached backbone features
(peft ``head``), and returns one :class:`~dptune.trial.TrialResult` per configuration, each the
mechanism :func:`~dptune.trial.run_trial` runs and accounts (``engine="fused"``). Ray-free.

Per configuration k, exactly as a trial (:mod:`dptune.dp.trainer`):

- coins: its own ``np.random.SeedSequence(seed_k)`` (``None``: 128 bits of fresh OS entropy)
  spawned into the trial's four child streams (:func:`~dptune.dp.coins.trial_coins`): the head is
  built under ``torch.manual_seed`` of 64 bits of the init stream (zero-initialised, as the
  trial's), the Poisson masks come from a CPU generator and the DP score noise from another, each
  with its whole MT19937 state (624 32-bit words) set from its stream
  (:func:`~dptune.dp.coins.cpu_generator`), and the Gaussian noise from the noise stream's
  :class:`~dptune.dp.coins.DeviceCoins` (CPU: the same full MT19937 state; CUDA: Philox with a
  fresh 64-bit key and 62-bit offset, 126 bits, from a PCG64 stream before every draw of up to
  :data:`MAX_CHUNK_STEPS` steps). Every stream is a function of the seed sequence's whole entropy,
  not of the 32 bits ``manual_seed`` keeps on the CPU. No draw is shared between configurations,
  so each one is an independent (ε, δ)-DP mechanism and composition across them holds as across
  trials;
- T = ``plan.total_steps(N, B, E)`` Poisson steps at q = B/N cut into epochs by
  ``plan.epoch_steps``, σ from ``privacy.calibrate_noise_multiplier(ε, δ, q, T)``;
- each step: per-example gradients g_i of the summed cross-entropy of the head y = W x + b,
  factors f_i = ``clip_factors(‖g_i‖, C_k, rule)``, released gradient
  ``update_scale(C_k, rule, q·N) · (Σ_i f_i g_i + N(0, s_k² I))`` with s_k = ``noise_std(σ, C_k,
  rule)`` (:mod:`dptune.dp.clipping`), then Adam or SGD with η_k (torch's defaults);
- evaluation on the validation split after every epoch, the test split after the last,
  per-class accuracies, diagnostics at epochs 0, ⌈E/2⌉ and E on the trial's probe, the noisy
  selection score, the trial's divergence rules, ``steps_taken`` and ``epsilon_spent`` (a
  diverged configuration, as a diverged trial, is charged ε of its planned T steps).

Configurations with the same B share q, T, σ and the epoch split, so they step in lock-step: a
*group*. A group's heads are stacked as one (K, classes, dim + 1) tensor [W | b] acting on
features augmented by a constant 1, x̃ = (x, 1) (:func:`stack_heads`). A step gathers every
configuration's own Poisson batch into a padded (K, n, dim + 1) tensor with a mask; the
per-example gradient of a linear head is closed form: with δ_i = softmax(W x_i + b) − onehot(y_i),
g_i = δ_i x̃_iᵀ (∇_W ℓ_i = δ_i x_iᵀ, ∇_b ℓ_i = δ_i), so ‖g_i‖ = ‖δ_i‖·√(‖x_i‖² + 1), and the
clipped sum Σ_i f_i g_i = (f ⊙ δ)ᵀ X̃ is one batched matrix product (the FiLM engine's head path,
:mod:`dptune.dp.film`, for K heads at once). A configuration that diverges stops updating (its
row is frozen) while the others continue.

Differences from a trial that change no distribution: the Poisson masks are drawn as geometric
gaps (:class:`PoissonSteps`) rather than as N uniforms per step, and noise is drawn for several
steps at once, so the same explicit seed gives other draws than ``run_trial`` (same law); the
forward pass runs in float32 on every device (a trial on CUDA autocasts it to bf16);
``max_physical_batch_size`` is not used (:func:`max_fused_configurations` bounds memory);
``wall_time_s`` and ``examples_per_s`` are each configuration's share of its group's time.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dptune.contract import Diagnostics, EpochMetrics, TrialConfig, TrialResult
from dptune.data import Workload
from dptune.dp.clipping import ClippingRule, clip_factors, noise_std, update_scale
from dptune.dp.coins import DeviceCoins, cpu_generator, init_seed, trial_coins
from dptune.dp.diagnostics import ProbeGradients, diagnose
from dptune.dp.trainer import (
    Evaluation,
    _process_workload,
    check_config,
    check_fits_workload,
    diagnostic_epochs,
    diverged_charge,
    noisy_score,
    probe_indices,
    torch_threads,
    workload_spec,
)
from dptune.errors import DptuneError, TrialConfigError
from dptune.models import build_model
from dptune.plan import epoch_steps, sample_rate, total_steps
from dptune.privacy import calibrate_noise_multiplier, epsilon_spent

#: Working-set budget of one fused group on its device (bytes): :func:`max_fused_configurations`.
FUSED_MEMORY_BYTES: int = 2 << 30
#: The ``TrialResult.engine`` of a fused configuration.
FUSED_ENGINE = "fused"
#: The fields in which the configurations of one ``run_fused`` call may differ.
FUSABLE_FIELDS: tuple[str, ...] = ("clip_bound", "batch_size", "learning_rate", "base_learning_rate", "seed")
#: Engines a fused configuration may ask for: the fused runner computes the head's per-example
#: gradients in closed form, as the FiLM engine does.
FUSABLE_ENGINES: tuple[str, ...] = ("auto", "film")
#: Optimizers :class:`StackedOptimizer` steps (a subset of ``dptune.dp.optimizers.OPTIMIZERS``).
FUSABLE_OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
#: Noise drawn per configuration per call: as many steps as fit this many bytes (float32).
NOISE_CHUNK_BYTES = 1 << 20
#: Most steps whose noise and Poisson batches are drawn in one call.
MAX_CHUNK_STEPS = 64
#: Evaluation rows scored at once (all configurations of a group together).
EVALUATION_ROWS = 4096
#: Adam's defaults in torch.optim.Adam.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPSILON = 1e-8


class FusedTrialsFailed(DptuneError, RuntimeError):
    """A fused group failed after training began. ``results`` holds one :class:`TrialResult` per
    configuration given to :func:`run_fused`, in order: groups that finished keep their results,
    the failed group's configurations have status ``error`` with the steps they took and the ε
    those spent, and configurations of groups not yet started have status ``error`` with 0 steps."""

    def __init__(self, message: str, results: list[TrialResult]) -> None:
        super().__init__(message)
        self.results = results


# --------------------------------------------------------------------------- checks before compute


def fused_refusal(config: TrialConfig) -> str | None:
    """Why the fused runner cannot run this config (None: it can).

    It runs peft ``head`` (a linear head on cached backbone features, the ``features`` workload),
    any clipping rule, optimizer adam or sgd, engine ``auto`` or ``film``. A config with unknown
    names or bad values is for :func:`~dptune.dp.trainer.check_config` to refuse.
    """
    if config.peft != "head":
        return (f"peft {config.peft!r} trains backbone parameters; the fused runner trains a linear head on "
                f"cached features (peft 'head')")
    if config.engine not in FUSABLE_ENGINES:
        allowed = " or ".join(map(repr, FUSABLE_ENGINES))
        return (f"engine {config.engine!r} asks for another per-example gradient engine; the fused runner "
                f"computes the head's per-example gradients in closed form (engine {allowed})")
    if config.optimizer not in FUSABLE_OPTIMIZERS:
        return (f"optimizer {config.optimizer!r} has no stacked form here; the fused runner steps "
                f"{' or '.join(map(repr, FUSABLE_OPTIMIZERS))}")
    return None


def check_fusable(configs: Sequence[TrialConfig]) -> torch.device:
    """Raise :class:`TrialConfigError` unless ``configs`` can run as fused trials; return their device.

    Every config must pass the trial's own checks (:func:`~dptune.dp.trainer.check_config`) and
    :func:`fused_refusal`, and all must agree on every field but :data:`FUSABLE_FIELDS`.
    """
    if not configs:
        raise TrialConfigError("run_fused got no configurations; give one or more TrialConfigs of one cell")
    for index, config in enumerate(configs):
        if not isinstance(config, TrialConfig):
            raise TrialConfigError(f"configuration {index} is a {type(config).__name__}, not a TrialConfig")
    device = check_config(configs[0])
    neutral = {name: None for name in FUSABLE_FIELDS}
    cell = dataclasses.replace(configs[0], **neutral)
    for index, config in enumerate(configs):
        check_config(config)
        refusal = fused_refusal(config)
        if refusal is not None:
            raise TrialConfigError(f"configuration {index} cannot be fused: {refusal}")
        other = dataclasses.replace(config, **neutral)
        if other != cell:
            field = next(f.name for f in dataclasses.fields(cell) if getattr(other, f.name) != getattr(cell, f.name))
            raise TrialConfigError(
                f"configuration {index} differs from configuration 0 in {field} ({getattr(config, field)!r} vs "
                f"{getattr(configs[0], field)!r}); fused configurations may differ only in {', '.join(FUSABLE_FIELDS)}"
            )
    return device


def _padded_batch_size(batch_size: int) -> int:
    """A bound on the largest Poisson batch of a group chunk: B + 6√B + 16 (memory planning only)."""
    return int(batch_size + 6 * math.sqrt(batch_size) + 16)


def chunk_steps(parameters: int) -> int:
    """Steps whose noise (``parameters`` float32 values each) and Poisson batches are drawn at once."""
    return max(1, min(MAX_CHUNK_STEPS, NOISE_CHUNK_BYTES // (4 * parameters)))


def max_fused_configurations(config: TrialConfig, num_train: int, feature_dim: int, num_classes: int,
                             memory_bytes: int = FUSED_MEMORY_BYTES) -> int:
    """How many configurations at ``config.batch_size`` fit one fused group in ``memory_bytes`` (≥ 0).

    The model (bytes, float32 unless said): shared by the group, the augmented training features
    with their squared norms and labels, 4·(N + 1)·(dim + 4), an evaluation block of augmented
    features, 4·``EVALUATION_ROWS``·(dim + 1), and the probe's per-example gradients with their
    running sums, 16·n_probe·d (d = (dim + 1)·classes); per configuration, with n = B + 6√B + 16
    and S = :func:`chunk_steps` steps per draw: the gathered batch, its logits, δ, factors and
    norms, 4·n·(dim + 2 + 6·classes), the drawn batch indices, 16·S·n, the head, its optimizer
    state, gradient and S steps of noise, 4·d·(5 + S), and its share of the evaluation block's
    logits, 12·``EVALUATION_ROWS``·classes.
    """
    parameters = (feature_dim + 1) * num_classes
    steps = chunk_steps(parameters)
    padded = _padded_batch_size(config.batch_size)
    probe = min(config.diagnostic_examples, num_train) if config.diagnostics else 0
    shared = 4 * (num_train + 1) * (feature_dim + 4) + 4 * EVALUATION_ROWS * (feature_dim + 1) + 16 * probe * parameters
    per_config = (4 * padded * (feature_dim + 2 + 6 * num_classes) + 16 * steps * padded
                  + 4 * parameters * (5 + steps) + 12 * EVALUATION_ROWS * num_classes)
    return max(0, (memory_bytes - shared) // per_config)


# --------------------------------------------------------------------------- the mechanism's pieces


class PoissonSteps:
    """The Poisson batches of one configuration: at every step each of the N examples is included
    independently with probability q, drawn from the configuration's own (CPU) generator.

    Exactness. Number the (step, example) pairs of the coming steps in order, position
    p = step·N + example. Inclusion of each pair is an independent Bernoulli(q) trial, so the
    included positions are a Bernoulli process, whose gaps (failures before each success) are
    i.i.d. Geometric(q): P(F ≥ k) = (1 − q)^k. A gap is drawn by inversion from a float64 uniform
    U ∈ [0, 1): F = ⌊log(1 − U) / log(1 − q)⌋ has P(F ≥ k) = P(1 − U ≤ (1 − q)^k) = (1 − q)^k, exact
    up to the 2⁻⁵³ resolution of U (Opacus' loader compares float32 uniforms with q, a 2⁻²⁴
    resolution). Gaps are drawn in batches; when a batch ends before the last position, the process
    restarts at the next position with fresh gaps, which by the independence of the Bernoulli trials
    (the geometric law's memorylessness) is the same process. Draws past the last position are
    discarded, so the batches of disjoint steps are independent. Expected cost: q·N + O(1) uniforms
    per step instead of N.
    """

    def __init__(self, num_examples: int, sample_rate: float, generator: torch.Generator) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.num_examples = num_examples
        self.sample_rate = sample_rate
        self.generator = generator
        self._log_miss = math.log1p(-sample_rate) if sample_rate < 1 else -math.inf

    def draw(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``steps`` steps' batches: (step, example) int64 tensors of every inclusion, in
        order of step then example (steps counted from 0 at this call)."""
        end = steps * self.num_examples
        if self.sample_rate == 1:  # full batch: every pair, no coin is drawn
            positions = torch.arange(end)
            return positions // self.num_examples, positions % self.num_examples
        found: list[torch.Tensor] = []
        start = 0  # the first position not yet decided
        while start < end:
            expected = (end - start) * self.sample_rate
            count = int(expected + 6 * math.sqrt(expected) + 16)
            uniforms = torch.rand(count, generator=self.generator, dtype=torch.float64)
            gaps = torch.floor(torch.log1p(-uniforms) / self._log_miss).clamp_(max=end).long()
            positions = start + torch.cumsum(gaps + 1, 0) - 1
            inside = positions[positions < end]
            found.append(inside)
            start = end if len(inside) < count else int(positions[-1]) + 1
        positions = torch.cat(found)
        return positions // self.num_examples, positions % self.num_examples


@dataclass
class HeadGradients:
    """One step's released gradients of K stacked heads and what the trial reads off them.

    ``heads`` (K, classes, dim + 1) is ``update_scale_k · (Σ_i f_i g_i + s_k·z_k)`` in the layout
    of :func:`stack_heads`; ``losses`` (K,) Σ_i ℓ_i over each configuration's batch; ``norms``
    (K, n) ‖g_i‖ (0 at padding).
    """

    heads: torch.Tensor
    losses: torch.Tensor
    norms: torch.Tensor


def stack_heads(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]) -> torch.Tensor:
    """K heads y = W x + b as one (K, classes, dim + 1) float32 tensor [W | b]: column ``dim`` is b.

    With features augmented by a constant 1 (:func:`augment`), x̃ = (x, 1), a head is the linear
    map y = [W | b] x̃, its per-example gradient is δ x̃ᵀ (weight and bias at once) and
    ‖g_i‖ = ‖δ_i‖·‖x̃_i‖ = ‖δ_i‖·√(‖x_i‖² + 1).
    """
    return torch.cat([torch.stack(list(weights)), torch.stack(list(biases)).unsqueeze(2)], dim=2).float()


def augment(features: torch.Tensor) -> torch.Tensor:
    """x̃ = (x, 1) for every row of ``features`` (…, dim) → (…, dim + 1), float32."""
    return torch.cat([features.float(), features.new_ones(*features.shape[:-1], 1, dtype=torch.float32)], dim=-1)


def head_deltas(heads: torch.Tensor, features: torch.Tensor,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """δ_i = ∂ℓ_i/∂logits = softmax([W | b] x̃_i) − onehot(y_i) and ℓ_i (cross-entropy), float32.

    ``heads`` (K, classes, dim + 1), augmented ``features`` (K, n, dim + 1), ``labels`` (K, n)
    → δ of shape (K, n, classes) and ℓ of shape (K, n).
    """
    log_probs = F.log_softmax(torch.bmm(features, heads.transpose(1, 2)), dim=2)
    losses = -log_probs.gather(2, labels.unsqueeze(2)).squeeze(2)
    deltas = log_probs.exp()
    deltas.scatter_add_(2, labels.unsqueeze(2), torch.full_like(losses, -1.0).unsqueeze(2))
    return deltas, losses


def head_noisy_gradients(
    heads: torch.Tensor,
    features: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    clip_bounds: torch.Tensor,
    rule: ClippingRule,
    noise: torch.Tensor,
    noise_stds: torch.Tensor,
    scales: torch.Tensor,
    feature_square_norms: torch.Tensor | None = None,
) -> HeadGradients:
    """The DP step of :mod:`dptune.dp.engine` for K linear heads on K padded batches at once.

    Shapes: ``heads`` (K, classes, dim + 1) (:func:`stack_heads`), ``features`` (K, n, dim + 1)
    augmented (:func:`augment`), ``labels`` (K, n) int64, ``mask`` (K, n) bool (False: padding,
    contributes nothing); ``clip_bounds``, ``noise_stds`` (s_k) and ``scales``
    (``update_scale``) are (K,); ``noise`` (K, classes, dim + 1) standard normal draws, one per
    parameter; ``feature_square_norms`` (K, n) ‖x̃_i‖² when already known. Per configuration k::

        released_k = scales_k · (Σ_i f_i g_i + noise_stds_k · noise_k),  f = clip_factors(‖g‖, C_k, rule)

    with g_i = δ_i x̃_iᵀ and ‖g_i‖ = ‖δ_i‖·‖x̃_i‖; the clipped sum is one batched product (f ⊙ δ)ᵀ X̃.
    """
    k = heads.shape[0]
    deltas, losses = head_deltas(heads, features, labels)
    deltas = deltas * mask.unsqueeze(2)
    if feature_square_norms is None:
        feature_square_norms = features.square().sum(2)
    norms = (deltas.square().sum(2) * feature_square_norms).sqrt()
    factors = clip_factors(norms, clip_bounds.unsqueeze(1), rule) * mask
    clipped = torch.bmm((deltas * factors.unsqueeze(2)).transpose(1, 2), features)
    released = torch.addcmul(clipped, noise_stds.view(k, 1, 1), noise).mul_(scales.view(k, 1, 1))
    return HeadGradients(heads=released, losses=torch.where(mask, losses, torch.zeros_like(losses)).sum(1), norms=norms)


class StackedOptimizer:
    """Adam or SGD over K stacked parameter sets, each with its own learning rate η_k.

    Matches ``torch.optim.Adam(params, lr=η_k)`` (betas (0.9, 0.999), eps 1e-8, bias correction,
    no weight decay) and ``torch.optim.SGD(params, lr=η_k)`` (no momentum) stepping each
    configuration's parameters on its gradient. ``params`` are tensors with the configurations on
    their first axis, updated in place; ``step(grads, active)`` leaves the rows where ``active``
    (K,) is False untouched (a configuration that diverged stops updating).
    """

    def __init__(self, name: str, params: Sequence[torch.Tensor], learning_rates: torch.Tensor) -> None:
        if name not in FUSABLE_OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} is not one of {', '.join(FUSABLE_OPTIMIZERS)}")
        self.name = name
        self.params = list(params)
        self.learning_rates = learning_rates
        self.steps = 0
        self.first_moments = [torch.zeros_like(p) for p in self.params] if name == "adam" else []
        self.second_moments = [torch.zeros_like(p) for p in self.params] if name == "adam" else []

    def step(self, grads: Sequence[torch.Tensor], active: torch.Tensor) -> None:
        """One optimizer step of every active configuration on ``grads`` (shapes as ``params``)."""
        self.steps += 1
        beta1, beta2 = ADAM_BETAS
        for index, (param, grad) in enumerate(zip(self.params, grads, strict=True)):
            rows = (-1, *([1] * (param.dim() - 1)))
            rate = self.learning_rates.view(rows)
            if self.name == "sgd":
                update = rate * grad
            else:
                first, second = self.first_moments[index], self.second_moments[index]
                first.lerp_(grad, 1 - beta1)
                second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denominator = (second.sqrt() / math.sqrt(1 - beta2**self.steps)).add_(ADAM_EPSILON)
                update = (rate / (1 - beta1**self.steps)) * first / denominator
            param.sub_(torch.where(active.view(rows), update, torch.zeros_like(update)))


def stacked_evaluations(heads: torch.Tensor, features: torch.Tensor, labels: torch.Tensor,
                        num_classes: int) -> list[Evaluation]:
    """Mean cross-entropy, accuracy and per-class counts of each of K heads (K, classes, dim + 1)
    on one split. ``features`` (rows, dim) and ``labels`` (rows,) may live on the CPU; they are
    scored ``EVALUATION_ROWS`` at a time on the heads' device, all K heads in one matrix product.
    """
    k, classes, _ = heads.shape
    device = heads.device
    flat = heads.reshape(k * classes, -1)
    loss = torch.zeros(k, dtype=torch.float64, device=device)
    correct = torch.zeros(k, num_classes, dtype=torch.float64, device=device)
    for rows, row_labels in zip(features.split(EVALUATION_ROWS), labels.split(EVALUATION_ROWS), strict=True):
        rows, row_labels = augment(rows.to(device)), row_labels.to(device)
        logits = (rows @ flat.T).view(-1, k, classes).transpose(0, 1)  # (K, rows, classes)
        loss += F.cross_entropy(logits.transpose(1, 2), row_labels.expand(k, -1), reduction="none").sum(1).double()
        correct.index_add_(1, row_labels, (logits.argmax(2) == row_labels).double())
    examples = torch.bincount(labels, minlength=num_classes).numpy()
    total = int(examples.sum())
    loss_np, correct_np = loss.cpu().numpy(), correct.cpu().numpy().round().astype(np.int64)
    return [
        Evaluation(loss=float(loss_np[i]) / total, accuracy=float(correct_np[i].sum()) / total,
                   correct_per_class=correct_np[i], examples_per_class=examples)
        for i in range(k)
    ]


def head_probe_gradients(head: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> ProbeGradients:
    """The probe's per-example gradients g_i = δ_i x̃_iᵀ of one head (classes, dim + 1) on augmented
    ``features`` (n, dim + 1), summarised for the diagnostics, which depend on them only through
    inner products: g_iᵀg_j = (δ_iᵀδ_j)(x̃_iᵀx̃_j), an (n, n) Gram matrix in O(n²·(classes + dim))
    instead of n gradients of classes·(dim + 1) entries."""
    deltas, _ = head_deltas(head.unsqueeze(0), features.unsqueeze(0), labels.unsqueeze(0))
    deltas, features = deltas[0].double(), features.double()
    return ProbeGradients.from_gram((deltas @ deltas.T) * (features @ features.T), labels,
                                    head.shape[0] * head.shape[1])


# --------------------------------------------------------------------------- one fused group


@dataclass(frozen=True)
class _Cell:
    """What every group of one ``run_fused`` call shares: the workload on the device."""

    workload: Workload
    device: torch.device
    features: torch.Tensor  # (N + 1, dim + 1) augmented training features x̃ on the device; row N is zeros (padding)
    square_norms: torch.Tensor  # (N + 1,) ‖x̃_i‖² = ‖x_i‖² + 1
    labels: torch.Tensor  # (N + 1,) int64; row N is 0 (padding)
    probe: tuple[torch.Tensor, torch.Tensor] | None  # augmented probe features and labels on the device

    @classmethod
    def build(cls, config: TrialConfig, workload: Workload, device: torch.device) -> _Cell:
        features, labels = workload.train.tensors
        features = augment(features.to(device))
        features = torch.cat([features, features.new_zeros(1, features.shape[1])])
        labels = torch.cat([labels, labels.new_zeros(1)]).to(device)
        probe = None
        if config.diagnostics:
            rows = probe_indices(config, len(workload.train), features.shape[1] * workload.num_classes).to(device)
            probe = (features[rows], labels[rows])
        return cls(workload=workload, device=device, features=features,
                   square_norms=features.square().sum(1), labels=labels, probe=probe)


@dataclass(frozen=True)
class Draws:
    """A group's coins for S steps. ``index[t, k, r]`` (S, K, width; on the device) is the r-th
    training row in configuration k's Poisson batch at step t, in increasing order, padded with N
    (the zero row); ``counts[t, k]`` (numpy) its batch size; ``noise[t, k]`` (S, K, classes,
    dim + 1; on the device) the standard normal draws of its Gaussian noise."""

    index: torch.Tensor
    counts: np.ndarray
    noise: torch.Tensor


class _Group:
    """K configurations with one batch size B, trained in lock-step (see the module docstring)."""

    def __init__(self, cell: _Cell, configs: Sequence[TrialConfig], noise_multiplier: float) -> None:
        self.cell = cell
        self.configs = list(configs)
        first = self.configs[0]
        workload = cell.workload
        num_train = len(workload.train)
        device = cell.device
        self.num_train = num_train
        self.sample_rate = sample_rate(num_train, first.batch_size)
        self.steps = total_steps(num_train, first.batch_size, first.epochs)
        self.epoch_steps = epoch_steps(num_train, first.batch_size, first.epochs)
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = self.sample_rate * num_train
        self.rule: ClippingRule = first.clipping
        self.private_score = first.score_noise_multiplier is not None
        k = len(self.configs)
        weights, biases = [], []
        self.samplers: list[PoissonSteps] = []
        self.noise_coins: list[DeviceCoins] = []
        self.score_generators: list[torch.Generator] = []
        for config in self.configs:
            coins = trial_coins(config.seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(init_seed(coins.init))
                head = build_model(config.backbone, config.peft, workload.num_classes, feature_input=True)
            weights.append(head.weight.detach())
            biases.append(head.bias.detach())
            self.samplers.append(PoissonSteps(num_train, self.sample_rate, cpu_generator(coins.sampling)))
            self.noise_coins.append(DeviceCoins(coins.noise, device))
            self.score_generators.append(cpu_generator(coins.score))
        self.heads = stack_heads(weights, biases).to(device)  # (K, classes, dim + 1)
        self.parameters = self.heads[0].numel()
        clip_bounds = [c.clip_bound for c in self.configs]
        self.clip_bounds = torch.tensor(clip_bounds, device=device)
        self.noise_stds = torch.tensor([noise_std(noise_multiplier, c, self.rule) for c in clip_bounds], device=device)
        self.scales = torch.tensor([update_scale(c, self.rule, self.expected_batch_size) for c in clip_bounds],
                                   device=device)
        self.optimizer = StackedOptimizer(first.optimizer, [self.heads],
                                          torch.tensor([c.learning_rate for c in self.configs], device=device))
        self.active = torch.ones(k, dtype=torch.bool, device=device)  # not diverged
        self.last_step = torch.zeros(k, dtype=torch.int64, device=device)  # steps taken by each configuration
        self.divergent_loss = torch.zeros(k, device=device)  # the non-finite step loss that ended a configuration
        self.steps_done = 0  # steps the group ran
        self.results = [self._new_result(config) for config in self.configs]

    def _new_result(self, config: TrialConfig) -> TrialResult:
        workload = self.cell.workload
        return TrialResult(
            config=config, status="ok", noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate,
            steps=self.steps, num_train=self.num_train, num_val=len(workload.val), num_test=len(workload.test),
            num_classes=workload.num_classes, trainable_parameters=self.parameters, device=str(self.cell.device),
            engine=FUSED_ENGINE, class_names=dict(enumerate(workload.class_names)),
        )

    def steps_taken(self) -> list[int]:
        """Steps each configuration took (a diverged one: up to the step where it diverged)."""
        return self.last_step.tolist()

    def epsilon_spent(self, steps_taken: int) -> float:
        """ε of ``steps_taken`` of this group's steps (0 before the first)."""
        if not steps_taken:
            return 0.0
        return epsilon_spent(self.noise_multiplier, self.sample_rate, steps_taken, self.configs[0].delta)

    def _diagnose(self, live: list[int], epoch: int) -> None:
        """Append the probe's diagnostics at ``epoch`` to the results of configurations ``live``."""
        assert self.cell.probe is not None
        features, labels = self.cell.probe
        for k in live:
            start = time.perf_counter()
            record: Diagnostics = diagnose(
                head_probe_gradients(self.heads[k], features, labels), epoch=epoch,
                clip_bound=self.configs[k].clip_bound, noise_multiplier=self.noise_multiplier,
                expected_batch_size=self.expected_batch_size)
            record.wall_time_s = time.perf_counter() - start
            self.results[k].diagnostics.append(record)

    def draw(self, steps: int) -> Draws:
        """The coins of the next ``steps`` steps, each configuration's from its own generators."""
        k, num_train = len(self.configs), self.num_train
        draws = [sampler.draw(steps) for sampler in self.samplers]
        noise = []
        for coins in self.noise_coins:
            coins.refresh()  # CUDA: a fresh secret Philox key and offset for this chunk; CPU: nothing
            noise.append(torch.randn(steps, *self.heads.shape[1:], generator=coins.generator, device=self.cell.device))
        stacked = torch.stack(noise, dim=1)
        counts = np.stack([np.bincount(step.numpy(), minlength=steps) for step, _ in draws], axis=1)
        index = torch.full((steps, k, max(1, int(counts.max()))), num_train, dtype=torch.int64)
        for column, (step, example) in enumerate(draws):
            starts = np.concatenate([[0], np.cumsum(counts[:, column])[:-1]])
            rank = torch.arange(len(step)) - torch.from_numpy(starts)[step]
            index[step, column, rank] = example
        return Draws(index=index.to(self.cell.device), counts=counts, noise=stacked)

    def _train_chunk(self, steps: int, examples: np.ndarray, losses: torch.Tensor) -> None:
        """``steps`` fused steps; adds each configuration's batch sizes to ``examples`` (steps, K) and
        its step losses to ``losses`` (K,) while it has not diverged."""
        cell, num_train = self.cell, self.num_train
        draws = self.draw(steps)
        examples += draws.counts
        check_loss = not self.private_score
        for t in range(steps):
            rows = draws.index[t, :, : max(1, int(draws.counts[t].max()))]
            flat = rows.reshape(-1)  # index_select: a faster gather than advanced indexing on the CPU
            gradients = head_noisy_gradients(
                self.heads, cell.features.index_select(0, flat).view(*rows.shape, -1),
                cell.labels.index_select(0, flat).view(rows.shape), rows < num_train, self.clip_bounds, self.rule,
                draws.noise[t], self.noise_stds, self.scales, cell.square_norms.index_select(0, flat).view(rows.shape))
            self.steps_done += 1
            self.last_step.add_(self.active.long())  # the step counts for every configuration that ran it
            if check_loss:  # the trial's rule: a non-finite loss ends it before its optimizer steps
                finite = torch.isfinite(gradients.losses)
                self.divergent_loss = torch.where(self.active & ~finite, gradients.losses, self.divergent_loss)
                self.active &= finite
            losses += torch.where(self.active, gradients.losses, torch.zeros_like(gradients.losses)).double()
            self.optimizer.step([gradients.heads], self.active)

    def run(self) -> list[TrialResult]:
        """Train the group's T steps epoch by epoch, as a trial does; one result per configuration."""
        cell, configs = self.cell, self.configs
        k = len(configs)
        epochs = configs[0].epochs
        probe_epochs = diagnostic_epochs(epochs) if configs[0].diagnostics else []
        start = time.perf_counter()
        train_time = 0.0
        examples_seen = np.zeros(k)
        finished = [False] * k  # diverged: no more metrics
        if 0 in probe_epochs:
            self._diagnose(list(range(k)), 0)
        chunk = chunk_steps(self.parameters)
        for epoch, epoch_length in enumerate(self.epoch_steps, start=1):
            epoch_start = time.perf_counter()
            live = [i for i in range(k) if not finished[i]]
            examples = np.zeros((epoch_length, k), dtype=np.int64)
            losses = torch.zeros(k, dtype=torch.float64, device=cell.device)
            first_step = self.steps_done
            for offset in range(0, epoch_length, chunk):
                steps = min(chunk, epoch_length - offset)
                self._train_chunk(steps, examples[offset : offset + steps], losses)
            taken = self.steps_taken()
            epoch_train_time = time.perf_counter() - epoch_start
            train_time += epoch_train_time
            share = epoch_train_time / len(live)
            epoch_losses = losses.cpu().numpy()
            divergent_losses = self.divergent_loss.tolist()
            epoch_examples = {i: int(examples[: taken[i] - first_step, i].sum()) for i in live}
            for i in live:
                examples_seen[i] += epoch_examples[i]
                if taken[i] < self.steps_done:
                    loss = divergent_losses[i]
                    self._diverge(i, f"non-finite training loss ({loss}) at step {taken[i]} (epoch {epoch})")
                elif self.private_score and not self._parameters_finite(i):
                    self._diverge(i, f"non-finite parameters after epoch {epoch}")
                finished[i] = self.results[i].status == "diverged"
            live = [i for i in live if not finished[i]]
            if not live:
                break
            val = stacked_evaluations(self.heads, *cell.workload.val.tensors, cell.workload.num_classes)
            test = (stacked_evaluations(self.heads, *cell.workload.test.tensors, cell.workload.num_classes)
                    if epoch == epochs else None)
            epoch_time = time.perf_counter() - epoch_start
            for i in live:
                if not math.isfinite(val[i].loss) and not self.private_score:
                    self._diverge(i, f"non-finite validation loss ({val[i].loss}) after epoch {epoch}")
                    finished[i] = True
                    continue
                result = self.results[i]
                metrics = EpochMetrics(
                    epoch=epoch, steps=taken[i], train_loss=float(epoch_losses[i]) / max(epoch_examples[i], 1),
                    val_loss=val[i].loss, val_accuracy=val[i].accuracy, wall_time_s=epoch_time / len(live),
                    examples_per_s=epoch_examples[i] / share, test_accuracy=None if test is None else test[i].accuracy)
                result.epochs.append(metrics)
                if test is not None:
                    result.val_accuracy = val[i].accuracy
                    result.test_accuracy = test[i].accuracy
                    result.train_loss = metrics.train_loss
                    result.class_accuracy = test[i].class_accuracy()
                    result.class_val_accuracy = val[i].class_accuracy()
                    if self.private_score:
                        result.noisy_val_accuracy = noisy_score(val[i], configs[i].score_noise_multiplier,
                                                                self.score_generators[i])
            if epoch in probe_epochs:
                self._diagnose([i for i in live if not finished[i]], epoch)
        wall = time.perf_counter() - start
        diagnostics_time = [sum(d.wall_time_s for d in r.diagnostics) for r in self.results]
        shared_time = (wall - sum(diagnostics_time)) / k
        for i, (result, steps) in enumerate(zip(self.results, self.steps_taken(), strict=True)):
            result.wall_time_s = shared_time + diagnostics_time[i]
            result.diagnostics_wall_time_s = diagnostics_time[i]
            result.examples_per_s = examples_seen[i] / (train_time / k) if train_time > 0 else 0.0
            result.steps_taken = steps
            # a diverged configuration stopped on the data (see _diverge): charged its planned steps
            result.epsilon_spent = self.epsilon_spent(self.steps if result.status == "diverged" else steps)
        return self.results

    def _parameters_finite(self, index: int) -> bool:
        """Whether configuration ``index``'s head is finite: a function of the DP outputs only."""
        return bool(torch.isfinite(self.heads[index]).all())

    def _diverge(self, index: int, reason: str) -> None:
        """Mark configuration ``index`` diverged: its head stops updating, its result says why and
        that it is charged its planned steps (:func:`~dptune.dp.trainer.diverged_charge`)."""
        self.results[index].status = "diverged"
        self.results[index].reason = reason + diverged_charge(self.steps, self.private_score)
        self.active[index] = False

    def failed(self, error: BaseException) -> list[TrialResult]:
        """The results of this group after ``error`` interrupted it: ``error`` with the steps each took,
        except a configuration that had diverged before, which keeps its record and its charge of
        the planned steps."""
        results = []
        active = self.active.tolist()
        for index, (config, steps) in enumerate(zip(self.configs, self.steps_taken(), strict=True)):
            if not active[index] and self.results[index].status != "diverged":  # its loss stopped it mid-epoch
                self._diverge(index, f"non-finite training loss ({self.divergent_loss[index].item()}) at step {steps}")
            if self.results[index].status == "diverged":  # stopped on the data: keeps its planned-steps charge
                results.append(dataclasses.replace(self.results[index], steps_taken=steps,
                                                   epsilon_spent=self.epsilon_spent(self.steps)))
                continue
            results.append(dataclasses.replace(
                self._new_result(config), status="error", steps_taken=steps, epsilon_spent=self.epsilon_spent(steps),
                reason=f"{type(error).__name__}: {error} (after {steps} of {self.steps} steps)"[:2000]))
        return results


# --------------------------------------------------------------------------- the runner


def _unstarted(config: TrialConfig, reason: str, num_train: int, noise_multiplier: float) -> TrialResult:
    """The ``error`` record of a configuration whose group never took a step: nothing spent."""
    return TrialResult(config=config, status="error", reason=reason[:2000], noise_multiplier=noise_multiplier,
                       sample_rate=sample_rate(num_train, config.batch_size), num_train=num_train,
                       steps=total_steps(num_train, config.batch_size, config.epochs), steps_taken=0,
                       epsilon_spent=0.0, engine=FUSED_ENGINE)


def run_fused(configs: Sequence[TrialConfig],
              on_done: Callable[[list[int], list[TrialResult]], None] | None = None,
              *, memory_bytes: int | None = None) -> list[TrialResult]:
    """Train every config (K of them) as fused trials; one :class:`TrialResult` per config, in order,
    each what ``run_trial(config)`` would return in distribution (``engine="fused"``).

    The configs share everything except :data:`FUSABLE_FIELDS` (a :class:`TrialConfigError`
    before compute otherwise, as for a refused or bad config, an empty list, a batch size above N,
    or a batch size of which not one configuration fits ``memory_bytes``, default
    :data:`FUSED_MEMORY_BYTES`). σ of every batch size is calibrated before the first step.
    Configs are grouped by batch size, each group runs fused in chunks of at most
    :func:`max_fused_configurations`, and ``on_done(indices, results)`` is called after each
    chunk with the positions in ``configs`` and their results, so the caller can record them at
    once. A failure inside a chunk raises :class:`FusedTrialsFailed` carrying every config's result.
    """
    configs = list(configs)
    device = check_fusable(configs)
    budget = FUSED_MEMORY_BYTES if memory_bytes is None else memory_bytes
    first = configs[0]
    with torch_threads(first.threads):
        workload = _process_workload(workload_spec(first))
        num_train = len(workload.train)
        for config in configs:
            check_fits_workload(config, num_train)
        groups: dict[int, list[int]] = {}
        for index, config in enumerate(configs):
            groups.setdefault(config.batch_size, []).append(index)
        chunks: list[list[int]] = []
        noise_multipliers: dict[int, float] = {}  # σ by batch size
        for batch_size, members in groups.items():
            fits = max_fused_configurations(configs[members[0]], num_train, workload.feature_dim,
                                            workload.num_classes, budget)
            if fits < 1:
                raise TrialConfigError(
                    f"not one configuration at batch_size {batch_size} fits the fused memory budget of {budget} bytes "
                    f"(N = {num_train}, {workload.feature_dim} features, {workload.num_classes} classes); choose a "
                    f"smaller batch_size or a larger memory budget")
            rate, steps = sample_rate(num_train, batch_size), total_steps(num_train, batch_size, first.epochs)
            noise_multipliers[batch_size] = calibrate_noise_multiplier(first.epsilon, first.delta, rate, steps)
            chunks += [members[i : i + fits] for i in range(0, len(members), fits)]
        cell = _Cell.build(first, workload, device)
        results: list[TrialResult | None] = [None] * len(configs)
        for members in chunks:
            batch_size = configs[members[0]].batch_size
            group: _Group | None = None
            try:
                group = _Group(cell, [configs[i] for i in members], noise_multipliers[batch_size])
                group_results = group.run()
            except Exception as error:  # say what every configuration spent, finished or not
                failure = f"{type(error).__name__}: {error}"
                failed = group.failed(error) if group is not None else [
                    _unstarted(configs[i], failure, num_train, noise_multipliers[batch_size]) for i in members]
                for i, result in zip(members, failed, strict=True):
                    results[i] = result
                final = [r if r is not None else _unstarted(c, f"not run: an earlier fused group failed ({failure})",
                                                            num_train, noise_multipliers[c.batch_size])
                         for r, c in zip(results, configs, strict=True)]
                raise FusedTrialsFailed(f"fused group of batch_size {batch_size} failed: {failure}", final) from error
            for i, result in zip(members, group_results, strict=True):
                results[i] = result
            if on_done is not None:
                on_done(members, group_results)
    return [r for r in results if r is not None]
