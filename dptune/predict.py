"""``python -m dptune.predict``: label new rows with a model a search published (``<results>/models/<model>/``,
:mod:`dptune.search.finish.publish`), a command-line layer over :class:`dptune.model.Model`.

The input (a csv, tsv, jsonl or parquet file or a ``save_to_disk`` folder, by suffix or ``--format``)
has a column of texts (``--column``, by default the model's input column: the training file's), or
of embeddings for a model trained with backbone ``none``; for an image model it is an image folder
(``<input>/<class>/<image>``, no column: the output has each image's ``file`` and ``folder``, its
class folder). The output, written whole or not at all, is the input file's columns plus
``prediction`` (the class name) and ``softmax_score`` (its softmax probability: a score, not a
calibrated confidence), in the output suffix's format. Predicting costs no privacy (post-processing
of a DP release).

``--label-column`` scores the rows against their labels (:func:`evaluate_file`): accuracy with its
95% Wilson interval, recall by class, the confusion table. That is the data owner's private
evaluation, on their own labelled rows inside their trust boundary: the model's (ε, δ) does not
cover it and it is no release (:data:`OWNER_EVALUATION_NOTE`).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dptune import __version__
from dptune.errors import DptuneError
from dptune.model import Model, ModelError, load_model

if TYPE_CHECKING:
    import pandas as pd

#: The first line of a printed evaluation (``--label-column``): what the numbers are, and are not.
OWNER_EVALUATION_NOTE = (
    "The owner's private evaluation of {input}: computed on your own labelled rows, inside your trust "
    "boundary. It is not covered by the model's (ε, δ) and is not a release: if these rows are a private "
    "test set, publishing these numbers is a release about them."
)
#: The command's description in ``--help`` (plain text).
DESCRIPTION = (
    "Label the rows of a file (or the images of a folder) with a model a search published: the rows plus "
    "'prediction' (the class name) and 'softmax_score' (its softmax probability, not a calibrated confidence). "
    "With --label-column, score labelled rows: the data owner's private evaluation."
)
#: Output formats by suffix.
OUTPUT_SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}


class PredictError(ModelError):
    """A bad input file, column or output path: raised before any encoding."""


def read_inputs(path: str, column: str, declared: str = "auto") -> tuple[Any, list[str] | list[Path] | np.ndarray]:
    """The whole input table of ``path`` and its ``column`` (texts, image paths relative to the file,
    or float32 embeddings (n, d)); for an image folder, a table of its images' ``file`` (relative) and
    ``folder``, and the image files. ``column`` is ``--column``, or the model's input column."""
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
        table = read_columns(path, declared, [column], every_column=True)
    except WorkloadError as error:
        raise PredictError(f"{error} (--column names the input column; by default the model's)") from None
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
    """Write ``input_path``'s rows with each one's ``prediction`` and ``softmax_score`` to ``output_path``;
    ``column``: the input column (None: the model's). Every check (model, input, column, output suffix)
    runs before anything is encoded. Returns the number of rows."""
    _check_output(output_path)
    loaded = load_model(model)
    table, inputs = read_inputs(input_path, column or loaded.input_column, declared)
    _check_output(output_path, table)
    _write_predictions(table, loaded.predict_frame(_checked(loaded, inputs, input_path)), output_path)
    return int(table.num_rows)


def evaluate_file(
    model: str | Path,
    input_path: str,
    column: str | None,
    label_column: str,
    declared: str = "auto",
    *,
    output_path: str | None = None,
) -> Evaluation:
    """Score ``model`` on the labelled rows of ``input_path`` (their ``label_column``): the owner's
    private evaluation (:class:`Evaluation`). A label is a class name of the card's ``class_names`` or
    an int, read as training read the file's labels (:func:`label_ids`). Every check (model, input,
    columns, labels, output suffix) runs before anything is encoded; with ``output_path`` the
    predictions are written as :func:`predict_file` writes them, from the same one encoding pass."""
    if output_path is not None:
        _check_output(output_path)
    loaded = load_model(model)
    table, inputs = read_inputs(input_path, column or loaded.input_column, declared)
    if output_path is not None:
        _check_output(output_path, table)
    names = loaded.classes
    labels = label_ids(table, label_column, names, input_path, declared)
    predicted = loaded.predict_frame(_checked(loaded, inputs, input_path))
    if output_path is not None:
        _write_predictions(table, predicted, output_path)
    chosen = np.array([names.index(name) for name in predicted["prediction"]], dtype=np.int64)
    return evaluate(names, labels=labels, predictions=chosen)


def _checked(
    model: Model, inputs: list[str] | list[Path] | np.ndarray, where: str
) -> list[str] | list[Path] | np.ndarray:
    """``inputs`` as ``model`` takes them (:meth:`Model.inputs`); its refusal names ``--input``."""
    try:
        return model.inputs(inputs)
    except ModelError as error:
        raise PredictError(f"--input {where}: {error}") from None


