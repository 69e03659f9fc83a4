"""The paper's diagnostics against direct numpy computations and brute-force per-example backward passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from dptune.dp.diagnostics import (
    ProbeGradients,
    class_diagnostics,
    clipping_mse,
    optimal_clip_bound,
    per_example_gradients,
    probe_gradients,
)
from dptune.dp.sampling import physical_batches
from dptune.models import build_model


def probe_from_vectors(vectors: np.ndarray) -> ProbeGradients:
    return ProbeGradients.from_per_example(torch.from_numpy(vectors), torch.zeros(len(vectors), dtype=torch.int64))


def direct_mse(vectors: np.ndarray, clip_bound: float, sigma: float, batch: float) -> tuple[float, float]:
    """‖mean_i(clip_C(g_i) − g_i)‖² and σ²C²d/B², straight from the vectors."""
    norms = np.linalg.norm(vectors, axis=1)
    clipped = vectors * np.minimum(1.0, clip_bound / norms)[:, None]
    bias = float(np.sum((clipped - vectors).mean(axis=0) ** 2))
    return bias, sigma**2 * clip_bound**2 * vectors.shape[1] / batch**2


def random_vectors(seed: int, n: int = 14, d: int = 6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=d)
    vectors = rng.normal(size=(n, d)) + 1.5 * direction  # correlated, so clipping bias is not trivial
    return vectors * rng.lognormal(0.0, 0.8, size=(n, 1))  # spread of norms over several octaves


def test_probe_gradients_match_a_brute_force_per_example_backward_pass() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.ReLU(), nn.Linear(6, 3))
    model[0].bias.requires_grad_(False)
    x, y = torch.randn(9, 4) * 2, torch.tensor([0, 1, 2, 0, 1, 2, 0, 0, 1])
    trainable = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(y)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, trainable)]).double().numpy())
    brute = np.stack(rows)

    gradients, labels = per_example_gradients(model.train(), physical_batches((x, y), 4, torch.device("cpu")))

    np.testing.assert_allclose(gradients.double().numpy(), brute, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(labels.numpy(), y.numpy())
    assert all(p.grad is None for p in model.parameters())  # left clean for the next optimizer step
    probe = probe_gradients(model, physical_batches((x, y), 4, torch.device("cpu")))
    assert probe.dimension == sum(p.numel() for p in trainable)
    np.testing.assert_allclose(probe.norms, np.linalg.norm(brute, axis=1), rtol=1e-5)


def test_suffix_forms_match_the_clipped_sets_directly() -> None:
    vectors = random_vectors(seed=6)
    probe = probe_from_vectors(vectors)
    norms = np.linalg.norm(vectors, axis=1)
    np.testing.assert_allclose(probe.sorted_norms, np.sort(norms))
    for k, threshold in enumerate(np.concatenate([[-1.0], np.sort(norms)])):
        clipped = norms > threshold  # I_k: the examples above the k-th smallest norm
        big_g = vectors[clipped].sum(axis=0)
        big_n = (vectors[clipped] / norms[clipped, None]).sum(axis=0)
        assert (probe.nn[k], probe.ng[k], probe.gg[k]) == pytest.approx(
            (big_n @ big_n, big_n @ big_g, big_g @ big_g), rel=1e-10, abs=1e-10
        )


def test_probe_gradients_of_minilm_film_match_brute_force() -> None:
    """The real text backbone: FiLM over every LayerNorm of MiniLM plus the head."""
    torch.manual_seed(0)
    model = build_model("minilm", "film", 4)
    nn.init.normal_(model.head.weight, std=0.5)  # a zero head would pass no gradient to the LayerNorms
    model.eval()  # no dropout, so that one-at-a-time passes see the same network ...
    for module in model.modules():  # ... but Opacus records trainable layers only in training mode
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            module.train()
    ids = torch.randint(1000, 20000, (5, 12))
    mask = torch.ones_like(ids)
    mask[3, 8:] = 0  # a padded example
    y = torch.tensor([0, 1, 2, 3, 1])
    trainable = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(len(y)):
        loss = nn.functional.cross_entropy(model(ids[i : i + 1], mask[i : i + 1]), y[i : i + 1], reduction="sum")
        norms.append(float(torch.sqrt(sum((g**2).sum() for g in torch.autograd.grad(loss, trainable)))))

    probe = probe_gradients(model, physical_batches((ids, mask, y), 3, torch.device("cpu")))

    assert probe.dimension == sum(p.numel() for p in trainable)
    np.testing.assert_allclose(probe.norms, norms, rtol=1e-4)


def test_class_diagnostics_match_numpy() -> None:
    norms = np.array([0.2, 0.9, 1.5, 3.0, 0.1, 4.0, 2.5, 0.7])
    labels = np.array([0, 0, 0, 0, 1, 1, 1, 2])
    clip_bound = 1.0

    by_label = {c.label: c for c in class_diagnostics(norms, labels, clip_bound)}

    assert sorted(by_label) == [0, 1, 2]
    for label in (0, 1, 2):
        members = norms[labels == label]
        record = by_label[label]
        assert record.examples == len(members)
        assert record.clipped_fraction == pytest.approx(np.mean(members > clip_bound))
        assert record.retention_weight == pytest.approx(np.mean(np.minimum(1.0, clip_bound / members)), rel=1e-5)
        assert record.grad_norm_quantiles["q50"] == pytest.approx(np.median(members))
        assert record.grad_norm_quantiles["q05"] <= record.grad_norm_quantiles["q95"]
    assert by_label[0].retention_weight == pytest.approx((1 + 1 + 1 / 1.5 + 1 / 3.0) / 4, rel=1e-5)


@pytest.mark.parametrize(("sigma", "batch"), [(0.0, 14.0), (0.3, 14.0), (1.0, 14.0), (0.8, 50.0), (4.0, 3.0)])
def test_clipping_mse_matches_numpy_at_every_clip_bound(sigma: float, batch: float) -> None:
    vectors = random_vectors(seed=3)
    probe = probe_from_vectors(vectors)
    for clip_bound in np.concatenate([np.linalg.norm(vectors, axis=1), [0.05, 0.7, 2.0, 100.0]]):
        bias, variance = clipping_mse(probe, float(clip_bound), sigma, batch)
        want_bias, want_variance = direct_mse(vectors, float(clip_bound), sigma, batch)
        assert bias == pytest.approx(want_bias, rel=1e-9, abs=1e-12)
        assert variance == pytest.approx(want_variance, rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("sigma", "batch"), [(0.2, 14.0), (1.0, 14.0), (0.8, 40.0), (3.0, 5.0)])
def test_optimal_clip_bound_matches_dense_grid_search(seed: int, sigma: float, batch: float) -> None:
    vectors = random_vectors(seed)
    probe = probe_from_vectors(vectors)
    norms = np.linalg.norm(vectors, axis=1)
    grid = np.linspace(0.0, 1.2 * norms.max(), 20001)
    factors = np.minimum(1.0, grid[:, None] / norms[None, :])  # (grid, n): min(1, C/‖g_i‖)
    bias = np.sum(((factors - 1.0)[:, :, None] * vectors[None]).mean(axis=1) ** 2, axis=1)
    grid_mse = bias + sigma**2 * grid**2 * vectors.shape[1] / batch**2

    best = optimal_clip_bound(probe, sigma, batch)

    assert sum(direct_mse(vectors, best, sigma, batch)) <= grid_mse.min() + 1e-12
    assert best == pytest.approx(grid[np.argmin(grid_mse)], abs=2 * (grid[1] - grid[0]))


def test_optimal_clip_bound_is_the_fixed_point_of_theorem_5_2_when_batch_is_the_probe() -> None:
    vectors = random_vectors(seed=4)
    n, d = vectors.shape
    sigma = 0.15
    best = optimal_clip_bound(probe_from_vectors(vectors), sigma, float(n))
    norms = np.linalg.norm(vectors, axis=1)
    assert not np.isclose(norms, best).any()  # an interior solution, not one of the ‖g_i‖
    clipped = norms > best  # I_{C*}
    big_g = vectors[clipped].sum(axis=0)  # G_{C*}
    big_n = (vectors[clipped] / norms[clipped, None]).sum(axis=0)  # N_{C*}
    assert best == pytest.approx(big_n @ big_g / (big_n @ big_n + sigma**2 * d), rel=1e-10)


def test_float32_gradients_give_the_float64_diagnostics() -> None:
    """Trials summarise float32 gradients: C* and the bias at C barely move from float64."""
    vectors = random_vectors(seed=7, n=200, d=300)
    exact = probe_from_vectors(vectors)
    single = ProbeGradients.from_per_example(torch.from_numpy(vectors).float(), torch.zeros(200, dtype=torch.int64))
    clip_bound = float(np.quantile(exact.norms, 0.3))  # most examples clipped, slightly: C·N_C ≈ G_C
    assert optimal_clip_bound(single, 0.5, 64.0) == pytest.approx(optimal_clip_bound(exact, 0.5, 64.0), rel=1e-5)
    assert clipping_mse(single, clip_bound, 0.5, 64.0)[0] == pytest.approx(
        clipping_mse(exact, clip_bound, 0.5, 64.0)[0], rel=1e-5
    )


def test_without_noise_nothing_should_be_clipped() -> None:
    vectors = random_vectors(seed=5)
    probe = probe_from_vectors(vectors)
    assert optimal_clip_bound(probe, 0.0, 10.0) == pytest.approx(np.linalg.norm(vectors, axis=1).max())


def test_gram_summary_of_rank_one_gradients_equals_the_per_example_one() -> None:
    """A linear head's g_i = δ_i x̃_iᵀ: the (n, n) Gram route gives the same norms, forms, MSE and C*."""
    generator = torch.Generator().manual_seed(3)
    deltas = torch.randn(64, 5, generator=generator, dtype=torch.float64)
    features = torch.randn(64, 9, generator=generator, dtype=torch.float64)
    deltas[7] = 0  # a zero gradient: its inverse norm is 0 on both routes
    labels = torch.randint(0, 5, (64,), generator=generator)
    per_example = (deltas.unsqueeze(2) * features.unsqueeze(1)).flatten(1)
    dense = ProbeGradients.from_per_example(per_example, labels)
    gram = ProbeGradients.from_gram((deltas @ deltas.T) * (features @ features.T), labels, 45)
    assert gram.dimension == dense.dimension == 45 and gram.per_example is None
    for field in ("norms", "sorted_norms", "nn", "ng", "gg"):
        np.testing.assert_allclose(getattr(gram, field), getattr(dense, field), rtol=1e-10, atol=1e-10)
    for clip_bound in (0.1, 1.0, 10.0):
        np.testing.assert_allclose(
            clipping_mse(gram, clip_bound, 1.3, 32.0), clipping_mse(dense, clip_bound, 1.3, 32.0), rtol=1e-10
        )
    assert optimal_clip_bound(gram, 1.3, 32.0) == pytest.approx(optimal_clip_bound(dense, 1.3, 32.0), rel=1e-10)
