"""Make Opacus use its fast per-sample-gradient hooks for timm's normalisation layers and for
BatchNorm with frozen running statistics.

Opacus picks a grad sampler by the *exact* module type. timm's ``LayerNorm`` subclasses
``nn.LayerNorm`` (same maths, ``F.layer_norm`` over the last dimension) but is not registered,
so Opacus silently falls back to functorch (vmap) for every ViT norm layer — the slow path.
Registering Opacus' own ``nn.LayerNorm`` sampler for it restores the hooks. Opacus has no
BatchNorm sampler at all (it refuses BatchNorm); dptune registers the frozen-statistics rule of
:mod:`dptune.models.batch_norm`, which itself refuses a BatchNorm that uses batch statistics.
"""

from __future__ import annotations

from dptune.models.batch_norm import compute_frozen_batch_norm_grad_sample, frozen_batch_norm_types


def register_opacus_grad_samplers() -> None:
    """Register Opacus' LayerNorm grad sampler for timm's ``LayerNorm`` and dptune's frozen
    BatchNorm sampler for :func:`~dptune.models.batch_norm.frozen_batch_norm_types` (idempotent).

    :mod:`dptune.dp.opacus_engine` calls it when imported (Opacus and timm are imported here, not
    with :mod:`dptune.models`); code that wraps a model in Opacus' ``GradSampleModule`` itself calls it first.
    """
    from opacus.grad_sample import register_grad_sampler
    from opacus.grad_sample.layer_norm import compute_layer_norm_grad_sample
    from timm.layers import LayerNorm as TimmLayerNorm

    register_grad_sampler(TimmLayerNorm)(compute_layer_norm_grad_sample)
    register_grad_sampler(list(frozen_batch_norm_types()))(compute_frozen_batch_norm_grad_sample)
