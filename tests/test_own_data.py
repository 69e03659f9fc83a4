"""A data owner's own dataset file: real rows (20 Newsgroups texts, MNIST-5k pixel vectors) written
as CSV, TSV, JSONL and Parquet, read into workloads, refused with a message when bad (before any
compute), and searched end to end (privately) on the embedded local Ray."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import REPO_ROOT
from dptune.contract import DatasetFile, WorkloadSpec
from dptune.data import load_workload
from dptune.data.sources import load_20newsgroups, load_mnist5k
from dptune.data.spec import WorkloadError
from dptune.data.workload import check_spec, row_digests, split_rows
from dptune.records import TRUST_BOUNDARY, read_table
from dptune.space import SpaceError, load_space
from hidden_runs import assert_nothing_of_the_hidden_runs_outside, assert_owner_only, private_search

#: Newsgroups kept, and rows of each in the training and the test file.
GROUPS = ("rec.autos", "sci.space", "talk.politics.guns")
TRAIN_PER_GROUP, TEST_PER_GROUP = 40, 15


@pytest.fixture(scope="module")
def texts() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Real 20 Newsgroups documents of three groups with string labels: (training rows, test rows)."""
    raw = load_20newsgroups()
    frame = pd.DataFrame({"text": raw.inputs, "label": [raw.class_names[c] for c in raw.labels]})
    official = raw.num_official_train
    train, test = frame.iloc[:official], frame.iloc[official:]
    pick = lambda part, n: pd.concat([part[part["label"] == g].head(n) for g in GROUPS], ignore_index=True)  # noqa: E731
    return pick(train, TRAIN_PER_GROUP), pick(test, TEST_PER_GROUP)


@pytest.fixture(scope="module")
def embeddings() -> pd.DataFrame:
    """625 real MNIST-5k digits (every 8th: the file is ordered by class) as 784-long pixel vectors in
    [0, 1] with int labels."""
    raw = load_mnist5k()
    pixels = raw.inputs.reshape(len(raw.labels), -1)[::8].float().div(255).numpy()
    return pd.DataFrame({"pixels": list(pixels), "digit": raw.labels[::8]})


def _write(frame: pd.DataFrame, path: Path) -> Path:
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    elif path.suffix == ".tsv":
        frame.to_csv(path, index=False, sep="\t")
    elif path.suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path)
    return path


def _spec(source: DatasetFile, backbone: str = "minilm") -> WorkloadSpec:
    return WorkloadSpec(dataset=source.display_name, backbone=backbone, peft="head", dataset_file=source)


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".parquet"])
def test_a_text_file_in_each_format_reads_the_same_rows_classes_and_splits(
    texts: tuple[pd.DataFrame, pd.DataFrame], tmp_path: Path, suffix: str
) -> None:
    train, test = texts
    source = DatasetFile(
        path=str(_write(train, tmp_path / f"train{suffix}")),
        input_column="text",
        label_column="label",
        test_path=str(_write(test, tmp_path / f"test{suffix}")),
        test_public=True,
    )
    info = check_spec(_spec(source))
    assert (info.modality, info.num_classes, info.official_test_split) == ("text", 3, True)
    raw = info.load(None, None)
    assert raw.class_names == sorted(GROUPS) and raw.inputs[: len(train)] == list(train["text"])
    assert raw.num_official_train == len(train) and len(raw.labels) == len(train) + len(test)
    assert [raw.class_names[c] for c in raw.labels] == [*train["label"], *test["label"]]
    # the test file is the test split; validation is carved from the training file's rows
    rows = split_rows(raw.labels, 3, raw.num_official_train, _spec(source), row_digests(raw))
    assert list(rows.test) == list(range(len(train), len(train) + len(test)))
    assert len(rows.train) + len(rows.val) == len(train) and len(rows.val) > 0


