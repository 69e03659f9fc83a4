"""The PEFT registry ``PEFTS``: which parameters of a :class:`Classifier` are trained.

Each entry ``apply(model, info)`` freezes the model, then unfreezes exactly its parameters
(LoRA first injects its adapters). The head is always trained.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from dptune.contract import PEFT_NAMES, check_registry
from dptune.models.base import BackboneInfo, ModelError

NORM_LAYERS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, _NormBase)
"""Normalisation layers whose affine scale/bias FiLM trains (``_NormBase`` = BatchNorm and
InstanceNorm). A BatchNorm is trained with its running statistics frozen (``Classifier`` holds
it in eval mode); one that would use batch statistics is refused by :func:`check_dp_compatible`."""

LORA_RANK = 8
LORA_ALPHA = 8  # scaling alpha/rank = 1


def _freeze_all_but_head(model: nn.Module) -> None:
    model.requires_grad_(False)
    model.head.requires_grad_(True)


def head_only(model: nn.Module, info: BackboneInfo) -> None:
    """Train the linear classifier only; the backbone is a fixed feature map."""
    _freeze_all_but_head(model)


def film(model: nn.Module, info: BackboneInfo) -> None:
    """FiLM: train the scale and bias of every normalisation layer of the backbone plus the head."""
    _freeze_all_but_head(model)
    norms = [
        m
        for m in model.get_submodule("backbone").modules()
        if isinstance(m, NORM_LAYERS) and any(True for _ in m.parameters(recurse=False))
    ]
    if not norms:
        raise ModelError(f"peft 'film' needs affine normalisation layers; backbone {info.name!r} has none")
    for module in norms:
        module.requires_grad_(True)


def lora(model: nn.Module, info: BackboneInfo) -> None:
    """LoRA (Hu et al. 2022): rank-``LORA_RANK`` adapters ``W + (α/r)·B·A`` on the attention
    projections ``info.lora_targets`` (B zero-initialised), plus the head."""
    from peft import LoraConfig, inject_adapter_in_model

    if not info.lora_targets:
        raise ModelError(lora_unsupported(info.name))
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(info.lora_targets))
    model.backbone = inject_adapter_in_model(config, model.get_submodule("backbone"))
    _freeze_all_but_head(model)
    for name, parameter in model.get_submodule("backbone").named_parameters():
        parameter.requires_grad_("lora_" in name)


def full(model: nn.Module, info: BackboneInfo) -> None:
    """Train every parameter."""
    model.requires_grad_(True)


def lora_unsupported(backbone: str) -> str:
    from dptune.models.backbones import BACKBONES

    supported = sorted(name for name, info in BACKBONES.items() if info.lora_targets)
    return (
        f"peft 'lora' adapts attention projections and backbone {backbone!r} has no attention; "
        f"use it with one of {supported}, or pick peft 'film', 'head' or 'full'"
    )


#: PEFT methods by name: the implementations of ``dptune.contract.PEFT_NAMES``, in its order.
PEFTS: dict[str, Callable[[nn.Module, BackboneInfo], None]] = check_registry(
    "PEFT",
    PEFT_NAMES,
    {
        "head": head_only,
        "film": film,
        "lora": lora,
        "full": full,
    },
)
