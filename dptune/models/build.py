"""``build_model``: backbone × PEFT × classes → a classifier with exactly the PEFT's parameters
trainable; DP compatibility check; parameter counting."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dptune.models.backbones import get_backbone
from dptune.models.base import BackboneInfo, ModelError
from dptune.models.batch_norm import batch_norm_refusal, hold_batch_norm_in_eval
from dptune.models.peft import PEFTS, lora_unsupported


class Classifier(nn.Module):
    """``head(backbone(*inputs))``: a feature extractor and a zero-initialised linear head.

    Zero initialisation makes the first logits uniform and the head independent of the seed
    (common practice in DP transfer learning). When no backbone parameter is trainable the
    backbone is a fixed feature map: it stays in eval mode even under ``train()``, so dropout
    is off and normalisation statistics are never updated — the same map as cached features.
    Every BatchNorm stays in eval mode too, whatever is trained: it normalises with its running
    statistics (the pretraining data's), which private data never updates, so it is a fixed
    per-channel affine map of each example and its γ, β have per-example gradients
    (:mod:`dptune.models.batch_norm`).
    """

    def __init__(self, backbone: nn.Module, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = new_head(feature_dim, num_classes)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(*inputs))

    def train(self, mode: bool = True) -> Classifier:
        super().train(mode)
        if not any(p.requires_grad for p in self.backbone.parameters()):
            self.backbone.eval()
        hold_batch_norm_in_eval(self)
        return self


def new_head(feature_dim: int, num_classes: int) -> nn.Linear:
    """A zero-initialised ``nn.Linear(feature_dim, num_classes)``."""
    head = nn.Linear(feature_dim, num_classes)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def build_feature_extractor(backbone: str, *, pretrained: bool = True, image_size: int | None = None) -> nn.Module:
    """The frozen-or-not feature extractor of ``backbone``: ``forward(*inputs) -> (n, feature_dim)``.

    ``image_size`` (px, image backbones only) overrides the backbone's default input side
    ``BACKBONES[backbone].image_size``.
    Raises :class:`ModelError` for an unknown name or weights that cannot be had.
    """
    info = get_backbone(backbone)
    _check_image_size(info.name, info.modality, image_size)
    return info.create(pretrained, image_size or info.image_size)


def build_model(
    backbone: str,
    peft: str,
    num_classes: int,
    *,
    feature_input: bool = False,
    pretrained: bool = True,
    image_size: int | None = None,
) -> nn.Module:
    """Build the classifier for ``backbone`` fine-tuned with ``peft`` over ``num_classes`` classes.

    ``forward(*inputs)`` returns logits ``(n, num_classes)`` for the inputs ``dptune.data``
    yields. With ``feature_input=True`` (only for ``peft="head"``) the model is a zero-initialised
    ``nn.Linear(feature_dim, num_classes)`` applied to cached backbone features. Exactly the
    PEFT's parameters have ``requires_grad`` (see ``dptune.models``). All names and values are
    checked (:func:`check_model_request`) before any weights are loaded.
    """
    info = check_model_request(backbone, peft, num_classes, feature_input=feature_input, image_size=image_size)
    if feature_input:
        return new_head(info.feature_dim, num_classes)
    model = Classifier(info.create(pretrained, image_size or info.image_size), info.feature_dim, num_classes)
    PEFTS[peft](model, info)
    return model.train()  # the mode DP training runs in: BatchNorm held in eval mode


def check_model_request(
    backbone: str,
    peft: str,
    num_classes: int = 2,
    *,
    feature_input: bool = False,
    image_size: int | None = None,
) -> BackboneInfo:
    """Validate a :func:`build_model` request without building anything; return the backbone.

    Raises :class:`ModelError` naming the problem and the valid choices: unknown backbone or
    PEFT, fewer than 2 classes, ``feature_input`` with a PEFT other than ``head``, LoRA on a
    backbone without attention, ``image_size`` on a text backbone or below 16 px.
    """
    info = get_backbone(backbone)
    if peft not in PEFTS:
        raise ModelError(f"unknown peft {peft!r}; choose one of {sorted(PEFTS)}")
    if num_classes < 2:
        raise ModelError(f"num_classes must be >= 2 for a classifier, got {num_classes}")
    if feature_input and peft != "head":
        raise ModelError(
            f"feature_input=True means a linear head on cached features, which is peft 'head'; "
            f"got peft {peft!r} (use feature_input=False to fine-tune the backbone)"
        )
    if peft == "lora" and not info.lora_targets:
        raise ModelError(lora_unsupported(info.name))
    _check_image_size(info.name, info.modality, image_size)
    return info


def load_tokenizer(backbone: str) -> Any:
    """The Hugging Face tokenizer of a text backbone (offline for ``minilm``)."""
    info = get_backbone(backbone)
    if info.tokenizer is None:
        raise ModelError(f"backbone {backbone!r} takes images, it has no tokenizer")
    return info.tokenizer()


def trainable_parameter_count(model: nn.Module) -> int:
    """d: the number of scalar parameters with ``requires_grad`` (the dimension DP noise lives in)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_dp_compatible(model: nn.Module) -> None:
    """Raise :class:`ModelError` unless DP-SGD can train ``model`` example by example.

    Checked in training mode (``model.train()``, what DP training runs). Refused: a BatchNorm that
    normalises with batch statistics — in training mode, or without running statistics — since
    they mix the examples of a batch, so a per-example gradient is not a function of one example
    and clipping bounds nothing; a trained BatchNorm of a type without a per-example rule
    (:func:`dptune.models.batch_norm.batch_norm_refusal`); a model with no trainable parameter;
    anything Opacus' ``ModuleValidator`` rejects among the trainable modules (its blanket
    BatchNorm refusal aside). Accepted: a BatchNorm held in evaluation mode with running
    statistics, trained (FiLM, full) or not, as :class:`Classifier` holds every BatchNorm.
    """
    from opacus.validators import ModuleValidator

    was_training = model.training
    model.train()  # what DP training will run; Opacus validates training-mode models only
    try:
        batch_norms = [
            f"{name} {reason}"
            for name, module in model.named_modules()
            if (reason := batch_norm_refusal(module)) is not None
        ]
        opacus_errors = [
            error
            for module in model.modules()
            if not isinstance(module, _BatchNorm)  # accepted above when frozen
            and any(p.requires_grad for p in module.parameters(recurse=False))
            and type(module) in ModuleValidator.VALIDATORS
            for error in ModuleValidator.VALIDATORS[type(module)](module)
        ]
    finally:
        model.train(was_training)
    if batch_norms:
        shown = ", ".join(batch_norms[:3]) + (f" and {len(batch_norms) - 3} more" if len(batch_norms) > 3 else "")
        raise ModelError(
            f"BatchNorm cannot be trained under DP: its batch statistics mix examples, so "
            f"per-example clipping does not bound one example's influence ({len(batch_norms)} "
            f"layers: {shown}). BatchNorm is accepted only with its running statistics frozen "
            f"(evaluation mode for the whole trial, as dptune.models.Classifier holds it), where "
            f"it is a fixed per-channel affine map of each example. Otherwise use a backbone with "
            f"GroupNorm/LayerNorm (e.g. wrn16_4, ViT), or peft 'head' (frozen backbone, e.g. on "
            f"cached features)"
        )
    if trainable_parameter_count(model) == 0:
        raise ModelError("model has no trainable parameter; nothing to fine-tune")
    if opacus_errors:
        raise ModelError("Opacus cannot compute per-example gradients: " + "; ".join(map(str, opacus_errors)))


def _check_image_size(backbone: str, modality: str, image_size: int | None) -> None:
    if image_size is None:
        return
    if modality != "image":
        raise ModelError(f"image_size applies to image backbones; {backbone!r} takes text")
    if image_size < 16:
        raise ModelError(f"image_size must be >= 16 px, got {image_size}")
