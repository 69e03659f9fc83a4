"""A newcomer's own file: labels that are missing are refused with their rows (never a class named ""), a
``;``-separated CSV is read with ``sep`` and, without it, answered with a hint at it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import REPO_ROOT
from dptune.contract import DatasetFile
from dptune.data.files import read_dataset_file
from dptune.data.people import read_people
from dptune.data.sources import load_20newsgroups
from dptune.data.spec import WorkloadError
from dptune.space import load_space

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"


@pytest.fixture(scope="module")
def tickets() -> pd.DataFrame:
    """30 real 20 Newsgroups posts of three groups with string labels, ten of each, and a customer per two rows."""
    raw = load_20newsgroups()
    frame = pd.DataFrame({"text": raw.inputs, "label": [raw.class_names[c].split(".")[-1] for c in raw.labels]})
    picked = pd.concat([frame[frame["label"] == group].head(10) for group in ("autos", "space", "guns")])
    return picked.reset_index(drop=True).assign(customer=[f"c{row // 2}" for row in range(len(picked))])


def _write(frame: pd.DataFrame, path: Path) -> Path:
    """``frame`` written as its suffix says: csv, jsonl or else Parquet."""
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    elif path.suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path)
    return path


@pytest.mark.parametrize(
    ("suffix", "missing", "rows"),
    [
        (
            ".csv",
            np.nan,
            "data rows 4, 11 (0-based, the header not counted; rows 6, 13 in a spreadsheet, whose header is row 1)",
        ),
        (".csv", "   ", "data rows 4, 11 (0-based, the header not counted; rows 6, 13 in a spreadsheet"),
        (".csv", "nan", "data rows 4, 11 (0-based, the header not counted; rows 6, 13 in a spreadsheet"),
        (".jsonl", None, "data rows 4, 11 (0-based, the header not counted; lines 5, 12 of the file)"),
        (".parquet", None, "data rows 4, 11 (0-based, the header not counted)"),
        (".parquet", "", "data rows 4, 11 (0-based, the header not counted)"),
    ],
)
def test_missing_labels_are_refused_naming_the_file_the_column_and_the_rows(
    tickets: pd.DataFrame, tmp_path: Path, suffix: str, missing: object, rows: str
) -> None:
    frame = tickets.astype({"label": object})
    frame.loc[[4, 11], "label"] = missing
    path = _write(frame, tmp_path / f"tickets{suffix}")
    with pytest.raises(WorkloadError) as error:
        read_dataset_file(DatasetFile(str(path), "text", "label"))
    message = str(error.value)
    assert message.startswith(
        f"task.dataset {path}: data row 4 has no 'label' (a missing label: empty, blank, NaN or null)"
    )
    assert f"2 row(s) in all: {rows}" in message and message.endswith("drop those rows or fill in their labels")


def test_a_float_label_column_with_nan_and_a_test_file_with_a_missing_label_are_refused_by_row(
    tickets: pd.DataFrame, tmp_path: Path
) -> None:
    """pandas makes ints with a NaN floats: told as the missing label it is, not as a column of doubles."""
    numbered = tickets.assign(label=tickets["label"].map({"autos": 0.0, "space": 1.0, "guns": 2.0}))
    numbered.loc[7, "label"] = np.nan
    path = _write(numbered, tmp_path / "numbered.parquet")
    with pytest.raises(WorkloadError, match=r"data row 7 has no 'label' .* 1 row\(s\) in all: data rows 7 "):
        read_dataset_file(DatasetFile(str(path), "text", "label"))
    train = _write(tickets, tmp_path / "train.csv")
    test = tickets.head(6).copy()
    test.loc[5, "label"] = np.nan
    with pytest.raises(WorkloadError, match=rf"task.dataset {tmp_path / 'test.csv'}: data row 5 has no 'label'"):
        read_dataset_file(DatasetFile(str(train), "text", "label", test_path=str(_write(test, tmp_path / "test.csv"))))
    assert read_dataset_file(DatasetFile(str(train), "text", "label")).class_names == ["autos", "guns", "space"]


def test_a_classlabel_minus_one_is_a_missing_label(tickets: pd.DataFrame, tmp_path: Path) -> None:
    import datasets

    names = ["autos", "guns", "space"]
    ids = [names.index(label) for label in tickets["label"]]
    ids[9] = -1  # Hugging Face's "no label"
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)})
    datasets.Dataset.from_dict({"text": list(tickets["text"]), "label": ids}, features=features).save_to_disk(
        str(tmp_path / "saved")
    )
    with pytest.raises(WorkloadError, match=r"data row 9 has no 'label' .*, or -1 in a ClassLabel column\)"):
        read_dataset_file(DatasetFile(str(tmp_path / "saved"), "text", "label"))


def test_a_semicolon_csv_is_read_with_sep_and_without_it_the_message_hints_at_it(
    tickets: pd.DataFrame, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tickets.csv"
    tickets.to_csv(path, index=False, sep=";")
    comma = read_dataset_file(DatasetFile(str(_write(tickets, tmp_path / "comma.csv")), "text", "label"))
    with pytest.raises(WorkloadError) as error:
        read_dataset_file(DatasetFile(str(path), "text", "label"))
    assert str(error.value) == (
        f"task.dataset.input_column 'text' is not a column of {path}; its columns: ['text;label;customer']; the "
        "header is one column holding ';': if that is the file's delimiter, set task.dataset.sep: \";\""
    )
    monkeypatch.chdir(tmp_path)
    dataset = {"path": "tickets.csv", "input_column": "text", "label_column": "label", "sep": ";"}
    own = load_space(TINY, {"task.dataset": dataset}).space.task.dataset_file  # the key, through the space
    assert own is not None and own.sep == ";"
    read = read_dataset_file(own)
    assert read.class_names == comma.class_names and list(read.inputs) == list(comma.inputs)
    assert np.array_equal(read.labels, comma.labels) and read.fingerprint != comma.fingerprint
    people = read_people(own, "customer", read.labels)  # a person column of the same file, split alike
    assert people.index.max() + 1 == len(tickets) // 2
    tickets.to_csv(tmp_path / "tabs.csv", index=False, sep="\t")
    with pytest.raises(
        WorkloadError, match=r"holding '\\t': if that is the file's delimiter, set task.dataset.sep: \"\\t\""
    ):
        read_dataset_file(DatasetFile(str(tmp_path / "tabs.csv"), "text", "label"))
    parquet = _write(tickets, tmp_path / "tickets.parquet")
    with pytest.raises(
        WorkloadError, match=r"task.dataset.sep ';': applies to csv and tsv files; .* is parquet: drop sep"
    ):
        read_dataset_file(DatasetFile(str(parquet), "text", "label", sep=";"))
