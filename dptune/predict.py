"""``python -m dptune.predict``: label new rows with a model a search published (``<results>/models/<model>/``,
:mod:`dptune.search.publish`).

The input (a csv, tsv, jsonl or parquet file or a ``save_to_disk`` folder, by suffix or ``--format``)
has a column of texts, or of embeddings for a model trained with backbone ``none``; for an image
model it is an image folder (``<input>/<class>/<image>``, no column: the output has each image's
``file`` and ``folder``, its class folder). Each row is encoded as the search encoded its
training rows (the card's backbone, ``max_tokens`` and precision; the backbone's weights must match
the card's ``weights_sha256``), and the model's linear head maps its features to logits by the card's
rule (``logits``: ``augmented`` x̃·[W | b]ᵀ with x̃ = (x, 1), as the fused runner scored; ``module``:
W x + b, as ``nn.Linear``). The output, written whole or not at all, is the input file's columns
plus ``prediction`` (the class name) and ``confidence`` (its softmax probability), in the output
suffix's format. A PEFT model (``film``, ``lora``, ``full``) is the public backbone, rebuilt by
name and checked against the card's ``frozen_sha256``, with the run's trained parameters loaded
(:func:`peft_logits`).

Predicting costs no privacy: a published model is a DP release, and what is computed from it and
new data is post-processing (it protects the training rows, not the rows you predict on).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from dptune import __version__
from dptune.errors import DptuneError
from dptune.records.weights import CARD_JSON, MODEL_FILE, trained_model

#: Output formats by suffix.
OUTPUT_SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}


class PredictError(DptuneError, ValueError):
    """A bad model folder, input file, column or output path: raised before any encoding."""


def load_model(folder: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The card (``model_card.json``) and trained parameters (a head's, or a PEFT's) of a published model folder."""
    folder = Path(folder)
    card_path, model_path = folder / CARD_JSON, folder / MODEL_FILE
    if not card_path.is_file() or not model_path.is_file():
        raise PredictError(
            f"--model {folder}: not a dptune model folder (it needs {CARD_JSON} and {MODEL_FILE}; "
            "a search writes them under <results>/models/<cell>/)"
        )
    card = json.loads(card_path.read_text())
    parameters = trained_model(model_path.read_bytes()).parameters
    if card.get("peft") == "head" and set(parameters) != {"weight", "bias"}:
        raise PredictError(f"--model {folder}: expected a linear head (weight, bias), found {sorted(parameters)}")
    return card, parameters


def head_logits(features: np.ndarray, weight: np.ndarray, bias: np.ndarray, rule: str) -> np.ndarray:
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


def model_features(card: dict[str, Any], inputs: list[str] | list[Path] | np.ndarray) -> np.ndarray:
    """Features of ``inputs`` (texts, image files, or embeddings for backbone ``none``) as the search made them."""
    from dptune.contract import NO_BACKBONE

    data = card["data"]
    backbone = data["backbone"]
    if backbone == NO_BACKBONE:
        if not isinstance(inputs, np.ndarray):
            raise PredictError("this model was trained on embeddings (backbone 'none'): the column must hold them")
        return inputs
    from dptune.data.features import encode_images, encode_texts, folder_fingerprint, weights_fingerprint
    from dptune.data.sources import ImageFiles
    from dptune.models import build_feature_extractor, load_tokenizer
    from dptune.models.backbones import get_backbone

    info = get_backbone(backbone)
    images = _inputs_fit(info.modality, backbone, inputs)
    extractor = build_feature_extractor(backbone)
    source = info.weight_source() if info.weight_source is not None else None  # as the feature cache keys them
    digest = folder_fingerprint(source) if source is not None else weights_fingerprint(extractor)
    if digest != data["weights_sha256"]:
        raise PredictError(
            f"backbone {backbone!r} here has weights sha256 {digest[:12]}…, the model was trained on features "
            f"of {data['weights_sha256'][:12]}…: install the weights the search used"
        )
    why = ", as the model was trained"
    if images:
        files = ImageFiles(inputs, info.image_size)  # type: ignore[arg-type]
        return encode_images(extractor, files, np.arange(len(files)), info.feature_dim, data["precision"], why)
    max_tokens = None if data["max_tokens"] == "None" else int(data["max_tokens"])
    tokenizer = load_tokenizer(backbone)
    return encode_texts(extractor, tokenizer, inputs, max_tokens, info.feature_dim, data["precision"], why=why)  # type: ignore[arg-type]


