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
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
from safetensors.numpy import load, save

from dptune.contract import TrainedModel
from dptune.paths import read_file, write_file_atomic

#: The folder of the runs' weights, under the runs' root (the trust boundary of a private search).
WEIGHTS_FOLDER = "weights"
#: The folder of the models a search publishes, under its results root.
MODELS_FOLDER = "models"
#: The one weights file of a saved model, and its cards, in ``<results>/models/<model>/``.
MODEL_FILE, CARD_JSON, CARD_MD = "model.safetensors", "model_card.json", "model_card.md"


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
    """Run ``trial_id``'s trained parameters, or None when it wrote none (not ``ok``, or older results)."""
    data = read_file(f"{runs}/{WEIGHTS_FOLDER}", f"{trial_id}.safetensors")
    return None if data is None else trained_model(data)
