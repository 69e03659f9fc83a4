"""A published model in memory: :func:`load_model` reads a folder a search wrote (``<results>/models/<cell>/``,
:mod:`dptune.search.finish.publish`) into a :class:`Model` that labels texts, images or embeddings.

Each input is encoded as the search encoded its training rows (the card's backbone, ``max_tokens`` and
precision; the backbone's weights must match the card's ``weights_sha256``), and the model's linear
head maps its features to logits by the card's rule (``augmented``: x̃·[W | b]ᵀ with x̃ = (x, 1), as
the fused runner scored; ``module``: W x + b, as ``nn.Linear``). A PEFT model (``film``, ``lora``,
``full``) is the public backbone, rebuilt by name and checked against the card's ``frozen_sha256``,
with the run's trained parameters loaded.

``softmax_score`` is the softmax probability of the predicted class: a score, not a calibrated
confidence (a DP-trained head is often over- or under-confident, and calibrating it on private
validation rows would be one more release the model's (ε, δ) does not cover).

Predicting costs no privacy: a published model is a DP release, and what is computed from it and new
data is post-processing (it protects the training rows, not the rows you predict on).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dptune.errors import DptuneError
from dptune.records.weights import CARD_JSON, MODEL_FILE, trained_model

if TYPE_CHECKING:
    import pandas as pd

#: The input column of a model trained on a registry dataset (no column of the owner's), by modality.
DEFAULT_INPUT_COLUMNS = {"text": "text", "image": "image", "embedding": "embedding"}
#: Rows encoded at a time.
PREDICT_BATCH_ROWS = 64

#: What :meth:`Model.predict` and its kin take: texts, image files, embeddings (rows, dim), or a
#: table whose :attr:`Model.input_column` holds one of those.
Inputs = Sequence[str] | Sequence[Path] | np.ndarray | Any


class ModelError(DptuneError, ValueError):
    """A folder that is no dptune model, or inputs the model cannot take: raised before any encoding."""


@dataclass(frozen=True, eq=False)
class Model:
    """A published dptune model: its ``card`` (``model_card.json``: data, configuration, privacy,
    accuracy) and its trained ``parameters`` (a linear head's ``weight`` (classes, dim) and ``bias``,
    or a PEFT's), read from ``folder``."""

    folder: Path
    card: dict[str, Any]
    parameters: dict[str, np.ndarray]

    @property
    def classes(self) -> list[str]:
        """The class names, in the order of the model's outputs."""
        return [str(name) for name in self.card["data"]["class_names"]]

    @property
    def modality(self) -> str:
        """What the model reads: ``text``, ``image`` (image files) or ``embedding`` (backbone ``none``)."""
        from dptune.contract import NO_BACKBONE
        from dptune.models.backbones import get_backbone

        backbone = self.card["data"]["backbone"]
        return "embedding" if backbone == NO_BACKBONE else get_backbone(backbone).modality

    @property
    def input_column(self) -> str:
        """The column of a table that holds the inputs: the training file's input column, else (a
        registry dataset, or an image folder) ``text``, ``image`` or ``embedding``."""
        return self.card["data"].get("input_column") or DEFAULT_INPUT_COLUMNS[self.modality]

    @property
    def privacy(self) -> dict[str, Any]:
        """The card's privacy section: ``epsilon``, ``delta`` and what they cover."""
        return dict(self.card["privacy"])

    def logits(self, inputs: Inputs) -> np.ndarray:
        """The logits (rows, classes) float32 of ``inputs``."""
        rows = self.inputs(inputs)
        if isinstance(rows, np.ndarray):  # embeddings: a head on backbone none
            features = rows
        elif self.card.get("peft") != "head":
            return _peft_logits(self.card, self._network, rows)
        else:
            features = _features(self.card, self._encoder, rows)
        weight, bias = self.parameters["weight"], self.parameters["bias"]
        if features.shape[1] != weight.shape[1]:
            raise ModelError(f"{features.shape[1]}-d inputs: the model takes {weight.shape[1]}-d ones")
        return _head_logits(features, weight, bias, self.card["logits"])

    def probabilities(self, inputs: Inputs) -> np.ndarray:
        """The softmax of :meth:`logits`: (rows, classes) float32, each row summing to 1."""
        logits = self.logits(inputs)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)

    def predict_proba(self, inputs: Inputs) -> pd.DataFrame:
        """Each row's softmax probabilities: a DataFrame (rows × :attr:`classes`), indexed as a
        DataFrame input (else 0..rows-1)."""
        import pandas as pd

        return pd.DataFrame(self.probabilities(inputs), columns=self.classes, index=_index(inputs))

    def predict(self, inputs: Inputs) -> np.ndarray:
        """Each row's predicted class name: an object array (rows,)."""
        chosen = self.probabilities(inputs).argmax(axis=1)
        return np.array(self.classes, dtype=object)[chosen]

    def predict_frame(self, inputs: Inputs) -> pd.DataFrame:
        """``prediction`` (class name) and ``softmax_score`` (its softmax probability, float32; not a
        calibrated confidence) per row, indexed as a DataFrame input: what ``python -m dptune.predict``
        appends to a file and what the model's MLflow pyfunc returns."""
        import pandas as pd

        probabilities = self.probabilities(inputs)
        chosen = probabilities.argmax(axis=1)
        return pd.DataFrame(
            {
                "prediction": np.array(self.classes, dtype=object)[chosen],
                "softmax_score": probabilities[np.arange(len(chosen)), chosen],
            },
            index=_index(inputs),
        )

    def inputs(self, inputs: Inputs) -> list[str] | list[Path] | np.ndarray:
        """``inputs`` as the encoder takes them: texts, image files or float32 embeddings (rows, dim).
        A DataFrame (pandas, polars, pyarrow) gives its :attr:`input_column`; :class:`ModelError`
        names an input that is empty, a single value rather than rows, or of the wrong kind."""
        if isinstance(inputs, (str, bytes, Path, Mapping)):
            raise ModelError(
                f"pass rows, not one {type(inputs).__name__}: a list of texts, image paths or embeddings, or a "
                f"table with the column {self.input_column!r} (e.g. model.predict([text]))"
            )
        values = _column(inputs, self.input_column)
        if isinstance(values, np.ndarray) and values.dtype.kind in "USO":  # numpy strings or objects
            values = values.tolist()
        if len(values) == 0:
            raise ModelError("no inputs: pass at least one row")
        if self.modality == "embedding":
            try:
                return np.asarray(values, dtype=np.float32).reshape(len(values), -1)
            except (TypeError, ValueError):
                raise ModelError(
                    "this model was trained on embeddings (backbone 'none'): pass lists of numbers"
                ) from None
        rows = list(values)
        if self.modality == "image":
            if not all(isinstance(row, (str, Path)) for row in rows):
                raise ModelError(f"this model reads images ({self.card['data']['backbone']!r}): pass image file paths")
            return [Path(row) for row in rows]
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, str) or not row.strip()), None)
        if bad is not None:
            raise ModelError(f"input row {bad} is {rows[bad]!r}: this model reads texts, each non-empty")
        return rows

    @cached_property
    def _encoder(self) -> tuple[Any, Any]:
        """The backbone's feature extractor (its weights checked against the card's ``weights_sha256``)
        and its tokenizer (None for images), built once per model."""
        return _feature_encoder(self.card)

    @cached_property
    def _network(self) -> Any:
        """A PEFT model's network with the run's parameters loaded, built once per model."""
        return _peft_network(self.card, self.parameters)

    def __repr__(self) -> str:
        privacy = self.card["privacy"]
        return (
            f"Model({self.card['model']['cell_id']!r}, {len(self.classes)} classes, "
            f"backbone {self.card['data']['backbone']!r}, peft {self.card['peft']!r}, "
            f"(ε, δ) = ({privacy['epsilon']:.4g}, {privacy['delta']:.3g}))"
        )