def _inputs_fit(modality: str, backbone: str, inputs: list[str] | list[Path] | np.ndarray) -> bool:
    """Whether ``inputs`` are image files; :class:`PredictError` unless they are what ``backbone`` encodes."""
    images = isinstance(inputs, list) and bool(inputs) and isinstance(inputs[0], Path)
    if isinstance(inputs, np.ndarray) or images != (modality == "image"):
        wanted = "an image folder" if modality == "image" else "a column of strings"
        raise PredictError(f"this model encodes {modality} with backbone {backbone!r}: the input must be {wanted}")
    return images


def peft_logits(card: dict[str, Any], parameters: dict[str, np.ndarray], inputs: list[str] | list[Path]) -> np.ndarray:
    """Logits (rows, classes) of a PEFT model (film, lora, full) on texts or image files: the public
    backbone built by name, its frozen part checked against the card's ``frozen_sha256``, the run's
    trained parameters loaded, in eval mode; texts tokenized as the search did (the card's
    ``max_tokens``, padded), images read at the backbone's ``image_size``."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from dptune.data.features import weights_fingerprint
    from dptune.data.sources import ImageFiles
    from dptune.data.workload import tokenized_texts
    from dptune.models import build_model, get_backbone, load_tokenizer

    data = card["data"]
    backbone = data["backbone"]
    info = get_backbone(backbone)
    images = _inputs_fit(info.modality, backbone, inputs)
    model = build_model(backbone, card["peft"], len(data["class_names"]))
    own = dict(model.named_parameters())
    unknown = sorted(set(parameters) - set(own))
    if unknown:
        raise PredictError(f"the model's parameters {unknown[:3]} are not {backbone!r} with peft {card['peft']!r}'s")
    if weights_fingerprint(model, exclude=parameters) != data.get("frozen_sha256"):
        raise PredictError(
            f"backbone {backbone!r} here is not the one the model was trained on (its frozen part's sha256 differs "
            "from the card's frozen_sha256): install the weights the search used"
        )
    with torch.no_grad():
        for name, value in parameters.items():
            own[name].copy_(torch.from_numpy(value))
    model.eval()
    if images:
        dataset: Any = ImageFiles(inputs, info.image_size or 224)  # type: ignore[arg-type]
    else:
        max_tokens = None if data.get("max_tokens") in (None, "None") else int(data["max_tokens"])
        dataset = TensorDataset(*tokenized_texts(inputs, load_tokenizer(backbone), max_tokens))  # type: ignore[arg-type]
    with torch.inference_mode():
        return torch.cat([model(*batch).float() for batch in DataLoader(dataset, batch_size=64)]).numpy()


def read_inputs(
    path: str, column: str | None, declared: str = "auto"
) -> tuple[Any, list[str] | list[Path] | np.ndarray]:
    """The whole input table of ``path`` and its ``column`` (texts, or float32 embeddings (n, d)); for
    an image folder, a table of its images' ``file`` (relative) and ``folder``, and the image files."""
    import pyarrow as pa

    from dptune.data.files import IMAGE_SUFFIXES, file_format, image_folder, read_columns
    from dptune.data.spec import WorkloadError

    if not Path(path).exists():
        raise PredictError(f"--input {path}: no such file or folder")
    try:
        if file_format(path, declared) == "imagefolder":
            files, folders = image_folder(path)
            relative = [str(file.relative_to(path)) for file in files]
            return pa.table({"file": relative, "folder": folders}), files
        if column is None:
            raise PredictError(f"--column: required for the table {path} (only an image folder has none)")
        table = read_columns(path, declared, [column], every_column=True)
    except WorkloadError as error:
        raise PredictError(str(error)) from None
    values = table.column(column)
    if table.num_rows == 0:
        raise PredictError(f"--input {path}: no rows")
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        texts = values.to_pylist()
        empty = [row for row, text in enumerate(texts) if text is None or not text.strip()]
        if empty:
            raise PredictError(f"--input {path}: row {empty[0]} has an empty {column!r}; every text must be non-empty")
        if all(text.lower().endswith(IMAGE_SUFFIXES) for text in texts):  # image paths, relative to the file
            return table, [Path(path).parent / text for text in texts]
        return table, texts
    try:
        return table, np.asarray(values.to_pylist(), dtype=np.float32)
    except (TypeError, ValueError):
        raise PredictError(f"--column {column!r} of {path} holds {values.type}: texts or lists of numbers") from None


