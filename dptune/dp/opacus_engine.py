"""The Opacus engine: per-example gradients from Opacus' grad-sample hooks, any supported model.

Attaching Opacus' hooks walks the module tree several times (≈ 7 ms for a ViT on a CPU core, a
third of a ViT-Ti step on a GPU), so :class:`OpacusEngine` attaches them once and keeps them
*disabled* outside its step: the model then computes exactly as a plain module. The diagnostics
enter the same hooks through :func:`grad_sample_hooks`, which attaches them for the duration
only when no engine keeps them.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator
from weakref import WeakKeyDictionary

import torch
from opacus.grad_sample import GradSampleHooks
from torch import nn

from dptune.dp.batch_norm import FROZEN_BATCH_NORM_TYPES, batch_norm_refusal
from dptune.dp.engine import DPStepSpec, PhysicalBatch, summed_cross_entropy
from dptune.dp.optimizers import RuleDPOptimizer
from dptune.dp.precision import autocast

#: Hooks kept attached (disabled between uses) by an engine, by model. Both sides are weak: the
#: hooks live as long as the model does (its modules hold them), and a finished trial's model and
#: hooks are freed together.
_KEPT_HOOKS: WeakKeyDictionary[nn.Module, weakref.ReferenceType[GradSampleHooks]] = WeakKeyDictionary()


class _FrozenBatchNormHooks(GradSampleHooks):
    """Opacus' hooks, recording the inputs of frozen-statistics BatchNorm layers too.

    Opacus records a module's inputs only when the module is in training mode; a frozen
    BatchNorm is in evaluation mode by design (:mod:`dptune.dp.batch_norm`). For such a layer
    the flag reads ``True`` during the recording only: its forward has already run, on the
    running statistics, so nothing is computed differently.
    """

    def capture_activations_hook(
        self, module: nn.Module, forward_input: list[torch.Tensor], _forward_output: torch.Tensor
    ) -> None:
        if type(module) not in FROZEN_BATCH_NORM_TYPES or batch_norm_refusal(module) is not None:
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
    the pretrained model; :mod:`dptune.dp.batch_norm`), whose registered grad sampler refuses to
    run on batch statistics.
    """
    with_buffers = [
        module
        for module in model.modules()
        if any(True for _ in module.buffers())  # as Opacus checks: its own and its children's
        and any(p.requires_grad for p in module.parameters(recurse=False))
    ]
    strict = not all(
        type(module) in FROZEN_BATCH_NORM_TYPES and batch_norm_refusal(module) is None for module in with_buffers
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


class OpacusEngine:
    """DP step gradient with Opacus hooks and :class:`~dptune.dp.optimizers.RuleDPOptimizer`.

    Keeps Opacus' hooks on ``model`` (disabled outside :meth:`noisy_gradient`). Per physical
    batch: forward (under autocast when ``spec.autocast_dtype``), backward of the
    summed loss, ``clip_and_accumulate`` (Σ f_i g_i into ``p.summed_grad``), free the per-example
    gradients. After the last one: ``add_noise`` and ``scale_grad`` leave the released gradient
    in ``p.grad`` — Opacus' own pre-step split over physical batches, as its
    ``BatchMemoryManager`` does it.
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
            for *inputs, labels in physical_batches:
                with autocast(self._device_type, self.spec.autocast_dtype):
                    logits = self.model(*inputs)
                loss = summed_cross_entropy(logits, labels)
                loss.backward()
                losses.append(loss.detach())
                self.dp_optimizer.clip_and_accumulate()
                hooks.set_grad_sample_to_none()
        self.dp_optimizer.add_noise()
        self.dp_optimizer.scale_grad()
        return float(torch.stack(losses).sum()) if losses else 0.0  # one device sync per step