def _check_output(output_path: str, table: Any = None) -> None:
    """:class:`PredictError` unless ``output_path``'s suffix names an output format that can hold
    every column of ``table`` (when given): a csv or tsv file holds no lists (a column of embeddings)."""
    import pyarrow as pa

    kind = OUTPUT_SUFFIXES.get(Path(output_path).suffix.lower())
    if kind is None:
        raise PredictError(f"--output {output_path}: the suffix must be one of {sorted(OUTPUT_SUFFIXES)}")
    nested = [] if table is None else [field.name for field in table.schema if pa.types.is_nested(field.type)]
    if kind in ("csv", "tsv") and nested:
        raise PredictError(
            f"--output {output_path}: a {kind} file cannot hold the list column(s) {nested}; write .parquet or .jsonl"
        )


def _write_predictions(table: Any, predicted: pd.DataFrame, output_path: str) -> None:
    """``table`` plus ``predicted``'s ``prediction`` and ``softmax_score`` written whole to ``output_path``."""
    import pyarrow as pa

    from dptune.paths import write_file_atomic

    table = table.append_column("prediction", pa.array([str(name) for name in predicted["prediction"]]))
    table = table.append_column("softmax_score", pa.array(predicted["softmax_score"].to_numpy(), pa.float32()))
    output = Path(output_path).resolve()
    kind = OUTPUT_SUFFIXES[output.suffix.lower()]
    write_file_atomic(str(output.parent), output.name, _encoded(table, kind))


def label_ids(table: Any, label_column: str, class_names: list[str], path: str, declared: str = "auto") -> np.ndarray:
    """The class id (rows,) int64 of each row's label in ``table``'s ``label_column``, an index into
    ``class_names``. Labels are read as training read a dataset file's (:mod:`dptune.data.files`: ints
    or strings, the classes their distinct values, names kept): a string is a class name; an int is,
    in a ``save_to_disk`` dataset's ``ClassLabel`` column, the id of that column's name; where the
    model was trained on int labels (every class name an int), the class ``str(label)``; else a class
    id. :class:`PredictError`, before anything is encoded, naming a missing column (with the columns
    there), an unlabelled row, or the labels that are no class of the model (with its classes)."""
    import pyarrow as pa

    if label_column not in table.column_names:
        raise PredictError(
            f"--label-column {label_column!r} is not a column of {path}; its columns: {table.column_names}"
        )
    column = table.column(label_column)
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise PredictError(f"--input {path}: row {row} has no {label_column!r}; every row scored needs its label")
    values = column.to_pylist()
    if pa.types.is_integer(column.type):
        by_id = _class_label_names(path, declared, label_column)
        if by_id is None and all(re.fullmatch(r"-?[0-9]+", name) for name in class_names):
            named: list[Any] = [str(value) for value in values]
        else:
            names = by_id if by_id is not None else class_names
            named = [names[value] if 0 <= value < len(names) else None for value in values]
    elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        named = values
    else:
        raise PredictError(
            f"--label-column {label_column!r} of {path} holds {column.type}; labels are class names or int class ids"
        )
    index = {name: i for i, name in enumerate(class_names)}
    unknown = sorted({value for value, name in zip(values, named, strict=True) if name not in index})
    if unknown:
        raise PredictError(
            f"--label-column {label_column!r} of {path}: labels {unknown[:10]} ({len(unknown)} in all) are not "
            f"classes of the model; its classes (ids 0–{len(class_names) - 1}): {class_names}"
        )
    return np.array([index[name] for name in named], dtype=np.int64)


def _class_label_names(path: str, declared: str, column: str) -> list[str] | None:
    """The names by id of ``column`` of a ``save_to_disk`` dataset ``path`` where it is a ``ClassLabel``, else None."""
    from dptune.data.files import file_format

    if file_format(path, declared) != "hf_disk":
        return None
    import datasets

    feature = datasets.load_from_disk(path).features[column]
    return [str(name) for name in feature.names] if isinstance(feature, datasets.ClassLabel) else None


@dataclass(frozen=True, eq=False)
class Evaluation:
    """A model scored on rows whose labels are known: the data owner's private evaluation. It is
    computed on the owner's own labelled rows inside their trust boundary; the model's (ε, δ) does
    not cover it and it is no release (of a private test set, publishing it is a release about
    those rows).

    ``rows`` (≥ 1) scored, ``correct`` of them predicted right; ``accuracy`` = correct / rows in
    [0, 1] and its 95% Wilson score ``interval`` (:func:`dptune.search.finish.publish.accuracy_interval`).
    ``per_class``, indexed by class name in the card's order: ``support`` (rows of that true class),
    ``correct``, ``recall`` = correct / support and its Wilson interval ``low``, ``high`` (all three NaN
    for a class with no rows). ``confusion``: row counts, index the true class, columns the predicted
    class (the card's class names both); it sums to ``rows``, its diagonal to ``correct``."""

    rows: int
    correct: int
    accuracy: float
    interval: tuple[float, float]
    per_class: pd.DataFrame
    confusion: pd.DataFrame

    def summary(self) -> str:
        """The evaluation as text: the accuracy line, the recall table by class, the confusion table."""

        def share(value: float) -> str:
            return "—" if np.isnan(value) else f"{value:.1%}"

        recall = [
            [str(name), str(row.support), str(row.correct), share(row.recall)]
            + ["—" if np.isnan(row.low) else f"[{share(row.low)}, {share(row.high)}]"]
            for name, row in zip(self.per_class.index, self.per_class.itertuples(), strict=True)
        ]
        names = [str(name) for name in self.confusion.columns]
        confusion = [[name, *map(str, counts)] for name, counts in zip(names, self.confusion.to_numpy(), strict=True)]
        low, high = self.interval
        return "\n".join(
            [
                f"accuracy: {share(self.accuracy)} ({self.correct} of {self.rows} rows), "
                f"95% Wilson interval [{share(low)}, {share(high)}]",
                "",
                "recall by class (support: rows of the class):",
                *_text_table(["class", "support", "correct", "recall", "95% interval"], recall),
                "",
                "confusion (rows: true class, columns: predicted class):",
                *_text_table(["", *names], confusion),
            ]
        )

    def __str__(self) -> str:
        return self.summary()


