"""The audit's canaries: m of them, each in the training with probability ½ by a secret coin.

One canary j is two things at once, so that one training is audited under both threat models:

- **an input canary** (black-box): a training row the final model is asked about. Its features
  are out of distribution (a random Gaussian direction of norm :data:`INPUT_NORM`, a public constant:
  nothing of the canaries is measured on the private rows) and its label is drawn uniformly; where
  j is in, the row is in the training split (q = B/N counts it), and the auditor scores it by the
  final model's loss on it (lower: more likely in);
- **a gradient canary** (white-box; Nasr et al. 2023, Steinke et al. 2023 §6): a Dirac direction
  e_j of the parameter vector that no training row's gradient touches. The audit pads every split's
  features with ⌈m/classes⌉ columns of zeros, so the head gains coordinates (class c, column k) on
  which every row's gradient δ x̃ᵀ is 0 and which no row's logits read; canary j owns one of them.
  At each step it is Poisson-sampled at the run's q and, where it is in and sampled, it adds a
  gradient of exactly the sensitivity (C·e_j; e_j under AUTO-S), as the strongest row the accountant
  allows, scaled by the run's ``update_scale``, to the released gradient, which already holds the
  run's own noise on that coordinate. The auditor reads every step's released value y_t on e_j (in
  units of the sensitivity) before the optimizer steps, and scores the canary by Σ_t y_t (a shift
  of one per sampled step: the sum is the likelihood-ratio statistic of the Gaussian) and by
  Σ_t (y_t − y_{t−1})² (which sees noise that does not change from step to step). A gradient
  canary is already clipped, so it tests the noise, its scale, the sampling rate and the coins, not
  whether the engine clips rows: the input canaries, whose gradients the engine clips, do that.

The coins: the inclusion bits, the input canaries, each configuration's canary sampler and the
guesses' tie-breaks are children of one ``np.random.SeedSequence`` (fresh OS entropy unless a test
gives a seed); the inclusion bits are written only to the audit's own folder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dptune.contract import ClippingRule
from dptune.data import Workload
from dptune.dp.coins import cpu_generator
from dptune.runners.batches import PoissonSteps, feature_tensors

#: An input canary's feature norm: public, far above the norms of pooled text embeddings (20 Newsgroups'
#: MiniLM features: 1.3 to 7.4, median 2.2), so that its gradient, ‖δ‖·√(‖x‖² + 1), is clipped unless the
#: model already fits it and the canary is as strong as the clip bound lets a row be; where the engine does
#: not clip, its loss shows it (bench/RESULTS.md, issue 55).
INPUT_NORM = 50.0
#: Steps of canary samples drawn at once.
_DRAWN_STEPS = 256


@dataclass(frozen=True)
class Canaries:
    """m canaries (module docstring): ``included`` (m,) the secret coins, the input canaries'
    ``features`` (m, dim) and ``labels`` (m,), the ``block_columns`` of zeros added to every split
    and ``coins``, whose children draw each configuration's canary sampler and the guesses' tie-breaks."""

    included: np.ndarray
    features: torch.Tensor
    labels: torch.Tensor
    block_columns: int
    coins: np.random.SeedSequence

    @property
    def count(self) -> int:
        """m, the canaries."""
        return len(self.included)

    @classmethod
    def draw(cls, workload: Workload, count: int, coins: np.random.SeedSequence) -> Canaries:
        """``count`` canaries for ``workload`` (cached features), from ``coins``."""
        inclusion, inputs, sampling = coins.spawn(3)
        rng = np.random.default_rng(inputs)
        features, _ = feature_tensors(workload.train)
        directions = rng.standard_normal((count, features.shape[1]))
        directions *= INPUT_NORM / np.linalg.norm(directions, axis=1, keepdims=True)
        return cls(
            included=np.random.default_rng(inclusion).random(count) < 0.5,
            features=torch.from_numpy(directions).float(),
            labels=torch.from_numpy(rng.integers(0, workload.num_classes, count)),
            block_columns=math.ceil(count / workload.num_classes),
            coins=sampling,
        )

    def workload(self, workload: Workload) -> Workload:
        """``workload`` with every split's features padded by :attr:`block_columns` zeros and the
        included input canaries appended to its training split (last)."""

        def padded(features: torch.Tensor) -> torch.Tensor:
            return torch.cat([features.float(), features.new_zeros(len(features), self.block_columns)], dim=1)

        train_features, train_labels = feature_tensors(workload.train)
        keep = torch.from_numpy(self.included)
        train = TensorDataset(
            padded(torch.cat([train_features.float(), self.features[keep]])),
            torch.cat([train_labels, self.labels[keep]]),
        )
        val, test = (TensorDataset(padded(f), y) for f, y in map(feature_tensors, (workload.val, workload.test)))
        dim = train_features.shape[1]
        return replace(workload, train=train, val=val, test=test, feature_dim=dim + self.block_columns)

    def positions(self, feature_dim: int, num_classes: int) -> torch.Tensor:
        """Each gradient canary's flat index in a (classes, dim + columns + 1) head: canary j owns
        class j mod classes of block column j div classes."""
        j = torch.arange(self.count)
        width = feature_dim + self.block_columns + 1
        return (j % num_classes) * width + feature_dim + j // num_classes

    def input_losses(self, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """Each input canary's cross-entropy under the head y = W x + b (the padded W; float64)."""
        features = torch.cat([self.features, self.features.new_zeros(self.count, self.block_columns)], dim=1)
        logits = features.double() @ torch.from_numpy(weight).double().T + torch.from_numpy(bias).double()
        return torch.nn.functional.cross_entropy(logits, self.labels, reduction="none").numpy()


