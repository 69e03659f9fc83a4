"""The Opacus engine: per-example gradients from Opacus' grad-sample hooks, any supported model.

Attaching Opacus' hooks walks the module tree several times (≈ 7 ms for a ViT on a CPU core, a
third of a ViT-Ti step on a GPU), so :class:`OpacusEngine` attaches them once and keeps them
*disabled* outside its step: the model then computes exactly as a plain module. The diagnostics
enter the same hooks through :func:`grad_sample_hooks`, which attaches them for the duration
only when no engine keeps them.

:class:`RuleDPOptimizer` overrides the three stages of Opacus' pre-step with the rule's factors from
:mod:`dptune.dp.clipping` — per-example factor f_i (``clip_and_accumulate``), noise std s
(``add_noise``) and update scale (``scale_grad``) — so that after a step's backward passes

    p.grad = update_scale(C, rule, B) · (Σ_i f_i g_i + N(0, s² I)).

With rule ``standard`` this is exactly Opacus' DP-SGD step (flat clipping, std σC, divide by B);
``normalized`` is the paper's Algorithm 1 (divide by C·B as well); ``auto_s`` is AUTO-S. Everything
else (parameter bookkeeping, the processed-gradient checks, ``zero_grad``, ``step`` and Opacus'
``BatchMemoryManager`` skip logic) is Opacus', so ``RuleDPOptimizer(Adam(...))`` is DP-Adam in
Opacus' own training loop; the engine runs it through these three stages only, and the trial's
base optimizer (:data:`dptune.dp.optimizers.OPTIMIZERS`) steps.

Importing this module imports Opacus (seconds) and registers dptune's grad samplers with it
(:func:`dptune.models.register_opacus_grad_samplers`); the modules a head-on-features trial uses
import neither.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator
from weakref import WeakKeyDictionary

import torch
from opacus.grad_sample import GradSampleHooks
from opacus.optimizers.optimizer import DPOptimizer
from torch import nn

from dptune._thirdparty import check_processed_flag, generate_noise, mark_as_processed
from dptune.contract import ClippingRule
from dptune.dp.clipping import AUTO_S_STABILITY, check_rule, clip_factors, noise_std, update_scale
from dptune.dp.engine import DPStepSpec, PersonRows, PhysicalBatch, summed_cross_entropy, unpack
from dptune.dp.optimizers import per_example_norms
from dptune.dp.precision import autocast
from dptune.models.batch_norm import batch_norm_refusal, frozen_batch_norm_types
from dptune.models.opacus_support import register_opacus_grad_samplers

register_opacus_grad_samplers()

#: Hooks kept attached (disabled between uses) by an engine, by model. Both sides are weak: the
#: hooks live as long as the model does (its modules hold them), and a finished trial's model and
#: hooks are freed together.
_KEPT_HOOKS: WeakKeyDictionary[nn.Module, weakref.ReferenceType[GradSampleHooks]] = WeakKeyDictionary()


class _FrozenBatchNormHooks(GradSampleHooks):
    """Opacus' hooks, recording the inputs of frozen-statistics BatchNorm layers too.

    Opacus records a module's inputs only when the module is in training mode; a frozen
    BatchNorm is in evaluation mode by design (:mod:`dptune.models.batch_norm`). For such a layer
    the flag reads ``True`` during the recording only: its forward has already run, on the
    running statistics, so nothing is computed differently.
    """

    def capture_activations_hook(
        self, module: nn.Module, forward_input: list[torch.Tensor], _forward_output: torch.Tensor
    ) -> None:
        if type(module) not in frozen_batch_norm_types() or batch_norm_refusal(module) is not None:
            super().capture_activations_hook(module, forward_input, _forward_output)
            return
        module.training = True  # this module only, not its children
        try:
            super().capture_activations_hook(module, forward_input, _forward_output)
        finally:
            module.training = False


def _attach(model: nn.Module) -> GradSampleHooks:
    """Opacus' hooks on ``model`` for g_i of a *summed* loss, attached disabled.

    Opacus' ``strict`` mode refuses every trainable module with buffers. It is relaxed only when
    each such module is a BatchNorm with frozen running statistics (its buffers are constants of
    the pretrained model; :mod:`dptune.models.batch_norm`), whose registered grad sampler refuses to
    run on batch statistics.
    """
    with_buffers = [
        module
        for module in model.modules()
        if any(True for _ in module.buffers())  # as Opacus checks: its own and its children's
        and any(p.requires_grad for p in module.parameters(recurse=False))
    ]
    strict = not all(
        type(module) in frozen_batch_norm_types() and batch_norm_refusal(module) is None for module in with_buffers
    )
    hooks = _FrozenBatchNormHooks(model, batch_first=True, loss_reduction="sum", strict=strict)
    hooks.disable_hooks()
    return hooks


def _kept(model: nn.Module) -> GradSampleHooks | None:
    reference = _KEPT_HOOKS.get(model)
    return None if reference is None else reference()


def keep_grad_sample_hooks(model: nn.Module) -> GradSampleHooks:
    """Attach Opacus' hooks to ``model`` for good (disabled until :func:`grad_sample_hooks`)."""
    hooks = _kept(model)
    if hooks is None:
        hooks = _attach(model)
        _KEPT_HOOKS[model] = weakref.ref(hooks)
    return hooks


