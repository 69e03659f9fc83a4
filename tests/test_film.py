"""The FiLM engine against Opacus: same model, batch and seed give the same per-example gradient
norms and the same clipped, summed, scaled gradient (fp32, 1e-5 relative), for every clipping
rule, on a timm ViT, MiniLM with real weights and padded inputs, a Linear head on features, and a
token model that exercises GroupNorm, module reuse and both Linear norm paths. Also: empty
Poisson batches, micro-batch accumulation, the noise, bf16 autocast, refusals and the model
being plain outside a step.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from timm.layers import LayerNorm2d
from torch import nn

from dptune.dp.clipping import CLIPPING_RULES, noise_std, update_scale
from dptune.dp.engine import DPStepSpec, summed_cross_entropy
from dptune.dp.engine_registry import select_engine
from dptune.dp.film import FilmEngine, unsupported_modules
from dptune.dp.opacus_engine import OpacusEngine, grad_sample_hooks
from dptune.dp.optimizers import per_example_norms
from dptune.models import build_model, load_tokenizer

# Its module fixtures are costly: under pytest-xdist the whole module runs on one worker.
pytestmark = pytest.mark.xdist_group("film")

torch.set_num_threads(1)

VIT = "vit_tiny_patch16_224.augreg_in21k"
RTOL = 1e-5


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def perturb_film_parameters(model: nn.Module, seed: int) -> None:
    """Move the trainable parameters off their initial values (γ=1, β=0, zero head), so that
    gradients reach the norm layers through the head and x̂ cannot be confused with the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable(model):
            p.add_(torch.randn(p.shape, generator=generator), alpha=0.3)


def spec_for(rule: str, clip_bound: float, noise_multiplier: float = 0.0, **kwargs: object) -> DPStepSpec:
    return DPStepSpec(
        noise_multiplier=noise_multiplier, clip_bound=clip_bound, rule=rule, expected_batch_size=7.5, **kwargs
    )


Batch = tuple[torch.Tensor, ...]


def film_step(
    model: nn.Module, batches: list[Batch], spec: DPStepSpec, seed: int = 0
) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    """(loss, ‖g_i‖, p.grad of every trainable p) from the FiLM engine."""
    engine = FilmEngine(model, spec, torch.Generator().manual_seed(seed))
    torch.manual_seed(1234)  # identical dropout masks in every engine's forward
    loss = engine.noisy_gradient(batches)
    assert all(p.grad.grad_fn is None and not p.grad.requires_grad for p in trainable(model))
    assert not engine.last_grad_norms.requires_grad
    grads = [p.grad.clone() for p in trainable(model)]
    for p in trainable(model):
        p.grad = None
    return loss, engine.last_grad_norms, grads


def opacus_step(model: nn.Module, batches: list[Batch], spec: DPStepSpec) -> tuple[float, list[torch.Tensor]]:
    """(loss, p.grad of every trainable p) from the Opacus engine (grad-sample hooks, flat clipping)."""
    engine = OpacusEngine(model, spec, torch.Generator().manual_seed(0))
    torch.manual_seed(1234)
    loss = engine.noisy_gradient(batches)
    grads = [p.grad.clone() for p in trainable(model)]
    for p in trainable(model):
        p.grad = None
    return loss, grads


def opacus_norms(model: nn.Module, batch: Batch) -> torch.Tensor:
    """‖g_i‖ over all trainable parameters from Opacus' per-example gradients."""
    *inputs, labels = batch
    with grad_sample_hooks(model):
        torch.manual_seed(1234)
        summed_cross_entropy(model(*inputs), labels).backward()
        norms = per_example_norms([p.grad_sample for p in trainable(model)])
    for p in trainable(model):
        p.grad = None
    return norms


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    error = float(torch.linalg.vector_norm(actual - expected))
    scale = float(torch.linalg.vector_norm(expected))
    assert scale > 0, "reference is zero: the comparison would be vacuous"
    assert error <= rtol * scale, f"relative error {error / scale:.3g} > {rtol}"


# ------------------------------------------------------------------------------ the models


