"""A data owner's dataset beyond flat files: an image folder of real MNIST-5k digits, a ``save_to_disk``
dataset of real 20 Newsgroups texts, and a Parquet file on an S3-compatible server on loopback (moto,
the path ``ray job submit`` users take with a bucket). Each is read, refused when bad (before any
compute), and searched end to end on the embedded local Ray; ``dptune.predict`` then labels its
held-out rows in a fresh process, as many right as the model card counts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from conftest import REPO_ROOT, run_search, s3_client, s3_server
from dptune.contract import DatasetFile, WorkloadSpec
from dptune.data.files import read_dataset_file
from dptune.data.sources import load_20newsgroups, load_mnist5k
from dptune.data.spec import WorkloadError
from dptune.data.workload import check_spec
from dptune.records import read_table
from dptune.records.weights import CARD_JSON
from dptune.space import SpaceError, load_space

#: Digits kept, and images of each in the training and the test folder.
DIGITS = (0, 1, 7)
TRAIN_PER_DIGIT, TEST_PER_DIGIT = 40, 12
GROUPS = ("rec.autos", "sci.space", "talk.politics.guns")
#: What the searches here share: one ε, no AUTO-S comparison or diagnostics, small batches.
SEARCH_FLAGS = {
    "privacy.epsilons": "[8]",
    "training.compare_auto_s": "false",
    "training.diagnostics": "false",
    "batch_size.values": "[16, 32]",
    "min_steps": "5",
}


def _image_folder(folder: Path, per_digit: int, skip: int) -> Path:
    """Real MNIST-5k digits of :data:`DIGITS` as PNGs, ``<folder>/digit-<d>/<row>.png``."""
    raw = load_mnist5k()
    for digit in DIGITS:
        (folder / f"digit-{digit}").mkdir(parents=True)
        for row in np.flatnonzero(raw.labels == digit)[skip : skip + per_digit]:
            Image.fromarray(raw.inputs[row, 0].numpy()).save(folder / f"digit-{digit}" / f"{row}.png")
    return folder


@pytest.fixture(scope="module")
def digit_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(training folder, test folder) of distinct real digits, with a notes file that is no image."""
    root = tmp_path_factory.mktemp("digits")
    train = _image_folder(root / "train", TRAIN_PER_DIGIT, 0)
    (train / "digit-0" / "notes.txt").write_text("not an image: skipped")
    return train, _image_folder(root / "test", TEST_PER_DIGIT, TRAIN_PER_DIGIT)