@contextlib.contextmanager
def grad_sample_hooks(model: nn.Module) -> Iterator[GradSampleHooks]:
    """Opacus' grad-sample hooks active on ``model`` inside the block, inactive after it.

    Inside, each ``loss.backward()`` of a training-mode forward leaves ``p.grad_sample`` of shape
    (n, *p.shape) on every trainable parameter (g_i of the summed loss). Hooks an engine keeps
    (:func:`keep_grad_sample_hooks`) are reused and disabled on exit; otherwise they are attached
    for the block and removed with Opacus' parameter attributes on exit.
    """
    kept = _kept(model)
    hooks = kept if kept is not None else _attach(model)
    hooks.enable_hooks()
    try:
        with warnings.catch_warnings():
            # Opacus' full backward hook on the first trainable layer of a model fed with data
            # (inputs that need no gradient) makes torch warn; per-example gradients are unaffected.
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            yield hooks
    finally:
        hooks.disable_hooks()
        hooks.set_grad_sample_to_none()
        if kept is None:
            hooks.cleanup()


class RuleDPOptimizer(DPOptimizer):
    """Opacus ``DPOptimizer`` whose clip, noise and scale follow a :mod:`dptune.dp.clipping` rule.

    ``max_grad_norm`` is the clip bound C; ``expected_batch_size`` is B = q·N (examples);
    ``noise_multiplier`` is σ. Per-example gradients come from Opacus' grad-sample hooks with
    ``loss_reduction="sum"`` (g_i is one example's gradient).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float,
        clip_bound: float,
        expected_batch_size: float,
        rule: ClippingRule,
        stability: float = AUTO_S_STABILITY,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=clip_bound,
            expected_batch_size=expected_batch_size,  # B = q·N need not be an int
            loss_reduction="mean",
            generator=generator,
        )
        self.rule: ClippingRule = check_rule(rule)
        self.stability = stability

    def clip_and_accumulate(self) -> None:
        """p.summed_grad += Σ_i f_i · g_i with the rule's per-example factors f_i (flat norms)."""
        grad_samples = self.grad_samples
        factors = clip_factors(per_example_norms(grad_samples), self.max_grad_norm, self.rule, self.stability)
        for p, grad_sample in zip(self.params, grad_samples, strict=True):
            check_processed_flag(p.grad_sample)
            grad = torch.einsum("i,i...", factors.to(grad_sample.device, p.dtype), grad_sample.to(p.dtype))
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            mark_as_processed(p.grad_sample)

    def add_noise(self) -> None:
        """p.grad = p.summed_grad + N(0, s² I), s = ``noise_std(σ, C, rule)``.

        A parameter with no accumulated sum (an empty Poisson batch: no backward pass ran) gets
        noise alone, as the mechanism requires.
        """
        std = noise_std(self.noise_multiplier, self.max_grad_norm, self.rule)
        for p in self.params:
            summed = torch.zeros_like(p) if p.summed_grad is None else p.summed_grad
            check_processed_flag(summed)
            noise = generate_noise(std=std, reference=summed, generator=self.generator, secure_mode=self.secure_mode)
            p.grad = (summed + noise).view_as(p)
            mark_as_processed(summed)

    def scale_grad(self) -> None:
        """p.grad *= ``update_scale(C, rule, B)`` (1/B; 1/(C·B) for ``normalized``)."""
        scale = update_scale(self.max_grad_norm, self.rule, self.expected_batch_size)
        for p in self.params:
            p.grad *= scale