class GradientCanaries:
    """The white-box view of one fused group (a :class:`~dptune.runners.fused_group.StepObserver`):
    adds each configuration's sampled, included gradient canaries to its released gradient and reads
    every canary's coordinate (module docstring)."""

    def __init__(
        self,
        canaries: Canaries,
        positions: torch.Tensor,
        coins: Sequence[np.random.SeedSequence],
        sample_rate: float,
    ) -> None:
        self.positions = positions
        self.included = torch.from_numpy(canaries.included)
        self.samplers = [PoissonSteps(canaries.count, sample_rate, cpu_generator(c)) for c in coins]
        k, m = len(coins), canaries.count
        self.sums = torch.zeros(k, m, dtype=torch.float64)
        self.variation = torch.zeros(k, m, dtype=torch.float64)
        self.previous: torch.Tensor | None = None
        self.steps = 0
        self._drawn: list[list[torch.Tensor]] = [[] for _ in coins]

    def _sampled(self, k: int) -> torch.Tensor:
        """The canaries configuration ``k``'s sampler includes at this step."""
        if not self._drawn[k]:
            step_of, canary = self.samplers[k].draw(_DRAWN_STEPS)
            counts = torch.bincount(step_of, minlength=_DRAWN_STEPS).tolist()
            self._drawn[k] = list(reversed(torch.split(canary, counts)))
        return self._drawn[k].pop()

    def __call__(
        self, released: torch.Tensor, clip_bounds: torch.Tensor, scales: torch.Tensor, rule: ClippingRule
    ) -> None:
        flat = released.view(len(released), -1)
        step = scales * (torch.ones_like(clip_bounds) if rule == "auto_s" else clip_bounds)  # one sensitivity, released
        positions = self.positions.to(flat.device)
        for k in range(len(flat)):
            sampled = self._sampled(k)
            hits = sampled[self.included[sampled]]
            if len(hits):
                flat[k, positions[hits.to(flat.device)]] += step[k]
        observed = (flat[:, positions] / step.unsqueeze(1)).double().cpu()
        self.sums += observed
        if self.previous is not None:
            self.variation += (observed - self.previous).square()
        self.previous = observed
        self.steps += 1
