"""The trained parameters of every run that finished, as ``.safetensors`` files. Torch-free.

A run that ends ``ok`` writes its :class:`~dptune.contract.TrainedModel` to
``<runs root>/weights/<trial_id>.safetensors`` (atomically, before its rows: a recorded ``ok`` run
always has its weights) beside its records, so in a private search they stay inside the trust
boundary with the records. The file holds the float32 arrays by parameter name and, in the
safetensors header's ``__metadata__`` (str → str), ``provenance`` (JSON) and ``logits``
(``contract.LogitsRule``). Only what the runs trained is stored: a linear head is
classes·(dim + 1) floats (30 KB for 20 classes on 384-d features), a PEFT model its PEFT
parameters; ``peft: full`` stores the whole model per run. :mod:`dptune.search.finish.publish` copies the
ones a search may publish to ``<results>/models/``.

Bundles (:func:`bundle_weights`, from :mod:`dptune.records.compaction`): at a unit's end and at the
finishing step the small files (under :data:`SINGLE_BYTES`) become one bundle
``weights/bundle-<seq>-<tag>.safetensors`` (written atomically, then the files are deleted): tensors
``<trial_id>/<parameter>``, and in ``__metadata__`` under :data:`BUNDLE_INDEX` a JSON object giving each
trial's own metadata, its index. Small bundles are merged in turn. A trial's weights come from its own
file when there is one, else from the newest bundle (by ``(seq, tag)``) holding it, so a kill between
writing a bundle and deleting what it replaces loses and duplicates nothing. Every file is written with
the process's umask (owner-only in a private search: ``records.owner_only``).
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import pyarrow.fs as pafs
from safetensors.numpy import load, save

from dptune.contract import TrainedModel
from dptune.paths import filesystem, read_file, write_file_atomic

#: The folder of the runs' weights, under the runs' root (the trust boundary of a private search).
WEIGHTS_FOLDER = "weights"
#: The folder of the models a search publishes, under its results root.
MODELS_FOLDER = "models"
#: The one weights file of a saved model, and its cards, in ``<results>/models/<model>/``.
MODEL_FILE, CARD_JSON, CARD_MD = "model.safetensors", "model_card.json", "model_card.md"
#: A bundle's name: ``bundle-<seq>-<tag>.safetensors``; a newer bundle has a greater ``(seq, tag)``.
BUNDLE_NAME = re.compile(r"bundle-(?P<seq>\d{12})-(?P<tag>[0-9a-f]{32})\.safetensors")
#: The ``__metadata__`` key of a bundle's index: JSON, trial id → that trial's own metadata (str → str).
BUNDLE_INDEX = "dptune.trials"
#: Weights files at most this large (bytes) are bundled; larger ones (a whole model) stay on their own.
SINGLE_BYTES = 16 * 2**20
#: A bundle at least this large (bytes) is full: never merged again; the bundling of many files starts a
#: new bundle after twice as many bytes.
BUNDLE_FULL_BYTES = 32 * 2**20

#: Listings :func:`read_weights` takes at most when bundles it listed are merged away meanwhile.
RELISTS = 5

#: The headers of bundles read, by (path, size, mtime in ns): bundles are never rewritten in place.
_HEADERS: dict[tuple[str, int, int], tuple[int, dict[str, Any]]] = {}
_HEADER_ENTRIES = 1024


def weights_bytes(trained: TrainedModel, extra: dict[str, str] | None = None) -> bytes:
    """``trained`` as safetensors bytes; ``extra`` (str → str) joins its header's metadata."""
    arrays = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in trained.parameters.items()}
    metadata = {"provenance": json.dumps(trained.provenance, sort_keys=True), "logits": trained.logits, **(extra or {})}
    return save(arrays, metadata=metadata)


