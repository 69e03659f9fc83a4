"""DP step: Poisson sampling, clipping rules against independent computations, engine selection."""

from __future__ import annotations

import math

import pytest
import torch
from opacus import GradSampleModule
from opacus.data_loader import DPDataLoader
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptune.dp.clipping import AUTO_S_STABILITY
from dptune.dp.engine import DPStepSpec
from dptune.dp.engine_registry import select_engine
from dptune.dp.film import FilmEngine
from dptune.dp.opacus_engine import OpacusEngine, RuleDPOptimizer
from dptune.dp.optimizers import build_optimizer
from dptune.dp.sampling import physical_batches, poisson_loader

CPU = torch.device("cpu")


def small_model(seed: int = 0) -> nn.Module:
    """Linear → LayerNorm → tanh → Linear with the first layer frozen (4 trainable tensors)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))
    model[0].requires_grad_(False)
    return model


def small_batch(n: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=generator) * 3, torch.randint(0, 3, (n,), generator=generator)


def brute_force_per_example(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    """g_i for every example by its own backward pass (list over examples of per-parameter grads)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(len(y)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        grads.append([g.detach() for g in torch.autograd.grad(loss, trainable)])
    return grads


def engine_gradient(
    model: nn.Module, rule: str, clip_bound: float, noise_multiplier: float, batch, expected: float, seed: int = 5
) -> tuple[list[torch.Tensor], float]:
    spec = DPStepSpec(noise_multiplier=noise_multiplier, clip_bound=clip_bound, rule=rule, expected_batch_size=expected)
    engine = OpacusEngine(model, spec, torch.Generator().manual_seed(seed))
    loss = engine.noisy_gradient(physical_batches(batch, 3, CPU))
    return [p.grad.clone() for p in model.parameters() if p.requires_grad], loss


def test_standard_clipping_matches_brute_force_per_example_computation() -> None:
    model = small_model()
    x, y = small_batch()
    clip_bound, sigma, expected, seed = 1.5, 0.7, 6.0, 11
    per_example = brute_force_per_example(model, x, y)
    norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gs)) for gs in per_example])
    assert (norms > clip_bound).any() and (norms < clip_bound).any()  # both branches of min(1, C/‖g‖)
    generator = torch.Generator().manual_seed(seed)  # the engine draws noise per parameter, in order
    expected_grads = []
    for k, p in enumerate(p for p in model.parameters() if p.requires_grad):
        clipped_sum = sum(min(1.0, clip_bound / float(norms[i])) * per_example[i][k] for i in range(len(y)))
        noise = torch.normal(0.0, sigma * clip_bound, size=p.shape, generator=generator)
        expected_grads.append((clipped_sum + noise) / expected)
    expected_loss = nn.functional.cross_entropy(model(x), y, reduction="sum").item()

    grads, loss = engine_gradient(model, "standard", clip_bound, sigma, (x, y), expected, seed)

    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert model[0].weight.grad is None  # frozen parameters get no gradient


def test_normalized_clipping_update_is_invariant_to_clip_bound_when_all_examples_are_clipped() -> None:
    x, y = small_batch()
    first, _ = engine_gradient(small_model(), "normalized", 1e-3, 1.3, (x, y), 7.0)
    second, _ = engine_gradient(small_model(), "normalized", 1e-2, 1.3, (x, y), 7.0)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    standard_first, _ = engine_gradient(small_model(), "standard", 1e-3, 1.3, (x, y), 7.0)
    standard_second, _ = engine_gradient(small_model(), "standard", 1e-2, 1.3, (x, y), 7.0)
    assert not torch.allclose(standard_first[0], standard_second[0])  # standard clipping does scale with C


def test_auto_s_matches_its_formula_on_a_hand_example() -> None:
    # Linear(2→2) at zero: softmax = (½, ½), so g_i = (½ − onehot(y_i)) x_iᵀ and ‖g_i‖ = ‖x_i‖/√2.
    model = nn.Linear(2, 2, bias=False)
    nn.init.zeros_(model.weight)
    x = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    y = torch.tensor([0, 1])
    g1 = torch.tensor([[-1.5, -2.0], [1.5, 2.0]])  # norm 5/√2
    g2 = torch.tensor([[0.0, 0.5], [0.0, -0.5]])  # norm 1/√2
    gamma = AUTO_S_STABILITY
    expected = (g1 / (5 / math.sqrt(2) + gamma) + g2 / (1 / math.sqrt(2) + gamma)) / 4.0

    (grad,), _ = engine_gradient(model, "auto_s", 123.0, 0.0, (x, y), 4.0)  # C plays no role in AUTO-S

    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # Opacus' hook on the input layer
