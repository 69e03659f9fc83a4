"""BatchNorm with frozen running statistics under DP, on the real EfficientNet-Lite0 weights and
MNIST-5k digits: per-example γ/β gradients of both engines equal an exact per-example autograd
reference (fp32, 1e-5); the frozen model does not mix examples; a trial (FiLM engine, Opacus
engine, full fine-tuning) leaves the running statistics untouched; BatchNorm that would use batch
statistics is still refused, before training and at run time.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import timm
import torch
from torch import nn

from dptune.contract import WorkloadSpec
from dptune.data.sources import load_mnist5k
from dptune.dp.engine import DPStepSpec
from dptune.dp.engine_registry import select_engine
from dptune.dp.film import FilmEngine, unsupported_modules
from dptune.dp.opacus_engine import OpacusEngine, grad_sample_hooks
from dptune.models import ModelError, build_model, check_dp_compatible
from dptune.runners import trainer
from dptune.runners.trial import TrialConfig, TrialConfigError, check_trial_can_run, run_trial
from test_film import assert_relative, perturb_film_parameters, trainable
from trial_configs import planned

# Its module fixtures are costly: under pytest-xdist the whole module runs on one worker.
pytestmark = pytest.mark.xdist_group("batch_norm")

torch.set_num_threads(1)

BACKBONE = "efficientnet_lite0"
IMAGE_SIZE = 32  # px: small for speed; 5 stride-2 stages leave a 1x1 map


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Eight real MNIST-5k digits (uint8, 1x28x28) and their labels."""
    raw = load_mnist5k()
    rows = torch.arange(0, 4000, 500)  # one example of each of eight classes
    return raw.inputs[rows], torch.from_numpy(raw.labels)[rows]


@pytest.fixture(scope="module")
def film_model() -> nn.Module:
    """FiLM on the pretrained EfficientNet-Lite0 (49 BatchNormAct2d + head), moved off γ=1, β=0."""
    torch.manual_seed(0)
    model = build_model(BACKBONE, "film", 10, image_size=IMAGE_SIZE)
    perturb_film_parameters(model, seed=1)
    return model