class TokenModel(nn.Module):
    """(n, T, d) tokens → logits, with every supported case the engine distinguishes: a
    LayerNorm called twice (reuse), GroupNorm over channels, a token-wise Linear whose ghost norm
    is cheaper (2T² ≤ d²) and one whose (out, in) gradient is (2T² > 3d), and a pooled head."""

    def __init__(self, width: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)  # ghost norm at T = 6: 72 ≤ 256
        self.group = nn.GroupNorm(4, width)
        self.narrow = nn.Linear(width, 3)  # materialised at T = 6: 72 > 48
        self.head = nn.Linear(width + 3, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm(tokens))
        h = self.norm(torch.tanh(h))  # second call of the same LayerNorm
        h = self.group(h.transpose(1, 2)).transpose(1, 2)
        pooled = torch.cat([h.mean(1), self.narrow(h).mean(1)], dim=1)
        return self.head(pooled)


def image_batch(n: int, seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=generator) * 255, torch.randint(0, 10, (n,), generator=generator)


@pytest.fixture(scope="module")
def vit() -> nn.Module:
    """ViT-Ti/16, random weights, 48 px images (9 patches + class token), FiLM."""
    torch.manual_seed(0)
    model = build_model(VIT, "film", 10, pretrained=False, image_size=48).train()
    perturb_film_parameters(model, seed=1)
    return model


@pytest.fixture(scope="module")
def minilm() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """all-MiniLM-L6-v2 with its real weights, FiLM, and a padded batch of unequal sentences."""
    model = build_model("minilm", "film", 4, pretrained=True).train()
    perturb_film_parameters(model, seed=2)
    tokenizer = load_tokenizer("minilm")
    texts = [
        "privacy",
        "the gradient of every example is clipped before the sum",
        "noise is added once per step",
        "a much longer sentence that will certainly be truncated at sixteen tokens by the tokenizer here",
        "short one",
        "layer norm scale and shift are the only trained parameters besides the head",
        "ok",
        "batches are drawn by poisson sampling",
    ]
    encoded = tokenizer(texts, padding=True, truncation=True, max_length=16, return_tensors="pt")
    labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    return model, (encoded["input_ids"], encoded["attention_mask"], labels)


@pytest.fixture(scope="module")
def features() -> nn.Module:
    """peft 'head' on cached features: the model is one nn.Linear."""
    model = build_model("minilm", "head", 6, feature_input=True, pretrained=False)
    perturb_film_parameters(model, seed=3)
    return model


def model_and_batch(name: str, request: pytest.FixtureRequest) -> tuple[nn.Module, Batch]:
    if name == "vit":
        return request.getfixturevalue("vit"), image_batch(10, seed=5, size=48)
    if name == "minilm":
        return request.getfixturevalue("minilm")
    generator = torch.Generator().manual_seed(6)
    if name == "features":
        model = request.getfixturevalue("features")
        return model, (torch.randn(9, 384, generator=generator), torch.randint(0, 6, (9,), generator=generator))
    torch.manual_seed(7)
    model = TokenModel()
    perturb_film_parameters(model, seed=8)
    return model, (torch.randn(9, 6, 16, generator=generator), torch.randint(0, 5, (9,), generator=generator))


# ---------------------------------------------------------------------- equality with Opacus


@pytest.mark.parametrize("rule", CLIPPING_RULES)
@pytest.mark.parametrize("name", ["vit", "minilm", "features", "tokens"])
def test_norms_and_clipped_sum_equal_opacus(name: str, rule: str, request: pytest.FixtureRequest) -> None:
    model, batch = model_and_batch(name, request)
    reference = copy.deepcopy(model)  # Opacus may keep (disabled) hooks on its model
    expected_norms = opacus_norms(reference, batch)
    clip_bound = float(expected_norms.median())
    clipped = expected_norms > clip_bound
    assert 0 < int(clipped.sum()) < len(clipped), "C at the median norm must clip some examples and not others"
    spec = spec_for(rule, clip_bound)

    loss, norms, grads = film_step(model, [batch], spec)
    expected_loss, expected_grads = opacus_step(reference, [batch], spec)

    assert_relative(norms, expected_norms)
    assert torch.allclose(norms, expected_norms, rtol=RTOL, atol=0)
    assert math.isclose(loss, expected_loss, rel_tol=RTOL)
    assert len(grads) == len(expected_grads) == len(trainable(model))
    for grad, expected, p in zip(grads, expected_grads, trainable(model), strict=True):
        assert grad.shape == p.shape and grad.dtype == p.dtype
        assert_relative(grad, expected)


