"""The fast DP engine for FiLM and head-only fine-tuning.

FiLM trains only the scale γ and shift β of the normalisation layers and the classifier head, so
the per-example gradients DP-SGD needs are closed-form functions of tensors the forward and
backward passes already produce. For one example i with layer input x_i, normalised input x̂_i
and output gradient δ_i = ∂ℓ_i/∂y_i (summed loss, so δ_i is one example's):

- LayerNorm over the trailing ``normalized_shape`` (tokens t)::

      ∇_γ ℓ_i = Σ_t x̂_{i,t} ⊙ δ_{i,t}        ∇_β ℓ_i = Σ_t δ_{i,t}

- GroupNorm over channels c (spatial positions s): the same sums over s, per channel.
- BatchNorm with frozen running statistics (evaluation mode; :mod:`dptune.models.batch_norm`): the
  same sums over s, with x̂ from the running statistics and δ pulled back through timm's fused
  activation. A BatchNorm that normalises with batch statistics is refused (here and at run time).
- Linear head y = W a + b::

      ∇_W ℓ_i = Σ_t δ_{i,t} a_{i,t}ᵀ        ∇_b ℓ_i = Σ_t δ_{i,t}

  with no token axis ‖∇_W ℓ_i‖ = ‖δ_i‖·‖a_i‖ (ghost norm, Goodfellow 2015); with tokens
  ‖∇_W ℓ_i‖² = Σ_{t,s} (δ_t·δ_s)(a_t·a_s) (ghost clipping, Li et al. 2022) when that is cheaper
  than the (out, in) matrix; the clipped sum Σ_i f_i ∇_W ℓ_i = (f ⊙ δ)ᵀ a is one matrix product
  (book-keeping, Bu et al. 2023), so per-example weight matrices never exist.

The engine then forms the step of :mod:`dptune.dp.engine` in one flat float32 vector over all
trainable parameters: flat norms ‖g_i‖ = √(Σ_layers ‖g_i,layer‖²), factors f_i from
:func:`~dptune.dp.clipping.clip_factors`, Σ_i f_i g_i (one matrix-vector product for all norm
layers), one Gaussian draw N(0, s² I), times ``update_scale``; ``p.grad`` are views into it.

Person-level steps (user-level DP, McMahan et al. 2018; Levy et al. 2021; :mod:`dptune.dp.engine`)
clip each person's mean gradient G_u = Σ_{i ∈ u} w_i g_i, w_i = 1/m_u. Norm layers: the (n, d)
per-example pieces are averaged per person into (P, d). Linear layers: a person is one example whose
tokens are all (row, token) pairs of their rows, with δ scaled by w_i: the calls are regrouped into
(P, K·T, ·) tensors (K the most rows of one person in the batch, zero-padded), so that the same ghost
norm gives ‖∇_W G_u‖² = Σ_{(i,t),(j,s) ∈ u} w_i w_j (δ_{i,t}·δ_{j,s})(a_{i,t}·a_{j,s}) over same-person
pairs only (or the (P, out, in) per-person matrices, when cheaper), and the same book-keeping gives
Σ_u f_u ∇_W G_u = (f_{u(i)} w_i δ)ᵀ a.

How the tensors are captured: while :meth:`FilmEngine.noisy_gradient` runs (and only then), a
forward hook on each trainable module wraps its output in an identity autograd function, the
*tap*, that saves the module's input. The backward pass is ``torch.autograd.grad(loss, anchor)``
for a scalar ``anchor`` that every tap takes as an input: autograd runs exactly the nodes between
the loss and the taps, hands each tap its δ, and computes no parameter gradient at all. A norm
layer's tap turns (x, δ) into its (n, d) per-example gradients at once, so no activation-sized δ
outlives its layer's backward; a Linear's tap keeps (a, δ) until the clip factors are known.
A tap's output is a view made inside a custom function: a model that modifies a trainable
module's output in place fails loudly (PyTorch refuses), rather than giving a wrong gradient.

Precision: under ``torch.autocast`` LayerNorm runs in float32 on CUDA; x̂ is recomputed from the
saved input in float32 and every sum is accumulated in float32, whatever dtype δ arrives in.

Only exact module types are supported (as Opacus matches its grad samplers): ``nn.LayerNorm``,
``nn.GroupNorm``, ``nn.Linear``, timm's ``LayerNorm``/``GroupNorm``/``GroupNorm1``
subclasses, whose forward is the parent's, and the frozen-statistics BatchNorms of
:func:`~dptune.models.batch_norm.frozen_batch_norm_types`. A subclass with another layout (timm's
``LayerNorm2d`` normalises channels first) is refused, as is a parameter shared by two modules;
:func:`unsupported_modules` names them and the trial falls back to Opacus.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
import operator
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
from timm.layers import GroupNorm as TimmGroupNorm
from timm.layers import GroupNorm1 as TimmGroupNorm1
from timm.layers import LayerNorm as TimmLayerNorm
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dptune.dp.clipping import clip_factors, noise_std, update_scale
from dptune.dp.engine import DPStepSpec, PersonRows, PhysicalBatch, summed_cross_entropy, unpack
from dptune.dp.precision import autocast
from dptune.models.batch_norm import batch_norm_refusal, frozen_batch_norm_terms, frozen_batch_norm_types

_Norm: TypeAlias = nn.LayerNorm | nn.GroupNorm | _BatchNorm
_LAYER_NORMS: tuple[type[nn.LayerNorm], ...] = (nn.LayerNorm, TimmLayerNorm)
_GROUP_NORMS: tuple[type[nn.GroupNorm], ...] = (nn.GroupNorm, TimmGroupNorm, TimmGroupNorm1)
_LINEARS: tuple[type[nn.Linear], ...] = (nn.Linear,)
_NORMS: tuple[type[_Norm], ...] = _LAYER_NORMS + _GROUP_NORMS + frozen_batch_norm_types()
#: Module types the engine computes per-example gradients for (matched exactly, not by subclass).
SUPPORTED_MODULE_TYPES: tuple[type[nn.Module], ...] = _NORMS + _LINEARS
#: PEFTs whose trainable modules (norm-layer scale and shift, the linear head) have the closed-form
#: per-example gradients this engine computes.
ENGINE_PEFTS: tuple[str, ...] = ("film", "head")


def _trainable_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[nn.Parameter]]]:
    """(qualified name, module, its own trainable parameters) for every module that has some."""
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own:
            yield name or "<root>", module, own


def unsupported_modules(model: nn.Module) -> list[str]:
    """Qualified names (with type) of the trainable modules of ``model`` the engine cannot run.

    Empty means :class:`FilmEngine` computes exactly the per-example gradients of every trainable
    parameter. A module is unsupported when its type is not in :data:`SUPPORTED_MODULE_TYPES`
    (exact match), when one of its trainable parameters also belongs to another module, or when
    it is a BatchNorm that normalises with batch statistics (see :mod:`dptune.models.batch_norm`).
    """
    refused: list[str] = []
    owner: dict[int, str] = {}
    for name, module, params in _trainable_modules(model):
        batch_norm = batch_norm_refusal(module)
        if type(module) not in SUPPORTED_MODULE_TYPES:
            refused.append(f"{name} ({type(module).__name__})")
        elif batch_norm is not None:
            refused.append(f"{name} ({type(module).__name__} {batch_norm})")
        for p in params:
            if id(p) in owner:
                refused.append(f"{name} ({type(module).__name__}, shares a parameter with {owner[id(p)]})")
            owner[id(p)] = name
    return refused


def engine_refusal(model: nn.Module, peft: str) -> str | None:
    """Why :class:`FilmEngine` cannot run ``model`` fine-tuned with ``peft`` (``None``: it can); the
    refusal :mod:`dptune.dp.engine_registry` asks before it picks this engine."""
    if peft not in ENGINE_PEFTS:
        return f"peft {peft!r} is not one of {', '.join(ENGINE_PEFTS)}"
    unsupported = unsupported_modules(model)
    if unsupported:
        return f"trainable modules not supported by the FiLM engine: {', '.join(unsupported)}"
    return None


class _Tap(torch.autograd.Function):
    """Identity on a module's output whose backward hands (module input, δ) to the module's slot."""

    @staticmethod
    def forward(
        ctx: Any, output: torch.Tensor, layer_input: torch.Tensor, anchor: torch.Tensor, slot: _Slot
    ) -> torch.Tensor:
        ctx.save_for_backward(layer_input)
        ctx.slot = slot
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (layer_input,) = ctx.saved_tensors
        ctx.slot.receive(layer_input, grad_output)  # no graph is recorded in a backward
        return grad_output, None, None, None


def _total(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of one or more tensors, added in order (``sum`` would start from the int 0)."""
    return functools.reduce(operator.add, tensors)


