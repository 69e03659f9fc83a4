"""The seam between a trial and the code that computes one DP step's gradient.

A trial owns the model, a plain torch optimizer over the trainable parameters and a Poisson
loader; a :class:`DPEngine` owns the per-example gradients. For each Poisson batch the trial
calls ``engine.noisy_gradient(physical_batches)``, then ``optimizer.step()`` and
``optimizer.zero_grad(set_to_none=True)``. Two engines implement the seam: the Opacus hooks
engine (:mod:`dptune.dp.opacus_engine`, any model Opacus supports) and the fast FiLM/head engine
(:mod:`dptune.dp.film`). They are registered by name in :mod:`dptune.dp.engine_registry`, whose
:func:`~dptune.dp.engine_registry.select_engine` decides which one a trial gets; this module imports
neither engine.

The step every engine computes, for the Poisson batch's examples i with per-example gradients
g_i = ∇_θ ℓ(x_i, y_i) (summed cross-entropy, so g_i is one example's gradient) and the rule's
f_i, s and scale (:mod:`dptune.dp.clipping`)::

    p.grad = scale · (Σ_i f_i · g_i + N(0, s² I))      for every trainable parameter p

with ``scale = update_scale(C, rule, B)`` and ``B`` the *expected* batch size q·N (never the
realised one, which would leak the batch size).

Person-level steps (user-level DP: McMahan et al. 2018, "Learning differentially private recurrent
language models"; Levy et al. 2021, "Learning with user-level privacy"), when
:attr:`DPStepSpec.person_level` is set: the Poisson batch samples *people* u (q = B/N_people), each
with the m_u rows the sampler drew for them, and the clipped unit is a person's mean gradient::

    G_u = (1/m_u) Σ_{i ∈ u} g_i        p.grad = scale · (Σ_u f_u · G_u + N(0, s² I))

with f_u the rule's factor of the flat norm ‖G_u‖ and B = q·N_people. Σ_u f_u G_u = Σ_i (f_{u(i)}/m_{u(i)}) g_i,
so each person's summand has norm ≤ the rule's sensitivity, whatever their rows. The carrier: each
physical batch is ``(*inputs, labels, people)`` with ``people`` an int64 tensor of shape (n,) of
batch-local person ids ``0..P-1``, non-decreasing (a person's rows are contiguous), and a person's
rows are never split across physical batches (:func:`dptune.dp.sampling.person_physical_batches`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dptune.contract import ENGINE_NAMES, ClippingRule, EngineName
from dptune.dp.clipping import check_rule

#: One physical batch: ``(*inputs, labels)`` already on the engine's device; ``model(*inputs)``
#: returns logits of shape (n, classes), ``labels`` is an int64 tensor of shape (n,). Person-level
#: (:attr:`DPStepSpec.person_level`): ``(*inputs, labels, people)``, ``people`` the rows' batch-local
#: person ids (int64, shape (n,), ``0..P-1`` non-decreasing; module docstring).
PhysicalBatch = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class DPStepSpec:
    """What defines one DP step's gradient, shared by every engine.

    ``noise_multiplier`` is σ (noise std in units of the sensitivity), ``clip_bound`` is C in
    gradient-norm units, ``expected_batch_size`` is B = q·N (examples), ``autocast_dtype`` the
    dtype of the forward pass under ``torch.autocast`` (``None``: full precision).
    ``person_level``: the privacy unit is a person (module docstring): physical batches carry the rows'
    person ids, the clipped unit is a person's mean gradient and B = q·N_people counts people.
    """

    noise_multiplier: float
    clip_bound: float
    rule: ClippingRule
    expected_batch_size: float
    autocast_dtype: torch.dtype | None = None
    person_level: bool = False

    def __post_init__(self) -> None:
        check_rule(self.rule)
        if not self.clip_bound > 0:
            raise ValueError(f"clip_bound must be > 0, got {self.clip_bound}")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be ≥ 0, got {self.noise_multiplier}")
        if not self.expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {self.expected_batch_size}")


class DPEngine(Protocol):
    """Computes the clipped, noised and scaled gradient of one Poisson batch.

    Contract, for an engine built by an :class:`EngineFactory` on ``model`` with a
    :class:`DPStepSpec` and a noise ``generator``:

    - ``noisy_gradient(physical_batches)`` consumes every physical batch of one Poisson batch
      (their concatenation is the Poisson batch; an *empty* Poisson batch is an empty iterable)
      and sets ``p.grad`` (same dtype and shape as ``p``) of every trainable parameter ``p`` of
      ``model`` to ``update_scale · (Σ_i f_i g_i + N(0, s² I))`` (module docstring), with the
      noise drawn from ``generator``. The norms ‖g_i‖ are over *all* trainable parameters (flat
      clipping). It returns Σ_i ℓ_i, the summed training loss of the batch's examples as a float
      (0.0 for an empty batch; a non-finite value tells the trial the run diverged).
    - With ``spec.person_level`` every physical batch ends with the rows' person ids, and the
      summands are people's clipped mean gradients ``f_u G_u`` instead (module docstring; McMahan et
      al. 2018, Levy et al. 2021). A person's rows all arrive in one physical batch.
    - It never steps or zeroes the optimizer: the trial calls ``optimizer.step()`` and
      ``optimizer.zero_grad(set_to_none=True)`` after it.
    - Outside ``noisy_gradient`` the model behaves as a plain module (evaluation and the
      diagnostics run ``model(*inputs)`` and ``loss.backward()`` on it directly): hooks an
      engine needs are only attached, or only active, inside the call.
    """

    name: str

    def noisy_gradient(self, physical_batches: Iterable[PhysicalBatch]) -> float: ...


class EngineFactory(Protocol):
    """Builds an engine: ``factory(model, spec, generator) -> DPEngine``.

    ``generator`` draws the DP noise and lives on the model's device. The engine finds the
    trainable parameters itself (``requires_grad``); the trial owns the optimizer that steps them.
    """

    def __call__(self, model: nn.Module, spec: DPStepSpec, generator: torch.Generator) -> DPEngine: ...


@dataclass(frozen=True)
class PersonRows:
    """The people of one person-level physical batch (module docstring), on its device.

    ``people`` (n,) are the rows' batch-local person ids ``0..P-1``, non-decreasing; ``rows`` (P,) is
    m_u, each person's rows in the batch (≥ 1); ``weights`` (n,) float32 is 1/m_{u(i)}, the weight of
    row i in its person's mean G_u = (1/m_u) Σ_{i ∈ u} g_i (McMahan et al. 2018; Levy et al. 2021).
    """

    people: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor

    @classmethod
    def of(cls, people: torch.Tensor) -> PersonRows:
        """The :class:`PersonRows` of a physical batch's person ids."""
        rows = torch.bincount(people)
        return cls(people=people, rows=rows, weights=1.0 / rows[people].float())

    @property
    def count(self) -> int:
        """P, the people in the batch."""
        return self.rows.shape[0]

    def ranks(self) -> torch.Tensor:
        """(n,) int64: each row's position ``0..m_u-1`` among its person's rows."""
        return (
            torch.arange(len(self.people), device=self.people.device) - (self.rows.cumsum(0) - self.rows)[self.people]
        )

    def mean(self, per_row: torch.Tensor) -> torch.Tensor:
        """Per-person means (P, *rest) of per-row values ``per_row`` (n, *rest): G_u from the g_i."""
        total = per_row.new_zeros(self.count, *per_row.shape[1:]).index_add_(0, self.people, per_row)
        return total / self.rows.view(-1, *(1,) * (per_row.dim() - 1)).to(per_row.dtype)


def unpack(
    batch: PhysicalBatch, person_level: bool
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, PersonRows | None]:
    """``(inputs, labels, people)`` of a physical batch; ``people`` is ``None`` unless ``person_level``."""
    if person_level:
        *inputs, labels, people = batch
        return tuple(inputs), labels, PersonRows.of(people)
    *inputs, labels = batch
    return tuple(inputs), labels, None


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ_i ℓ_i over a batch, computed in float32 (the loss every engine differentiates)."""
    return F.cross_entropy(logits.float(), labels, reduction="sum")


def check_engine(name: str) -> EngineName:
    """Return ``name`` if it names an engine choice, else raise naming the choices."""
    if name not in ENGINE_NAMES:
        raise ValueError(f"engine {name!r} is unknown; choose one of {', '.join(ENGINE_NAMES)}")
    return name  # type: ignore[return-value]
