"""A team's own backbone, named in the space instead of the registry (``task.backbone`` as a mapping).

Their names (:func:`dptune.contract.hf_name`, :func:`dptune.contract.timm_name`) are what records,
trials and caches carry.

- ``{hf: DIR}``: a Hugging Face transformers encoder saved with ``save_pretrained`` (its config,
  weights and tokenizer in ``DIR``), mean-pooled over the attention mask, or the first token's
  hidden state with ``pooling: cls``. Its name is ``hf:<DIR>`` (``hf-cls:<DIR>``).
- ``{timm: NAME, weights: FILE}``: the timm architecture ``NAME`` (``timm.list_models()``) with the
  weights of ``FILE`` (``.safetensors``, ``.pth`` or ``.bin``: a state dict), its classifier dropped,
  normalised by the architecture's pretrained configuration. Its name is ``timm:<NAME>:<FILE>``.

:func:`own_backbone` checks one before any data loads, never downloading and without building it
(a timm model is made on the meta device): the folder or file, the config, that the architecture is
known, its output size, and for timm that the file's tensors are the architecture's, name by name
and shape by shape. The weights are identified by the bytes of the folder or file (the feature
cache's and the model card's ``weights_sha256``), so a retrained encoder in the same place is never
served stale features.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from dptune.contract import HF_CLS_PREFIX, HF_PREFIX, TIMM_PREFIX
from dptune.models.base import BackboneInfo, ModelError
from dptune.models.extractors import TextEncoder, timm_extractor

#: Weight files an own timm backbone may come in.
TIMM_SUFFIXES = (".safetensors", ".pth", ".bin")
#: The attention projections LoRA adapts, by transformers ``model_type`` (others: LoRA refused).
HF_LORA_TARGETS = {
    "bert": ("query", "value"),
    "roberta": ("query", "value"),
    "xlm-roberta": ("query", "value"),
    "electra": ("query", "value"),
    "distilbert": ("q_lin", "v_lin"),
    "mpnet": ("q", "v"),
    "deberta-v2": ("query_proj", "value_proj"),
    "modernbert": ("Wqkv",),
}
#: Text backbones' default ``max_tokens`` (the registry's), capped by the model's positions.
DEFAULT_MAX_TOKENS = 128


@functools.lru_cache(maxsize=16)
def own_backbone(name: str) -> BackboneInfo:
    """The :class:`BackboneInfo` of the own backbone ``name``, checked (:class:`ModelError` naming the
    folder or file, what is wrong and what is allowed)."""
    if name.startswith(TIMM_PREFIX):
        architecture, _, weights = name.removeprefix(TIMM_PREFIX).partition(":")
        return _timm_info(name, architecture, Path(weights))
    pooling = "cls" if name.startswith(HF_CLS_PREFIX) else "mean"
    return _hf_info(name, Path(name.removeprefix(HF_CLS_PREFIX if pooling == "cls" else HF_PREFIX)), pooling)


# ------------------------------------------------------------------------- transformers


def _hf_info(name: str, folder: Path, pooling: str) -> BackboneInfo:
    from transformers import AutoConfig

    where = f"backbone {{hf: {folder}}}"
    if not folder.is_dir():
        raise ModelError(f"{where}: no such folder (a folder written by save_pretrained)")
    if not (folder / "config.json").is_file():
        raise ModelError(f"{where}: no config.json; save the model with save_pretrained(folder)")
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, OSError, KeyError) as error:
        raise ModelError(f"{where}: config.json names no architecture transformers knows ({error})") from None
    weights = [p.name for p in folder.iterdir() if p.name.startswith(("model", "pytorch_model"))]
    if not any(w.endswith((".safetensors", ".bin", ".index.json")) for w in weights):
        raise ModelError(f"{where}: no weights (model.safetensors or pytorch_model.bin); save_pretrained writes them")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json")):
        raise ModelError(f"{where}: no tokenizer; save it beside the model (tokenizer.save_pretrained(folder))")
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"{where}: {config.model_type} is an encoder-decoder; name an encoder (BERT-like)")
    dim = getattr(config, "hidden_size", None)
    if not isinstance(dim, int) or dim < 1:
        raise ModelError(f"{where}: its config has no hidden_size, the size of the features it outputs")
    positions = getattr(config, "max_position_embeddings", None)
    return BackboneInfo(
        name=name,
        modality="text",
        feature_dim=dim,
        create=functools.partial(_hf_create, folder, pooling),
        weights=f"own save_pretrained folder {folder} ({config.model_type})",
        max_tokens=min(DEFAULT_MAX_TOKENS, positions) if isinstance(positions, int) else DEFAULT_MAX_TOKENS,
        tokenizer=functools.partial(_hf_tokenizer, folder),
        lora_targets=HF_LORA_TARGETS.get(config.model_type, ()),
        weight_source=lambda: folder,
        pooling="first-token hidden state" if pooling == "cls" else None,
    )


def _hf_create(folder: Path, pooling: Any, pretrained: bool, image_size: int | None) -> nn.Module:
    from transformers import AutoConfig, AutoModel

    if pretrained:
        return TextEncoder(AutoModel.from_pretrained(str(folder), local_files_only=True), pooling)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    return TextEncoder(AutoModel.from_config(config), pooling)


def _hf_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


# --------------------------------------------------------------------------------- timm


def _timm_info(name: str, architecture: str, file: Path) -> BackboneInfo:
    import timm

    where = f"backbone {{timm: {architecture}, weights: {file}}}"
    if not timm.is_model(architecture):
        raise ModelError(f"{where}: timm {timm.__version__} has no architecture {architecture!r} (timm.list_models())")
    if file.suffix not in TIMM_SUFFIXES or not file.is_file():
        raise ModelError(f"{where}: no such weights file (a state dict in a {', '.join(TIMM_SUFFIXES)} file)")
    with torch.device("meta"):
        net = timm.create_model(architecture, pretrained=False, num_classes=0)
    expected = {key: tuple(value.shape) for key, value in net.state_dict().items()}
    found = _tensor_shapes(file, where)
    missing = sorted(set(expected) - set(found))
    wrong = sorted(key for key in set(expected) & set(found) if expected[key] != found[key])
    if missing or wrong:
        key = (missing or wrong)[0]
        raise ModelError(
            f"{where}: the file is not a {architecture} state dict: {len(missing)} of its {len(expected)} tensors "
            f"missing, {len(wrong)} of another shape (first: {key}"
            + (f" {found[key]} where {expected[key]} is expected)" if key in found else " is missing)")
        )
    cfg = cast(dict[str, Any], net.pretrained_cfg)
    lora = tuple(sorted({n.rsplit(".", 1)[-1] for n, m in net.named_modules() if isinstance(m, nn.Linear)} & {"qkv"}))
    return BackboneInfo(
        name=name,
        modality="image",
        feature_dim=int(cast(int, net.num_features)),
        create=functools.partial(_timm_create, architecture, file),
        weights=f"own weights file {file} for timm {architecture}",
        image_size=int(cfg.get("input_size", (3, 224, 224))[-1]),
        lora_targets=lora,
        weight_source=lambda: file,
    )


def _tensor_shapes(file: Path, where: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the state-dict file ``file``, read without loading the tensors
    where the format allows (safetensors' header; a pickle is memory-mapped)."""
    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as handle:
                return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 (any unreadable file: the message says which)
        raise ModelError(f"{where}: unreadable as a state dict ({str(error)[:200]})") from None
    if not isinstance(state, dict):
        raise ModelError(f"{where}: holds a {type(state).__name__}, not a state dict (save model.state_dict())")
    return {key: tuple(value.shape) for key, value in state.items() if isinstance(value, torch.Tensor)}


def _timm_create(architecture: str, file: Path, pretrained: bool, image_size: int | None) -> nn.Module:
    import timm
    from safetensors.torch import load_file

    net = timm.create_model(architecture, pretrained=False, num_classes=0)
    if pretrained:
        state = load_file(str(file)) if file.suffix == ".safetensors" else torch.load(file, weights_only=True)
        expected = net.state_dict().keys()
        net.load_state_dict({key: value for key, value in state.items() if key in expected}, strict=True)
    assert image_size is not None, "an image backbone is created at a resolved size"
    return timm_extractor(net, image_size)