class _Slot(abc.ABC):
    """One trainable module: its parameters' place in the flat gradient and its captured calls.

    ``params`` are the module's trainable parameters, weight then bias; they occupy
    ``flat[offset : offset + numel]``, each flattened, in that order.
    """

    def __init__(self, name: str, module: nn.Module, offset: int) -> None:
        self.name = name
        self.module = module
        # weight and bias are parameters, or None (a norm layer without affine, a Linear without bias)
        weight, bias = module.weight, module.bias
        self.train_weight = isinstance(weight, nn.Parameter) and weight.requires_grad
        self.train_bias = isinstance(bias, nn.Parameter) and bias.requires_grad
        self.params = [p for p in (weight, bias) if isinstance(p, nn.Parameter) and p.requires_grad]
        self.offset = offset
        self.numel = sum(p.numel() for p in self.params)

    @abc.abstractmethod
    def receive(self, layer_input: torch.Tensor, grad_output: torch.Tensor) -> None:
        """Take one call's input and output gradient during the backward pass."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget the previous physical batch."""


class _NormSlot(_Slot):
    """LayerNorm, GroupNorm or frozen-statistics BatchNorm: per-example γ and β gradients,
    materialised as (n, size) float32 pieces, one per trainable parameter (weight then bias)."""

    module: _Norm

    def __init__(self, name: str, module: _Norm, offset: int) -> None:
        super().__init__(name, module, offset)
        self.pieces: list[torch.Tensor] = []

    def reset(self) -> None:
        self.pieces = []

    def receive(self, layer_input: torch.Tensor, grad_output: torch.Tensor) -> None:
        m = self.module
        n = layer_input.shape[0]
        if isinstance(m, _BatchNorm):  # one of frozen_batch_norm_types()
            # (n, C, *spatial): x̂ from the running statistics, sum over positions, per channel
            x_hat, delta = frozen_batch_norm_terms(m, layer_input, grad_output)
            reduce_dim = 2
        elif isinstance(m, nn.GroupNorm):
            # (n, C, *spatial): sum over positions, per channel
            x_hat = F.group_norm(layer_input.float(), m.num_groups, eps=m.eps).reshape(n, m.num_channels, -1)
            delta = grad_output.float().reshape(n, m.num_channels, -1)
            reduce_dim = 2
        else:
            # (n, *tokens, *normalized_shape): sum over tokens, per normalised feature
            features = math.prod(m.normalized_shape)
            x_hat = F.layer_norm(layer_input.float(), m.normalized_shape, eps=m.eps).reshape(n, -1, features)
            delta = grad_output.float().reshape(n, -1, features)
            reduce_dim = 1
        pieces = []
        if self.train_weight:
            pieces.append(torch.linalg.vecdot(x_hat, delta, dim=reduce_dim))
        if self.train_bias:
            pieces.append(delta.sum(reduce_dim))
        # a module called several times in one forward: its gradient is the sum over calls
        self.pieces = [a + b for a, b in zip(self.pieces, pieces, strict=True)] if self.pieces else pieces


