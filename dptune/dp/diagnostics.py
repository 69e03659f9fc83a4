"""The paper's clipping diagnostics on a fixed probe of training examples (§4–5). Ray-free.

From the per-example gradients g_i (i = 1..n, dimension d) of a probe, at the trial's clip bound
C, noise multiplier σ and expected batch size B:

- gradient norms ‖g_i‖ (overall and per-class quantiles) and the clipped share ‖g_i‖ > C per class;
- the re-weighting view of clipping (Eq. 3): w_y(C) = mean over class y of min(1, C/‖g_i‖);
- the per-step MSE of the clipped-noised mean gradient against the true one, split into its
  clipping-bias and noise-variance terms, and the C* that minimises it (Theorem 5.2).

Normalisation. A step on B examples drawn like the probe releases
g̃ = (1/B)(Σ_batch clip_C(g_i) + N(0, σ²C²I_d)) for the mean gradient ḡ. Under the theorem's
Assumption 5.1 (no sampling noise: the batch's clipped mean is the probe's), with
I_C = {i : ‖g_i‖ > C}, G_C = Σ_{i∈I_C} g_i and N_C = Σ_{i∈I_C} g_i/‖g_i‖,

    MSE(C) = ‖(1/n) Σ_i (clip_C(g_i) − g_i)‖² + σ²C²d/B²
           = (1/n²) ‖C·N_C − G_C‖²  +  σ²C²d/B²            (bias + variance)

On each interval between consecutive sorted norms I_C is fixed, so MSE is a quadratic in C whose
minimiser is C = N_Cᵀ G_C / (N_Cᵀ N_C + σ²d·n²/B²); the global minimiser is that point clamped
to its interval, or an interval end (one of the ‖g_i‖), whichever gives the least MSE. With
B = n this is Theorem 5.2's C* = N_{C*}ᵀ G_{C*} / (N_{C*}ᵀ N_{C*} + σ²d) exactly (the theorem's
sum-form MSE is n² times the one above).

These use the *standard* clipped sum for every rule (the theorem's setting): ``normalized``
divides the same sum by C, a scale the learning rate absorbs.

None of this is differentially private: it reads exact per-example gradients of training
examples and releases norms, labels and C* without noise, outside the trial's (ε, δ) accounting.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dptune.contract import ClassDiagnostics, Diagnostics
from dptune.dp.clipping import clip_factors
from dptune.dp.engine import PhysicalBatch, summed_cross_entropy
from dptune.dp.precision import autocast

#: Per-class gradient-norm quantiles recorded, by key of ``ClassDiagnostics.grad_norm_quantiles``.
QUANTILES: dict[str, float] = {"q05": 0.05, "q25": 0.25, "q50": 0.50, "q75": 0.75, "q95": 0.95}
#: Columns of the per-example gradients summed at once (bounds the extra memory).
_BLOCK_COLUMNS = 1 << 14


@dataclass(frozen=True)
class ProbeGradients:
    """A probe's per-example gradients g_i (i = 1..n, dimension d) as the diagnostics need them.

    With the examples sorted by norm (``sorted_norms`` ascending) and I_k the examples k..n-1 of
    that order (k = 0..n; I_n is empty), N_k = Σ_{i∈I_k} g_i/‖g_i‖ and G_k = Σ_{i∈I_k} g_i:
    ``nn[k]`` = N_kᵀN_k, ``ng[k]`` = N_kᵀG_k, ``gg[k]`` = G_kᵀG_k (length n + 1). Every clipped
    set I_C = {i : ‖g_i‖ > C} is one of the I_k. ``norms`` (float64) and ``labels`` keep the
    probe's order. The gradients themselves are kept as one of: ``per_example``, the (n, d)
    matrix (:meth:`from_per_example`), or ``gram``, the (n, n) float64 matrix of g_iᵀg_j
    (:meth:`from_gram`, when d ≫ n and the inner products are cheap, as for a linear head).
    """

    labels: np.ndarray
    norms: np.ndarray
    sorted_norms: np.ndarray
    nn: np.ndarray
    ng: np.ndarray
    gg: np.ndarray
    dimension: int  # d, the number of trainable parameters
    per_example: torch.Tensor | None = None
    gram: torch.Tensor | None = None

    def square_norm(self, weights: torch.Tensor) -> float:
        """‖Σ_i w_i g_i‖² for float64 ``weights`` (n,) in the probe's order."""
        if self.per_example is not None:
            combined = weights.to(self.per_example) @ self.per_example
            return float(torch.linalg.vector_norm(combined, dtype=torch.float64) ** 2)
        assert self.gram is not None
        weights = weights.to(self.gram)
        return float(weights @ self.gram @ weights)

    @classmethod
    def from_per_example(cls, per_example: torch.Tensor, labels: torch.Tensor) -> ProbeGradients:
        """Summarise an (n, d) matrix of per-example gradients in O(n·d) (no n×n Gram matrix).

        Running sums of the rows in *descending* norm order give N_k and G_k for every k at once
        (row j sums the j + 1 largest, i.e. I_{n−1−j}), one block of columns at a time; their
        row-wise dot products accumulate over blocks in float64. The sums run in the matrix's
        dtype: float32 for a trial (relative error ~1e-7, which only moves C* by as much; the
        bias at the trial's C is computed without them, see :func:`clipping_mse`).
        """
        n = len(per_example)
        norms = torch.linalg.vector_norm(per_example, dim=1, dtype=torch.float64)
        descending = torch.argsort(norms, descending=True, stable=True)
        inverse = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))[descending, None]
        inverse = inverse.to(per_example.dtype)
        forms = torch.zeros(3, n + 1, dtype=torch.float64, device=per_example.device)  # column n: I_n = ∅
        for rows in per_example.index_select(0, descending).split(_BLOCK_COLUMNS, dim=1):
            g_sums = rows.cumsum(0)
            n_sums = (rows * inverse).cumsum(0)
            for form, (a, b) in zip(forms, ((n_sums, n_sums), (n_sums, g_sums), (g_sums, g_sums)), strict=True):
                form[:n] += torch.linalg.vecdot(a, b).double()
        return cls._summary(forms, norms, descending, labels, per_example.shape[1], per_example=per_example)

    @classmethod
    def from_gram(cls, gram: torch.Tensor, labels: torch.Tensor, dimension: int) -> ProbeGradients:
        """Summarise per-example gradients of dimension ``dimension`` given by their (n, n) Gram
        matrix K_ij = g_iᵀg_j, in O(n²) float64.

        In descending norm order with u_i = 1/‖g_i‖, the forms over the m largest are the sums over
        the leading m×m block of u_a u_b K_ab, u_a K_ab and K_ab: the diagonal of the matrices'
        two-dimensional running sums.
        """
        gram = gram.double()
        n = len(gram)
        norms = gram.diagonal().clamp_min(0).sqrt()
        descending = torch.argsort(norms, descending=True, stable=True)
        sorted_gram = gram[descending][:, descending]
        inverse = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))[descending]
        forms = torch.zeros(3, n + 1, dtype=torch.float64, device=gram.device)  # column n: I_n = ∅
        for form, matrix in zip(
            forms,
            (inverse[:, None] * sorted_gram * inverse[None, :], inverse[:, None] * sorted_gram, sorted_gram),
            strict=True,
        ):
            form[:n] = matrix.cumsum(0).cumsum(1).diagonal()
        return cls._summary(forms, norms, descending, labels, dimension, gram=gram)

    @classmethod
    def _summary(
        cls,
        forms: torch.Tensor,
        norms: torch.Tensor,
        descending: torch.Tensor,
        labels: torch.Tensor,
        dimension: int,
        **gradients: torch.Tensor,
    ) -> ProbeGradients:
        """The record from running forms whose entry j covers the j + 1 largest norms."""
        n = len(norms)
        forms[:, :n] = forms[:, :n].flip(1)  # entry k ↔ I_k, the examples from the k-th smallest up
        nn_form, ng_form, gg_form = forms.cpu().numpy()
        norms_np = norms.cpu().numpy()
        return cls(
            labels=labels.cpu().numpy(),
            norms=norms_np,
            sorted_norms=norms_np[descending.flip(0).cpu().numpy()],
            nn=nn_form,
            ng=ng_form,
            gg=gg_form,
            dimension=dimension,
            **gradients,
        )