def trained_model(data: bytes) -> TrainedModel:
    """The :class:`TrainedModel` of safetensors bytes written by :func:`weights_bytes`."""
    metadata = safetensors_metadata(data)
    return TrainedModel(
        parameters=dict(sorted(load(data).items())),  # by name: the header's order varies from write to write
        provenance=json.loads(metadata.get("provenance", "{}")),
        logits="augmented" if metadata.get("logits") == "augmented" else "module",
    )


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes: the header is an 8-byte little-endian length and
    that many bytes of JSON (the format's specification)."""
    (length,) = struct.unpack("<Q", data[:8])
    header: dict[str, Any] = json.loads(data[8 : 8 + length])
    return dict(header.get("__metadata__") or {})


def write_weights(runs: str, trial_id: str, trained: TrainedModel) -> None:
    """Write run ``trial_id``'s trained parameters under ``<runs>/weights/`` (atomic)."""
    write_file_atomic(f"{runs}/{WEIGHTS_FOLDER}", f"{trial_id}.safetensors", weights_bytes(trained))


def read_weights(runs: str, trial_id: str) -> TrainedModel | None:
    """Run ``trial_id``'s trained parameters, or None when it wrote none (not ``ok``, or older results): its
    own file, else the newest bundle holding it (each bundle's header read once per process)."""
    data = read_file(f"{runs}/{WEIGHTS_FOLDER}", f"{trial_id}.safetensors")
    if data is not None:
        return trained_model(data)
    fs, root = filesystem(f"{runs}/{WEIGHTS_FOLDER}")
    for _ in range(RELISTS - 1):
        with contextlib.suppress(FileNotFoundError):  # a bundle merged away meanwhile: its runs are in the next listing
            return _in_bundles(fs, root, trial_id)
    return _in_bundles(fs, root, trial_id)


def _in_bundles(fs: pafs.FileSystem, root: str, trial_id: str) -> TrainedModel | None:
    """Run ``trial_id``'s model from the newest bundle in ``root`` holding it, or None."""
    for info in reversed(_listing(fs, root)[1]):
        start, header = _header(fs, info)
        if trial_id in (index := _index(header)):
            return _from_bundle(fs, info.path, start, header, trial_id, index[trial_id])
    return None


def bundle_weights(
    runs: str, trial_ids: Collection[str] | None, select: Callable[[Sequence[tuple[str, int]]], list[str]]
) -> None:
    """Bundle the small weights files (at most :data:`SINGLE_BYTES`) of ``trial_ids`` (None: every one)
    under ``runs``: one bundle per 2 · :data:`BUNDLE_FULL_BYTES` of files, then the files are deleted; then
    merge the bundles ``select`` picks from the ``(path, bytes)`` of every bundle, until it picks none. Every
    bundle is written (atomically) before the files it replaces are deleted."""
    folder = f"{runs}/{WEIGHTS_FOLDER}"
    fs, root = filesystem(folder)
    singles, bundles = _listing(fs, root)
    chosen = [
        info
        for trial, info in sorted(singles.items())
        if (trial_ids is None or trial in trial_ids) and info.size <= SINGLE_BYTES
    ]
    held: dict[str, tuple[dict[str, np.ndarray], dict[str, str]]] = {}
    size, seq = 0, _next_seq(bundles)
    for info in chosen:
        with fs.open_input_file(info.path) as file:
            data = file.readall()
        held[info.base_name[: -len(".safetensors")]] = (load(data), safetensors_metadata(data))
        size += len(data)
        if size >= 2 * BUNDLE_FULL_BYTES:
            _write_bundle(folder, held, seq)
            held, size = {}, 0
    if held:
        _write_bundle(folder, held, seq)
    _delete(fs, [info.path for info in chosen])
    while True:
        bundles = _listing(fs, root)[1]
        group = select([(info.path, info.size) for info in bundles])
        if not group:
            return
        try:
            merged = _merged(fs, bundles, set(group))
        except FileNotFoundError:
            continue  # another unit merged one of them meanwhile (what it wrote holds its runs): list again
        _write_bundle(folder, merged, _next_seq(bundles))
        _delete(fs, group)


def _write_bundle(folder: str, held: dict[str, tuple[dict[str, np.ndarray], dict[str, str]]], seq: int) -> None:
    """Write ``held`` (per trial id: its arrays and metadata) as one bundle at ``seq`` in ``folder`` (atomic)."""
    arrays = {f"{trial}/{name}": array for trial, (parameters, _) in held.items() for name, array in parameters.items()}
    index = json.dumps({trial: metadata for trial, (_, metadata) in held.items()}, sort_keys=True)
    name = f"bundle-{seq:012d}-{uuid.uuid4().hex}.safetensors"
    write_file_atomic(folder, name, save(arrays, metadata={BUNDLE_INDEX: index}))


def _merged(
    fs: pafs.FileSystem, bundles: list[pafs.FileInfo], group: set[str]
) -> dict[str, tuple[dict[str, np.ndarray], dict[str, str]]]:
    """The trials of the bundles at the paths ``group`` (of ``bundles``, oldest first), each from the newest
    of them holding it, less those a newer bundle outside ``group`` holds (it keeps them)."""
    held: dict[str, tuple[dict[str, np.ndarray], dict[str, str]]] = {}
    newer: set[str] = set()
    for info in reversed(bundles):
        index = _index(_header(fs, info)[1])
        if info.path in group:
            with fs.open_input_file(info.path) as file:
                arrays = load(file.readall())
            for trial in set(index) - newer:
                prefix = f"{trial}/"
                held[trial] = ({n[len(prefix) :]: a for n, a in arrays.items() if n.startswith(prefix)}, index[trial])
        newer |= set(index)
    return held


def _delete(fs: pafs.FileSystem, paths: list[str]) -> None:
    """Delete ``paths``; one already gone (another process deleted it) is no error."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            fs.delete_file(path)


def _index(header: dict[str, Any]) -> dict[str, dict[str, str]]:
    """A bundle's index (:data:`BUNDLE_INDEX`): trial id → that trial's metadata."""
    index: dict[str, dict[str, str]] = json.loads(header.get("__metadata__", {}).get(BUNDLE_INDEX, "{}"))
    return index


def _listing(fs: pafs.FileSystem, root: str) -> tuple[dict[str, pafs.FileInfo], list[pafs.FileInfo]]:
    """The weights folder listed: single files by trial id, and bundles oldest first."""
    singles, bundles = {}, []
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if match := BUNDLE_NAME.fullmatch(info.base_name):
            bundles.append(((int(match["seq"]), match["tag"]), info))
        elif info.base_name.endswith(".safetensors") and not info.base_name.startswith("."):
            singles[info.base_name[: -len(".safetensors")]] = info
    return singles, [info for _, info in sorted(bundles, key=lambda pair: pair[0])]


def _next_seq(bundles: list[pafs.FileInfo]) -> int:
    """A sequence number newer than every bundle of ``bundles``."""
    return 1 + max(
        (int(match["seq"]) for info in bundles if (match := BUNDLE_NAME.fullmatch(info.base_name))), default=0
    )


def _header(fs: pafs.FileSystem, info: pafs.FileInfo) -> tuple[int, dict[str, Any]]:
    """A bundle's header (kept for the process) and where its data starts (bytes)."""
    key = (info.path, info.size, info.mtime_ns)
    if key not in _HEADERS:
        with fs.open_input_file(info.path) as file:
            (length,) = struct.unpack("<Q", file.read_at(8, 0))
            header = json.loads(file.read_at(length, 8))
        while len(_HEADERS) >= _HEADER_ENTRIES:
            del _HEADERS[next(iter(_HEADERS))]
        _HEADERS[key] = (8 + length, header)
    return _HEADERS[key]


def _from_bundle(
    fs: pafs.FileSystem, path: str, start: int, header: dict[str, Any], trial_id: str, metadata: dict[str, str]
) -> TrainedModel:
    """Trial ``trial_id``'s model from the bundle at ``path``: its tensors' bytes only (float32, as
    :func:`weights_bytes` writes every array)."""
    prefix = f"{trial_id}/"
    tensors = {name: entry for name, entry in header.items() if name.startswith(prefix)}
    parameters = {}
    with fs.open_input_file(path) as file:
        for name, entry in sorted(tensors.items()):
            begin, end = entry["data_offsets"]
            raw = file.read_at(end - begin, start + begin)
            parameters[name[len(prefix) :]] = np.frombuffer(raw, dtype="<f4").reshape(entry["shape"]).copy()
    return TrainedModel(
        parameters=parameters,
        provenance=json.loads(metadata.get("provenance", "{}")),
        logits="augmented" if metadata.get("logits") == "augmented" else "module",
    )