class _LinearSlot(_Slot):
    """Linear layer: norms and clipped sums from (input a, output gradient δ), weight never per example."""

    module: nn.Linear

    def __init__(self, name: str, module: nn.Linear, offset: int) -> None:
        super().__init__(name, module, offset)
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.per_example_weight: torch.Tensor | None = None

    def reset(self) -> None:
        self.calls = []
        self.per_example_weight = None

    def receive(self, layer_input: torch.Tensor, grad_output: torch.Tensor) -> None:
        n = layer_input.shape[0]
        # (n, tokens, features) in float32; no token axis is one token
        self.calls.append(
            (
                layer_input.detach().float().reshape(n, -1, layer_input.shape[-1]),
                grad_output.float().reshape(n, -1, grad_output.shape[-1]),
            )
        )

    def group_by_person(self, persons: PersonRows) -> None:
        """Regroup the calls so that each person is one example (module docstring): (n, T, f) →
        (P, K·T, f) with row i's tokens at its rank within its person, δ scaled by 1/m_{u(i)}."""
        rank = persons.ranks()
        most = int(persons.rows.max())

        def by_person(per_row: torch.Tensor) -> torch.Tensor:
            padded = per_row.new_zeros(persons.count, most, *per_row.shape[1:])
            padded[persons.people, rank] = per_row
            return padded.reshape(persons.count, -1, per_row.shape[-1])

        weights = persons.weights[:, None, None]
        self.calls = [(by_person(a), by_person(delta * weights)) for a, delta in self.calls]

    def squared_norms(self, n: int, device: torch.device) -> torch.Tensor:
        """‖∇_W ℓ_i‖² + ‖∇_b ℓ_i‖² of the trainable ones, shape (n,)."""
        if not self.calls:
            return torch.zeros(n, device=device)
        squared = torch.zeros(n, device=device)
        if self.train_bias:
            bias_grad = _total(delta.sum(1) for _, delta in self.calls)
            squared = squared + bias_grad.square().sum(1)
        if self.train_weight:
            if len(self.calls) == 1 and self._ghost_is_cheaper(*self.calls[0]):
                a, delta = self.calls[0]
                if a.shape[1] == 1:  # ‖δ aᵀ‖² = ‖δ‖²‖a‖²
                    squared = squared + delta.square().sum((1, 2)) * a.square().sum((1, 2))
                else:  # Σ_{t,s} (δ_t·δ_s)(a_t·a_s)
                    gram = torch.bmm(delta, delta.transpose(1, 2)) * torch.bmm(a, a.transpose(1, 2))
                    squared = squared + gram.sum((1, 2))
            else:
                self.per_example_weight = _total(torch.einsum("nto,nti->noi", delta, a) for a, delta in self.calls)
                squared = squared + self.per_example_weight.square().sum((1, 2))
        return squared

    @staticmethod
    def _ghost_is_cheaper(a: torch.Tensor, delta: torch.Tensor) -> bool:
        """Ghost norm when its (n, T, T) Gram matrices are smaller than the (n, out, in) gradients."""
        tokens = a.shape[1]
        return 2 * tokens * tokens <= a.shape[2] * delta.shape[2]

    def add_clipped_sum(self, factors: torch.Tensor, flat: torch.Tensor) -> None:
        """flat[this module] += Σ_i f_i g_i (weight: (f ⊙ δ)ᵀ a, one matrix product)."""
        if not self.calls:
            return
        out_features = self.calls[0][1].shape[2]
        view = flat[self.offset : self.offset + self.numel]
        start = 0
        if self.train_weight:
            weight = view[: self.module.weight.numel()].view(self.module.weight.shape)
            if self.per_example_weight is not None:
                weight.add_(torch.einsum("n,noi->oi", factors, self.per_example_weight))
            else:
                for a, delta in self.calls:
                    weighted = (delta * factors[:, None, None]).reshape(-1, out_features)
                    weight.addmm_(weighted.T, a.reshape(-1, a.shape[2]))
            start = weight.numel()
        if self.train_bias:
            bias = view[start:]
            for _, delta in self.calls:
                bias.addmv_(delta.sum(1).T, factors)


