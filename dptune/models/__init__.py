"""Backbones and parameter-efficient fine-tuning (PEFT) for DP trials.

Public API::

    model = build_model("vit_tiny_patch16_224.augreg_in21k", "film", num_classes=100)
    logits = model(*inputs)                       # inputs as dptune.data yields them
    trainable_parameter_count(model)              # d, the dimension DP noise is added in
    check_dp_compatible(model)                    # ModelError if BatchNorm would use batch statistics

``build_model(backbone, peft, num_classes, feature_input=True)`` with ``peft == "head"`` is a
plain ``nn.Linear(feature_dim, num_classes)`` on cached features (see ``dptune.data``).
Otherwise the model is :class:`Classifier`: ``backbone`` (preprocessing + encoder + pooling,
``forward(*inputs) -> (n, feature_dim)``) then ``head`` (``nn.Linear``, zero-initialised).
Exactly the PEFT's parameters have ``requires_grad``:

- ``head``: the classifier only;
- ``film``: the scale and bias of every LayerNorm/GroupNorm/BatchNorm (the FiLM parameters of
  Tobaben et al.) plus the head;
- ``lora``: LoRA adapters (``peft`` library) on the attention query and value projections,
  plus the head;
- ``full``: everything.

BatchNorm under DP: accepted exactly when it normalises with its running statistics (evaluation
mode, buffers present). :class:`Classifier` holds every BatchNorm in evaluation mode for the whole
trial, even under ``train()``, so the statistics of the pretraining data are used and never
updated from private data; each BatchNorm is then a fixed per-channel affine map of each example,
and its γ, β (FiLM, or ``full``) have per-example gradients (:mod:`dptune.models.batch_norm`). A
BatchNorm in training mode (batch statistics mix the examples of a batch) or without running
statistics is refused by :func:`check_dp_compatible`.

Opacus: importing this package registers Opacus' LayerNorm per-sample-gradient rule for
timm's ``LayerNorm`` subclass (Opacus matches grad samplers by exact type and would otherwise
fall back to slow functorch for every ViT norm layer), and dptune's frozen-statistics BatchNorm
sampler (Opacus itself has none). Full fine-tuning of a timm ViT still
vmaps the whole model, because ``cls_token``/``pos_embed`` live on the root module: prefer
FiLM or LoRA for ViTs under DP.

Registries ``BACKBONES`` and ``PEFTS`` are the one place to add a backbone or a PEFT method; a
team's own backbone (a ``save_pretrained`` folder, a timm architecture with its weights file) is
named in the space instead (:mod:`dptune.models.own`), and ``get_backbone`` resolves both.
"""

from dptune.models.backbones import BACKBONES, get_backbone, list_backbones
from dptune.models.base import BackboneInfo, ModelError
from dptune.models.build import (
    Classifier,
    build_feature_extractor,
    build_model,
    check_dp_compatible,
    check_model_request,
    load_tokenizer,
    new_head,
    trainable_parameter_count,
)
from dptune.models.opacus_support import register_opacus_grad_samplers
from dptune.models.peft import PEFTS

__all__ = [
    "BACKBONES",
    "PEFTS",
    "BackboneInfo",
    "Classifier",
    "ModelError",
    "build_feature_extractor",
    "build_model",
    "check_dp_compatible",
    "check_model_request",
    "get_backbone",
    "list_backbones",
    "load_tokenizer",
    "new_head",
    "register_opacus_grad_samplers",
    "trainable_parameter_count",
]