# torch warns when Opacus' full backward hook sits on a layer fed with data (no input needs a
# gradient); Opacus' per-example gradients are unaffected
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("name", ["vit", "minilm", "features", "tokens"])
def test_standard_rule_equals_plain_opacus_dp_sgd(name: str, request: pytest.FixtureRequest) -> None:
    """Against Opacus' own classes alone: GradSampleModule + DPOptimizer (flat clipping, /B)."""
    model, batch = model_and_batch(name, request)
    *inputs, labels = batch
    reference = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    optimizer = DPOptimizer(
        torch.optim.SGD(trainable(reference), lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=0.0,
        expected_batch_size=7.5,
        loss_reduction="mean",
    )
    torch.manual_seed(1234)
    summed_cross_entropy(reference(*inputs), labels).backward()
    norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in trainable(reference)], 1).norm(dim=1)
    optimizer.max_grad_norm = float(norms.median())
    optimizer.pre_step()  # clip_and_accumulate, add_noise (σ = 0), scale_grad

    _, film_norms, grads = film_step(model, [batch], spec_for("standard", float(norms.median())))
    assert torch.allclose(film_norms, norms, rtol=RTOL, atol=0)
    for grad, p in zip(grads, trainable(reference), strict=True):
        assert_relative(grad, p.grad)


def test_minilm_batch_is_padded(minilm: tuple[nn.Module, tuple[torch.Tensor, ...]]) -> None:
    """The MiniLM comparison above runs on padded, variable-length inputs."""
    _, (_, attention_mask, _) = minilm
    lengths = attention_mask.sum(1)
    assert int(lengths.min()) < int(lengths.max()) == attention_mask.shape[1]


# ----------------------------------------------------------- Poisson batches and the noise


def test_microbatches_accumulate_to_the_one_batch_result(vit: nn.Module) -> None:
    images, labels = image_batch(10, seed=9, size=48)
    spec = spec_for("normalized", clip_bound=1.0, noise_multiplier=0.7)
    whole = film_step(vit, [(images, labels)], spec, seed=3)
    split = [(images[:3], labels[:3]), (images[3:3], labels[3:3]), (images[3:8], labels[3:8]), (images[8:], labels[8:])]
    parts = film_step(vit, split, spec, seed=3)
    assert math.isclose(parts[0], whole[0], rel_tol=1e-6)
    assert torch.allclose(parts[1], whole[1], rtol=1e-6)
    for grad, expected in zip(parts[2], whole[2], strict=True):
        assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rule", ["standard", "auto_s"])
def test_empty_poisson_batch_releases_scaled_noise_only(vit: nn.Module, rule: str) -> None:
    spec = spec_for(rule, clip_bound=2.0, noise_multiplier=1.3)
    loss, norms, grads = film_step(vit, [], spec, seed=11)
    assert loss == 0.0 and norms.numel() == 0
    flat = torch.cat([g.flatten() for g in grads])
    assert flat.numel() == sum(p.numel() for p in trainable(vit))
    expected_std = noise_std(1.3, 2.0, rule) * update_scale(2.0, rule, 7.5)
    assert abs(float(flat.std()) / expected_std - 1) < 0.03
    assert abs(float(flat.mean())) < 0.03 * expected_std
    # an empty physical batch (what Opacus' Poisson loader yields) is the same as no batch
    images, labels = image_batch(0, seed=0, size=48)
    _, _, same = film_step(vit, [(images, labels)], spec, seed=11)
    for grad, expected in zip(same, grads, strict=True):
        assert torch.equal(grad, expected)