def test_embeddings_train_a_head_as_they_are_with_backbone_none(embeddings: pd.DataFrame, tmp_path: Path) -> None:
    source = DatasetFile(
        path=str(_write(embeddings, tmp_path / "digits.parquet")), input_column="pixels", label_column="digit"
    )
    workload = load_workload(_spec(source, backbone="none"))
    assert (workload.modality, workload.feature_dim, workload.num_classes) == ("features", 784, 10)
    assert workload.class_names == [str(d) for d in range(10)]
    total = len(workload.train) + len(workload.val) + len(workload.test)
    assert total == len(embeddings)  # no official test split: a test split is carved from the rows
    features, label = workload.train[0]
    matches = np.flatnonzero((np.stack(embeddings["pixels"]) == features.numpy()).all(axis=1))
    assert len(matches) >= 1 and int(label) in set(embeddings["digit"].iloc[matches])


def _bad(tmp_path: Path, texts: tuple[pd.DataFrame, pd.DataFrame], embeddings: pd.DataFrame, case: str):  # noqa: ANN202
    """A bad dataset file (and the backbone it is asked with) for ``case``."""
    train, test = texts
    base = {"input_column": "text", "label_column": "label"}
    if case == "missing file":
        return DatasetFile(path=str(tmp_path / "nowhere.csv"), **base), "minilm"
    if case == "missing column":
        return DatasetFile(
            path=str(_write(train, tmp_path / "a.csv")), input_column="body", label_column="label"
        ), "minilm"
    if case == "one class":
        one = train.assign(label="same")
        return DatasetFile(path=str(_write(one, tmp_path / "a.csv")), **base), "minilm"
    if case == "tiny class":
        tiny = pd.concat([train, train.head(1).assign(label="lonely")], ignore_index=True)
        return DatasetFile(path=str(_write(tiny, tmp_path / "a.csv")), **base), "minilm"
    if case == "empty text":
        empty = train.copy()
        empty.loc[7, "text"] = "   "
        return DatasetFile(path=str(_write(empty, tmp_path / "a.parquet")), **base), "minilm"
    if case == "missing label":
        unlabelled = train.copy()
        unlabelled.loc[5, "label"] = None
        return DatasetFile(path=str(_write(unlabelled, tmp_path / "a.parquet")), **base), "minilm"
    if case == "unknown suffix":
        return DatasetFile(path=str(_write(train, tmp_path / "a.csv").rename(tmp_path / "a.txt")), **base), "minilm"
    if case == "test labels differ":
        other = test.assign(label="comp.graphics")
        return DatasetFile(
            path=str(_write(train, tmp_path / "a.csv")), test_path=str(_write(other, tmp_path / "t.csv")), **base
        ), "minilm"
    digits = {"input_column": "pixels", "label_column": "digit"}
    if case == "ragged embedding":
        ragged = embeddings.copy()
        ragged.at[3, "pixels"] = ragged.at[3, "pixels"][:100]
        return DatasetFile(path=str(_write(ragged, tmp_path / "e.parquet")), **digits), "none"
    if case == "nan embedding":
        nan = embeddings.copy()
        vector = nan.at[9, "pixels"].copy()
        vector[4] = np.nan
        nan.at[9, "pixels"] = vector
        return DatasetFile(path=str(_write(nan, tmp_path / "e.parquet")), **digits), "none"
    if case == "embeddings with a text backbone":
        return DatasetFile(path=str(_write(embeddings, tmp_path / "e.parquet")), **digits), "minilm"
    assert case == "texts with backbone none"
    return DatasetFile(path=str(_write(train, tmp_path / "a.csv")), **base), "none"


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("missing file", "nowhere.csv: no such file"),
        ("missing column", "input_column 'body' is not a column of"),
        ("one class", "has 1 class; a classifier needs at least 2"),
        ("tiny class", "class(es) ['lonely']"),
        ("empty text", "row 7 has an empty 'text'"),
        ("missing label", "row 5 has no 'label'"),
        ("unknown suffix", "cannot tell the format from the suffix '.txt'"),
        ("test labels differ", "labels ['comp.graphics'] do not occur in the training file"),
        ("ragged embedding", "row 3 of 'pixels' has 100 numbers, row 0 has 784"),
        ("nan embedding", "row 9 of 'pixels' holds NaN"),
        ("embeddings with a text backbone", "holds embeddings (the rows' own features): use backbone 'none'"),
        ("texts with backbone none", "trains on a dataset's own embeddings; 'file:a.csv' holds text"),
    ],
)
def test_a_bad_dataset_file_is_refused_naming_what_is_wrong(
    texts: tuple[pd.DataFrame, pd.DataFrame],
    embeddings: pd.DataFrame,
    tmp_path: Path,
    no_encoding: None,
    case: str,
    named: str,
) -> None:
    source, backbone = _bad(tmp_path, texts, embeddings, case)
    with pytest.raises(WorkloadError) as error:
        check_spec(_spec(source, backbone))
    assert named in str(error.value)