def exact_per_example_gradients(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(n, d): ∇_θ ℓ_i for each example by plain autograd, one backward per example (θ = trainable)."""
    losses = nn.functional.cross_entropy(model(images), labels, reduction="none")
    rows = [torch.autograd.grad(loss, trainable(model), retain_graph=True) for loss in losses]
    return torch.stack([torch.cat([g.flatten() for g in row]) for row in rows])


def flat_grad(model: nn.Module) -> torch.Tensor:
    grad = torch.cat([p.grad.flatten() for p in trainable(model)])
    for p in trainable(model):
        p.grad = None
    return grad


def test_the_film_model_holds_every_batch_norm_in_eval_mode_and_trains_gamma_beta(film_model: nn.Module) -> None:
    film_model.train()
    batch_norms = [m for m in film_model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(batch_norms) == 49 and not any(m.training for m in batch_norms)
    assert film_model.training and film_model.head.training
    assert all(m.weight.requires_grad and m.bias.requires_grad for m in batch_norms)
    check_dp_compatible(film_model)
    assert unsupported_modules(film_model) == []


def test_per_example_gradients_of_both_engines_equal_the_exact_reference(film_model, digits) -> None:
    images, labels = digits
    film_model.train()
    reference = exact_per_example_gradients(film_model, images, labels)
    norms = reference.norm(dim=1)
    assert float(norms.min()) > 0
    # Opacus: the registered frozen-BatchNorm grad sampler, every per-example row
    with grad_sample_hooks(film_model):
        nn.functional.cross_entropy(film_model(images), labels, reduction="sum").backward()
        opacus_rows = torch.cat([p.grad_sample.flatten(1) for p in trainable(film_model)], dim=1)
    flat_grad(film_model)
    for row, expected in zip(opacus_rows, reference, strict=True):
        assert_relative(row, expected)
    # both engines: ‖g_i‖ and the clipped sum Σ_i min(1, C/‖g_i‖) g_i at C = the median norm,
    # which weights each example differently, so it checks the per-example vectors themselves
    clip_bound = float(norms.median())
    expected_sum = (reference * (clip_bound / norms).clamp(max=1.0)[:, None]).sum(0)
    spec = DPStepSpec(noise_multiplier=0.0, clip_bound=clip_bound, rule="standard", expected_batch_size=1.0)
    film = FilmEngine(film_model, spec, torch.Generator().manual_seed(0))
    film.noisy_gradient([(images[:5], labels[:5]), (images[5:], labels[5:])])  # two physical batches
    assert_relative(film.last_grad_norms, norms)
    assert_relative(flat_grad(film_model), expected_sum)
    OpacusEngine(film_model, spec, torch.Generator().manual_seed(0)).noisy_gradient([(images, labels)])
    assert_relative(flat_grad(film_model), expected_sum)


def test_frozen_statistics_do_not_mix_examples_and_batch_statistics_do(film_model, digits) -> None:
    """In float64 (no rounding-induced ReLU6 flips), example 0's gradient computed alone equals its
    gradient inside the batch when BatchNorm is frozen, and not when it is in training mode."""
    images, labels = digits
    model = build_model(BACKBONE, "film", 10, image_size=IMAGE_SIZE, pretrained=False).double()
    model.load_state_dict(film_model.state_dict())
    model.train()
    inside = exact_per_example_gradients(model, images, labels)[0]
    alone = exact_per_example_gradients(model, images[:1], labels[:1])[0]
    assert float((alone - inside).norm() / inside.norm()) < 1e-12
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            nn.Module.train(module)  # batch statistics, bypassing the Classifier
    mixed = exact_per_example_gradients(model, images[:2], labels[:2])[0]
    assert float((mixed - inside).norm() / inside.norm()) > 1e-2


def running_statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: buffer.clone() for name, buffer in model.named_buffers() if "running" in name or "num_batches" in name
    }


@pytest.mark.parametrize(("peft", "engine"), [("film", "auto"), ("film", "opacus")])
def test_a_trial_never_updates_the_running_statistics(peft: str, engine: str, monkeypatch, dptune_cache_dir) -> None:
    built: list[nn.Module] = []

    def spy(*args: object, **kwargs: object) -> nn.Module:
        built.append(build_model(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(trainer, "build_model", spy)
    config = TrialConfig(
        workload=WorkloadSpec(
            dataset="mnist5k", backbone=BACKBONE, peft=peft, max_train_examples=48, max_eval_examples=20
        ),
        epsilon=8.0,
        delta=1e-5,
        epochs=2,
        clip_bound=1.0,
        batch_size=16,
        learning_rate=1e-2,
        base_learning_rate=1e-2,
        engine=engine,
        threads=1,
        diagnostic_examples=8,
    )
    result = run_trial(planned(config))
    assert result.status == "ok" and 0 < result.epsilon_spent <= config.epsilon
    assert result.engine == {"auto": "film", "opacus": "opacus"}[engine]
    assert len(result.diagnostics) == 3  # the diagnostics' training-mode passes ran too
    (model,) = built
    pretrained = build_model(BACKBONE, peft, 10)
    before, after = running_statistics(pretrained), running_statistics(model.cpu())
    assert len(after) == 3 * 49 and before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    stem = model.backbone.net.bn1
    assert not torch.equal(stem.weight, pretrained.backbone.net.bn1.weight)  # γ was trained


def test_batch_norm_that_would_use_batch_statistics_is_refused(digits) -> None:
    # a bare timm network trains with batch statistics under train(): today's refusal
    net = nn.Sequential(timm.create_model("tf_efficientnet_lite0", pretrained=False, num_classes=10))
    with pytest.raises(ModelError, match=r"BatchNorm cannot be trained under DP.*\(49 layers: .*in training mode"):
        check_dp_compatible(net)
    with pytest.raises(ModelError, match="accepted only with its running statistics frozen"):
        check_dp_compatible(net)
    # BatchNorm without running statistics normalises with the batch even in eval mode
    model = build_model(BACKBONE, "film", 10, image_size=IMAGE_SIZE, pretrained=False)
    stem = model.backbone.net.bn1
    stem.running_mean = stem.running_var = None
    with pytest.raises(ModelError, match="1 layers: backbone.net.bn1 without running statistics"):
        check_dp_compatible(model)
    assert unsupported_modules(model) == [
        "backbone.net.bn1 (BatchNormAct2d without running statistics (track_running_stats=False: batch "
        "statistics in every mode))"
    ]
    # the engines refuse a step on batch statistics even if a BatchNorm is switched behind their back
    model = build_model(BACKBONE, "film", 10, image_size=IMAGE_SIZE, pretrained=False)
    spec = DPStepSpec(noise_multiplier=1.0, clip_bound=1.0, rule="standard", expected_batch_size=4.0)
    engines = [FilmEngine(model, spec, torch.Generator()), OpacusEngine(model, spec, torch.Generator())]
    nn.Module.train(model.backbone.net.bn2)
    images, labels = digits
    for engine in engines:
        with pytest.raises(RuntimeError, match="ran with batch statistics during a DP step"):
            engine.noisy_gradient([(images[:4], labels[:4])])


def test_full_fine_tuning_runs_on_opacus_with_frozen_statistics_and_not_on_the_film_engine(digits) -> None:
    images, labels = digits
    model = build_model(BACKBONE, "full", 10, image_size=IMAGE_SIZE)
    perturb_film_parameters(model.head, seed=2)  # off zero, so gradients reach the backbone
    model.train()
    check_dp_compatible(model)
    statistics = running_statistics(model)
    reference = exact_per_example_gradients(model, images[:4], labels[:4])
    spec = DPStepSpec(noise_multiplier=0.0, clip_bound=1e9, rule="standard", expected_batch_size=1.0)
    OpacusEngine(model, spec, torch.Generator().manual_seed(0)).noisy_gradient([(images[:4], labels[:4])])
    assert_relative(flat_grad(model), reference.sum(0))
    assert all(torch.equal(statistics[name], buffer) for name, buffer in running_statistics(model).items())
    with pytest.raises(ValueError, match="engine 'film' cannot run this model: peft 'full'"):
        select_engine("film", model, "full")
    config = TrialConfig(
        workload=WorkloadSpec(dataset="mnist5k", backbone=BACKBONE, peft="full"),
        epsilon=1.0,
        delta=1e-5,
        epochs=1,
        clip_bound=1.0,
        batch_size=8,
        learning_rate=1e-3,
        base_learning_rate=1e-3,
    )
    check_trial_can_run(config)  # engine 'auto': Opacus
    with pytest.raises(TrialConfigError, match="engine 'film' cannot run this model: peft 'full'"):
        check_trial_can_run(replace(config, engine="film"))