def per_example_gradients(
    model: nn.Module, physical_batches: Iterable[PhysicalBatch], autocast_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, d) float32 per-example gradients of the summed cross-entropy, and the (n,) labels.

    Via Opacus' hooks; rows are flattened over the trainable parameters in
    ``model.parameters()`` order. ``model`` must be in training mode (Opacus captures
    activations only then); call it between optimizer steps (it leaves ``p.grad`` as None).
    """
    from dptune.dp.opacus_engine import grad_sample_hooks  # imports Opacus: only the models that need it

    params = [p for p in model.parameters() if p.requires_grad]
    device_type = params[0].device.type
    rows: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    with grad_sample_hooks(model) as hooks:
        for *inputs, batch_labels in physical_batches:
            with autocast(device_type, autocast_dtype):
                logits = model(*inputs)
            summed_cross_entropy(logits, batch_labels).backward()
            # Opacus' hooks set each parameter's .grad_sample, an attribute torch's Parameter does not declare.
            grad_samples = [p.grad_sample for p in params]  # type: ignore[attr-defined]
            rows.append(torch.cat([g.reshape(len(batch_labels), -1).float() for g in grad_samples], dim=1))
            labels.append(batch_labels)
            hooks.set_grad_sample_to_none()
    for p in params:
        p.grad = None
    return torch.cat(rows), torch.cat(labels)


def probe_gradients(
    model: nn.Module, physical_batches: Iterable[PhysicalBatch], autocast_dtype: torch.dtype | None = None
) -> ProbeGradients:
    """:func:`per_example_gradients` of the probe, summarised (:meth:`ProbeGradients.from_per_example`)."""
    return ProbeGradients.from_per_example(*per_example_gradients(model, physical_batches, autocast_dtype))


def _variance_weight(probe: ProbeGradients, noise_multiplier: float, expected_batch_size: float) -> float:
    """σ²d·n²/B²: the noise term's coefficient of C² in n²·MSE(C)."""
    n = len(probe.labels)
    return noise_multiplier**2 * probe.dimension * (n / expected_batch_size) ** 2