def test_the_space_takes_a_file_mapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = REPO_ROOT / "tests/spaces/tiny.yaml"
    (tmp_path / "data").mkdir()
    (tmp_path / "data/tickets.csv").write_text("text,label\n")
    monkeypatch.chdir(tmp_path)  # a path given by --set is taken from the working folder
    dataset = {"path": "data/tickets.csv", "input_column": "text", "label_column": "label"}
    task = load_space(tiny, {"task.dataset": dataset}).space.task
    assert task.dataset_name == "file:tickets.csv" and task.dataset_file is not None
    assert task.dataset_file.path == str(tmp_path / "data/tickets.csv")
    with pytest.raises(SpaceError, match="test_public: true needs test_path"):
        load_space(tiny, {"task.dataset": {**dataset, "test_public": True}})


#: Installed as sitecustomize in the search's processes: the first private unit to start, in any
#: process, SIGKILLs its own process (a worker lost, as to the OOM killer); Ray Tune runs it again.
_KILL_ONE_UNIT = """
import importlib.abc, importlib.util, os, pathlib, signal, sys

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "dptune.search.runs.private_units":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        loader = spec.loader
        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)
            def exec_module(self, module):
                loader.exec_module(module)
                real = module.hidden_work
                def hidden_work(context):
                    try:
                        os.close(os.open(os.environ["DPTUNE_KILL_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    except FileExistsError:
                        return real(context)
                    os.kill(os.getpid(), signal.SIGKILL)
                module.hidden_work = hidden_work
        spec.loader = _Loader()
        return spec

sys.meta_path.insert(0, _Hook())
"""