def _mean_per_person(params: Iterable[nn.Parameter], persons: PersonRows) -> None:
    """Replace each ``p.grad_sample`` (n, *p.shape; one backward pass's g_i) by the per-person means
    G_u = (1/m_u) Σ_{i ∈ u} g_i, shape (P, *p.shape): the units the rule then clips."""
    for p in params:
        p.grad_sample = persons.mean(p.grad_sample)  # type: ignore[attr-defined]  # Opacus' attribute


class OpacusEngine:
    """DP step gradient with Opacus hooks and :class:`~dptune.dp.optimizers.RuleDPOptimizer`.

    Keeps Opacus' hooks on ``model`` (disabled outside :meth:`noisy_gradient`). Per physical
    batch: forward (under autocast when ``spec.autocast_dtype``), backward of the
    summed loss, ``clip_and_accumulate`` (Σ f_i g_i into ``p.summed_grad``), free the per-example
    gradients. After the last one: ``add_noise`` and ``scale_grad`` leave the released gradient
    in ``p.grad`` — Opacus' own pre-step split over physical batches, as its
    ``BatchMemoryManager`` does it.

    Person-level (``spec.person_level``; McMahan et al. 2018, Levy et al. 2021): before
    ``clip_and_accumulate`` each ``p.grad_sample`` (n, *p.shape) is replaced by its per-person means
    G_u (P, *p.shape), so the rule clips people, not rows; B = ``spec.expected_batch_size`` is
    q·N_people, Opacus' expected batch size and the divisor of ``scale_grad``.
    """

    name = "opacus"

    def __init__(self, model: nn.Module, spec: DPStepSpec, generator: torch.Generator) -> None:
        self.model = model
        self.spec = spec
        # Opacus' DPOptimizer reads the parameters off the optimizer it wraps; this one is never
        # stepped (the trial's optimizer is), so it is torch's bare Optimizer: parameters, no rule.
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.dp_optimizer = RuleDPOptimizer(
            torch.optim.Optimizer(trainable, defaults={}),
            noise_multiplier=spec.noise_multiplier,
            clip_bound=spec.clip_bound,
            expected_batch_size=spec.expected_batch_size,
            rule=spec.rule,
            generator=generator,
        )
        self._device_type = self.dp_optimizer.params[0].device.type
        self._hooks = keep_grad_sample_hooks(model)

    def noisy_gradient(self, physical_batches: Iterable[PhysicalBatch]) -> float:
        """Set ``p.grad`` to the rule's released gradient of one Poisson batch; return Σ_i ℓ_i."""
        self.dp_optimizer.zero_grad(set_to_none=True)  # clears the previous step's summed_grad
        losses: list[torch.Tensor] = []
        with grad_sample_hooks(self.model) as hooks:
            for batch in physical_batches:
                inputs, labels, persons = unpack(batch, self.spec.person_level)
                with autocast(self._device_type, self.spec.autocast_dtype):
                    logits = self.model(*inputs)
                loss = summed_cross_entropy(logits, labels)
                loss.backward()
                losses.append(loss.detach())
                if persons is not None:
                    _mean_per_person(self.dp_optimizer.params, persons)
                self.dp_optimizer.clip_and_accumulate()
                hooks.set_grad_sample_to_none()
        self.dp_optimizer.add_noise()
        self.dp_optimizer.scale_grad()
        return float(torch.stack(losses).sum()) if losses else 0.0  # one device sync per step
