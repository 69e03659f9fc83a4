"""The models a search hands back (``<results>/models/<cell>/``): the chosen run's weights with a card
saying what its (ε, δ) covers, and ``python -m dptune.predict`` labelling new rows with one in a fresh
process, on a real search of a data owner's CSV with a public test file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from safetensors.numpy import load_file

from conftest import ONE_CELL, REPO_ROOT, SearchRun, run_search
from dptune.analysis import best_configurations, finished_trials
from dptune.data.sources import load_20newsgroups
from dptune.records import read_table
from dptune.records.weights import CARD_JSON, CARD_MD, MODEL_FILE, read_weights
from dptune.search.finish.publish import model_name

GROUPS = ("rec.autos", "sci.space", "talk.politics.guns")


def _predict(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dptune.predict", *args], capture_output=True, text=True, timeout=600, check=False
    )


def test_each_cell_publishes_its_best_configurations_best_replicate_with_a_card(tiny_search: SearchRun) -> None:
    root = tiny_search.root
    trials = read_table(str(root), "trials")
    best = best_configurations(finished_trials(trials), by=["cell_id", "clipping"])
    assert len(best) == 4
    for row in best.itertuples():
        folder = root / "models" / model_name(row.cell_id, row.clipping)
        card = json.loads((folder / CARD_JSON).read_text())
        replicates = trials[(trials["configuration_id"] == row.configuration_id) & (trials["status"] == "ok")]
        run = replicates.sort_values(["val_accuracy", "trial_id"], ascending=[False, True]).iloc[0]
        assert card["model"] == {"cell_id": row.cell_id, "clipping": row.clipping, "trial_id": run["trial_id"]}
        assert card["configuration"]["clip_bound"] == run["clip_bound"]
        assert card["configuration"]["batch_size"] == run["batch_size"]
        assert card["privacy"]["epsilon"] == run["epsilon"] and card["privacy"]["delta"] == run["delta"]
        assert "NOT covered" in card["privacy"]["covers"]
        low, high = card["accuracy"]["test_interval"]
        assert card["accuracy"]["test_accuracy"] == run["test_accuracy"] and low < run["test_accuracy"] < high
        assert card["data"]["class_names"][:2] == ["alt.atheism", "comp.graphics"] and card["logits"] == "augmented"
        published = load_file(folder / MODEL_FILE)
        kept_model = read_weights(str(root), run["trial_id"])  # its own file, or the bundle of its unit
        assert kept_model is not None
        kept = kept_model.parameters
        assert published.keys() == kept.keys() == {"weight", "bias"}
        assert all(np.array_equal(published[name], kept[name]) for name in kept)
        assert published["weight"].shape == (20, 384)
        assert "(ε, δ) = (" in (folder / CARD_MD).read_text()
    assert "models: 4 in" in tiny_search.stdout


@pytest.fixture(scope="module")
def newsgroup_frames() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Real 20 Newsgroups texts of three groups: training rows (40 per group) and test rows (15 per
    group, with a ``ticket`` number)."""
    raw = load_20newsgroups()
    frame = pd.DataFrame({"text": raw.inputs, "label": [raw.class_names[c] for c in raw.labels]})
    official = raw.num_official_train
    pick = lambda part, n: pd.concat([part[part["label"] == g].head(n) for g in GROUPS], ignore_index=True)  # noqa: E731
    train, test = pick(frame.iloc[:official], 40), pick(frame.iloc[official:], 15)
    return train, test.assign(ticket=range(len(test)))