def test_a_private_search_on_embeddings_releases_one_run_says_one_line_for_a_killed_unit_and_shows_nothing_else(
    search_env: dict[str, str], embeddings: pd.DataFrame, tmp_path: Path
) -> None:
    dataset = {
        "path": str(_write(embeddings, tmp_path / "digits.parquet")),
        "input_column": "pixels",
        "label_column": "digit",
    }
    flags = [
        "--set",
        f"task.dataset={json.dumps(dataset)}",
        "--set",
        "task.backbone=none",
        "--set",
        "task.max_tokens=null",
    ]
    flags += ["--set", "sampler.trials_per_cell=3", "--set", "epochs=[5]"]
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_KILL_ONE_UNIT)
    env = {
        **search_env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), search_env.get("PYTHONPATH", "")])),
        "DPTUNE_KILL_MARK": str(tmp_path / "killed"),
    }
    completed = private_search(env, tmp_path, REPO_ROOT / "search_spaces/private.yaml", "private", *flags)
    # a unit's process was killed once: the console says so in one line of its own (no time, no trial
    # name: assert_nothing_of_the_hidden_runs_outside finds no timestamped line) and the unit ran again
    assert (tmp_path / "killed").exists()
    (said,) = [line for line in completed.stdout.splitlines() if "a unit of the private search failed" in line]
    assert f"{tmp_path / 'private' / TRUST_BOUNDARY}/_tune" in said and "private_unit_trainable" not in said
    root = tmp_path / "private"
    (release,) = read_table(str(root), "release").itertuples()
    # no official test split: the carved test rows are private, so their accuracy is withheld
    assert not release.test_split_public and pd.isna(release.test_accuracy) and release.epsilon_total == 8
    trials = read_table(str(root / TRUST_BOUNDARY), "trials")
    assert set(trials["dataset"]) == {"file:digits.parquet"} and set(trials["backbone"]) == {"none"}
    out = " ".join(completed.stdout.split())
    assert "ERROR" not in completed.stdout + completed.stderr and "(raylet)" not in completed.stdout
    assert "file:digits.parquet has no official test split: its test rows are carved from the same private pool" in out
    assert "One row of file:digits.parquet is one record: (ε, δ) protects each row" in out
    assert_nothing_of_the_hidden_runs_outside(
        root, completed.stdout, (tmp_path / "private-tmp").resolve(), os.cpu_count() or 1
    )
    assert_owner_only(root)
    (model,) = (root / "models").iterdir()  # the released run's model, and nothing that orders it
    card = json.loads((model / "model_card.json").read_text())
    assert card["model"]["trial_id"] is None and card["accuracy"]["test_accuracy"] is None
    assert card["data"]["data_sha256"] is None  # a hash of the private rows is no DP release
    # why the test accuracy is withheld, and how the owner scores the model, on the card and the console
    assert "carved from the private pool" in card["accuracy"]["test_withheld"]
    assert "--label-column" in card["accuracy"]["test_withheld"]
    assert "test accuracy of eps=8|delta=1e-05|epochs=5 withheld: the test split is carved" in out
    assert card["privacy"]["epsilon"] == release.epsilon_total and "the whole tuning" in card["privacy"]["covers"]
    assert card["configuration"]["batch_size"] == release.batch_size and card["data"]["backbone"] == "none"
    labelled = tmp_path / "labelled.jsonl"  # the model on embeddings (backbone none), in a fresh process
    argv = ["--model", str(model), "--input", dataset["path"], "--column", "pixels", "--output", str(labelled)]
    done = subprocess.run([sys.executable, "-m", "dptune.predict", *argv], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    predicted = pd.read_json(labelled, lines=True)
    assert len(predicted) == len(embeddings) and set(predicted["prediction"].astype(str)) <= set(
        card["data"]["class_names"]
    )


def test_the_example_space_plans_a_private_search_on_the_files_dptune_makes(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    """``search_spaces/own_data.yaml`` on the files ``python -m dptune.data.example data`` writes
    (the README's "Your own data"), in a copy of the repository's layout (its ``../data/`` paths taken
    from the space file's folder): read, checked and planned."""
    from conftest import search_command
    from dptune.data.example import GROUPS

    shutil.copytree(REPO_ROOT / "search_spaces", tmp_path / "search_spaces")  # the repository's layout
    made = subprocess.run(
        [sys.executable, "-m", "dptune.data.example", "data"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert made.returncode == 0 and "wrote data/tickets.csv" in made.stdout, made.stderr
    train, test = (pd.read_csv(tmp_path / "data" / name) for name in ("tickets.csv", "tickets_test.csv"))
    assert sorted(set(train["label"])) == sorted(GROUPS) == sorted(set(test["label"])) and len(train) > len(test) > 1000
    space = "search_spaces/own_data.yaml"
    planned = subprocess.run(
        search_command("--space", space, "--dry-run"), cwd=tmp_path, env=search_env, capture_output=True, text=True
    )
    assert planned.returncode == 0, planned.stderr[-3000:]
    out = " ".join(planned.stdout.split())
    assert "task: file:tickets.csv / minilm / head" in out and "private selection: total ε = 8" in out
