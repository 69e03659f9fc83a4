"""A team's own backbone named in the space: a ``save_pretrained`` folder (``{hf: DIR}``) and a timm
architecture with its own weights file (``{timm: NAME, weights: FILE}``), made here from the real
embedded MiniLM and EfficientNet-Lite0 weights: named, checked before any data loads, refused with a
message naming what is wrong, and computing the registry backbones' features exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO_ROOT
from dptune.contract import DatasetFile, WorkloadSpec
from dptune.data.spec import WorkloadError
from dptune.data.workload import check_spec
from dptune.models import ModelError, build_feature_extractor, get_backbone, load_tokenizer
from dptune.models.backbones import efficientnet_lite0_state_dict
from dptune.space import SpaceError, load_space

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"


@pytest.fixture(scope="module")
def lite_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded EfficientNet-Lite0 ImageNet weights as timm ``tf_efficientnet_lite0``'s safetensors file."""
    file = tmp_path_factory.mktemp("own") / "lite0.safetensors"
    save_file({key: value.contiguous() for key, value in efficientnet_lite0_state_dict().items()}, str(file))
    return file


def _task_backbone(backbone: object) -> str:
    """The backbone name the space makes of ``backbone`` (tiny.yaml's max_tokens set aside: an image backbone
    refuses one)."""
    return load_space(TINY, {"task.backbone": backbone, "task.max_tokens": None}).space.task.backbone


def test_the_space_names_an_own_backbone_by_its_folder_or_file(own_encoder: Path, lite_weights: Path) -> None:
    assert _task_backbone({"hf": str(own_encoder)}) == f"hf:{own_encoder}"
    assert _task_backbone({"hf": str(own_encoder), "pooling": "cls"}) == f"hf-cls:{own_encoder}"
    named = _task_backbone({"timm": "tf_efficientnet_lite0", "weights": str(lite_weights)})
    assert named == f"timm:tf_efficientnet_lite0:{lite_weights}"
    with pytest.raises(SpaceError, match="a backbone mapping has the key hf"):
        _task_backbone({"onnx": "model.onnx"})
    with pytest.raises(SpaceError, match="pooling"):
        _task_backbone({"hf": str(own_encoder), "pooling": "max"})


def test_an_own_encoder_computes_the_registry_backbones_features(own_encoder: Path, lite_weights: Path) -> None:
    own = get_backbone(f"hf:{own_encoder}")
    assert (own.modality, own.feature_dim, own.lora_targets, own.max_tokens) == ("text", 384, ("query", "value"), 128)
    batch = load_tokenizer(f"hf:{own_encoder}")(["a shuttle launch", "the engine"], padding=True, return_tensors="pt")
    inputs = (batch["input_ids"], batch["attention_mask"])
    with torch.inference_mode():
        mean = build_feature_extractor(f"hf:{own_encoder}").eval()(*inputs)
        cls = build_feature_extractor(f"hf-cls:{own_encoder}").eval()(*inputs)
        registry = build_feature_extractor("minilm").eval()(*inputs)
    assert torch.equal(mean, registry) and not torch.allclose(cls, registry, atol=1e-3)
    lite = get_backbone(f"timm:tf_efficientnet_lite0:{lite_weights}")
    assert (lite.modality, lite.feature_dim, lite.image_size) == ("image", 1280, 224)
    images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        own_features = build_feature_extractor(lite.name, image_size=64).eval()(images)
        registry_features = build_feature_extractor("efficientnet_lite0", image_size=64).eval()(images)
    assert torch.equal(own_features, registry_features)


def _bad_backbone(case: str, encoder: Path, weights: Path, tmp: Path) -> str:  # noqa: PLR0911
    if case == "no folder":
        return f"hf:{tmp / 'nowhere'}"
    copy = Path(shutil.copytree(encoder, tmp / "copy"))
    if case == "no config":
        (copy / "config.json").unlink()
    elif case == "unknown architecture":
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "model_type": "no-such-transformer"}))
    elif case == "no tokenizer":
        for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
            (copy / name).unlink()
    elif case == "no weights":
        (copy / "model.safetensors").unlink()
    elif case == "unknown timm architecture":
        return f"timm:no_such_net:{weights}"
    elif case == "weights of another architecture":
        return f"timm:resnet18:{weights}"
    elif case == "a tensor missing":
        state = efficientnet_lite0_state_dict()
        state.pop("conv_stem.weight")
        save_file({key: value.contiguous() for key, value in state.items()}, str(tmp / "short.safetensors"))
        return f"timm:tf_efficientnet_lite0:{tmp / 'short.safetensors'}"
    else:
        assert case == "not a state dict"
        torch.save([1, 2, 3], tmp / "list.pth")
        return f"timm:tf_efficientnet_lite0:{tmp / 'list.pth'}"
    return f"hf:{copy}"


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("no folder", "nowhere}: no such folder"),
        ("no config", "no config.json; save the model with save_pretrained"),
        ("unknown architecture", "config.json names no architecture transformers knows"),
        ("no tokenizer", "no tokenizer; save it beside the model"),
        ("no weights", "no weights (model.safetensors or pytorch_model.bin)"),
        ("unknown timm architecture", "has no architecture 'no_such_net'"),
        ("weights of another architecture", "the file is not a resnet18 state dict"),
        ("a tensor missing", "1 of its 294 tensors missing, 0 of another shape (first: conv_stem.weight is missing)"),
        ("not a state dict", "holds a list, not a state dict"),
    ],
)
def test_a_bad_own_backbone_is_refused_before_the_data_is_read(
    own_encoder: Path,
    lite_weights: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    named: str,
) -> None:
    import dptune.data.workload as workload

    def read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bad backbone reached the data")

    monkeypatch.setattr(workload, "dataset_info", read)
    backbone = _bad_backbone(case, own_encoder, lite_weights, tmp_path)
    source = DatasetFile(path=str(tmp_path / "rows.csv"), input_column="text", label_column="label")
    with pytest.raises(WorkloadError) as error:
        check_spec(WorkloadSpec(dataset=source.display_name, backbone=backbone, peft="head", dataset_file=source))
    assert named in str(error.value)
    with pytest.raises(ModelError):
        get_backbone(backbone)