#: Writing and reading a table in each format (pandas, the way a data owner would make the file).
WRITE = {
    ".csv": lambda frame, path: frame.to_csv(path, index=False),
    ".tsv": lambda frame, path: frame.to_csv(path, index=False, sep="\t"),
    ".jsonl": lambda frame, path: frame.to_json(path, orient="records", lines=True),
}
READ = {
    ".csv": pd.read_csv,
    ".tsv": lambda path: pd.read_csv(path, sep="\t"),
    ".jsonl": lambda path: pd.read_json(path, lines=True),
}


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_predict_labels_a_public_test_file_as_the_search_scored_it(
    search_env: dict[str, str], newsgroup_frames: tuple[pd.DataFrame, pd.DataFrame], tmp_path: Path, suffix: str
) -> None:
    train, test = tmp_path / f"train{suffix}", tmp_path / f"test{suffix}"
    for frame, path in zip(newsgroup_frames, (train, test), strict=True):
        WRITE[suffix](frame, path)
    dataset = {"path": str(train), "input_column": "text", "label_column": "label", "test_path": str(test)}
    completed = run_search(
        search_env,
        "--space",
        str(REPO_ROOT / "tests/spaces/tiny.yaml"),
        "--storage",
        str(tmp_path),
        "--no-report",
        "--set",
        f"task.dataset={json.dumps({**dataset, 'test_public': True})}",
        *ONE_CELL,
        "--set",
        "batch_size.values=[16, 32]",
        "--set",
        "min_steps=5",
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    (folder,) = (tmp_path / "tiny" / "models").iterdir()
    card = json.loads((folder / CARD_JSON).read_text())
    assert card["data"]["class_names"] == sorted(GROUPS) and card["accuracy"]["num_test"] == 45
    out = tmp_path / "labelled.parquet"
    done = _predict("--model", str(folder), "--input", str(test), "--column", "text", "--output", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    labelled = pd.read_parquet(out)
    source = READ[suffix](test)
    assert list(labelled.columns) == [*source.columns, "prediction", "softmax_score"]
    assert labelled["ticket"].tolist() == source["ticket"].tolist()
    assert set(labelled["prediction"]) <= set(GROUPS) and labelled["softmax_score"].between(1 / 3, 1).all()
    correct = int((labelled["prediction"] == labelled["label"]).sum())
    # the same features (same backbone, weights and precision) and head: the search's test count, up to
    # one row whose two top logits a float rounding of another batching could swap
    assert abs(correct - round(card["accuracy"]["test_accuracy"] * 45)) <= 1


def test_predict_refuses_bad_input_before_encoding_anything(tiny_search: SearchRun, tmp_path: Path) -> None:
    folder = next((tiny_search.root / "models").iterdir())
    rows = tmp_path / "rows.csv"
    pd.DataFrame({"body": ["a question about the space shuttle"]}).to_csv(rows, index=False)
    cases = [
        (["--model", str(tmp_path), "--input", str(rows), "--column", "body"], "not a dptune model folder"),
        (["--model", str(folder), "--input", str(tmp_path / "none.csv"), "--column", "body"], "no such file"),
        (["--model", str(folder), "--input", str(rows), "--column", "text"], "column 'text' is not a column of"),
    ]
    for args, message in cases:
        done = _predict(*args, "--output", str(tmp_path / "out.csv"))
        assert done.returncode == 2 and message in done.stderr, done.stderr
    done = _predict("--model", str(folder), "--input", str(rows), "--column", "body", "--output", str(tmp_path / "o.x"))
    assert done.returncode == 2 and "the suffix must be one of" in done.stderr
    assert not any(tmp_path.glob("out*")) and not any(tmp_path.glob("o.*"))


def test_the_report_names_each_model_folder_with_its_accuracy_and_what_its_privacy_covers(
    tiny_search: SearchRun, tmp_path: Path
) -> None:
    from dptune.analysis import published_models
    from dptune.report import build_report

    models = published_models([str(tiny_search.root)])
    folders = sorted((tiny_search.root / "models").iterdir())
    assert models["folder"].tolist() == [str(folder) for folder in folders]
    for row, folder in zip(models.itertuples(), folders, strict=True):
        card = json.loads((folder / CARD_JSON).read_text())
        assert (row.cell_id, row.clipping, row.batch_size) == (
            card["model"]["cell_id"],
            card["model"]["clipping"],
            card["configuration"]["batch_size"],
        )
        assert row.test_accuracy == card["accuracy"]["test_accuracy"] and "NOT covered" in row.covers
    page = build_report([str(tiny_search.root)], tmp_path / "report").read_text()
    assert "Models handed back" in page and all(str(folder) in page for folder in folders)
    low, high = models["test_interval"].iloc[0]
    assert f"{100 * models['test_accuracy'].iloc[0]:.1f} [{100 * low:.1f}, {100 * high:.1f}]" in page