def _text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a plain-text table: each column as wide as its widest cell, the first left-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    return [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        )
        for line in (header, *rows)
    ]


def evaluate(class_names: Sequence[str], *, labels: np.ndarray, predictions: np.ndarray) -> Evaluation:
    """The :class:`Evaluation` of ``predictions`` against ``labels``: class ids (rows,) of at least one
    row, ints in [0, len(class_names)), ``class_names`` naming them."""
    import pandas as pd

    from dptune.search.finish.publish import accuracy_interval

    names = [str(name) for name in class_names]
    truth, chosen = np.asarray(labels, dtype=np.int64), np.asarray(predictions, dtype=np.int64)
    if truth.ndim != 1 or truth.shape != chosen.shape or not len(truth):
        raise ValueError(f"labels {truth.shape} and predictions {chosen.shape}: one class id per row, at least one row")
    if min(truth.min(), chosen.min()) < 0 or max(truth.max(), chosen.max()) >= len(names):
        raise ValueError(f"class ids must lie in [0, {len(names)}): the ids of {names}")
    counts = np.zeros((len(names), len(names)), dtype=np.int64)
    np.add.at(counts, (truth, chosen), 1)
    support, right = counts.sum(axis=1), np.diag(counts)

    def wilson(correct: int, rows: int) -> tuple[float, float]:
        interval = accuracy_interval(correct / rows, rows) if rows else None
        return (float("nan"), float("nan")) if interval is None else (interval[0], interval[1])

    bounds = [wilson(int(k), int(n)) for k, n in zip(right, support, strict=True)]
    per_class = pd.DataFrame(
        {
            "support": support,
            "correct": right,
            "recall": [k / n if n else float("nan") for k, n in zip(right, support, strict=True)],
            "low": [low for low, _ in bounds],
            "high": [high for _, high in bounds],
        },
        index=pd.Index(names, name="class"),
    )
    confusion = pd.DataFrame(counts, index=pd.Index(names, name="true"), columns=pd.Index(names, name="predicted"))
    correct = int(right.sum())
    return Evaluation(
        rows=len(truth),
        correct=correct,
        accuracy=correct / len(truth),
        interval=wilson(correct, len(truth)),
        per_class=per_class,
        confusion=confusion,
    )


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
    parser = argparse.ArgumentParser(prog="python -m dptune.predict", description=DESCRIPTION)
    parser.add_argument("--model", required=True, help="a model folder: <results>/models/<cell>/")
    parser.add_argument(
        "--input", required=True, help="csv, tsv, jsonl or parquet file, save_to_disk folder or image folder to label"
    )
    parser.add_argument(
        "--column",
        help="the input column: texts, or embeddings for backbone none (default: the model's input column, "
        "the one it was trained on; none for an image folder)",
    )
    parser.add_argument(
        "--output", help="where to write the rows with their predictions (optional with --label-column)"
    )
    parser.add_argument("--format", default="auto", help="the input's format (default: by suffix)")
    parser.add_argument(
        "--label-column",
        help="score the rows against their labels in this column (class names or int class ids; an image "
        "folder's is 'folder') and print the owner's private evaluation: accuracy, recall by class, confusion",
    )
    parser.add_argument("--version", action="version", version=f"dptune {__version__}")
    args = parser.parse_args(argv)
    if args.output is None and args.label_column is None:
        parser.error("--output is required (or --label-column, to score labelled rows)")
    try:
        if args.label_column is None:
            rows = predict_file(args.model, args.input, args.output, args.column, args.format)
        else:
            evaluation = evaluate_file(
                args.model, args.input, args.column, args.label_column, args.format, output_path=args.output
            )
    except DptuneError as error:
        print(f"dptune.predict: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.label_column is None:
        print(f"{rows} rows labelled: {args.output}")
        return
    print(OWNER_EVALUATION_NOTE.format(input=args.input), "", evaluation.summary(), sep="\n")
    if args.output is not None:
        print(f"\n{evaluation.rows} rows labelled: {args.output}")


if __name__ == "__main__":
    main()