def clipping_mse(
    probe: ProbeGradients, clip_bound: float, noise_multiplier: float, expected_batch_size: float
) -> tuple[float, float]:
    """(bias, variance) of the per-step MSE at C (module docstring): ‖(CN_C − G_C)/n‖², σ²C²d/B².

    The bias is the squared norm of the vector (1/n) Σ_i (min(1, C/‖g_i‖) − 1)·g_i (formed, or from
    the Gram matrix as a quadratic form in float64), which, unlike expanding ‖CN − G‖², loses no
    precision when C·N_C is close to G_C.
    """
    norms = torch.from_numpy(probe.norms)
    weights = torch.where(norms > clip_bound, clip_bound / norms - 1.0, torch.zeros_like(norms)) / len(norms)
    bias = probe.square_norm(weights)
    variance = noise_multiplier**2 * clip_bound**2 * probe.dimension / expected_batch_size**2
    return float(bias), float(variance)


def optimal_clip_bound(probe: ProbeGradients, noise_multiplier: float, expected_batch_size: float) -> float:
    """C* minimising MSE(C) over C ≥ 0 (Theorem 5.2; search over the intervals between norms).

    On the interval [s_(k), s_(k+1)] (s sorted, s_(0) = 0, s_(n+1) = ∞) the clipped set is I_k
    and n²·MSE(C) = C²(N_kᵀN_k + v) − 2C·N_kᵀG_k + G_kᵀG_k with v = σ²d·n²/B²; its minimiser
    N_kᵀG_k/(N_kᵀN_k + v) is clamped to the interval and the best interval wins (ties: smallest C).
    """
    weight = _variance_weight(probe, noise_multiplier, expected_batch_size)
    lower = np.concatenate([[0.0], probe.sorted_norms])
    upper = np.concatenate([probe.sorted_norms, [np.inf]])
    curvature = probe.nn + weight
    stationary = np.divide(probe.ng, curvature, out=np.zeros_like(probe.ng), where=curvature > 0)
    candidates = np.clip(stationary, lower, upper)
    mse = candidates**2 * curvature - 2 * candidates * probe.ng + probe.gg
    return float(candidates[int(np.argmin(mse))])


def class_diagnostics(norms: np.ndarray, labels: np.ndarray, clip_bound: float) -> list[ClassDiagnostics]:
    """Per class y of the probe: norm quantiles, share with ‖g_i‖ > C, and w_y(C) (Eq. 3).

    w_y(C) is the mean of the very factors min(1, C/‖g_i‖) the standard clipping step applies.
    """
    factors = clip_factors(torch.from_numpy(norms), clip_bound, "standard").numpy()
    result = []
    for label in np.unique(labels):
        members = labels == label
        class_norms = norms[members]
        quantiles = np.quantile(class_norms, list(QUANTILES.values()))
        result.append(
            ClassDiagnostics(
                label=int(label),
                examples=int(members.sum()),
                grad_norm_quantiles={key: float(q) for key, q in zip(QUANTILES, quantiles, strict=True)},
                clipped_fraction=float(np.mean(class_norms > clip_bound)),
                retention_weight=float(np.mean(factors[members])),
            )
        )
    return result


def diagnose(
    probe: ProbeGradients, *, epoch: int, clip_bound: float, noise_multiplier: float, expected_batch_size: float
) -> Diagnostics:
    """All of the module's diagnostics of one probe at one epoch, as a :class:`Diagnostics` record."""
    norms = probe.norms
    bias, variance = clipping_mse(probe, clip_bound, noise_multiplier, expected_batch_size)
    return Diagnostics(
        epoch=epoch,
        clip_bound=clip_bound,
        noise_multiplier=noise_multiplier,
        dimension=probe.dimension,
        grad_norms=norms.tolist(),
        labels=probe.labels.tolist(),
        mse_bias=bias,
        mse_variance=variance,
        optimal_clip_bound=optimal_clip_bound(probe, noise_multiplier, expected_batch_size),
        classes=class_diagnostics(norms, probe.labels, clip_bound),
        expected_batch_size=expected_batch_size,
    )
