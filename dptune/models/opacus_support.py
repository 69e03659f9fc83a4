"""Make Opacus use its fast per-sample-gradient hooks for timm's normalisation layers and for
BatchNorm with frozen running statistics.

Opacus picks a grad sampler by the *exact* module type. timm's ``LayerNorm`` subclasses
``nn.LayerNorm`` (same maths, ``F.layer_norm`` over the last dimension) but is not registered,
so Opacus silently falls back to functorch (vmap) for every ViT norm layer — the slow path.
Registering Opacus' own ``nn.LayerNorm`` sampler for it restores the hooks. Opacus has no
BatchNorm sampler at all (it refuses BatchNorm); dptune registers the frozen-statistics rule of
:mod:`dptune.dp.batch_norm`, which itself refuses a BatchNorm that uses batch statistics.
"""

from __future__ import annotations

from opacus.grad_sample import register_grad_sampler
from opacus.grad_sample.layer_norm import compute_layer_norm_grad_sample

from dptune.dp.batch_norm import FROZEN_BATCH_NORM_TYPES, compute_frozen_batch_norm_grad_sample


def register_opacus_grad_samplers() -> None:
    """Register Opacus' LayerNorm grad sampler for timm's ``LayerNorm`` and dptune's frozen
    BatchNorm sampler for :data:`~dptune.dp.batch_norm.FROZEN_BATCH_NORM_TYPES` (idempotent)."""
    from timm.layers import LayerNorm as TimmLayerNorm

    register_grad_sampler(TimmLayerNorm)(compute_layer_norm_grad_sample)
    register_grad_sampler(list(FROZEN_BATCH_NORM_TYPES))(compute_frozen_batch_norm_grad_sample)