def test_noise_is_added_once_to_the_clipped_sum(vit: nn.Module) -> None:
    """grad(σ, batch) − grad(0, batch) = grad(σ, empty batch) for the same generator seed."""
    batch = image_batch(6, seed=12, size=48)
    noisy = film_step(vit, [batch], spec_for("standard", 0.5, noise_multiplier=2.0), seed=21)[2]
    clean = film_step(vit, [batch], spec_for("standard", 0.5), seed=21)[2]
    noise_only = film_step(vit, [], spec_for("standard", 0.5, noise_multiplier=2.0), seed=21)[2]
    assert any(float(c.abs().max()) > 0 for c in clean)
    for n, c, e in zip(noisy, clean, noise_only, strict=True):
        assert torch.allclose(n - c, e, atol=1e-6)
    other_seed = film_step(vit, [], spec_for("standard", 0.5, noise_multiplier=2.0), seed=22)[2]
    assert not torch.equal(other_seed[0], noise_only[0])


def test_bf16_autocast_keeps_float32_sums_close_to_fp32(vit: nn.Module) -> None:
    batch = image_batch(8, seed=13, size=48)
    reference = film_step(vit, [batch], spec_for("standard", 1.0))
    mixed = film_step(vit, [batch], spec_for("standard", 1.0, autocast_dtype=torch.bfloat16))
    assert mixed[1].dtype == torch.float32
    assert_relative(mixed[1], reference[1], rtol=0.05)
    for grad, expected in zip(mixed[2], reference[2], strict=True):
        assert grad.dtype == torch.float32
        assert_relative(grad, expected, rtol=0.05)


# ------------------------------------------------------------------ refusals and plainness


def test_unsupported_modules_are_named_and_selection_falls_back() -> None:
    full = build_model(VIT, "full", 10, pretrained=False, image_size=32)
    refused = unsupported_modules(full)
    assert "backbone.net.patch_embed.proj (Conv2d)" in refused
    assert any(name.startswith("backbone.net (VisionTransformer") for name in refused)  # cls_token, pos_embed
    assert select_engine("auto", full, "full") is OpacusEngine
    with pytest.raises(ValueError, match="patch_embed.proj"):
        select_engine("film", full, "film")
    with pytest.raises(ValueError, match="Conv2d"):
        FilmEngine(full, spec_for("standard", 1.0), torch.Generator())

    film = build_model(VIT, "film", 10, pretrained=False, image_size=32)
    assert unsupported_modules(film) == []
    assert select_engine("auto", film, "film") is FilmEngine

    channels_first = nn.Sequential(LayerNorm2d(3), nn.Flatten(), nn.Linear(12, 2))
    assert unsupported_modules(channels_first) == ["0 (LayerNorm2d)"]
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    assert unsupported_modules(tied) == ["1 (Linear, shares a parameter with 0)"]
    with pytest.raises(ValueError, match="no trainable parameters"):
        FilmEngine(nn.Linear(3, 2).requires_grad_(False), spec_for("standard", 1.0), torch.Generator())


def test_model_is_plain_outside_the_step(vit: nn.Module) -> None:
    images, labels = image_batch(4, seed=14, size=48)
    _, norms, grads = film_step(vit, [(images, labels)], spec_for("auto_s", 1.0))
    with torch.no_grad():  # the engine turns gradients on for its own forward
        _, same_norms, same_grads = film_step(vit, [(images, labels)], spec_for("auto_s", 1.0))
    assert torch.equal(norms, same_norms) and all(torch.equal(a, b) for a, b in zip(grads, same_grads, strict=True))
    assert all(not m._forward_hooks for m in vit.modules())
    summed_cross_entropy(vit(images), labels).backward()
    assert all(p.grad is not None for p in trainable(vit))
    assert all(p.grad is None for p in vit.parameters() if not p.requires_grad)
    for p in trainable(vit):
        p.grad = None


class InPlaceAfterNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x).mul_(2.0))


def test_in_place_change_of_a_trained_output_fails_loudly() -> None:
    model = InPlaceAfterNorm()
    engine = FilmEngine(model, spec_for("standard", 1.0), torch.Generator())
    with pytest.raises(RuntimeError, match="modified inplace"):
        engine.noisy_gradient([(torch.randn(3, 4), torch.tensor([0, 1, 0]))])
    assert not model.norm._forward_hooks and not model.head._forward_hooks