def test_rule_optimizer_in_opacus_own_flow_matches_the_engine_step() -> None:
    """DP-SGD as Opacus runs it (GradSampleModule, BatchMemoryManager, optimizer.step) = engine + SGD."""
    x, y = small_batch(n=9)
    lr, clip_bound, sigma, expected = 0.3, 1.0, 0.8, 8.0
    engine_model = small_model()
    trainable = [p for p in engine_model.parameters() if p.requires_grad]
    sgd = build_optimizer("sgd", trainable, lr)
    spec = DPStepSpec(noise_multiplier=sigma, clip_bound=clip_bound, rule="normalized", expected_batch_size=expected)
    OpacusEngine(engine_model, spec, torch.Generator().manual_seed(4)).noisy_gradient(physical_batches((x, y), 4, CPU))
    sgd.step()

    opacus_model = GradSampleModule(small_model(), loss_reduction="sum")
    optimizer = RuleDPOptimizer(
        build_optimizer("sgd", [p for p in opacus_model.parameters() if p.requires_grad], lr),
        noise_multiplier=sigma,
        clip_bound=clip_bound,
        expected_batch_size=expected,
        rule="normalized",
        generator=torch.Generator().manual_seed(4),
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=len(y))  # one logical batch: all 9 examples
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer) as physical:
        for inputs, labels in physical:
            nn.functional.cross_entropy(opacus_model(inputs), labels, reduction="sum").backward()
            optimizer.step()
            optimizer.zero_grad()

    for a, b in zip(engine_model.parameters(), opacus_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(engine_model[3].weight, small_model()[3].weight)  # a step was taken


def test_an_empty_poisson_batch_releases_scaled_noise_only() -> None:
    model = small_model()
    x, y = small_batch(n=0)
    grads, loss = engine_gradient(model, "normalized", 2.0, 0.9, (x, y), 10.0, seed=3)
    generator = torch.Generator().manual_seed(3)
    for got, p in zip(grads, (p for p in model.parameters() if p.requires_grad), strict=True):
        noise = torch.normal(0.0, 0.9 * 2.0, size=p.shape, generator=generator)
        torch.testing.assert_close(got, noise / (2.0 * 10.0))
    assert loss == 0.0


def test_poisson_loader_samples_each_example_independently_at_rate_q() -> None:
    n, q, steps = 400, 0.05, 20
    dataset = TensorDataset(torch.randn(n, 3), torch.randint(0, 2, (n,)))
    loader = poisson_loader(dataset, q, steps, torch.Generator().manual_seed(0))
    assert isinstance(loader, DPDataLoader)
    assert isinstance(loader.batch_sampler, UniformWithReplacementSampler)
    sizes = [len(labels) for _, labels in loader]
    assert len(sizes) == steps  # exactly the requested number of batches per pass
    assert len(set(sizes)) > 3  # batch sizes vary (Poisson), unlike a fixed-size shuffled loader
    mean, std = sum(sizes) / steps, math.sqrt(n * q * (1 - q) / steps)
    assert abs(mean - n * q) < 4 * std
    again = [len(labels) for _, labels in poisson_loader(dataset, q, steps, torch.Generator().manual_seed(0))]
    assert again == sizes


def test_empty_poisson_draws_keep_their_shape_and_split_into_no_physical_batch() -> None:
    dataset = TensorDataset(torch.randn(10, 3), torch.randint(0, 2, (10,)))
    batches = list(poisson_loader(dataset, 0.1, 30, torch.Generator().manual_seed(1)))
    empty = [b for b in batches if len(b[1]) == 0]
    assert empty and empty[0][0].shape == (0, 3)
    assert list(physical_batches(empty[0], 4, CPU)) == []
    full = next(b for b in batches if len(b[1]) > 0)
    chunks = list(physical_batches(full, 1, CPU))
    assert [len(c[1]) for c in chunks] == [1] * len(full[1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rule": "clip_everything"}, "standard, normalized, auto_s"),
        ({"clip_bound": 0.0}, "clip_bound"),
        ({"expected_batch_size": -1.0}, "expected_batch_size"),
    ],
)
def test_step_spec_rejects_bad_values(kwargs: dict, message: str) -> None:
    values = {"noise_multiplier": 1.0, "clip_bound": 1.0, "rule": "standard", "expected_batch_size": 8.0} | kwargs
    with pytest.raises(ValueError, match=message):
        DPStepSpec(**values)


def test_engine_selection_prefers_film_and_falls_back_to_opacus() -> None:
    assert select_engine("auto", nn.Linear(4, 3), "head") is FilmEngine
    model = small_model()
    assert select_engine("auto", model, "lora") is OpacusEngine
    assert select_engine("opacus", model, "film") is OpacusEngine
    with pytest.raises(ValueError, match="peft 'lora'"):
        select_engine("film", model, "lora")
    with pytest.raises(ValueError, match="auto, opacus, film"):
        select_engine("fastest", model, "film")
