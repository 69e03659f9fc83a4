"""The data owner's private evaluation: ``python -m dptune.predict --label-column`` (and
:func:`dptune.predict.evaluate_file`) scores a published model on a labelled file of their own:
accuracy with its 95% Wilson interval, recall by class, the confusion table, every count exact.

The model is a linear head on embeddings (backbone ``none``) written as a search publishes one
(``model.safetensors`` by :func:`dptune.records.weights.weights_bytes`, ``model_card.json``), with
weights 4·I: a row whose embedding is the one-hot vector of class c is predicted c by a logit
margin of 4, so every prediction is known in advance and no rounding can change it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from dptune.contract import TrainedModel
from dptune.model import Model
from dptune.paths import write_file_atomic
from dptune.predict import PredictError, evaluate, evaluate_file, main
from dptune.records.weights import CARD_JSON, MODEL_FILE, weights_bytes
from dptune.search.finish.publish import accuracy_interval

#: The model's classes; ``spam`` has no row in the file, so its recall is undefined.
CLASSES = ["billing", "outage", "refund", "spam"]
#: Each row's (true class, predicted class) by id: 4 billing, 5 outage, 3 refund rows, 9 predicted right.
PAIRS = [(0, 0), (0, 0), (0, 1), (0, 0), (1, 1), (1, 2), (1, 1), (1, 0), (1, 1), (2, 2), (2, 2), (2, 2)]
CONFUSION = [[3, 1, 0, 0], [1, 3, 1, 0], [0, 0, 3, 0], [0, 0, 0, 0]]


def _model(folder: Path, class_names: list[str]) -> Path:
    """A published head on 4-d embeddings (backbone ``none``, ``module`` logits W x + b) with W = 4·I,
    b = 0, and its card naming ``class_names``."""
    weight = 4 * np.eye(len(class_names), dtype=np.float32)
    trained = TrainedModel(
        parameters={"weight": weight, "bias": np.zeros(len(class_names), np.float32)},
        provenance={"backbone": "none", "class_names": json.dumps(class_names)},
        logits="module",
    )
    card = {
        "model": {"cell_id": "eps=8|delta=1e-05|epochs=10", "clipping": "flat", "trial_id": None},
        "data": {"dataset": "file:tickets.parquet", "class_names": class_names, "backbone": "none"},
        "peft": "head",
        "logits": "module",
        "parameters": {"weight": list(weight.shape), "bias": [len(class_names)]},
    }
    write_file_atomic(str(folder), MODEL_FILE, weights_bytes(trained))
    write_file_atomic(str(folder), CARD_JSON, json.dumps(card).encode())
    return folder


def _rows(labels: list[object]) -> pd.DataFrame:
    """The labelled file's rows: ``embedding`` (the one-hot vector of each row's predicted class in
    ``PAIRS``), ``label`` (``labels``, one per row) and a ``ticket`` number."""
    embeddings = [list(np.eye(len(CLASSES), dtype=np.float32)[chosen]) for _, chosen in PAIRS]
    return pd.DataFrame({"ticket": range(len(PAIRS)), "embedding": embeddings, "label": labels})


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return _model(tmp_path / "model", CLASSES)


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    """The labelled file, its labels class names."""
    path = tmp_path / "tickets.parquet"
    _rows([CLASSES[truth] for truth, _ in PAIRS]).to_parquet(path)
    return path


def test_accuracy_interval_recall_and_confusion_are_exact(model: Path, rows: Path, tmp_path: Path) -> None:
    out = tmp_path / "scored.jsonl"
    evaluation = evaluate_file(model, str(rows), "embedding", "label", output_path=str(out))
    scored = pd.read_json(out, lines=True)
    assert scored["ticket"].tolist() == list(range(len(PAIRS)))
    assert scored["prediction"].tolist() == [CLASSES[chosen] for _, chosen in PAIRS]
    right = int((scored["prediction"] == scored["label"]).sum())
    assert (evaluation.rows, evaluation.correct, right) == (12, 9, 9)
    assert evaluation.accuracy == right / len(scored) == 0.75
    wilson = stats.binomtest(9, 12).proportion_ci(confidence_level=0.95, method="wilson")
    assert evaluation.interval == pytest.approx((wilson.low, wilson.high), abs=1e-12)
    assert list(evaluation.interval) == accuracy_interval(0.75, 12)

    per_class = evaluation.per_class
    assert per_class.index.tolist() == CLASSES
    assert per_class["support"].tolist() == [4, 5, 3, 0] and per_class["correct"].tolist() == [3, 3, 3, 0]
    assert per_class["recall"].iloc[:3].tolist() == [3 / 4, 3 / 5, 1.0] and np.isnan(per_class.loc["spam", "recall"])
    for name, correct, support in [("billing", 3, 4), ("outage", 3, 5), ("refund", 3, 3)]:
        interval = stats.binomtest(correct, support).proportion_ci(confidence_level=0.95, method="wilson")
        assert per_class.loc[name, ["low", "high"]].tolist() == pytest.approx([interval.low, interval.high], abs=1e-12)
    assert per_class.loc["spam", ["low", "high"]].isna().all()

    confusion = evaluation.confusion
    assert confusion.index.tolist() == confusion.columns.tolist() == CLASSES
    assert (confusion.index.name, confusion.columns.name) == ("true", "predicted")
    assert confusion.to_numpy().tolist() == CONFUSION
    assert pd.crosstab(scored["label"], scored["prediction"]).to_numpy().tolist() == [row[:3] for row in CONFUSION[:3]]


def test_evaluate_scores_class_ids_without_a_model() -> None:
    truth, chosen = (np.array(ids) for ids in zip(*PAIRS, strict=True))
    evaluation = evaluate(CLASSES, labels=truth, predictions=chosen)
    assert (evaluation.rows, evaluation.correct) == (12, 9)
    assert evaluation.confusion.to_numpy().tolist() == CONFUSION
    with pytest.raises(ValueError, match=r"class ids must lie in \[0, 4\)"):
        evaluate(CLASSES, labels=np.array([0, 4]), predictions=np.array([0, 1]))
    with pytest.raises(ValueError, match="one class id per row"):
        evaluate(CLASSES, labels=np.array([0, 1]), predictions=np.array([0]))


@pytest.mark.parametrize(
    ("class_names", "labels"),
    [
        (CLASSES, [truth for truth, _ in PAIRS]),  # class ids: indices into the card's class names
        (["0", "1", "2", "3"], [truth for truth, _ in PAIRS]),  # trained on int labels 0–3: names and ids agree
        (["3", "7", "12", "40"], [[3, 7, 12, 40][truth] for truth, _ in PAIRS]),  # trained on int labels: the labels
    ],
)
def test_int_labels_score_as_their_class_names_do(class_names: list[str], labels: list[int], tmp_path: Path) -> None:
    model = _model(tmp_path / "model", class_names)
    by_name, by_int = tmp_path / "names.jsonl", tmp_path / "ints.jsonl"
    _rows([class_names[truth] for truth, _ in PAIRS]).to_json(by_name, orient="records", lines=True)
    _rows(labels).to_json(by_int, orient="records", lines=True)
    named, numbered = (evaluate_file(model, str(path), "embedding", "label") for path in (by_name, by_int))
    assert (numbered.rows, numbered.correct) == (named.rows, named.correct) == (12, 9)
    assert numbered.interval == named.interval
    pd.testing.assert_frame_equal(numbered.per_class, named.per_class)
    pd.testing.assert_frame_equal(numbered.confusion, named.confusion)
    assert numbered.confusion.to_numpy().tolist() == CONFUSION and numbered.confusion.index.tolist() == class_names


def test_a_saved_datasets_class_label_column_names_its_ids_as_it_trained(tmp_path: Path) -> None:
    """A ``ClassLabel`` column stores ids of its own names: "1 star" … as 0 …, the card's class names."""
    import datasets

    stars = ["1", "2", "3", "4"]
    model = _model(tmp_path / "model", stars)
    frame = _rows([truth for truth, _ in PAIRS])
    features = datasets.Features(
        {
            "ticket": datasets.Value("int64"),
            "embedding": datasets.Sequence(datasets.Value("float32")),
            "label": datasets.ClassLabel(names=stars),
        }
    )
    datasets.Dataset.from_pandas(frame, features=features).save_to_disk(str(tmp_path / "saved"))
    evaluation = evaluate_file(model, str(tmp_path / "saved"), "embedding", "label")
    assert evaluation.correct == 9 and evaluation.confusion.to_numpy().tolist() == CONFUSION


