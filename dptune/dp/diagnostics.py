"""The paper's clipping diagnostics on a fixed probe of training examples (§4–5). Ray-free.

From the per-example gradients g_i (i = 1..n, dimension d) of a probe, summarised by their Gram
matrix K_ij = g_iᵀg_j (float64), at the trial's clip bound C, noise multiplier σ and expected batch
size B:

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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dptune.dp.clipping import clip_factors
from dptune.dp.engine import PhysicalBatch, summed_cross_entropy
from dptune.dp.opacus_engine import autocast, grad_sample_hooks
from dptune.trial import ClassDiagnostics, Diagnostics

#: Per-class gradient-norm quantiles recorded, by key of ``ClassDiagnostics.grad_norm_quantiles``.
QUANTILES: dict[str, float] = {"q05": 0.05, "q25": 0.25, "q50": 0.50, "q75": 0.75, "q95": 0.95}
#: Columns of per-example gradients multiplied at once when forming the Gram matrix in float64.
_GRAM_COLUMNS = 1 << 16


@dataclass(frozen=True)
class ProbeGradients:
    """Per-example gradients of a probe, kept as their Gram matrix K_ij = g_iᵀ g_j.

    ``gram`` is (n, n) float64, ``labels`` (n,) int64 aligned with it, ``dimension`` is d.
    """

    gram: np.ndarray
    labels: np.ndarray
    dimension: int

    @property
    def norms(self) -> np.ndarray:
        """‖g_i‖₂ of every probe example, shape (n,)."""
        return np.sqrt(np.clip(np.diag(self.gram), 0.0, None))


def probe_gradients(
    model: nn.Module, physical_batches: Iterable[PhysicalBatch], autocast_dtype: torch.dtype | None = None
) -> ProbeGradients:
    """Per-example gradients of the summed cross-entropy on the probe, via Opacus' hooks.

    ``model`` must be in training mode (Opacus captures activations only then) with no other
    grad-sample hooks attached; call it between optimizer steps (it leaves ``p.grad`` as None).
    Gradients are flattened over all trainable parameters in ``model.parameters()`` order.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    device_type = params[0].device.type
    rows: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    with grad_sample_hooks(model) as hooks:
        for *inputs, batch_labels in physical_batches:
            with autocast(device_type, autocast_dtype):
                logits = model(*inputs)
            summed_cross_entropy(logits, batch_labels).backward()
            rows.append(torch.cat([p.grad_sample.reshape(len(batch_labels), -1).float() for p in params], dim=1))
            labels.append(batch_labels.cpu())
            hooks.set_grad_sample_to_none()
    for p in params:
        p.grad = None
    per_example = torch.cat(rows)
    gram = torch.zeros(len(per_example), len(per_example), dtype=torch.float64, device=per_example.device)
    for block in per_example.split(_GRAM_COLUMNS, dim=1):
        block64 = block.double()
        gram += block64 @ block64.T
    return ProbeGradients(gram=gram.cpu().numpy(), labels=torch.cat(labels).numpy(), dimension=per_example.shape[1])


def _suffix_forms(gram: np.ndarray, order: np.ndarray, inverse_norms: np.ndarray) -> tuple[np.ndarray, ...]:
    """NᵀN, NᵀG and GᵀG over every suffix {order[k:]} of the examples sorted by norm, k = 0..n.

    Entry k sums over I = order[k:] (entry n is the empty set): NᵀN = Σ_{a,b∈I} K_ab/(s_a s_b),
    NᵀG = Σ_{a,b∈I} K_ab/s_a, GᵀG = Σ_{a,b∈I} K_ab, read off the diagonal of a 2-D suffix sum.
    """
    sorted_gram = gram[np.ix_(order, order)]
    u = inverse_norms[order]
    forms = []
    for matrix in (sorted_gram * np.outer(u, u), sorted_gram * u[:, None], sorted_gram):
        suffix = matrix[::-1, ::-1].cumsum(axis=0).cumsum(axis=1)[::-1, ::-1]
        forms.append(np.append(np.diag(suffix), 0.0))
    return tuple(forms)


def _sorted_suffixes(probe: ProbeGradients) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    norms = probe.norms
    order = np.argsort(norms, kind="stable")
    inverse_norms = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    return norms[order], _suffix_forms(probe.gram, order, inverse_norms)


def _variance_weight(probe: ProbeGradients, noise_multiplier: float, expected_batch_size: float) -> float:
    """σ²d·n²/B²: the noise term's coefficient of C² in n²·MSE(C)."""
    n = len(probe.labels)
    return noise_multiplier**2 * probe.dimension * (n / expected_batch_size) ** 2


def clipping_mse(
    probe: ProbeGradients, clip_bound: float, noise_multiplier: float, expected_batch_size: float
) -> tuple[float, float]:
    """(bias, variance) of the per-step MSE at C (module docstring): ‖(CN_C − G_C)/n‖², σ²C²d/B²."""
    sorted_norms, (nn_form, ng_form, gg_form) = _sorted_suffixes(probe)
    k = int(np.searchsorted(sorted_norms, clip_bound, side="right"))  # I_C = sorted examples k..n-1
    n = len(sorted_norms)
    bias = (clip_bound**2 * nn_form[k] - 2 * clip_bound * ng_form[k] + gg_form[k]) / n**2
    variance = noise_multiplier**2 * clip_bound**2 * probe.dimension / expected_batch_size**2
    return float(max(bias, 0.0)), float(variance)


def optimal_clip_bound(probe: ProbeGradients, noise_multiplier: float, expected_batch_size: float) -> float:
    """C* minimising MSE(C) over C ≥ 0 (Theorem 5.2; search over the intervals between norms).

    On the interval [s_(k), s_(k+1)] (s sorted, s_(0) = 0, s_(n+1) = ∞) the clipped set is the
    examples k+1..n and n²·MSE(C) = C²(NᵀN + v) − 2C·NᵀG + GᵀG with v = σ²d·n²/B²; its minimiser
    NᵀG/(NᵀN + v) is clamped to the interval and the best interval wins (ties: smallest C).
    """
    sorted_norms, (nn_form, ng_form, gg_form) = _sorted_suffixes(probe)
    weight = _variance_weight(probe, noise_multiplier, expected_batch_size)
    lower = np.concatenate([[0.0], sorted_norms])
    upper = np.concatenate([sorted_norms, [np.inf]])
    curvature = nn_form + weight
    stationary = np.divide(ng_form, curvature, out=np.zeros_like(ng_form), where=curvature > 0)
    candidates = np.clip(stationary, lower, upper)
    mse = candidates**2 * curvature - 2 * candidates * ng_form + gg_form
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
        result.append(
            ClassDiagnostics(
                label=int(label),
                examples=int(members.sum()),
                grad_norm_quantiles={key: float(np.quantile(class_norms, q)) for key, q in QUANTILES.items()},
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
