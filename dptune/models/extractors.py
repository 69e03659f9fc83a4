"""The feature extractors' building blocks, shared by the registry (:mod:`dptune.models.backbones`)
and a team's own backbones (:mod:`dptune.models.own`): image preprocessing, a transformer encoder's
pooling, and a timm network behind its normalisation."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn


class ImagePreprocess(nn.Module):
    """uint8/float images in [0, 255], ``(n, 1|3, H, W)`` → normalised float ``(n, 3, s, s)``.

    Grey images are replicated to three channels; a different resolution is resized with
    antialiased bilinear interpolation to ``image_size`` = s px; then
    ``(x/255 - mean)/std`` per channel. No parameters (invisible to DP).
    """

    mean: torch.Tensor  # (1, 3, 1, 1) buffers
    std: torch.Tensor

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.image_size = image_size
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float()
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", antialias=True)
        return (x / 255.0 - self.mean) / self.std


class TextEncoder(nn.Module):
    """A transformer encoder followed by a pooling of its last hidden state ``h``, in float32 whatever
    the encoder's dtype: ``mean`` weights it by the attention mask ``m`` (sentence-transformers'
    pooling), ``Σ_t m_t h_t / max(Σ_t m_t, 1e-9)``; ``cls`` takes the first token's ``h_0``."""

    def __init__(self, transformer: nn.Module, pooling: Literal["mean", "cls"] = "mean") -> None:
        super().__init__()
        self.transformer = transformer
        self.pooling = pooling

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
        if self.pooling == "cls":
            return hidden[:, 0]
        mask = attention_mask.unsqueeze(-1).float()
        summed = (hidden * mask).sum(dim=1)
        return summed / mask.sum(dim=1).clamp_min(1e-9)


def image_extractor(net: nn.Module, image_size: int, mean: Sequence[float], std: Sequence[float]) -> nn.Module:
    return nn.Sequential(OrderedDict(preprocess=ImagePreprocess(image_size, mean, std), net=net))


def timm_extractor(net: nn.Module, image_size: int) -> nn.Module:
    """The timm model ``net`` behind the normalisation of its pretrained configuration (mean, std)."""
    # timm.create_model is annotated nn.Module, but every model it creates carries its pretrained_cfg dict.
    cfg = cast(dict[str, Any], net.pretrained_cfg)
    return image_extractor(net, image_size, cfg["mean"], cfg["std"])