def load_model(folder: str | Path) -> Model:
    """The published model in ``folder`` (``<results>/models/<cell>/``, or the ``models`` a search's
    result lists): its card and trained parameters. :class:`ModelError` unless it holds
    ``model_card.json`` and ``model.safetensors`` of a dptune model."""
    folder = Path(folder)
    card_path, model_path = folder / CARD_JSON, folder / MODEL_FILE
    if not card_path.is_file() or not model_path.is_file():
        raise ModelError(
            f"{folder}: not a dptune model folder (it needs {CARD_JSON} and {MODEL_FILE}; "
            "a search writes them under <results>/models/<cell>/)"
        )
    card = json.loads(card_path.read_text())
    parameters = trained_model(model_path.read_bytes()).parameters
    if card.get("peft") == "head" and set(parameters) != {"weight", "bias"}:
        raise ModelError(f"{folder}: expected a linear head (weight, bias), found {sorted(parameters)}")
    return Model(folder, card, parameters)


def _column(inputs: Any, column: str) -> Any:
    """The values of ``inputs``: a table's (pandas, polars, pyarrow) ``column``, a series' or an
    array's values, or ``inputs`` as they are (a list, a numpy array)."""
    if isinstance(inputs, (np.ndarray, list, tuple)):
        return inputs
    names = getattr(inputs, "column_names", None)  # a pyarrow Table
    if names is None and not hasattr(inputs, "to_list"):  # a DataFrame (a Series has no columns)
        names = getattr(inputs, "columns", None)
    if names is not None:
        if column not in list(names):
            raise ModelError(
                f"the table has no column {column!r} (the model's input column); its columns: {list(names)}"
            )
        inputs = inputs[column]
    for method in ("to_pylist", "to_list"):  # pyarrow; pandas and polars
        if hasattr(inputs, method):
            return getattr(inputs, method)()
    return inputs


def _index(inputs: Inputs) -> Any:
    """A pandas DataFrame's or Series' index, else None (0..rows-1)."""
    import pandas as pd

    return inputs.index if isinstance(inputs, (pd.DataFrame, pd.Series)) else None


