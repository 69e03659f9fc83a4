"""Make Opacus use its fast per-sample-gradient hooks for timm's normalisation layers.

Opacus picks a grad sampler by the *exact* module type. timm's ``LayerNorm`` subclasses
``nn.LayerNorm`` (same maths, ``F.layer_norm`` over the last dimension) but is not registered,
so Opacus silently falls back to functorch (vmap) for every ViT norm layer — the slow path.
Registering Opacus' own ``nn.LayerNorm`` sampler for it restores the hooks.
"""

from __future__ import annotations

from opacus.grad_sample import register_grad_sampler
from opacus.grad_sample.layer_norm import compute_layer_norm_grad_sample


def register_opacus_grad_samplers() -> None:
    """Register Opacus' LayerNorm grad sampler for timm's ``LayerNorm`` (idempotent)."""
    from timm.layers import LayerNorm as TimmLayerNorm

    register_grad_sampler(TimmLayerNorm)(compute_layer_norm_grad_sample)
