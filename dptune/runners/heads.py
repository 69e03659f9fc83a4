"""K linear heads as one stacked tensor: the closed-form DP step, the stacked optimizer, evaluation
and the probe's gradients of the fused runner (:mod:`dptune.runners.fused`).

A head y = W x + b over features x (dim,) is stored as [W | b], a (classes, dim + 1) matrix acting
on the augmented features x̃ = (x, 1); K heads are a (K, classes, dim + 1) tensor
(:func:`stack_heads`). With δ_i = softmax(W x_i + b) − onehot(y_i) the per-example gradient is
g_i = δ_i x̃_iᵀ, so ‖g_i‖ = ‖δ_i‖·√(‖x_i‖² + 1) and the clipped sum Σ_i f_i g_i = (f ⊙ δ)ᵀ X̃ is one
batched matrix product (:func:`head_noisy_gradients`; the FiLM engine's head path,
:mod:`dptune.dp.film`, for K heads at once). Where the privacy unit is a person (McMahan et al.
2018; Levy et al. 2021) the clipped vector is a person's mean gradient G_u
(:func:`dptune.runners.person_heads.head_person_noisy_gradients`). Everything here is
float32 (float64 sums) and Ray-free; nothing draws a coin (the noise comes in drawn, at its released
scale).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim.adam import adam

from dptune.contract import ClippingRule
from dptune.dp.clipping import clip_factors, noise_std, update_scale
from dptune.dp.diagnostics import ProbeGradients
from dptune.runners.common import Evaluation, PersonScore

#: Optimizers :class:`StackedOptimizer` steps (a subset of ``dptune.dp.optimizers.OPTIMIZERS``).
FUSABLE_OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
#: Evaluation rows scored at once (all configurations of a group together).
EVALUATION_ROWS = 4096
#: Adam's defaults in torch.optim.Adam.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPSILON = 1e-8


@dataclass
class HeadGradients:
    """One step's released gradients of K stacked heads and what the trial reads off them.

    ``heads`` (K, classes, dim + 1) is ``update_scale_k · (Σ_i f_i g_i + s_k·z_k)`` in the layout
    of :func:`stack_heads`; ``losses`` (K,) Σ_i ℓ_i over each configuration's batch; ``norms``
    (K, n) ‖g_i‖ (0 at padding; person-level: ‖G_u‖ of the row's person u).
    """

    heads: torch.Tensor
    losses: torch.Tensor
    norms: torch.Tensor


def stack_heads(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]) -> torch.Tensor:
    """K heads y = W x + b as one (K, classes, dim + 1) float32 tensor [W | b]: column ``dim`` is b.

    With features augmented by a constant 1 (:func:`augment`), x̃ = (x, 1), a head is the linear
    map y = [W | b] x̃, its per-example gradient is δ x̃ᵀ (weight and bias at once) and
    ‖g_i‖ = ‖δ_i‖·‖x̃_i‖ = ‖δ_i‖·√(‖x_i‖² + 1).
    """
    return torch.cat([torch.stack(list(weights)), torch.stack(list(biases)).unsqueeze(2)], dim=2).float()


def augment(features: torch.Tensor) -> torch.Tensor:
    """x̃ = (x, 1) for every row of ``features`` (…, dim) → (…, dim + 1), float32."""
    return torch.cat([features.float(), features.new_ones(*features.shape[:-1], 1, dtype=torch.float32)], dim=-1)


def head_deltas(heads: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """δ_i = ∂ℓ_i/∂logits = softmax([W | b] x̃_i) − onehot(y_i) and ℓ_i (cross-entropy), float32.

    ``heads`` (K, classes, dim + 1), augmented ``features`` (K, n, dim + 1), ``labels`` (K, n)
    → δ of shape (K, n, classes) and ℓ of shape (K, n).
    """
    log_probs = F.log_softmax(torch.bmm(features, heads.transpose(1, 2)), dim=2)
    label_index = labels.unsqueeze(2)
    losses = -log_probs.gather(2, label_index).squeeze(2)
    return log_probs.exp_().scatter_(2, label_index, -1.0, reduce="add"), losses


def head_noisy_gradients(
    heads: torch.Tensor,
    features: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    feature_norms: torch.Tensor,
    clip_bounds: torch.Tensor,
    rule: ClippingRule,
    noise: torch.Tensor,
    scales: torch.Tensor,
) -> HeadGradients:
    """The DP step of :mod:`dptune.dp.engine` for K linear heads on K padded batches at once.

    Shapes: ``heads`` (K, classes, dim + 1) (:func:`stack_heads`); ``features`` (K, n, dim + 1)
    augmented (:func:`augment`) and padded with rows of zeros (x̃ = 0, so a padding row's gradient
    δ x̃ᵀ is 0 and it adds nothing to the sum); ``labels`` (K, n) int64; ``row_weights`` (K, n) 1.0
    for a batch row, 0.0 for padding (whose loss is left out); ``feature_norms`` (K, n) ‖x̃_i‖ (0 at
    padding); ``clip_bounds`` and ``scales`` (``update_scale``) (K,); ``noise`` (K, classes, dim + 1)
    the released Gaussian noise, one draw per parameter, already at its released scale
    ``scales_k · s_k · z`` with s_k = ``noise_std`` and z standard normal (:func:`released_noise_stds`).
    Per configuration k::

        released_k = scales_k · Σ_i f_i g_i + noise_k,  f = clip_factors(‖g‖, C_k, rule)

    with g_i = δ_i x̃_iᵀ and ‖g_i‖ = ‖δ_i‖·‖x̃_i‖; the clipped sum and the noise are one batched
    product that accumulates into the noise, ``baddbmm(noise, (scales·f ⊙ δ)ᵀ, X̃)``. Each step is a
    dozen tensor operations, most of them in place: at small batches their dispatch, not their
    arithmetic, is the step's cost.
    """
    deltas, row_losses = head_deltas(heads, features, labels)
    losses = torch.linalg.vecdot(row_losses, row_weights)
    norms = torch.linalg.vector_norm(deltas, dim=2).mul_(feature_norms)
    factors = clip_factors(norms, clip_bounds.unsqueeze(1), rule).mul_(scales.unsqueeze(1))
    released = torch.baddbmm(noise, deltas.mul_(factors.unsqueeze(2)).transpose(1, 2), features)
    return HeadGradients(heads=released, losses=losses, norms=norms)


def released_noise_stds(
    noise_multiplier: float, clip_bounds: Sequence[float], rule: ClippingRule, expected_batch_size: float
) -> list[float]:
    """Each configuration's standard deviation of the noise in its released gradient,
    ``update_scale(C_k) · noise_std(σ, C_k)``: the noise of :func:`head_noisy_gradients` is drawn
    at this scale directly (one pass over the draws instead of two multiplications)."""
    return [update_scale(c, rule, expected_batch_size) * noise_std(noise_multiplier, c, rule) for c in clip_bounds]


class StackedOptimizer:
    """Adam or SGD over K stacked parameter sets, each with its own learning rate η_k.

    Matches ``torch.optim.Adam(params, lr=η_k)`` (betas (0.9, 0.999), eps 1e-8, bias correction,
    no weight decay) and ``torch.optim.SGD(params, lr=η_k)`` (no momentum) stepping each
    configuration's parameters on its gradient. ``params`` are tensors with the configurations on
    their first axis, updated in place; ``step(grads, active)`` leaves the rows where ``active``
    (K,) is False untouched (a configuration that diverged stops updating).

    Adam runs as torch's fused kernel (``torch.optim.adam.adam(fused=True)``, one pass over the
    gradient and both moments) at lr = 1 on a *direction* D zeroed before each step, so that
    afterwards D = −m̂/(√v̂ + eps), every configuration's step at unit rate; each configuration then
    moves by its own rate, θ_k ← θ_k + η_k·D_k, which is Adam's θ_k ← θ_k − η_k·m̂_k/(√v̂_k + eps).
    """

    def __init__(self, name: str, params: Sequence[torch.Tensor], learning_rates: torch.Tensor) -> None:
        if name not in FUSABLE_OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} is not one of {', '.join(FUSABLE_OPTIMIZERS)}")
        self.name = name
        self.params = list(params)
        self.learning_rates = learning_rates
        moments = name == "adam"
        self.first_moments = [torch.zeros_like(p) for p in self.params] if moments else []
        self.second_moments = [torch.zeros_like(p) for p in self.params] if moments else []
        self.directions = [torch.zeros_like(p) for p in self.params] if moments else []
        self.step_counts = [torch.zeros((), device=p.device) for p in self.params] if moments else []  # Adam's t

    def step(self, grads: Sequence[torch.Tensor], active: torch.Tensor | None) -> None:
        """One optimizer step of every active configuration on ``grads`` (shapes as ``params``);
        ``active`` (K,) bool, or None where every configuration is active (no mask is applied: a
        broadcast ``torch.where`` costs more than the fused Adam step on the CPU)."""
        if self.name == "adam":
            for direction in self.directions:
                direction.zero_()
            beta1, beta2 = ADAM_BETAS
            adam(
                self.directions,
                list(grads),
                self.first_moments,
                self.second_moments,
                [],
                self.step_counts,
                fused=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=1.0,
                weight_decay=0.0,
                eps=ADAM_EPSILON,
                maximize=False,
            )
            updates = self.directions
        else:
            updates = [-grad for grad in grads]
        for param, update in zip(self.params, updates, strict=True):
            rows = (-1, *([1] * (param.dim() - 1)))
            if active is not None:  # a stopped configuration's update may be NaN: 0·NaN would move its frozen head
                update = torch.where(active.view(rows), update, 0.0)
            param.addcmul_(update, self.learning_rates.view(rows))


def stacked_evaluations(
    heads: torch.Tensor,
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    people: np.ndarray | None = None,
) -> list[Evaluation]:
    """Mean cross-entropy, accuracy and per-class counts of each of K heads (K, classes, dim + 1)
    on one split. ``features`` (rows, dim) and ``labels`` (rows,) may live on the CPU; they are
    scored ``EVALUATION_ROWS`` at a time on the heads' device, all K heads in one matrix product.
    With ``people`` (the split's person of each row, :class:`dptune.data.People`), each evaluation
    carries its :class:`~dptune.runners.common.PersonScore`, the selection count per person.
    """
    k, classes, _ = heads.shape
    device = heads.device
    flat = heads.reshape(k * classes, -1)
    loss = torch.zeros(k, dtype=torch.float64, device=device)
    correct = torch.zeros(k, num_classes, dtype=torch.float64, device=device)
    right_rows: list[torch.Tensor] = []  # (K, rows) per block, person-level only
    for rows, row_labels in zip(features.split(EVALUATION_ROWS), labels.split(EVALUATION_ROWS), strict=True):
        rows, row_labels = augment(rows.to(device)), row_labels.to(device)
        logits = (rows @ flat.T).view(-1, k, classes).transpose(0, 1)  # (K, rows, classes)
        loss += F.cross_entropy(logits.transpose(1, 2), row_labels.expand(k, -1), reduction="none").sum(1).double()
        right = logits.argmax(2) == row_labels
        correct.index_add_(1, row_labels, right.double())
        if people is not None:
            right_rows.append(right.cpu())
    examples = torch.bincount(labels, minlength=num_classes).numpy()
    total = int(examples.sum())
    loss_np, correct_np = loss.cpu().numpy(), correct.cpu().numpy().round().astype(np.int64)
    scores: list[PersonScore | None] = [None] * k
    if people is not None:
        right_np = torch.cat(right_rows, dim=1).numpy() if right_rows else np.zeros((k, 0), dtype=bool)
        scores = [PersonScore.of(right_np[i], people) for i in range(k)]
    return [Evaluation.of(float(loss_np[i]) / total, correct_np[i], examples, scores[i]) for i in range(k)]


def head_probe_gradients(head: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> ProbeGradients:
    """The probe's per-example gradients g_i = δ_i x̃_iᵀ of one head (classes, dim + 1) on augmented
    ``features`` (n, dim + 1), summarised for the diagnostics, which depend on them only through
    inner products: g_iᵀg_j = (δ_iᵀδ_j)(x̃_iᵀx̃_j), an (n, n) Gram matrix in O(n²·(classes + dim))
    instead of n gradients of classes·(dim + 1) entries."""
    deltas, _ = head_deltas(head.unsqueeze(0), features.unsqueeze(0), labels.unsqueeze(0))
    deltas, features = deltas[0].double(), features.double()
    return ProbeGradients.from_gram(
        (deltas @ deltas.T) * (features @ features.T), labels, head.shape[0] * head.shape[1]
    )