def _max_tokens(data: dict[str, Any]) -> int | None:
    """The card's ``max_tokens``: an int, or None (a card before 0.2 wrote it as a string, ``"None"`` for none)."""
    value = data.get("max_tokens")
    return None if value in (None, "None") else int(value)


def _head_logits(features: np.ndarray, weight: np.ndarray, bias: np.ndarray, rule: str) -> np.ndarray:
    """Logits (rows, classes) float32 of ``features`` (rows, dim) under the card's ``rule``."""
    import torch

    from dptune.runners.heads import augment

    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
    w, b = torch.from_numpy(weight), torch.from_numpy(bias)
    if rule == "augmented":
        logits = augment(x) @ torch.cat([w, b[:, None]], dim=1).T
    else:
        logits = torch.nn.functional.linear(x, w, b)
    return logits.numpy()


def _feature_encoder(card: dict[str, Any]) -> tuple[Any, Any]:
    """The card's backbone as a feature extractor, its weights checked against ``weights_sha256``, and
    its tokenizer (None for an image backbone)."""
    from dptune.data.features import folder_fingerprint, weights_fingerprint
    from dptune.models import build_feature_extractor, load_tokenizer
    from dptune.models.backbones import get_backbone

    data = card["data"]
    backbone = data["backbone"]
    info = get_backbone(backbone)
    extractor = build_feature_extractor(backbone)
    source = info.weight_source() if info.weight_source is not None else None  # as the feature cache keys them
    digest = folder_fingerprint(source) if source is not None else weights_fingerprint(extractor)
    if digest != data["weights_sha256"]:
        raise ModelError(
            f"backbone {backbone!r} here has weights sha256 {digest[:12]}…, the model was trained on features "
            f"of {data['weights_sha256'][:12]}…: install the weights the search used"
        )
    return extractor, None if info.modality == "image" else load_tokenizer(backbone)


def _features(card: dict[str, Any], encoder: tuple[Any, Any], inputs: list[str] | list[Path]) -> np.ndarray:
    """Features of texts or image files as the search made them, with ``encoder`` (:func:`_feature_encoder`)."""
    from dptune.data.features import encode_images, encode_texts
    from dptune.data.sources import ImageFiles
    from dptune.models.backbones import get_backbone

    data = card["data"]
    info = get_backbone(data["backbone"])
    extractor, tokenizer = encoder
    why = ", as the model was trained"
    if tokenizer is None:
        files = ImageFiles(inputs, info.image_size)  # type: ignore[arg-type]
        return encode_images(extractor, files, np.arange(len(files)), info.feature_dim, data["precision"], why)
    return encode_texts(
        extractor,
        tokenizer,
        inputs,  # type: ignore[arg-type]
        _max_tokens(data),
        info.feature_dim,
        data["precision"],
        why=why,
    )


def _peft_network(card: dict[str, Any], parameters: dict[str, np.ndarray]) -> Any:
    """A PEFT model (film, lora, full): the public backbone built by name, its frozen part checked
    against the card's ``frozen_sha256``, the run's trained ``parameters`` loaded, in eval mode."""
    import torch

    from dptune.data.features import weights_fingerprint
    from dptune.models import build_model

    data = card["data"]
    backbone = data["backbone"]
    model = build_model(backbone, card["peft"], len(data["class_names"]))
    own = dict(model.named_parameters())
    unknown = sorted(set(parameters) - set(own))
    if unknown:
        raise ModelError(f"the model's parameters {unknown[:3]} are not {backbone!r} with peft {card['peft']!r}'s")
    if weights_fingerprint(model, exclude=parameters) != data.get("frozen_sha256"):
        raise ModelError(
            f"backbone {backbone!r} here is not the one the model was trained on (its frozen part's sha256 differs "
            "from the card's frozen_sha256): install the weights the search used"
        )
    with torch.no_grad():
        for name, value in parameters.items():
            own[name].copy_(torch.from_numpy(value))
    return model.eval()


def _peft_logits(card: dict[str, Any], network: Any, inputs: list[str] | list[Path]) -> np.ndarray:
    """Logits (rows, classes) of a PEFT ``network`` (:func:`_peft_network`) on texts or image files: texts
    tokenized as the search did (the card's ``max_tokens``, padded), images read at the backbone's
    ``image_size``."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from dptune.data.sources import ImageFiles
    from dptune.data.workload import tokenized_texts
    from dptune.models import get_backbone, load_tokenizer

    data = card["data"]
    backbone = data["backbone"]
    info = get_backbone(backbone)
    if info.modality == "image":
        dataset: Any = ImageFiles(inputs, info.image_size or 224)  # type: ignore[arg-type]
    else:
        dataset = TensorDataset(*tokenized_texts(inputs, load_tokenizer(backbone), _max_tokens(data)))  # type: ignore[arg-type]
    with torch.inference_mode():
        batches = DataLoader(dataset, batch_size=PREDICT_BATCH_ROWS)
        return torch.cat([network(*batch).float() for batch in batches]).numpy()
