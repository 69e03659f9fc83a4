"""Frozen-backbone features for ``peft == "head"``: encode once, cache on disk, reuse.

Text is mean-pooled over the attention mask (``dptune.models.TextEncoder``); images use the
backbone's own pooled output. Encoding runs under ``torch.inference_mode`` on CUDA when available,
else on the CPU with torch's thread setting (all cores unless ``OMP_NUM_THREADS`` or
``torch.set_num_threads`` says otherwise). How it runs (``PRECISIONS``: torch in fp32 or bf16, and,
for text on the CPU, OpenVINO's CPU runtime at fp32 or bf16 inference precision, its bf16 only where
it reports the CPU computes bf16, else left out and the probe says why) is chosen by
measurement, not by CPU flags (``choose_precision``): on first use per machine and backbone, a few
batches of the rows to encode are timed in each candidate (interleaved rounds, median), and the
fastest that the backbone's downstream evidence allows (``dptune.data.downstream``: DP probes on its
features inside the runs' own noise against fp32's; for a backbone or precision without evidence,
features within cosine ``MIN_COSINE`` of torch's fp32 ones on every probe row; both rules in
``dptune.data.precision_choice``) is chosen and recorded in ``dptune.paths.cache_dir("precision")``
with the machine's identity (CPU model and flags, threads, device, torch version, the candidates,
the evidence); ``DPTUNE_ENCODE_PRECISION`` overrides it. (bf16 was 2.4–2.7x faster than fp32 on
CPUs with AMX or on an AMD EPYC with AVX-512 BF16, and slower on an Intel Xeon with AVX-512 BF16
but no AMX; on the EPYC, OpenVINO in bf16 was 1.3x torch in bf16, with features closer to fp32:
flags do not tell, ``bench/RESULTS.md``.) torch
runs a text encoder in bf16 throughout (its weights cast to bf16; the mean pooling in float32),
which on a CPU was 1.1–1.2x faster than a bf16 autocast in two hand-timed runs of 1,536 documents;
an image encoder, whose preprocessing is float32, runs under a bf16 autocast. bf16 features of
MiniLM text are within cosine 0.9998 of fp32 ones, and DP linear probes trained on either agree
within 0.3 accuracy points (``bench/bench_encoding_precision.py``). Text is sorted by token count
and batched by a token budget, each batch padded only to its longest document (dynamic padding): the
attention mask makes this equal to padding every document to ``max_tokens`` up to float rounding.

Cache: ``dptune.paths.cache_dir("features")/<dataset>-<backbone>-<key>.npy`` (float32,
``(rows, feature_dim)``, rows in the dataset's raw order) plus a ``.json`` with the key. The key
hashes the dataset name and content fingerprint, the backbone name and a sha256 of its weights
(of the files of its local weight folder where the backbone names one, so that a cache hit
builds no model; else of the loaded state dict), ``max_tokens``/``image_size``, the pooling, the
precision, and (for capped test subsets only) the row set. Writes are atomic (temporary file +
``os.replace``) under an exclusive ``flock``: a second process encoding the same key waits and then
reads the first one's file.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import platform
import re
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from dptune.data.downstream import downstream_agreement
from dptune.data.openvino_runtime import TextBatch, TextRunner, openvino_left_out, openvino_text_runner
from dptune.data.precision_choice import REFERENCE_PRECISION, PrecisionChoice, measure_precision
from dptune.data.sources import ImageFiles, RawDataset
from dptune.paths import cache_dir, exclusive

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMAT_VERSION = 2  # 2: bf16 text features from bf16 weights (1: from a bf16 autocast)
#: How features are encoded: torch in full fp32 or in bf16 (text: bf16 weights; images: bf16
#: autocast), or (text on the CPU only) OpenVINO's CPU runtime at fp32 or bf16 inference precision.
#: The first, torch fp32, is the reference the others must agree with.
PRECISIONS = (REFERENCE_PRECISION, "bf16", "openvino-fp32", "openvino-bf16")
OPENVINO = "openvino-"
#: Environment variable that forces one of ``PRECISIONS`` (unset or ``auto``: the measured choice).
PRECISION_ENV = "DPTUNE_ENCODE_PRECISION"
#: Rows of the data to encode that the measurement (``precision_choice.measure_precision``) times.
PROBE_ROWS = 32
#: A long document is first tokenized from its first ``PREFIX_CHARS_PER_TOKEN × max_tokens``
#: characters (``token_ids``): at 128 tokens, 40 of the 18,821 20 Newsgroups documents needed their
#: whole text after that, and tokenizing them all took 3.5 s instead of 6.7 s on 2 cores.
PREFIX_CHARS_PER_TOKEN = 6
#: Tokens per text batch by device type. On a 2-core CPU, 4,096 (32 documents of 128 tokens) encoded
#: MiniLM 1.11x faster than 16,384 in bf16 and 1.15x in fp32 (medians of 3 interleaved rounds;
#: ``bench/bench_encoding_precision.py --batch-tokens``, ``bench/RESULTS.md``); a GPU gets larger
#: batches (not measured here).
TEXT_BATCH_TOKENS: dict[str, int] = {"cpu": 4096, "cuda": 16384}
IMAGE_BATCH = 256


def weights_fingerprint(module: nn.Module, exclude: Collection[str] = ()) -> str:
    """sha256 over the state dict (names, dtypes, shapes, values) less ``exclude``: the weights' identity."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if name in exclude:
            continue
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}\n".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def folder_fingerprint(folder: Path) -> str:
    """sha256 over every file under ``folder`` (relative names and contents, in name order); of a
    weights file, over its name and contents."""
    digest = hashlib.sha256()
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        digest.update(f"{path.relative_to(folder.parent if folder.is_file() else folder).as_posix()}\n".encode())
        with open(path, "rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def encoding_device() -> torch.device:
    """CUDA when available (a cluster's GPU), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpuinfo_field(field: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The value of ``cpuinfo``'s first ``field`` line (``model name``, ``flags``; "" where there is none)."""
    try:
        lines = [line.partition(":") for line in cpuinfo.read_text().splitlines()]
    except OSError:
        return ""
    return next((value.strip() for key, _, value in lines if key.strip() == field), "")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (``flags`` line of ``/proc/cpuinfo``; empty where there is none)."""
    return frozenset(cpuinfo_field("flags", cpuinfo).split())


def candidate_precisions(device: torch.device, modality: str) -> tuple[str, ...]:
    """The ``PRECISIONS`` that can encode ``modality`` on ``device``, torch fp32 first: OpenVINO's only for
    text on the CPU where it is installed, less those this CPU would not compute as named
    (``openvino_runtime.openvino_left_out``: the probe's message names them)."""
    if device.type == "cpu" and modality == "text" and importlib.util.find_spec("openvino") is not None:
        return tuple(p for p in PRECISIONS if p not in openvino_left_out())
    return tuple(p for p in PRECISIONS if not p.startswith(OPENVINO))


def forced_precision(candidates: tuple[str, ...] = PRECISIONS) -> str | None:
    """``$DPTUNE_ENCODE_PRECISION`` when it names one of ``candidates``; None when unset or ``auto``.
    Raises ``ValueError`` for any other value."""
    forced = os.environ.get(PRECISION_ENV, "auto").strip().lower()
    if forced in candidates:
        return forced
    if forced in PRECISIONS:
        raise ValueError(
            f"{PRECISION_ENV}={forced!r} is not available here (OpenVINO encodes only text on the CPU where it is "
            f"installed, and its bf16 only on a CPU that computes in bf16: AVX-512 BF16 or AMX); "
            f"choose one of {[*candidates, 'auto']}"
        )
    if forced != "auto":
        raise ValueError(f"{PRECISION_ENV}={forced!r}: expected one of {[*candidates, 'auto']}")
    return None


def machine_identity(device: torch.device) -> dict[str, str | int]:
    """What a measured choice of precision holds for: the processor (model name and a digest of its
    flags), the threads torch uses, the device and torch's version."""
    identity: dict[str, str | int] = {
        "cpu": cpuinfo_field("model name") or platform.processor() or platform.machine(),
        "cpu_flags_sha256": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(),
        "device": device.type,
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        identity["gpu"] = torch.cuda.get_device_name(device)
    return identity


def _precision_record(device: torch.device, backbone: str, candidates: tuple[str, ...]) -> Path:
    """Where the choice for this machine, backbone and candidates is recorded (other downstream
    evidence, as after an update of dptune, is another record: measured anew)."""
    evidence = {p: found.describe() for p, found in sorted(downstream_agreement(backbone).items())}
    identity = {**machine_identity(device), "backbone": backbone, "candidates": list(candidates), "evidence": evidence}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir("precision") / f"{file_label(backbone)}-{digest}.json"


def recorded_precision(device: torch.device, backbone: str, candidates: tuple[str, ...]) -> PrecisionChoice | None:
    """The choice forced by ``$DPTUNE_ENCODE_PRECISION``, else the one measured on this machine for
    ``backbone`` among ``candidates`` and recorded, else None (nothing measured yet)."""
    forced = forced_precision(candidates)
    if forced is not None:
        return PrecisionChoice(forced, f"forced by {PRECISION_ENV}", {}, {})
    path = _precision_record(device, backbone, candidates)
    try:
        recorded = json.loads(path.read_text())
        choice = PrecisionChoice(**recorded["choice"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: measure again
    return choice if choice.precision in candidates and isinstance(choice.min_cosine, dict) else None


def choose_precision(
    device: torch.device,
    backbone: str,
    encode: Callable[[str], np.ndarray],
    rows: int,
    candidates: tuple[str, ...],
    left_out: dict[str, str] | None = None,
) -> PrecisionChoice:
    """:func:`recorded_precision`, or a new :func:`measure_precision` of ``encode`` (``rows`` probe
    rows) among ``candidates`` by the backbone's downstream evidence
    (:func:`~dptune.data.downstream.downstream_agreement`), recorded for this machine and backbone;
    its reason ends with each of ``left_out`` (``openvino_runtime.openvino_left_out``) and why it was not measured."""
    choice = recorded_precision(device, backbone, candidates)
    if choice is None:
        choice = measure_precision(encode, rows, candidates, agreement=downstream_agreement(backbone))
        if left_out:
            notes = "; ".join(f"{p} not measured: {why}" for p, why in left_out.items())
            choice = replace(choice, reason=f"{choice.reason}; {notes}")
        path = _precision_record(device, backbone, candidates)
        data = {
            "machine": machine_identity(device),
            "backbone": backbone,
            "candidates": list(candidates),
            "choice": asdict(choice),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _atomic_write(path, lambda handle: handle.write(json.dumps(data, indent=1).encode()))
    return choice


def _autocast(device: torch.device, precision: str) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def _text_runner(
    extractor: nn.Module, precision: str, device: torch.device, features: np.ndarray, bulk: bool
) -> TextRunner:
    """What encodes ``extractor``'s features of each batch in ``precision`` on ``device`` into ``features``."""
    if precision.startswith(OPENVINO):
        return openvino_text_runner(extractor, precision.removeprefix(OPENVINO), features, bulk)
    if precision == "bf16":
        extractor = copy.deepcopy(extractor).to(torch.bfloat16)
    model = extractor.to(device).eval()

    def run(batches: Iterator[TextBatch], done: Callable[[int], object]) -> None:
        for rows, input_ids, attention_mask in batches:
            features[rows] = model(input_ids.to(device), attention_mask.to(device)).float().cpu().numpy()
            done(len(rows))

    return run


def token_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_tokens: int | None) -> list[list[int]]:
    """``tokenizer(texts, truncation=True, max_length=max_tokens)["input_ids"]``, without tokenizing
    more of a long document than its first ``max_tokens`` need.

    With a BERT tokenizer (``BertNormalizer``, ``BertPreTokenizer``: normalisation character by
    character, words split at whitespace and punctuation), the words before a space tokenize alike in
    a prefix cut there and in the whole text, so a prefix's truncated tokens are the whole document's
    whenever they reach ``max_tokens``. Each document longer than ``PREFIX_CHARS_PER_TOKEN ×
    max_tokens`` characters is cut at its last space before that; the few whose prefix comes out
    shorter, and every document of another kind of tokenizer, are tokenized whole.
    """

    def tokenize(batch: list[str]) -> list[list[int]]:
        return list(tokenizer(batch, truncation=True, max_length=max_tokens, return_attention_mask=False)["input_ids"])

    backend = getattr(tokenizer, "backend_tokenizer", None)
    bert = backend is not None and [type(backend.normalizer).__name__, type(backend.pre_tokenizer).__name__] == [
        "BertNormalizer",
        "BertPreTokenizer",
    ]
    if max_tokens is None or not bert:
        return tokenize(texts)
    limit = PREFIX_CHARS_PER_TOKEN * max_tokens
    prefixes = [
        text if len(text) <= limit or text.rfind(" ", 0, limit) <= 0 else text[: text.rfind(" ", 0, limit)]
        for text in texts
    ]
    ids = tokenize(prefixes)
    whole = [
        i
        for i, (prefix, text) in enumerate(zip(prefixes, texts, strict=True))
        if len(prefix) < len(text) and len(ids[i]) < max_tokens
    ]
    for i, row in zip(whole, tokenize([texts[i] for i in whole]) if whole else [], strict=True):
        ids[i] = row
    return ids


def encode_texts(
    extractor: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    max_tokens: int | None,
    feature_dim: int,
    precision: str = "fp32",
    why: str | None = "",
    bulk: bool = True,
) -> np.ndarray:
    """Features ``(len(texts), feature_dim)`` float32 of ``texts`` truncated to ``max_tokens`` (None:
    the tokenizer's own limit), computed in ``precision`` (one of ``PRECISIONS``; bf16 runs a bf16
    copy of ``extractor``; the ``openvino-`` ones OpenVINO's CPU runtime). ``why`` follows the precision
    in the progress bar; None: no bar. ``bulk``: OpenVINO keeps several batches in flight (False: one
    at a time, for the measurement's few rows; see :func:`openvino_text_runner`). A model card's
    ``openvino-bf16`` on a CPU that would not compute it (``openvino_left_out``) is encoded in
    ``openvino-fp32``, and the bar says so."""
    from tqdm.auto import tqdm

    device = encoding_device()
    if precision == f"{OPENVINO}bf16" and precision in (left_out := openvino_left_out()):
        why = None if why is None else f" in place of {precision}: {left_out[precision]}{why}"
        precision = f"{OPENVINO}fp32"
    ids = token_ids(tokenizer, texts, max_tokens)
    lengths = np.array([len(row) for row in ids])
    order = np.argsort(-lengths, kind="stable")  # longest first: the largest batch comes first
    features = np.empty((len(texts), feature_dim), dtype=np.float32)
    run = _text_runner(extractor, precision, device, features, bulk)

    def batches() -> Iterator[TextBatch]:
        start = 0
        while start < len(order):
            longest = int(lengths[order[start]])
            rows = order[start : start + max(1, TEXT_BATCH_TOKENS[device.type] // longest)]
            input_ids = torch.full((len(rows), longest), tokenizer.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
            for position, row in enumerate(rows):
                input_ids[position, : lengths[row]] = torch.tensor(ids[row])
                attention_mask[position, : lengths[row]] = 1
            yield rows, input_ids, attention_mask
            start += len(rows)

    with (
        torch.inference_mode(),
        tqdm(
            total=len(texts),
            desc=f"encoding text ({precision}{why or ''})",
            unit="doc",
            mininterval=2.0,
            disable=why is None,
        ) as bar,
    ):
        run(batches(), bar.update)
    return features


def encode_images(
    extractor: nn.Module,
    images: torch.Tensor | ImageFiles,
    rows: np.ndarray,
    feature_dim: int,
    precision: str = "fp32",
    why: str | None = "",
) -> np.ndarray:
    """Features ``(len(rows), feature_dim)`` float32 of ``images[rows]`` (uint8 in [0, 255]),
    computed in ``precision`` (``"fp32"`` or ``"bf16"``: torch's); ``why`` as for :func:`encode_texts`."""
    from tqdm.auto import tqdm

    device = encoding_device()
    if isinstance(images, torch.Tensor):
        batches: Iterator[torch.Tensor] = (images[rows[i : i + IMAGE_BATCH]] for i in range(0, len(rows), IMAGE_BATCH))
    else:
        workers = min(8, os.cpu_count() or 1)
        batches = (
            batch[0] for batch in DataLoader(Subset(images, rows.tolist()), batch_size=IMAGE_BATCH, num_workers=workers)
        )
    features = np.empty((len(rows), feature_dim), dtype=np.float32)
    extractor = extractor.to(device).eval()
    done = 0
    with (
        torch.inference_mode(),
        _autocast(device, precision),
        tqdm(
            total=len(rows),
            desc=f"encoding images ({precision}{why or ''})",
            unit="img",
            mininterval=2.0,
            disable=why is None,
        ) as bar,
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
    why: str | None = "",
    bulk: bool = True,
) -> np.ndarray:
    """Encode ``raw`` rows ``rows`` with the frozen ``extractor`` of ``backbone`` in
    ``precision`` (no cache); ``why`` and ``bulk`` as for :func:`encode_texts`."""
    from dptune.models import load_tokenizer

    if isinstance(raw.inputs, list):  # text: a list of documents
        texts = [raw.inputs[row] for row in rows]
        tokenizer = load_tokenizer(backbone)
        return encode_texts(extractor, tokenizer, texts, max_tokens, feature_dim, precision, why, bulk)
    assert not isinstance(raw.inputs, np.ndarray), "embeddings are features already: nothing encodes them"
    return encode_images(extractor, raw.inputs, rows, feature_dim, precision, why)


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path, rows: int, feature_dim: int, load: bool = True) -> np.ndarray | None:
    """The features in ``path`` if it holds (rows, feature_dim) float32 (``load`` False: mapped, not read)."""
    if not path.exists():
        return None
    features = np.load(path, mmap_mode=None if load else "r")
    if features.shape != (rows, feature_dim) or features.dtype != np.float32:
        return None  # stale or foreign file: re-encode and overwrite
    return features


def weights_digest(backbone: str) -> str | None:
    """The sha256 the feature cache keys ``backbone``'s weights by where they are a local folder or file
    (:func:`folder_fingerprint`, no model built); None where only the built model tells
    (:func:`weights_fingerprint` of its state dict)."""
    from dptune.models.backbones import get_backbone

    info = get_backbone(backbone)
    source = info.weight_source() if info.weight_source is not None else None
    return None if source is None else folder_fingerprint(source)


@dataclass(frozen=True, eq=False)
class FeatureCache:
    """The cache entries of ``raw``'s features by ``backbone``, of rows ``rows`` (None: every row): ``key``
    is the cache key less its precision (:meth:`of`)."""

    raw: RawDataset
    rows: np.ndarray | None
    backbone: str
    key: dict[str, object]

    @classmethod
    def of(
        cls,
        raw: RawDataset,
        rows: np.ndarray | None,
        backbone: str,
        weights: str,
        *,
        max_tokens: int | None,
        image_size: int | None,
    ) -> FeatureCache:
        """The entries of ``raw`` rows ``rows`` encoded by ``backbone`` of weights sha256 ``weights``."""
        from dptune.models.backbones import get_backbone

        pooling = get_backbone(backbone).pooling
        key = {
            "format": FORMAT_VERSION,
            "dataset": raw.name,
            "data_sha256": raw.fingerprint,
            "backbone": backbone,
            "weights_sha256": weights,
            "max_tokens": max_tokens if raw.modality == "text" else None,
            "image_size": image_size if raw.modality == "image" else None,
            "pooling": pooling
            or ("attention-mask mean of last hidden state" if raw.modality == "text" else "backbone pooled output"),
        }
        return cls(raw, rows, backbone, key)

    @property
    def target_rows(self) -> np.ndarray:
        """The rows an encoding encodes (ascending): every row, or each of ``rows`` once."""
        return np.arange(len(self.raw.labels)) if self.rows is None else np.unique(self.rows)

    def entry(self, precision: str) -> tuple[Path, Path, dict[str, object]]:
        """(the full-dataset entry, the entry of exactly :attr:`target_rows`, the latter's key) in ``precision``."""
        folder = cache_dir("features")
        key = {**self.key, "precision": precision}
        full = folder / _file_name(self.raw.name, self.backbone, key)
        if self.rows is None:
            return full, full, key
        key = {**key, "rows_sha256": hashlib.sha256(self.target_rows.astype(np.int64).tobytes()).hexdigest()}
        return full, folder / _file_name(self.raw.name, self.backbone, key), key

    def find(self, precisions: Collection[str], feature_dim: int, load: bool = True) -> tuple[np.ndarray, str] | None:
        """The features of ``rows`` (in ``rows`` order) and their precision from the first of ``precisions``
        with an entry that holds them (the full dataset's serves any rows); None: none does. ``load`` False:
        only which entry holds them (its file mapped, not read; the array is the whole entry's)."""
        for precision in precisions:
            full_path, path, _ = self.entry(precision)
            full = _read(full_path, len(self.raw.labels), feature_dim, load)
            if full is not None:
                return (full if self.rows is None or not load else full[self.rows]), precision
            if self.rows is not None:
                part = _read(path, len(self.target_rows), feature_dim, load)
                if part is not None and not load:
                    return part, precision
                if part is not None:
                    return part[np.searchsorted(self.target_rows, self.rows)], precision
        return None


def cached_features(
    raw: RawDataset,
    rows: np.ndarray | None,
    backbone: str,
    *,
    max_tokens: int | None,
    image_size: int | None,
    provenance: dict[str, str] | None = None,
) -> np.ndarray:
    """Features of ``raw`` rows ``rows`` (``None`` = every row, the normal case), from the cache
    or encoded once and cached. Returns ``(len(rows), feature_dim)`` float32 in ``rows`` order.
    ``provenance`` (if given) gets the features' identity as strings (data and weights digests,
    backbone, precision, max_tokens, pooling): what a saved model needs to encode new rows alike.

    A full-dataset cache entry serves any subset; a capped subset that finds none encodes just
    its rows and caches them under a key that includes the row set.
    """
    from dptune.models import build_feature_extractor
    from dptune.models.backbones import get_backbone

    info = get_backbone(backbone)
    device = encoding_device()
    candidates = candidate_precisions(device, raw.modality)
    choice = recorded_precision(device, backbone, candidates)
    extractor: nn.Module | None = None
    weights = weights_digest(backbone)
    if weights is None:  # weights from a hub or a builder: identified by the loaded state dict
        extractor = build_feature_extractor(backbone, image_size=image_size)
        weights = weights_fingerprint(extractor)
    cache = FeatureCache.of(raw, rows, backbone, weights, max_tokens=max_tokens, image_size=image_size)
    # Nothing chosen yet: an entry in either precision serves as it is (nothing to encode, nothing to choose).
    found = cache.find([choice.precision] if choice is not None else candidates, info.feature_dim)
    if found is not None:
        _describe(provenance, cache.key, found[1])
        return found[0]
    target_rows = cache.target_rows
    if choice is None:
        extractor = extractor if extractor is not None else build_feature_extractor(backbone, image_size=image_size)
        probe = target_rows[
            np.unique(np.linspace(0, len(target_rows) - 1, min(PROBE_ROWS, len(target_rows))).astype(int))
        ]
        encode_probe = partial(
            encode_rows, extractor, raw, probe, backbone, max_tokens, info.feature_dim, why=None, bulk=False
        )
        left_out = openvino_left_out() if f"{OPENVINO}fp32" in candidates else {}
        choice = choose_precision(device, backbone, encode_probe, len(probe), candidates, left_out)
    _, path, key = cache.entry(choice.precision)
    with exclusive(path.with_name(path.name + ".lock")):
        features = _read(path, len(target_rows), info.feature_dim)
        if features is None:
            if extractor is None:
                extractor = build_feature_extractor(backbone, image_size=image_size)
            features = encode_rows(
                extractor,
                raw,
                target_rows,
                backbone,
                max_tokens,
                info.feature_dim,
                choice.precision,
                why=f"; {choice.reason}",
            )
            _atomic_write(path.with_suffix(".json"), lambda h: h.write(json.dumps(key, indent=1).encode()))
            _atomic_write(path, lambda h: np.save(h, features))
    _describe(provenance, cache.key, choice.precision)
    if rows is None:
        return features
    return features[np.searchsorted(target_rows, rows)]


def _describe(provenance: dict[str, str] | None, base: dict[str, object], precision: str) -> None:
    """Fill ``provenance`` (if any) with the features' key ``base`` and ``precision``, as strings."""
    provenance is None or provenance.update(
        {n: str(base[n]) for n in ("data_sha256", "backbone", "weights_sha256", "max_tokens", "pooling")},
        precision=precision,
    )


def _file_name(dataset: str, backbone: str, key: dict[str, object]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return f"{file_label(dataset)}-{file_label(backbone)}-{digest}.npy"


def file_label(name: str) -> str:
    """``name`` (a dataset's or backbone's, which may hold a path: ``hf:/models/encoder``) as a part of a
    file name: its last 60 characters, each other than a letter, digit, ``.``, ``_`` or ``-`` as ``_``
    (the key's digest beside it tells names apart)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[-60:]
