"""What a fused group (:mod:`dptune.runners.fused_group`) trains on: the training split on the
device (:class:`DeviceWorkload`), each configuration's Poisson batches (:class:`PoissonSteps`), the
coins of a chunk of steps (:class:`Draws`) and the rows a step reads (:class:`BatchRows`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dptune.contract import TrialConfig
from dptune.data import Workload
from dptune.data.spec import Split
from dptune.runners.common import probe_indices
from dptune.runners.heads import augment

#: Noise drawn per configuration per call: as many steps as fit this many bytes (float32).
NOISE_CHUNK_BYTES = 1 << 20
#: Most steps whose noise and Poisson batches are drawn in one call.
MAX_CHUNK_STEPS = 64


def chunk_steps(parameters: int) -> int:
    """Steps whose noise (``parameters`` float32 values each) and Poisson batches are drawn at once."""
    return max(1, min(MAX_CHUNK_STEPS, NOISE_CHUNK_BYTES // (4 * parameters)))


class PoissonSteps:
    """The Poisson batches of one configuration: at every step each of the N examples is included
    independently with probability q, drawn from the configuration's own (CPU) generator.

    Exactness. Number the (step, example) pairs of the coming steps in order, position
    p = step·N + example. Inclusion of each pair is an independent Bernoulli(q) trial, so the
    included positions are a Bernoulli process, whose gaps (failures before each success) are
    i.i.d. Geometric(q): P(F ≥ k) = (1 − q)^k. A gap is drawn by inversion from a float64 uniform
    U ∈ [0, 1): F = ⌊log(1 − U) / log(1 − q)⌋ has P(F ≥ k) = P(1 − U ≤ (1 − q)^k) = (1 − q)^k, exact
    up to the 2⁻⁵³ resolution of U (Opacus' loader compares float32 uniforms with q, a 2⁻²⁴
    resolution). Gaps are drawn in batches; when a batch ends before the last position, the process
    restarts at the next position with fresh gaps, which by the independence of the Bernoulli trials
    (the geometric law's memorylessness) is the same process. Draws past the last position are
    discarded, so the batches of disjoint steps are independent. Expected cost: q·N + O(1) uniforms
    per step instead of N.
    """

    def __init__(self, num_examples: int, sample_rate: float, generator: torch.Generator) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.num_examples = num_examples
        self.sample_rate = sample_rate
        self.generator = generator
        self._log_miss = math.log1p(-sample_rate) if sample_rate < 1 else -math.inf

    def draw(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``steps`` steps' batches: (step, example) int64 tensors of every inclusion, in
        order of step then example (steps counted from 0 at this call)."""
        end = steps * self.num_examples
        if self.sample_rate == 1:  # full batch: every pair, no coin is drawn
            positions = torch.arange(end)
            return positions // self.num_examples, positions % self.num_examples
        found: list[torch.Tensor] = []
        start = 0  # the first position not yet decided
        while start < end:
            expected = (end - start) * self.sample_rate
            count = int(expected + 6 * math.sqrt(expected) + 16)
            uniforms = torch.rand(count, generator=self.generator, dtype=torch.float64)
            gaps = torch.floor(torch.log1p(-uniforms) / self._log_miss).clamp_(max=end).long()
            positions = start + torch.cumsum(gaps + 1, 0) - 1
            inside = positions[positions < end]
            found.append(inside)
            start = end if len(inside) < count else int(positions[-1]) + 1
        positions = torch.cat(found)
        return positions // self.num_examples, positions % self.num_examples


def feature_tensors(split: Split) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features, labels)`` of a split of cached features, the only kind a fused group trains on."""
    if not isinstance(split, TensorDataset):
        raise TypeError(f"the fused runner trains heads on cached features, not on {type(split).__name__}")
    features, labels = split.tensors
    return features, labels


@dataclass(frozen=True)
class DeviceWorkload:
    """What every group of one ``run_fused`` call shares: the workload's training split on the device."""

    workload: Workload
    device: torch.device
    features: torch.Tensor  # (N + 1, dim + 1) augmented training features x̃ on the device; row N is zeros (padding)
    feature_norms: torch.Tensor  # (N + 1,) ‖x̃_i‖ = √(‖x_i‖² + 1); 0 at row N
    labels: torch.Tensor  # (N + 1,) int64; row N is 0 (padding)
    probe: tuple[torch.Tensor, torch.Tensor] | None  # augmented probe features and labels on the device

    @classmethod
    def build(cls, config: TrialConfig, workload: Workload, device: torch.device) -> DeviceWorkload:
        features, labels = feature_tensors(workload.train)
        features = augment(features.to(device))
        features = torch.cat([features, features.new_zeros(1, features.shape[1])])
        labels = torch.cat([labels, labels.new_zeros(1)]).to(device)
        probe = None
        if config.diagnostics:
            rows = probe_indices(config, len(workload.train), features.shape[1] * workload.num_classes).to(device)
            probe = (features[rows], labels[rows])
        return cls(
            workload=workload,
            device=device,
            features=features,
            feature_norms=torch.linalg.vector_norm(features, dim=1),
            labels=labels,
            probe=probe,
        )

    @property
    def num_train(self) -> int:
        """N, the training examples (the padding row excluded)."""
        return len(self.workload.train)


@dataclass(frozen=True)
class Draws:
    """A group's coins for S steps. ``index[t, k, r]`` (S, K, width; on the device) is the r-th
    training row in configuration k's Poisson batch at step t, in increasing order, padded with N
    (the zero row); ``counts[t, k]`` (numpy) its batch size; ``noise[t, k]`` (S, K, classes,
    dim + 1; on the device; a view of a (K, S, …) block per configuration) its Gaussian noise at its
    released scale, N(0, r_k²) with r_k = ``GroupCoins.noise_stds[k]``."""

    index: torch.Tensor
    counts: np.ndarray
    noise: torch.Tensor


@dataclass(frozen=True)
class BatchRows:
    """Padded Poisson batches (see :class:`Draws`) and what a step reads of its rows besides their
    features: ``index``, ``labels`` (int64), ``row_weights`` (1.0 for a batch row, 0.0 for padding)
    and ``feature_norms`` (‖x̃_i‖, 0 at padding), all of one shape (steps, K, width) or, for one
    step, (K, width), on the device. :meth:`of` looks up the labels and norms of many steps at once."""

    index: torch.Tensor
    labels: torch.Tensor
    row_weights: torch.Tensor
    feature_norms: torch.Tensor

    @classmethod
    def of(cls, data: DeviceWorkload, index: torch.Tensor) -> BatchRows:
        """The rows ``index`` (padded with N) of ``data``'s training split."""
        return cls(
            index=index,
            labels=data.labels[index],
            row_weights=(index < data.num_train).float(),
            feature_norms=data.feature_norms[index],
        )

    def step(self, t: int, width: int) -> BatchRows:
        """Step ``t``'s batches, cut to ``width`` rows (the largest batch of the step)."""
        return BatchRows(*(getattr(self, f.name)[t, :, :width] for f in dataclasses.fields(self)))

    def configurations(self, first: int, end: int) -> BatchRows:
        """One step's batches of configurations ``first`` to ``end`` (excluded)."""
        return BatchRows(*(getattr(self, f.name)[first:end] for f in dataclasses.fields(self)))
