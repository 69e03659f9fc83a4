"""Poisson sampling, as the accountant assumes it, and physical batches bounded for memory.

Every step's batch includes each of the N training examples independently with probability
q = B/N (Opacus' ``DPDataLoader`` with its ``UniformWithReplacementSampler``): batch sizes vary
around B, and a batch can be empty. A logical batch is then cut into physical batches of at most
``max_physical_batch_size`` examples, moved to the device one at a time (the role of Opacus'
``BatchMemoryManager``, here at the :class:`~dptune.dp.engine.DPEngine` seam: the engine sees one
Poisson batch as a stream of physical batches). Host memory holds one logical batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from dptune.dp.engine import PhysicalBatch

if TYPE_CHECKING:
    from opacus.data_loader import DPDataLoader


def poisson_loader(
    dataset: Dataset[tuple[torch.Tensor, ...]], sample_rate: float, steps: int, generator: torch.Generator
) -> DPDataLoader:
    """Opacus' Poisson loader over ``dataset``: one pass yields exactly ``steps`` batches.

    ``sample_rate`` is q = B/N; ``generator`` (CPU) fixes the draws. A trial makes one pass of
    all T steps the accountant was given and cuts it into epochs. Batches are collated tuples
    ``(*inputs, labels)``; an empty draw yields zero-length tensors of the right shapes.
    """
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    from opacus.data_loader import DPDataLoader  # Opacus is imported only by the trials that use it

    loader = DPDataLoader(dataset, sample_rate=sample_rate, generator=generator)
    loader.batch_sampler.steps = steps  # Opacus' default is one "epoch" of int(1/q) batches
    return loader


def physical_batches(
    batch: tuple[torch.Tensor, ...], max_physical_batch_size: int, device: torch.device
) -> Iterator[PhysicalBatch]:
    """Cut a logical batch into consecutive chunks of ≤ ``max_physical_batch_size`` on ``device``.

    An empty logical batch yields no physical batch (the engine then releases noise alone).
    """
    if len(batch[-1]) == 0:
        return
    for chunk in zip(*(t.split(max_physical_batch_size) for t in batch), strict=True):
        yield tuple(t.to(device, non_blocking=True) for t in chunk)