def _refused(model: Path, path: Path, label_column: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The message ``evaluate_file`` refuses ``path`` with, asserting that nothing was encoded."""

    def encode(*args: object, **kwargs: object) -> None:
        raise AssertionError("a refused file reached the model")

    monkeypatch.setattr(Model, "probabilities", encode)
    with pytest.raises(PredictError) as error:
        evaluate_file(model, str(path), "embedding", label_column)
    return str(error.value)


def test_unknown_labels_and_a_missing_label_column_are_refused_before_encoding(
    model: Path, rows: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = _refused(model, rows, "category", monkeypatch)
    assert f"--label-column 'category' is not a column of {rows}; its columns: ['ticket', 'embedding', 'label']" in (
        message
    )
    typos = tmp_path / "typos.parquet"
    _rows(["billing"] * 10 + ["Billing", "refunds"]).to_parquet(typos)
    message = _refused(model, typos, "label", monkeypatch)
    assert "labels ['Billing', 'refunds'] (2 in all) are not classes of the model" in message
    assert "its classes (ids 0–3): ['billing', 'outage', 'refund', 'spam']" in message
    ids = tmp_path / "ids.parquet"
    _rows([0] * 10 + [4, -1]).to_parquet(ids)
    assert "labels [-1, 4] (2 in all) are not classes of the model" in _refused(model, ids, "label", monkeypatch)
    unlabelled = tmp_path / "unlabelled.parquet"
    _rows(["billing"] * 5 + [None] + ["refund"] * 6).to_parquet(unlabelled)
    assert "row 5 has no 'label'" in _refused(model, unlabelled, "label", monkeypatch)
    fractional = tmp_path / "fractional.parquet"
    _rows([0.5] * 12).to_parquet(fractional)
    assert "holds double; labels are class names or int class ids" in _refused(model, fractional, "label", monkeypatch)


def test_the_command_prints_the_owner_evaluation_and_writes_the_predictions(
    model: Path, rows: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scored.parquet"
    argv = ["--model", str(model), "--input", str(rows), "--column", "embedding", "--label-column", "label"]
    main([*argv, "--output", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"The owner's private evaluation of {rows}: computed on your own labelled rows")
    assert "not covered by the model's (ε, δ) and is not a release" in printed[0]
    wilson = stats.binomtest(9, 12).proportion_ci(confidence_level=0.95, method="wilson")
    accuracy = f"accuracy: 75.0% (9 of 12 rows), 95% Wilson interval [{wilson.low:.1%}, {wilson.high:.1%}]"
    assert printed[1:3] == ["", accuracy]
    recall_at = printed.index("recall by class (support: rows of the class):") + 1
    assert printed[recall_at].split() == ["class", "support", "correct", "recall", "95%", "interval"]
    recall = {line.split()[0]: line.split()[1:] for line in printed[recall_at + 1 : recall_at + 5]}
    billing = stats.binomtest(3, 4).proportion_ci(confidence_level=0.95, method="wilson")
    assert recall["billing"] == ["4", "3", "75.0%", f"[{billing.low:.1%},", f"{billing.high:.1%}]"]
    assert recall["outage"][:3] == ["5", "3", "60.0%"] and recall["refund"][:3] == ["3", "3", "100.0%"]
    assert recall["spam"] == ["0", "0", "—", "—"]
    confusion_at = printed.index("confusion (rows: true class, columns: predicted class):") + 1
    assert printed[confusion_at].split() == CLASSES
    assert [line.split() for line in printed[confusion_at + 1 : confusion_at + 5]] == [
        [name, *map(str, counts)] for name, counts in zip(CLASSES, CONFUSION, strict=True)
    ]
    assert printed[-1] == f"12 rows labelled: {out}"
    assert pd.read_parquet(out)["prediction"].tolist() == [CLASSES[chosen] for _, chosen in PAIRS]

    main(argv)  # without --output: the evaluation alone
    assert capsys.readouterr().out.splitlines() == printed[:-2]


def test_the_command_refuses_no_output_and_a_bad_label_naming_both(
    model: Path, rows: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(model), "--input", str(rows), "--column", "embedding"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "--output is required (or --label-column, to score labelled rows)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([*argv, "--label-column", "ticket", "--output", str(tmp_path / "scored.jsonl")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dptune.predict: --label-column 'ticket' of {rows}: labels [4, 5, 6, 7, 8, 9, 10, 11]")
    assert "(8 in all) are not classes of the model" in err
    with pytest.raises(SystemExit) as info:  # a csv holds no column of embeddings: refused before encoding
        main([*argv, "--label-column", "label", "--output", str(tmp_path / "scored.csv")])
    assert info.value.code == 2
    assert (
        "a csv file cannot hold the list column(s) ['embedding']; write .parquet or .jsonl" in capsys.readouterr().err
    )
    assert not any(tmp_path.glob("scored.*"))
