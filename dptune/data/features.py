"""Frozen-backbone features for ``peft == "head"``: encode once, cache on disk, reuse.

Text is mean-pooled over the attention mask (``dptune.models.TextEncoder``); images use the
backbone's own pooled output. Encoding runs under ``torch.inference_mode`` on CUDA when
available, else on the CPU with torch's thread setting (all cores unless ``OMP_NUM_THREADS`` or
``torch.set_num_threads`` says otherwise). Precision (``encoding_precision``): bf16 where the
hardware multiplies bf16 natively (a CUDA GPU with bf16; a CPU with the ``amx_bf16`` or
``avx512_bf16`` flag), fp32 elsewhere; ``DPTUNE_ENCODE_PRECISION=fp32|bf16`` overrides it. A text
encoder runs in bf16 throughout (its weights cast to bf16; the mean pooling in float32), which on
a CPU was 1.1–1.2x faster than a bf16 autocast of the same model in two hand-timed runs of 1,536
documents (autocast keeps layer norms, softmax and the casts between them in float32); an image
encoder, whose preprocessing is float32, runs under a bf16 autocast. bf16 features of MiniLM text
are within cosine 0.9998 of fp32 ones, and DP linear probes trained on either agree within 0.3
accuracy points (``bench/bench_encoding_precision.py``). Text is sorted
by token count and batched by a token budget, each batch padded only to its own longest document
(dynamic padding): the attention mask makes this equal to padding every document to
``max_tokens`` up to float rounding.

Cache: ``dptune.paths.cache_dir("features")/<dataset>-<backbone>-<key>.npy`` (float32,
``(rows, feature_dim)``, rows in the dataset's raw order) plus a ``.json`` with the key. The key
hashes the dataset name and content fingerprint, the backbone name and a sha256 of its weights
(of the files of its local weight folder where the backbone names one, so that a cache hit
builds no model; else of the loaded state dict),
``max_tokens``/``image_size``, the pooling, the precision, and (for capped test subsets only)
the row set.
Writes are atomic (temporary file + ``os.replace``) under an exclusive ``flock``: a second
process encoding the same key waits and then reads the first one's file.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from dptune.data.sources import ImageFiles, RawDataset
from dptune.paths import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMAT_VERSION = 2  # 2: bf16 text features from bf16 weights (1: from a bf16 autocast)
#: Precisions features are encoded in: full fp32, or bf16 (text: bf16 weights; images: bf16 autocast).
PRECISIONS = ("fp32", "bf16")
#: Environment variable that forces one of ``PRECISIONS`` (unset or ``auto``: the hardware rule).
PRECISION_ENV = "DPTUNE_ENCODE_PRECISION"
#: /proc/cpuinfo flags of native bf16 matrix instructions (Intel AMX, AVX-512 BF16 on Intel/AMD).
CPU_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
#: Tokens per text batch by device type. On a 2-core CPU, 4,096 (32 documents of 128 tokens) encoded
#: MiniLM 1.11x faster than 16,384 in bf16 and 1.15x in fp32 (medians of 3 interleaved rounds;
#: ``bench/bench_encoding_precision.py --batch-tokens``, ``bench/RESULTS.md``); a GPU gets larger
#: batches (not measured here).
TEXT_BATCH_TOKENS: dict[str, int] = {"cpu": 4096, "cuda": 16384}
IMAGE_BATCH = 256


def weights_fingerprint(module: nn.Module) -> str:
    """sha256 over the module's state dict (names, dtypes, shapes, values): the weights' identity."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}\n".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def folder_fingerprint(folder: Path) -> str:
    """sha256 over every file under ``folder`` (relative names and contents, in name order)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder).as_posix()}\n".encode())
        with open(path, "rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def encoding_device() -> torch.device:
    """CUDA when available (a cluster's GPU), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (``flags`` line of ``/proc/cpuinfo``; empty where there is none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def encoding_precision(device: torch.device) -> str:
    """The precision features are encoded in on ``device``: one of ``PRECISIONS``.

    ``$DPTUNE_ENCODE_PRECISION`` when set (``fp32``, ``bf16``; ``auto`` or unset: the rule);
    the rule is bf16 on a CUDA GPU with native bf16 (compute capability ≥ 8, ROCm) and on a
    CPU with a flag of ``CPU_BF16_FLAGS`` (where bf16 was measured faster: 2.4x with AVX-512
    BF16, 2.5x with AMX; ``bench/RESULTS.md``), fp32 elsewhere (bf16 would be emulated there;
    not measured). The GPU case is not measured in this repository.
    Raises ``ValueError`` for any other value of the variable.
    """
    forced = os.environ.get(PRECISION_ENV, "auto").strip().lower()
    if forced in PRECISIONS:
        return forced
    if forced != "auto":
        raise ValueError(f"{PRECISION_ENV}={forced!r}: expected one of {[*PRECISIONS, 'auto']}")
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
    return "bf16" if cpu_flags() & CPU_BF16_FLAGS else "fp32"


def _autocast(device: torch.device, precision: str) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def encode_texts(
    extractor: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    max_tokens: int,
    feature_dim: int,
    precision: str = "fp32",
) -> np.ndarray:
    """Features ``(len(texts), feature_dim)`` float32 of ``texts`` truncated to ``max_tokens``,
    computed in ``precision`` (one of ``PRECISIONS``; bf16 runs a bf16 copy of ``extractor``)."""
    from tqdm.auto import tqdm

    device = encoding_device()
    ids = tokenizer(texts, truncation=True, max_length=max_tokens, return_attention_mask=False)[
        "input_ids"
    ]
    lengths = np.array([len(row) for row in ids])
    order = np.argsort(-lengths, kind="stable")  # longest first: the largest batch comes first
    features = np.empty((len(texts), feature_dim), dtype=np.float32)
    if precision == "bf16":
        extractor = copy.deepcopy(extractor).to(torch.bfloat16)
    extractor = extractor.to(device).eval()
    with (
        torch.inference_mode(),
        tqdm(total=len(texts), desc=f"encoding text ({precision})", unit="doc", mininterval=2.0) as bar,
    ):
        start = 0
        while start < len(order):
            longest = int(lengths[order[start]])
            chunk = order[start : start + max(1, TEXT_BATCH_TOKENS[device.type] // longest)]
            input_ids = torch.full((len(chunk), longest), tokenizer.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), longest), dtype=torch.long)
            for position, row in enumerate(chunk):
                input_ids[position, : lengths[row]] = torch.tensor(ids[row])
                attention_mask[position, : lengths[row]] = 1
            output = extractor(input_ids.to(device), attention_mask.to(device))
            features[chunk] = output.float().cpu().numpy()
            start += len(chunk)
            bar.update(len(chunk))
    return features


def encode_images(
    extractor: nn.Module,
    images: torch.Tensor | ImageFiles,
    rows: np.ndarray,
    feature_dim: int,
    precision: str = "fp32",
) -> np.ndarray:
    """Features ``(len(rows), feature_dim)`` float32 of ``images[rows]`` (uint8 in [0, 255]),
    computed in ``precision`` (one of ``PRECISIONS``)."""
    from tqdm.auto import tqdm

    device = encoding_device()
    if isinstance(images, torch.Tensor):
        batches: Iterator = (
            images[rows[i : i + IMAGE_BATCH]] for i in range(0, len(rows), IMAGE_BATCH)
        )
    else:
        workers = min(8, os.cpu_count() or 1)
        batches = (
            batch[0]
            for batch in DataLoader(
                Subset(images, rows.tolist()), batch_size=IMAGE_BATCH, num_workers=workers
            )
        )
    features = np.empty((len(rows), feature_dim), dtype=np.float32)
    extractor = extractor.to(device).eval()
    done = 0
    with (
        torch.inference_mode(),
        _autocast(device, precision),
        tqdm(total=len(rows), desc=f"encoding images ({precision})", unit="img", mininterval=2.0) as bar,
    ):
        for batch in batches:
            features[done : done + len(batch)] = extractor(batch.to(device)).float().cpu().numpy()
            done += len(batch)
            bar.update(len(batch))
    return features


def encode_rows(
    extractor: nn.Module,
    raw: RawDataset,
    rows: np.ndarray,
    backbone: str,
    max_tokens: int | None,
    feature_dim: int,
    precision: str = "fp32",
) -> np.ndarray:
    """Encode ``raw`` rows ``rows`` with the frozen ``extractor`` of ``backbone`` in
    ``precision`` (no cache)."""
    from dptune.models import load_tokenizer

    if raw.modality == "text":
        texts = [raw.inputs[row] for row in rows]
        tokenizer = load_tokenizer(backbone)
        return encode_texts(extractor, tokenizer, texts, max_tokens, feature_dim, precision)
    return encode_images(extractor, raw.inputs, rows, feature_dim, precision)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path, rows: int, feature_dim: int) -> np.ndarray | None:
    if not path.exists():
        return None
    features = np.load(path)
    if features.shape != (rows, feature_dim) or features.dtype != np.float32:
        return None  # stale or foreign file: re-encode and overwrite
    return features