def predict_file(
    model: str | Path, input_path: str, output_path: str, column: str | None = None, declared: str = "auto"
) -> int:
    """Write ``input_path``'s rows with each one's ``prediction`` and ``confidence`` to ``output_path``.
    Every check (model, input, column, output suffix) runs before anything is encoded. Returns the
    number of rows."""
    import pyarrow as pa

    from dptune.paths import write_file_atomic

    suffix = Path(output_path).suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise PredictError(f"--output {output_path}: the suffix must be one of {sorted(OUTPUT_SUFFIXES)}")
    card, parameters = load_model(model)
    table, inputs = read_inputs(input_path, column, declared)
    if card.get("peft") != "head":
        if isinstance(inputs, np.ndarray):
            raise PredictError(f"--input {input_path}: a peft {card.get('peft')!r} model takes texts or images")
        logits = peft_logits(card, parameters, inputs)
    else:
        features = model_features(card, inputs)
        if features.shape[1] != parameters["weight"].shape[1]:
            raise PredictError(
                f"--input {input_path}: {features.shape[1]}-d inputs, the model takes {parameters['weight'].shape[1]}-d"
            )
        logits = head_logits(features, parameters["weight"], parameters["bias"], card["logits"])
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=1, keepdims=True)
    chosen = probabilities.argmax(axis=1)
    names = card["data"]["class_names"]
    table = table.append_column("prediction", pa.array([str(names[c]) for c in chosen]))
    table = table.append_column("confidence", pa.array(probabilities[np.arange(len(chosen)), chosen], pa.float32()))
    output = Path(output_path).resolve()
    write_file_atomic(str(output.parent), output.name, _encoded(table, OUTPUT_SUFFIXES[suffix]))
    return table.num_rows


def _encoded(table: Any, kind: str) -> bytes:
    """``table`` as the bytes of a ``kind`` file."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    if kind == "parquet":
        pq.write_table(table, sink)
    elif kind == "jsonl":
        for row in table.to_pylist():
            sink.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
    else:
        pacsv.write_csv(table, sink, pacsv.WriteOptions(delimiter="\t" if kind == "tsv" else ","))
    return sink.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dptune.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder: <results>/models/<cell>/")
    parser.add_argument(
        "--input", required=True, help="csv, tsv, jsonl or parquet file, save_to_disk folder or image folder to label"
    )
    parser.add_argument(
        "--column", help="the input column: texts, or embeddings for backbone none (none for an image folder)"
    )
    parser.add_argument("--output", required=True, help="where to write the rows with their predictions")
    parser.add_argument("--format", default="auto", help="the input's format (default: by suffix)")
    parser.add_argument("--version", action="version", version=f"dptune {__version__}")
    args = parser.parse_args(argv)
    try:
        rows = predict_file(args.model, args.input, args.output, args.column, args.format)
    except DptuneError as error:
        print(f"dptune.predict: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{rows} rows labelled: {args.output}")


if __name__ == "__main__":
    main()