class FilmEngine:
    """DP step gradient for models whose trainable modules are norm layers and Linear heads.

    Implements :class:`~dptune.dp.engine.DPEngine`: ``noisy_gradient`` sets ``p.grad`` of every
    trainable parameter to ``update_scale · (Σ_i f_i g_i + N(0, s² I))`` (flat clipping over all
    trainable parameters, loss :func:`~dptune.dp.engine.summed_cross_entropy`), accumulating
    Σ_i f_i g_i over the physical batches of one Poisson batch, noise from ``generator``.
    ``last_grad_norms`` holds ‖g_i‖ (float32, shape (n,)) of the last Poisson batch's examples in
    batch order (person-level, ``spec.person_level``: ‖G_u‖ of its people, shape (P,), module
    docstring). Nothing is attached to ``model`` outside ``noisy_gradient``.
    """

    name = "film"

    def __init__(self, model: nn.Module, spec: DPStepSpec, generator: torch.Generator) -> None:
        refused = unsupported_modules(model)
        if refused:
            raise ValueError(
                f"the FiLM engine cannot compute per-example gradients of: {', '.join(refused)}; "
                "supported trainable modules are "
                f"{', '.join(t.__module__ + '.' + t.__name__ for t in SUPPORTED_MODULE_TYPES)}"
            )
        self.model = model
        self.spec = spec
        self.generator = generator
        modules = [(name, module) for name, module, _ in _trainable_modules(model)]
        if not modules:
            raise ValueError("the model has no trainable parameters: nothing to train with DP")
        # flat layout: all norm layers first (one matrix-vector product clips them), then Linears
        self._norm_slots: list[_NormSlot] = []
        self._linear_slots: list[_LinearSlot] = []
        offset = 0
        for name, module in modules:
            if isinstance(module, _NORMS):
                self._norm_slots.append(_NormSlot(name, module, offset))
                offset += self._norm_slots[-1].numel
        self._norm_numel = offset
        for name, module in modules:
            if isinstance(module, _LINEARS):
                self._linear_slots.append(_LinearSlot(name, module, offset))
                offset += self._linear_slots[-1].numel
        self._numel = offset
        self._slots: list[_Slot] = [*self._norm_slots, *self._linear_slots]
        self._params = [p for slot in self._slots for p in slot.params]  # in flat order
        self._param_sizes = [p.numel() for p in self._params]
        first = self._slots[0].params[0]
        self._device = first.device
        if generator.device.type != self._device.type:
            raise ValueError(
                f"the noise generator is on {generator.device}, the model on {self._device}; they must match"
            )
        self._anchor = torch.zeros((), device=self._device, requires_grad=True)
        self.last_grad_norms = torch.zeros(0, device=self._device)

    @contextlib.contextmanager
    def _taps(self) -> Iterator[None]:
        """Forward hooks that wrap each trainable module's output in a :class:`_Tap`, removed on exit."""
        anchor = self._anchor

        def hook_for(slot: _Slot) -> Callable[[nn.Module, tuple[Any, ...], torch.Tensor], torch.Tensor]:
            def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
                if not args:
                    raise ValueError(
                        f"module {slot.name} was called without a positional input; the FiLM engine needs one"
                    )
                return _Tap.apply(output, args[0], anchor, slot)

            return hook

        handles = [slot.module.register_forward_hook(hook_for(slot)) for slot in self._slots]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for slot in self._slots:
                slot.reset()

    def _clip_and_accumulate(self, batch: PhysicalBatch, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One physical batch: flat += Σ_i f_i g_i (person-level: Σ_u f_u G_u); returns (Σ_i ℓ_i, the
        clipped units' norms ‖g_i‖ or ‖G_u‖) as device tensors."""
        inputs, labels, persons = unpack(batch, self.spec.person_level)
        n = labels.shape[0]
        for slot in self._slots:
            slot.reset()
        with torch.enable_grad():
            with autocast(self._device.type, self.spec.autocast_dtype):
                logits = self.model(*inputs)
            loss = summed_cross_entropy(logits, labels)
        torch.autograd.grad(loss, self._anchor, allow_unused=True)  # runs the taps, no parameter gradients
        with torch.no_grad():  # the saved inputs may require grad: record no graph
            pieces = [
                piece
                for slot in self._norm_slots
                for piece in (slot.pieces or [torch.zeros(n, slot.numel, device=self._device)])  # unused: no gradient
            ]
            per_example = torch.cat(pieces, dim=1) if pieces else None
            if persons is not None:  # the clipped units are people: G_u
                per_example = None if per_example is None else persons.mean(per_example)
                for slot in self._linear_slots:
                    slot.group_by_person(persons)
                n = persons.count
            squared = per_example.square().sum(1) if per_example is not None else torch.zeros(n, device=self._device)
            for slot in self._linear_slots:
                squared = squared + slot.squared_norms(n, self._device)
            norms = squared.sqrt()
            factors = clip_factors(norms, self.spec.clip_bound, self.spec.rule)
            if per_example is not None:
                flat[: self._norm_numel].addmv_(per_example.T, factors)
            for slot in self._linear_slots:
                slot.add_clipped_sum(factors, flat)
        return loss.detach(), norms

    def noisy_gradient(self, physical_batches: Iterable[PhysicalBatch]) -> float:
        """Set ``p.grad`` to the rule's released gradient of one Poisson batch; return Σ_i ℓ_i."""
        spec = self.spec
        flat = torch.zeros(self._numel, device=self._device)
        losses: list[torch.Tensor] = []
        norms: list[torch.Tensor] = []
        with self._taps():
            for batch in physical_batches:
                if batch[-1].shape[0] == 0:  # an empty physical batch contributes nothing
                    continue
                loss, batch_norms = self._clip_and_accumulate(batch, flat)
                losses.append(loss)
                norms.append(batch_norms)
        std = noise_std(spec.noise_multiplier, spec.clip_bound, spec.rule)
        if std > 0:
            flat.add_(torch.normal(0.0, std, size=flat.shape, generator=self.generator, device=self._device))
        flat.mul_(update_scale(spec.clip_bound, spec.rule, spec.expected_batch_size))
        for p, grad in zip(self._params, flat.split(self._param_sizes), strict=True):
            p.grad = grad.view(p.shape) if p.dtype == torch.float32 else grad.view(p.shape).to(p.dtype)
        self.last_grad_norms = torch.cat(norms) if norms else torch.zeros(0, device=self._device)
        return float(torch.stack(losses).sum()) if losses else 0.0  # one device sync per step