def cached_features(
    raw: RawDataset,
    rows: np.ndarray | None,
    backbone: str,
    *,
    max_tokens: int | None,
    image_size: int | None,
) -> np.ndarray:
    """Features of ``raw`` rows ``rows`` (``None`` = every row, the normal case), from the cache
    or encoded once and cached. Returns ``(len(rows), feature_dim)`` float32 in ``rows`` order.

    A full-dataset cache entry serves any subset; a capped subset that finds none encodes just
    its rows and caches them under a key that includes the row set.
    """
    from dptune.models import BACKBONES, build_feature_extractor

    info = BACKBONES[backbone]
    precision = encoding_precision(encoding_device())
    extractor: nn.Module | None = None
    source = info.weight_source() if info.weight_source is not None else None
    if source is None:  # weights from a hub or a builder: identified by the loaded state dict
        extractor = build_feature_extractor(backbone, image_size=image_size)
    key = {
        "format": FORMAT_VERSION,
        "dataset": raw.name,
        "data_sha256": raw.fingerprint,
        "backbone": backbone,
        "weights_sha256": weights_fingerprint(extractor) if extractor is not None else folder_fingerprint(source),
        "max_tokens": max_tokens if raw.modality == "text" else None,
        "image_size": image_size if raw.modality == "image" else None,
        "pooling": (
            "attention-mask mean of last hidden state"
            if raw.modality == "text"
            else "backbone pooled output"
        ),
        "precision": precision,
    }
    folder = cache_dir("features")
    full_path = folder / _file_name(raw.name, backbone, key)
    total = len(raw.labels)
    full = _read(full_path, total, info.feature_dim)
    if full is not None:
        return full if rows is None else full[rows]
    if rows is None:
        target_rows, path = np.arange(total), full_path
    else:
        target_rows = np.unique(rows)
        key["rows_sha256"] = hashlib.sha256(target_rows.astype(np.int64).tobytes()).hexdigest()
        path = folder / _file_name(raw.name, backbone, key)
    with _exclusive(path.with_name(path.name + ".lock")):
        features = _read(path, len(target_rows), info.feature_dim)
        if features is None:
            if extractor is None:
                extractor = build_feature_extractor(backbone, image_size=image_size)
            features = encode_rows(
                extractor, raw, target_rows, backbone, max_tokens, info.feature_dim, precision
            )
            _atomic_write(
                path.with_suffix(".json"), lambda h: h.write(json.dumps(key, indent=1).encode())
            )
            _atomic_write(path, lambda h: np.save(h, features))
    if rows is None:
        return features
    return features[np.searchsorted(target_rows, rows)]


def _file_name(dataset: str, backbone: str, key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return f"{dataset}-{backbone}-{digest}.npy"