@pytest.fixture(scope="module")
def newsgroup_frames() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Real 20 Newsgroups texts of :data:`GROUPS` with class ids 0..2: (training rows, test rows)."""
    raw = load_20newsgroups()
    frame = pd.DataFrame({"text": raw.inputs, "group": [raw.class_names[c] for c in raw.labels]})
    official = raw.num_official_train
    pick = lambda part, n: pd.concat([part[part["group"] == g].head(n) for g in GROUPS], ignore_index=True)  # noqa: E731
    train, test = pick(frame.iloc[:official], 40), pick(frame.iloc[official:], 15)
    return tuple(part.assign(label=part["group"].map(GROUPS.index)) for part in (train, test))  # type: ignore[return-value]


def _saved(frame: pd.DataFrame, folder: Path) -> Path:
    """``frame`` saved with ``datasets.Dataset.save_to_disk``, its label a ``ClassLabel`` of :data:`GROUPS`."""
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(GROUPS))})
    datasets.Dataset.from_pandas(frame[["text", "label"]], features=features, preserve_index=False).save_to_disk(
        str(folder)
    )
    return folder


def _spec(source: DatasetFile, backbone: str) -> WorkloadSpec:
    return WorkloadSpec(dataset=source.display_name, backbone=backbone, peft="head", dataset_file=source)


def test_an_image_folder_is_a_dataset_whose_class_folders_are_the_labels(digit_folders: tuple[Path, Path]) -> None:
    train, test = digit_folders
    source = DatasetFile(path=str(train), test_path=str(test), test_public=True)
    info = check_spec(_spec(source, "efficientnet_lite0"))
    assert (info.modality, info.num_classes, info.official_test_split) == ("image", 3, True)
    raw = info.load(None, 224)
    assert raw.class_names == [f"digit-{d}" for d in DIGITS] and raw.num_official_train == 3 * TRAIN_PER_DIGIT
    assert len(raw.inputs) == 3 * (TRAIN_PER_DIGIT + TEST_PER_DIGIT)  # notes.txt is no row
    (image,) = raw.inputs[0]
    assert image.shape == (3, 224, 224) and image.dtype.is_floating_point is False
    assert all(
        raw.class_names[label] == file.parent.name for file, label in zip(raw.inputs.files, raw.labels, strict=True)
    )


def test_a_table_of_image_paths_reads_its_images_relative_to_the_file(digit_folders: tuple[Path, Path]) -> None:
    train, _ = digit_folders
    files = sorted(train.glob("*/*.png"))
    table = pd.DataFrame(
        {"image": [str(file.relative_to(train)) for file in files], "digit": [f.parent.name for f in files]}
    )
    table.to_csv(train / "images.csv", index=False)
    source = DatasetFile(path=str(train / "images.csv"), input_column="image", label_column="digit")
    raw = check_spec(_spec(source, "efficientnet_lite0")).load(None, 64)
    assert raw.modality == "image" and raw.class_names == [f"digit-{d}" for d in DIGITS]
    assert raw.inputs.files == files and raw.inputs[0][0].shape == (3, 64, 64)
    table.assign(image=[*table["image"][:-1], "digit-7/missing.png"]).to_csv(train / "gone.csv", index=False)
    missing = DatasetFile(path=str(train / "gone.csv"), input_column="image", label_column="digit")
    with pytest.raises(WorkloadError, match=r"image .*/digit-7/missing.png does not exist"):
        check_spec(_spec(missing, "efficientnet_lite0"))


def test_a_saved_hf_dataset_keeps_its_classlabel_names(
    newsgroup_frames: tuple[pd.DataFrame, pd.DataFrame], tmp_path: Path
) -> None:
    train, test = newsgroup_frames
    source = DatasetFile(
        path=str(_saved(train, tmp_path / "train")),
        input_column="text",
        label_column="label",
        test_path=str(_saved(test, tmp_path / "test")),
    )
    raw = check_spec(_spec(source, "minilm")).load(None, None)
    assert raw.modality == "text" and raw.class_names == list(GROUPS)
    assert raw.inputs == [*train["text"], *test["text"]] and list(raw.labels) == [*train["label"], *test["label"]]


def _bad_source(case: str, folders: tuple[Path, Path], frames: tuple[pd.DataFrame, pd.DataFrame], tmp: Path):  # noqa: ANN202
    train, test = folders
    if case == "image folder without class folders":
        (tmp / "flat").mkdir()
        Image.new("L", (8, 8)).save(tmp / "flat" / "one.png")
        return DatasetFile(path=str(tmp / "flat"), format="imagefolder")
    if case == "a file that is no image":
        copy = tmp / "broken"
        for digit in DIGITS:
            (copy / f"digit-{digit}").mkdir(parents=True)
            for file in sorted((train / f"digit-{digit}").glob("*.png"))[:3]:
                (copy / f"digit-{digit}" / file.name).write_bytes(file.read_bytes())
        (copy / "digit-1" / "scan.png").write_bytes(b"these bytes are no PNG")
        return DatasetFile(path=str(copy))
    if case == "test folder with another class":
        other = tmp / "other"
        (other / "digit-9").mkdir(parents=True)
        Image.new("L", (8, 8)).save(other / "digit-9" / "x.png")
        return DatasetFile(path=str(train), test_path=str(other))
    if case == "a DatasetDict":
        import datasets

        parts = {
            name: datasets.Dataset.from_pandas(f[["text", "label"]])
            for name, f in zip(("train", "test"), frames, strict=True)
        }
        datasets.DatasetDict(parts).save_to_disk(str(tmp / "dict"))
        return DatasetFile(path=str(tmp / "dict"), input_column="text", label_column="label")
    if case == "saved dataset without the column":
        return DatasetFile(path=str(_saved(frames[0], tmp / "saved")), input_column="body", label_column="label")
    assert case == "a table without columns"
    frames[0].to_csv(tmp / "rows.csv", index=False)
    return DatasetFile(path=str(tmp / "rows.csv"))


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("image folder without class folders", "no class folders; an image folder is <path>/<class>/<image>"),
        ("a file that is no image", "broken/digit-1/scan.png is not a readable image"),
        ("test folder with another class", "labels ['digit-9'] do not occur in the training"),
        ("a DatasetDict", "a DatasetDict of the splits ['test', 'train']; name one split's folder"),
        ("saved dataset without the column", "input_column 'body' is not a column of"),
        ("a table without columns", "task.dataset.input_column: required for a csv dataset"),
    ],
)
def test_a_bad_folder_or_saved_dataset_is_refused_naming_what_is_wrong(
    digit_folders: tuple[Path, Path],
    newsgroup_frames: tuple[pd.DataFrame, pd.DataFrame],
    tmp_path: Path,
    no_encoding: None,
    case: str,
    named: str,
) -> None:
    source = _bad_source(case, digit_folders, newsgroup_frames, tmp_path)
    with pytest.raises(WorkloadError) as error:
        check_spec(_spec(source, "efficientnet_lite0" if "image" in case or "folder" in case else "minilm"))
    assert named in str(error.value)


def test_the_space_takes_object_store_uris_and_refuses_unknown_schemes_and_columns_of_a_folder() -> None:
    tiny = REPO_ROOT / "tests/spaces/tiny.yaml"
    dataset = {"path": "s3://bucket/tickets.parquet", "input_column": "text", "label_column": "label"}
    task = load_space(tiny, {"task.dataset": dataset}).space.task
    assert task.dataset_file is not None and task.dataset_file.path == "s3://bucket/tickets.parquet"
    with pytest.raises(SpaceError, match=r"unknown URI scheme 'ftp' \(a local path, or one of file://, s3://"):
        load_space(tiny, {"task.dataset": {**dataset, "path": "ftp://host/tickets.csv"}})
    with pytest.raises(SpaceError, match="an image folder has no columns"):
        load_space(tiny, {"task.dataset": {**dataset, "path": "photos", "format": "imagefolder"}})


def _search(env: dict[str, str], storage: Path, dataset: dict[str, object], *flags: str) -> Path:
    """A tiny grid search of ``dataset`` (public test split) into ``storage``; its one model folder."""
    overrides = {"task.dataset": json.dumps({**dataset, "test_public": True}), **SEARCH_FLAGS}
    argv = [item for key, value in overrides.items() for item in ("--set", f"{key}={value}")]
    space = str(REPO_ROOT / "tests/spaces/tiny.yaml")
    completed = run_search(env, "--space", space, "--storage", str(storage), "--no-report", *argv, *flags)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    (folder,) = (storage / "tiny" / "models").iterdir()
    return folder


def _predicted_right(model: Path, rows: Path, output: Path, *column: str) -> tuple[pd.DataFrame, int]:
    """``dptune.predict`` of ``rows`` in a fresh process: (its output, the card's count of right test rows)."""
    argv = ["--model", str(model), "--input", str(rows), "--output", str(output), *column]
    done = subprocess.run(
        [sys.executable, "-m", "dptune.predict", *argv], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = json.loads((model / CARD_JSON).read_text())["accuracy"]
    return pd.read_parquet(output), round(accuracy["test_accuracy"] * accuracy["num_test"])


@pytest.mark.parametrize("peft", ["head", "film"])
def test_an_image_folder_search_hands_back_a_model_that_labels_the_test_folder_as_scored(
    search_env: dict[str, str], digit_folders: tuple[Path, Path], tmp_path: Path, peft: str
) -> None:
    """A head on cached features, and FiLM (the backbone's public weights rebuilt by name, its
    trained FiLM parameters loaded): each labels the test folder in a fresh process as the search
    scored it."""
    train, test = digit_folders
    model = _search(
        search_env,
        tmp_path,
        {"path": str(train), "test_path": str(test)},
        "--set",
        "task.backbone=efficientnet_lite0",
        "--set",
        f"task.peft={peft}",
        "--set",
        "task.max_tokens=null",
    )
    card = json.loads((model / CARD_JSON).read_text())
    assert card["data"]["class_names"] == [f"digit-{d}" for d in DIGITS] and card["peft"] == peft
    assert card["data"]["backbone"] == "efficientnet_lite0"
    labelled, right = _predicted_right(model, test, tmp_path / "labelled.parquet")
    assert list(labelled.columns) == ["file", "folder", "prediction", "softmax_score"]
    assert len(labelled) == 3 * TEST_PER_DIGIT
    # the same inputs and parameters as the search's test pass, up to one row whose top two logits a
    # float rounding of another batching could swap
    assert abs(int((labelled["prediction"] == labelled["folder"]).sum()) - right) <= 1


def test_a_saved_hf_dataset_searched_with_an_own_encoder_hands_back_a_model_that_labels_its_test_split(
    search_env: dict[str, str], newsgroup_frames: tuple[pd.DataFrame, pd.DataFrame], own_encoder: Path, tmp_path: Path
) -> None:
    train, test = (
        _saved(frame, tmp_path / name) for frame, name in zip(newsgroup_frames, ("train", "test"), strict=True)
    )
    model = _search(
        search_env,
        tmp_path / "results",
        {"path": str(train), "input_column": "text", "label_column": "label", "test_path": str(test)},
        "--set",
        f"task.backbone={json.dumps({'hf': str(own_encoder)})}",
    )
    card = json.loads((model / CARD_JSON).read_text())
    assert card["data"]["backbone"] == f"hf:{own_encoder}" and card["data"]["class_names"] == list(GROUPS)
    labelled, right = _predicted_right(model, test, tmp_path / "labelled.parquet", "--column", "text")
    assert set(labelled["prediction"]) <= set(GROUPS)
    truth = [GROUPS[label] for label in labelled["label"]]
    assert abs(int((labelled["prediction"] == truth).sum()) - right) <= 1


@pytest.fixture
def bucket() -> Iterator[dict[str, str]]:
    """An S3-compatible server (moto) on loopback with the bucket ``owner`` (``conftest.s3_server``)."""
    with s3_server("owner") as env:
        yield env


def test_a_parquet_file_in_a_bucket_is_searched_as_a_local_one(
    search_env: dict[str, str],
    newsgroup_frames: tuple[pd.DataFrame, pd.DataFrame],
    bucket: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = s3_client(bucket)
    train, test = newsgroup_frames
    for name, frame in (("train", train), ("test", test)):
        frame.to_parquet(tmp_path / f"{name}.parquet")
        client.upload_file(str(tmp_path / f"{name}.parquet"), "owner", f"tickets/{name}.parquet")
    for key, value in bucket.items():
        monkeypatch.setenv(key, value)
    missing = DatasetFile(path="s3://owner/tickets/none.parquet", input_column="text", label_column="group")
    with pytest.raises(WorkloadError, match="task.dataset.path s3://owner/tickets/none.parquet: no such file"):
        check_spec(_spec(missing, "minilm"))
    dataset = {
        "path": "s3://owner/tickets/train.parquet",
        "input_column": "text",
        "label_column": "group",
        "test_path": "s3://owner/tickets/test.parquet",
    }
    model = _search({**search_env, **bucket}, tmp_path / "results", dataset)
    trials = read_table(str(tmp_path / "results" / "tiny"), "trials")
    assert set(trials["dataset"]) == {"file:train.parquet"}
    labelled, right = _predicted_right(
        model, tmp_path / "test.parquet", tmp_path / "labelled.parquet", "--column", "text"
    )
    assert abs(int((labelled["prediction"] == labelled["group"]).sum()) - right) <= 1
    # the card's data digest is that of the same bytes read from the local files
    local = DatasetFile(
        path=str(tmp_path / "train.parquet"),
        input_column="text",
        label_column="group",
        test_path=str(tmp_path / "test.parquet"),
    )
    assert json.loads((model / CARD_JSON).read_text())["data"]["data_sha256"] == read_dataset_file(local).fingerprint
