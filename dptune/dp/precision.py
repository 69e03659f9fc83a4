"""Mixed precision of a DP step's forward pass, shared by every engine, the diagnostics and evaluation."""

from __future__ import annotations

import contextlib

import torch


def autocast(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
    """``torch.autocast`` to ``dtype`` on ``device_type``, or no autocast when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
