"""BatchNorm with frozen running statistics: when DP training accepts it, and its per-example
gradients.

In training mode BatchNorm normalises each example with the mean and variance of the *batch*, so
example i's output (and gradient) depends on every other example of the batch: per-example
clipping then bounds nothing, and DP training refuses it. In evaluation mode, with running
statistics μ, v (per channel c, computed on the public pretraining data and never updated), it is
a fixed per-channel affine map of each example on its own::

    y_{i,c,s} = act(γ_c · x̂_{i,c,s} + β_c),      x̂_{i,c,s} = (x_{i,c,s} − μ_c) / √(v_c + eps)

(s runs over spatial positions; ``act`` is the identity for a plain BatchNorm and timm's fused
activation for ``BatchNormAct2d``). Its scale γ and shift β then have ordinary per-example
gradients, with δ_i = ∂ℓ_i/∂(γ x̂ + β) the gradient at the pre-activation output::

    ∇_γ ℓ_i = Σ_s x̂_{i,·,s} ⊙ δ_{i,·,s}        ∇_β ℓ_i = Σ_s δ_{i,·,s}

so FiLM on it is as private as FiLM on LayerNorm. dptune accepts a BatchNorm under DP exactly when
it normalises with running statistics (evaluation mode, ``track_running_stats`` with buffers
present) — :class:`dptune.models.Classifier` holds every BatchNorm in evaluation mode for the
whole trial, even under ``train()`` — and, when it is trained, its type is one of
:func:`frozen_batch_norm_types` (matched exactly: a subclass may change the forward).
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


@cache
def frozen_batch_norm_types() -> tuple[type[_BatchNorm], ...]:
    """BatchNorm types whose per-example γ/β gradients :func:`frozen_batch_norm_terms` computes:
    torch's ``BatchNorm1d/2d/3d`` and timm's ``BatchNormAct2d`` (timm is imported on the first
    call, not with this module: a model without BatchNorm never needs it)."""
    from timm.layers import BatchNormAct2d

    return nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, BatchNormAct2d


def uses_batch_statistics(module: _BatchNorm) -> bool:
    """True when ``module``'s forward normalises with the batch's statistics (mixing examples):
    in training mode, or in any mode when it keeps no running statistics."""
    return module.training or module.running_mean is None or module.running_var is None


def batch_norm_refusal(module: nn.Module) -> str | None:
    """Why DP training cannot accept the BatchNorm ``module`` as it is now (``None``: it can).

    Not a BatchNorm: ``None``. Refused: a BatchNorm that normalises with batch statistics, and a
    trained one whose exact type has no per-example gradient rule here.
    """
    if not isinstance(module, _BatchNorm):
        return None
    if module.training:
        return "in training mode (batch statistics)"
    if module.running_mean is None or module.running_var is None:
        return "without running statistics (track_running_stats=False: batch statistics in every mode)"
    trained = any(p.requires_grad for p in module.parameters(recurse=False))
    if trained and type(module) not in frozen_batch_norm_types():
        supported = ", ".join(t.__name__ for t in frozen_batch_norm_types())
        return f"of type {type(module).__name__}, which has no per-example gradient rule (supported: {supported})"
    return None


def hold_batch_norm_in_eval(model: nn.Module) -> None:
    """Put every BatchNorm of ``model`` in evaluation mode (running statistics used, never updated)."""
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            module.eval()


def frozen_batch_norm_terms(
    module: _BatchNorm, layer_input: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x̂, δ) of one call of a frozen-statistics BatchNorm, float32, shape (n, C, positions).

    ``layer_input`` is the module's input x, ``grad_output`` the gradient at its output (after the
    fused activation of ``BatchNormAct2d``); δ is pulled back through that activation at the
    recomputed pre-activation γ x̂ + β. Per-example gradients: ∇_γ = Σ_s x̂ δ, ∇_β = Σ_s δ.
    Raises ``RuntimeError`` for a module that uses batch statistics.
    """
    if uses_batch_statistics(module) or module.running_mean is None or module.running_var is None:
        raise RuntimeError(
            f"{type(module).__name__} ran with batch statistics during a DP step: per-example "
            f"gradients do not exist; hold it in evaluation mode (dptune.models.Classifier does)"
        )
    n, channels = layer_input.shape[:2]
    shape = (1, channels) + (1,) * (layer_input.dim() - 2)
    mean = module.running_mean.float().view(shape)
    inv_std = torch.rsqrt(module.running_var.float().view(shape) + module.eps)
    x_hat = (layer_input.float() - mean) * inv_std
    delta = grad_output.float()
    if (
        type(module).__name__ == "BatchNormAct2d"
        and type(module) in frozen_batch_norm_types()
        and not (isinstance(module.act, nn.Identity) and isinstance(module.drop, nn.Identity))
    ):
        act, drop = module.get_submodule("act"), module.get_submodule("drop")
        # A BatchNorm's weight and bias are parameters, or None when it is not affine.
        weight = module.weight.float().view(shape) if isinstance(module.weight, nn.Parameter) else 1.0
        bias = module.bias.float().view(shape) if isinstance(module.bias, nn.Parameter) else 0.0
        with torch.enable_grad():  # a backward pass runs with grad mode off
            pre_activation = (x_hat * weight + bias).detach().requires_grad_(True)
            output = act(drop(pre_activation.clone()))  # clone: the act may be in place
            (delta,) = torch.autograd.grad(output, pre_activation, delta)
    return x_hat.reshape(n, channels, -1), delta.reshape(n, channels, -1)


def compute_frozen_batch_norm_grad_sample(
    layer: _BatchNorm, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Opacus grad sampler for :func:`frozen_batch_norm_types` (summed loss, batch first)."""
    x_hat, delta = frozen_batch_norm_terms(layer, activations[0], backprops)
    grad_sample: dict[nn.Parameter, torch.Tensor] = {}
    # A BatchNorm's weight and bias are parameters, or None when it is not affine.
    if isinstance(layer.weight, nn.Parameter) and layer.weight.requires_grad:
        grad_sample[layer.weight] = torch.linalg.vecdot(x_hat, delta, dim=2).to(layer.weight.dtype)
    if isinstance(layer.bias, nn.Parameter) and layer.bias.requires_grad:
        grad_sample[layer.bias] = delta.sum(2).to(layer.bias.dtype)
    return grad_sample
