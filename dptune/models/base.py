"""Types shared by the model registry: :class:`BackboneInfo` and :class:`ModelError`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch import nn

from dptune.errors import DptuneError

WEIGHTS_ENV = "DPTUNE_WEIGHTS_DIR"
"""Folder of locally provided pretrained weights: ``<dir>/<backbone>.safetensors`` (or ``.pth``)
for timm backbones, ``<dir>/<backbone>/`` (a ``save_pretrained`` folder) for Hugging Face ones."""


class ModelError(DptuneError, ValueError):
    """A model cannot be built or used as asked: unknown backbone/PEFT, a PEFT the backbone does
    not support, weights that cannot be had, or a module that DP-SGD cannot train. The message
    names the problem and the valid choices or the way to provide what is missing."""


@dataclass(frozen=True)
class BackboneInfo:
    """One backbone of the registry.

    ``create(pretrained, image_size)`` (``image_size`` already resolved: the caller's or
    ``self.image_size``; None for text) returns the feature extractor: preprocessing + encoder +
    pooling, ``forward(*inputs) -> (n, feature_dim)`` float32. Image extractors take uint8 or
    float ``(n, 1|3, H, W)`` in [0, 255] and resize to ``image_size`` px themselves; text
    extractors take ``(input_ids, attention_mask)`` and mean-pool the last hidden state over
    the attention mask. ``lora_targets`` are the module-name suffixes of the attention
    projections LoRA adapts (empty: no attention, LoRA refused). ``weights`` says where the
    pretrained weights come from and how to provide them offline; ``has_pretrained_weights`` is
    False for backbones trained from scratch (``pretrained`` is then ignored). ``weight_source()``,
    where given, returns the local folder the pretrained weights load from (``None`` when they
    come from elsewhere): the feature cache then identifies the weights by its files, without
    building the model. ``pooling`` describes how a text backbone's hidden states become its
    features where that is not the attention-mask mean (the feature cache's key says it).
    """

    name: str
    modality: Literal["text", "image"]
    feature_dim: int
    create: Callable[[bool, int | None], nn.Module]
    weights: str
    image_size: int | None = None
    max_tokens: int | None = None
    tokenizer: Callable[[], Any] | None = None
    lora_targets: tuple[str, ...] = ()
    has_pretrained_weights: bool = True
    weight_source: Callable[[], Path | None] | None = None
    pooling: str | None = None


def offline() -> bool:
    """True when the Hugging Face hub must not be contacted (``HF_HUB_OFFLINE`` or
    ``TRANSFORMERS_OFFLINE`` set truthy), read at call time so that a failure is immediate
    instead of a minute of retries."""
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(flag.strip().lower() in {"1", "true", "yes", "on"} for flag in flags)


def local_weights(name: str, suffixes: tuple[str, ...]) -> Path | None:
    """Return ``$DPTUNE_WEIGHTS_DIR/<name><suffix>`` for the first suffix that exists, else None."""
    root = os.environ.get(WEIGHTS_ENV)
    if not root:
        return None
    for suffix in suffixes:
        candidate = Path(root).expanduser() / f"{name}{suffix}"
        if candidate.exists():
            return candidate
    return None
