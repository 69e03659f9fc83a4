"""The person-level DP step of K linear heads (user-level DP-SGD: McMahan et al. 2018; Levy et al. 2021):
the clipped vector is a person's mean gradient G_u, whose norm comes from the inner products of the
person's rows (:func:`person_norms`: Grams of tiles of consecutive rows), so no G_u is formed for
people with few rows. The row-level step and the rest of the fused runner's head arithmetic are
:mod:`dptune.runners.heads`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from dptune.contract import ClippingRule
from dptune.dp.clipping import clip_factors
from dptune.runners.batches import tile_rows
from dptune.runners.heads import HeadGradients, head_deltas

if TYPE_CHECKING:
    from dptune.runners.batches import PersonBatches


def head_person_noisy_gradients(
    heads: torch.Tensor,
    features: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    persons: PersonBatches,
    clip_bounds: torch.Tensor,
    rule: ClippingRule,
    noise: torch.Tensor,
    scales: torch.Tensor,
) -> HeadGradients:
    """The person-level DP step (user-level DP-SGD: McMahan et al. 2018, Algorithm 1 with per-user
    clipping; Levy et al. 2021) for K linear heads on K padded batches of people's rows at once.

    Shapes as :func:`head_noisy_gradients`; ``rows`` is its (``labels``, ``row_weights``,
    ``feature_norms``) and ``persons`` (:class:`~dptune.runners.batches.PersonBatches`, one step)
    says whose each row is. Person u's gradient is the mean of its m_u used rows' gradients,
    G_u = (1/m_u) Σ_{i∈u} δ_i x̃_iᵀ (weight and bias), and per configuration k::

        released_k = scales_k · Σ_u f_u G_u + noise_k,  f_u = clip_factors(‖G_u‖, C_k, rule)

    so each person's summand has norm ≤ C_k (1 under AUTO-S) whatever its rows: the sensitivity the
    accountant assumes, under add/remove of a person. ‖G_u‖ is :func:`person_norms`; the clipped sum
    is one batched product with row factors f_{u(i)}/m_{u(i)} (0 at padding).
    """
    labels, row_weights, feature_norms = rows
    deltas, row_losses = head_deltas(heads, features, labels)
    losses = torch.linalg.vecdot(row_losses, row_weights)
    norms = person_norms(deltas, features, feature_norms, persons)
    factors = clip_factors(norms, clip_bounds.unsqueeze(1), rule).mul_(scales.unsqueeze(1))
    row_factors = factors.gather(1, persons.segments).mul_(persons.weights)
    released = torch.baddbmm(noise, deltas.mul_(row_factors.unsqueeze(2)).transpose(1, 2), features)
    return HeadGradients(heads=released, losses=losses, norms=norms.gather(1, persons.segments).mul_(row_weights))


def person_norms(
    deltas: torch.Tensor, features: torch.Tensor, feature_norms: torch.Tensor, persons: PersonBatches
) -> torch.Tensor:
    """‖G_u‖ (K, ``persons.num_segments``; float32, ≥ 0) of every person's mean gradient, from the
    inner products of its rows (no G_u is formed for a person in the band):

        ‖G_u‖² = Σ_{i,j∈u} w_i w_j (δ_i·δ_j)(x̃_i·x̃_j),  w_i = 1/m_u,

    the diagonal as (w_i ‖δ_i‖ ‖x̃_i‖)², the pairs i ≠ j from :func:`_band_pairs` (a person's rows
    are consecutive, and a person of m_u ≤ D + 1 rows, D = ``persons.band``, has them at most D
    apart); a person listed in ``persons.blocks`` (more rows) has its ‖G_u‖² replaced by that of G_u
    itself (:func:`_block_squares`). ``deltas`` (K, n, classes), ``features`` (K, n, dim + 1)
    augmented, ``feature_norms`` (K, n). Per-row terms are float32, their sum per person float64.
    Cost: 2·K·n·T·(classes + dim + 1) products (T = :func:`~dptune.runners.batches.tile_rows`, none
    at D = 0) plus m_u·classes·(dim + 1) per block. The padding slot (the last) reads no row.
    """
    weights = persons.weights
    k, n = weights.shape
    terms = (torch.linalg.vector_norm(deltas, dim=2) * feature_norms * weights).square_()
    if persons.band:
        people = persons.segments + torch.arange(k, device=weights.device).unsqueeze(1) * persons.num_segments
        flat = (deltas.mul(weights.unsqueeze(2)).reshape(k * n, -1), features.reshape(k * n, -1), people.reshape(-1))
        terms += _band_pairs(*flat, tile_rows(persons.band)).view(k, n)
    squares = terms.new_zeros(k, persons.num_segments, dtype=torch.float64)
    squares.scatter_add_(1, persons.segments, terms.double())
    if len(persons.blocks):
        squares[persons.blocks[:, 1], persons.blocks[:, 4]] = _block_squares(deltas, features, persons.blocks)
    return squares.clamp_(min=0.0).sqrt_().float()


def _band_pairs(deltas: torch.Tensor, features: torch.Tensor, people: torch.Tensor, tile: int) -> torch.Tensor:
    """Per row i (float32, (R,)) of R rows cut into tiles of ``tile`` rows (the last, partial tile
    apart): Σ_j [u(j) = u(i), j ≠ i] (δ_i·δ_j)(x̃_i·x̃_j) over the rows j of i's tile, plus twice that
    over the rows of the next tile (each pair across two tiles counted once, at its first row).
    ``deltas`` (R, classes) already weighted by w, ``features`` (R, dim + 1), ``people`` (R,) int64
    ids, unique across configurations. Summed over a person whose rows lie within ``tile`` of each
    other, the terms are its Σ_{i≠j}; cost two (tile × tile) Grams per tile of deltas and features,
    as batched products of views (no gathers, no copies)."""
    rows = len(people)
    full = rows - rows % tile
    out = deltas.new_zeros(rows)
    tiles = full // tile
    if tiles:
        d, x, u = (
            deltas[:full].view(tiles, tile, -1),
            features[:full].view(tiles, tile, -1),
            people[:full].view(tiles, tile),
        )
        out[:full] = _gram_terms((d, x, u), (d, x, u), exclude_self=True).view(-1)
        if tiles > 1:
            out[: full - tile] += 2.0 * _gram_terms((d[:-1], x[:-1], u[:-1]), (d[1:], x[1:], u[1:]), False).view(-1)
    if full < rows:  # the partial tile: its own pairs, and its pairs with the last full tile
        tail = (deltas[full:].unsqueeze(0), features[full:].unsqueeze(0), people[full:].unsqueeze(0))
        out[full:] = _gram_terms(tail, tail, exclude_self=True).view(-1)
        if tiles:
            last = (d[-1:], x[-1:], u[-1:])
            out[full - tile : full] += 2.0 * _gram_terms(last, tail, exclude_self=False).view(-1)
    return out


def _gram_terms(
    left: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    right: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    exclude_self: bool,
) -> torch.Tensor:
    """(t, a): Σ_j [u_j = u_i] (δ_i·δ_j)(x̃_i·x̃_j) of batched (deltas (t, a | b, classes), features
    (t, a | b, dim + 1), people (t, a | b)) ``left`` rows i against ``right`` rows j, without j = i
    where ``exclude_self`` (``left`` is ``right``). Two batched (a × b) Grams, float32."""
    (left_deltas, left_features, left_people), (right_deltas, right_features, right_people) = left, right
    products = torch.bmm(left_deltas, right_deltas.transpose(1, 2))
    products.mul_(torch.bmm(left_features, right_features.transpose(1, 2)))
    same = left_people.unsqueeze(2) == right_people.unsqueeze(1)
    if exclude_self:
        same &= ~torch.eye(same.shape[1], dtype=torch.bool, device=same.device)
    return products.mul_(same).sum(2)


def _block_squares(deltas: torch.Tensor, features: torch.Tensor, blocks: np.ndarray) -> torch.Tensor:
    """‖G_u‖² (float64, one per block) of the people :attr:`~dptune.runners.batches.PersonBatches.blocks`
    lists, each formed outright: G_u = (1/m_u) δ[k, first:end]ᵀ X̃[k, first:end], m_u = end − first.
    Blocks of similar m_u (within a factor √2) are padded to their largest m and formed by one
    batched product (m·classes·(dim + 1) products each; the padding rows' δ are zeroed)."""
    k, n, classes = deltas.shape
    flat_deltas, flat_features = deltas.reshape(k * n, classes), features.reshape(k * n, -1)
    sizes = blocks[:, 3] - blocks[:, 2]
    starts = blocks[:, 1] * n + blocks[:, 2]
    buckets = np.ceil(2.0 * np.log2(sizes)).astype(np.int64)
    squares = torch.empty(len(blocks), dtype=torch.float64, device=deltas.device)
    for bucket in np.unique(buckets).tolist():
        chosen = np.flatnonzero(buckets == bucket)
        offsets = np.arange(int(sizes[chosen].max()))
        inside = offsets < sizes[chosen, None]
        positions = torch.from_numpy(starts[chosen, None] + np.where(inside, offsets, 0)).to(deltas.device)
        scale = torch.from_numpy(inside / sizes[chosen, None]).to(deltas.device, torch.float32)
        block_deltas = flat_deltas[positions].mul_(scale.unsqueeze(2))
        products = torch.bmm(block_deltas.transpose(1, 2), flat_features[positions])
        squares[torch.from_numpy(chosen).to(deltas.device)] = torch.linalg.matrix_norm(products).double().square_()
    return squares
