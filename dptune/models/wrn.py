"""WideResNet-16-4 with GroupNorm (Zagoruyko & Komodakis 2016; De et al. 2022 for DP).

GroupNorm replaces BatchNorm because BatchNorm mixes the examples of a batch, which breaks
per-example gradient clipping (and so DP). Trained from scratch: there are no pretrained weights.
"""

from __future__ import annotations

import torch
from torch import nn


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(groups, channels), channels)


class _Block(nn.Module):
    """Pre-activation basic block: GN-ReLU-conv3x3-GN-ReLU-conv3x3 plus a (1x1 conv) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, groups: int) -> None:
        super().__init__()
        self.norm1 = _norm(in_channels, groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.norm2 = _norm(out_channels, groups)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.shortcut = (
            nn.Conv2d(in_channels, out_channels, 1, stride, bias=False)
            if stride != 1 or in_channels != out_channels
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(torch.relu(self.norm1(x)))
        out = self.conv2(torch.relu(self.norm2(out)))
        return out + self.shortcut(x)


class WideResNet(nn.Module):
    """WRN-depth-width for 32x32 inputs; ``forward`` returns pooled features of size ``64*width``.

    ``depth = 6n + 4`` (n blocks per stage, three stages of widths 16k, 32k, 64k).
    """

    def __init__(self, depth: int = 16, width: int = 4, groups: int = 16) -> None:
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"WideResNet depth must be 6n+4, got {depth}")
        blocks_per_stage = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)]
        for stage in range(3):
            for block in range(blocks_per_stage):
                layers.append(
                    _Block(
                        widths[stage] if block == 0 else widths[stage + 1],
                        widths[stage + 1],
                        stride=2 if stage > 0 and block == 0 else 1,
                        groups=groups,
                    )
                )
        layers += [_norm(widths[-1], groups), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.num_features = widths[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)
