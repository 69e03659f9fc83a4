"""dptune from Python (``dptune.__all__``): every public name driven as a notebook user would, against
the command line's own results.

A real search runs once, in a fresh interpreter as a user's would (an embedded Ray of its own): a pandas
DataFrame of the example tickets and a dict space in, a :class:`dptune.SearchResult` out; its tables,
best configurations, models, privacy cost, report and resume are checked against the records the search
wrote and against ``python -m dptune.predict`` on the same rows. Bad input is refused before any
compute, in-process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

import dptune
from conftest import REPO_ROOT
from dptune.plan.table import plan as plan_rows
from dptune.records import read_table
from dptune.search.frames import FRAME_FILE, frame_file

#: The search the module runs: the example tickets from a DataFrame, one cell, four configurations.
SCRIPT = """
import json, sys, time
import numpy as np, pandas as pd
import dptune
from dptune.data.example import write_example

train, test = write_example("data")
tickets = pd.read_csv(train)
space = {
    "extends": sys.argv[1],
    "name": "tickets",
    "task": {"dataset": {"input_column": "text", "label_column": "label"}},
    "privacy": {"epsilons": [8]},
    "epochs": [5],
}
options = dict(storage="results", sampler__trials_per_cell=4, replicates=1, max_train_examples=300,
               max_eval_examples=150)
result = dptune.tune(space, data=tickets, **options)
model = dptune.load_model(result.models[0])
rows = pd.read_csv(test).head(40)
probabilities = model.predict_proba(rows)
report = result.report()
started = time.monotonic()
again = dptune.tune(space, data=tickets, resume=True, **options)
resumed_s = time.monotonic() - started
print(json.dumps({
    "root": result.root, "private": result.private, "models": result.models, "again": again.root,
    "resumed_s": resumed_s, "epsilon": [result.epsilon.epsilon, result.epsilon.delta, result.epsilon.covers],
    "best": result.best().to_dict("records"), "trials": len(result.trials), "epochs": len(result.epochs),
    "classes": len(result.classes), "repr": repr(result), "model_repr": repr(model),
    "input_column": model.input_column, "model_classes": model.classes,
    "predicted": model.predict(rows).tolist(), "from_texts": model.predict(rows["text"].tolist()).tolist(),
    "frame": model.predict_frame(rows).to_dict("list"), "probabilities": probabilities.to_numpy().tolist(),
    "probability_columns": list(probabilities.columns), "report": str(report), "figures": len(report.figures),
    "report_html": len(report._repr_html_()),
}, default=str))
"""


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory, search_env: dict[str, str]) -> tuple[Path, dict]:
    """The folder the script ran in and what it printed."""
    folder = tmp_path_factory.mktemp("api")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(REPO_ROOT / "search_spaces/default.yaml")],
        cwd=folder,
        env=search_env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return folder, json.loads(done.stdout.strip().splitlines()[-1])


def test_a_dataframe_search_returns_its_records_best_models_and_cost(searched: tuple[Path, dict]) -> None:
    folder, seen = searched
    root = str((folder / "results" / "tickets").resolve())
    assert seen["root"] == seen["again"] == root and not seen["private"]
    trials = read_table(root, "trials")
    assert seen["trials"] == len(trials) and (trials["status"] == "ok").sum() == 4  # and the pruned ones
    assert seen["epochs"] == len(read_table(root, "epochs")) > 0
    assert seen["classes"] == len(read_table(root, "classes")) > 0
    search = read_table(root, "search")
    assert seen["epsilon"] == [search["epsilon_search"].iloc[0], search["delta"].iloc[0], search["guarantee"].iloc[0]]
    assert set(search["dataset"]) == {f"file:{FRAME_FILE}"}  # the table's file, named by its kind, not its rows
    (best,) = seen["best"]
    ok = trials[trials["status"] == "ok"]
    assert best["val_accuracy"] == ok["val_accuracy"].max()  # one replicate: the best run's (ties: any of them)
    assert best["trial_id"] in set(ok["trial_id"]) and best["val_low"] <= best["val_accuracy"] <= best["val_high"]
    assert seen["models"] == [f"{root}/models/eps=8_epochs=5-normalized"]
    assert seen["repr"] == f"SearchResult(search at {root!r}, 1 model(s))"
    assert seen["figures"] >= 3 and seen["report"] == f"{root}/report/index.html"
    assert seen["report_html"] > 10_000  # the figures inline, base64
    assert seen["resumed_s"] < 120  # nothing retrained: the finished search is shown


def test_the_model_predicts_as_the_command_line_does(searched: tuple[Path, dict], search_env: dict[str, str]) -> None:
    folder, seen = searched
    assert seen["input_column"] == "text" and sorted(seen["model_classes"]) == ["cars", "firearms", "hardware", "space"]
    assert seen["predicted"] == seen["from_texts"] == seen["frame"]["prediction"]
    probabilities = np.array(seen["probabilities"])
    assert seen["probability_columns"] == seen["model_classes"]
    np.testing.assert_allclose(probabilities.sum(axis=1), 1, rtol=1e-5)
    assert [seen["model_classes"][i] for i in probabilities.argmax(axis=1)] == seen["predicted"]
    np.testing.assert_allclose(seen["frame"]["softmax_score"], probabilities.max(axis=1), rtol=1e-6)
    rows = folder / "rows.csv"
    pd.read_csv(folder / "data" / "tickets_test.csv").head(40).to_csv(rows, index=False)
    labelled = folder / "labelled.parquet"
    command = [sys.executable, "-m", "dptune.predict", "--model", seen["models"][0], "--input", str(rows)]
    done = subprocess.run(
        [*command, "--output", str(labelled)], env=search_env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]  # no --column: the model's input column
    cli = pd.read_parquet(labelled)
    assert cli["prediction"].tolist() == seen["predicted"]
    np.testing.assert_allclose(cli["softmax_score"], seen["frame"]["softmax_score"], rtol=1e-6)


def test_tables_in_memory_become_one_private_file_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(tmp_path))
    frame = pd.DataFrame({"text": ["a b", "c d", "e f"], "label": ["x", "y", "x"]})
    first, again = frame_file(frame), frame_file(frame.copy())
    assert first == again and first.name == FRAME_FILE and first.stat().st_mode & 0o777 == 0o600
    assert first.parent.stat().st_mode & 0o777 == 0o700 and pd.read_parquet(first).equals(frame)
    digest = __import__("hashlib").sha256(first.read_bytes()).hexdigest()
    assert digest[:32] not in str(first)  # named by a keyed hash: the name says nothing of the rows
    assert pd.read_parquet(frame_file(pl.from_pandas(frame))).equals(frame)
    assert pd.read_parquet(frame_file(pa.Table.from_pandas(frame))).equals(frame)
    assert frame_file(frame.iloc[:2]) != first
    assert frame_file(pa.Table.from_pandas(frame).replace_schema_metadata({"pandas": "another release"})) == first
    import datasets

    named = datasets.Dataset.from_dict(
        {"text": ["a", "b"], "label": [1, 0]},
        features=datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["x", "y"])}),
    )
    assert pd.read_parquet(frame_file(named))["label"].tolist() == ["y", "x"]  # a ClassLabel by its names


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: dptune.tune(REPO_ROOT / "no-such.yaml"), "no such search-space file"),
        (lambda: dptune.tune({"extends": str(REPO_ROOT / "search_spaces/default.yaml"), "epoks": [5]}), "epoks"),
        (lambda: dptune.tune(REPO_ROOT / "tests/spaces/tiny.yaml", data=42), "expected a file path or a pandas"),
        (lambda: dptune.tune(REPO_ROOT / "tests/spaces/tiny.yaml", name="../x"), "--name"),
        (lambda: dptune.tune(REPO_ROOT / "tests/spaces/tiny.yaml", privacy__epsilons=[-1]), "privacy.epsilons"),
        (lambda: dptune.tune(REPO_ROOT / "tests/spaces/tiny.yaml", max_train_examples=0), "max_train_examples="),
        (lambda: dptune.tune(3.5), "expected a YAML file's path, a mapping or a dptune SearchSpace"),
        (lambda: dptune.load_model(REPO_ROOT), "not a dptune model folder"),
        (
            lambda: dptune.tune(REPO_ROOT / "search_spaces/default.yaml", data=pd.DataFrame({"text": ["a"]})),
            "data=: the space's task.dataset is the registry dataset '20newsgroups'; for your own rows name their "
            "columns in the space: task: {dataset: {input_column: COLUMN, label_column: COLUMN}}",
        ),
        (
            lambda: dptune.tune(REPO_ROOT / "tests/spaces/tiny.yaml", data=pd.DataFrame({"t": [1]}), address="h:1"),
            "a table in memory is written to this machine's cache, which the nodes of the Ray cluster h:1 cannot read",
        ),
        (lambda: dptune.tune(REPO_ROOT / "tests/spaces/tiny.yaml", privacy__epsilons=[object()]), "privacy.epsilons"),
    ],
)
def test_bad_input_is_refused_before_any_compute(call, needle: str) -> None:  # noqa: ANN001
    started = time.monotonic()
    with pytest.raises(dptune.DptuneError) as refused:
        call()
    assert needle in str(refused.value) and time.monotonic() - started < 10


def test_spaces_in_python_mean_what_their_files_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dptune.search.api import search_options

    tiny = REPO_ROOT / "tests/spaces/tiny.yaml"
    from_file = dptune.load_space(tiny)
    assert isinstance(from_file.space, dptune.SearchSpace)
    monkeypatch.chdir(tmp_path)
    as_dict = search_options({"extends": str(tiny)}).load_space()
    as_object = search_options(from_file.space).load_space()
    assert as_dict.spec_hash == as_object.spec_hash == from_file.spec_hash
    assert search_options(tiny, overrides={"privacy.epsilons": [2]}).load_space().space.privacy.epsilons == [2]
    numpy_values = search_options(tiny, overrides={"privacy.epsilons": np.array([2.0, 4.0])}).load_space()
    assert numpy_values.space.privacy.epsilons == [2, 4]
    tracked = tmp_path / "tracked.yaml"
    tracked.write_text(f"extends: {tiny}\ntracking: {{mlflow: http://127.0.0.1:5000}}\n")
    loaded = dptune.load_space(tracked)  # its recorded text leaves tracking out: the values keep it
    assert search_options(loaded).load_space().space.tracking.mlflow == "http://127.0.0.1:5000"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert search_options(tiny, data="~/rows.csv").overrides["task.dataset.path"] == str(tmp_path / "rows.csv")


def test_the_plan_is_the_planners_table() -> None:
    table = dptune.plan(50_000, [1, 8], epochs=10)
    rows = plan_rows(50_000, [1, 8], 1e-5, 10)
    assert list(table.columns) == list(dptune.PlanRow.__dataclass_fields__)
    assert table.to_dict("records") == [row.__dict__ for row in rows]
    assert table.groupby("epsilon")["recommended"].sum().tolist() == [1, 1]
    assert dptune.plan(50_000, 8, epochs=10).equals(table[table["epsilon"] == 8].reset_index(drop=True))
    with pytest.raises(dptune.DptuneError, match="epochs"):
        dptune.plan(50_000, [1], epochs=0)


def test_the_public_api_is_its_all_and_import_is_light() -> None:
    assert sorted(dir(dptune)) == sorted(dptune.__all__)
    for name in dptune.__all__:
        assert getattr(dptune, name) is not None
        if name != "__version__":
            assert getattr(dptune, name).__doc__, name
    with pytest.raises(AttributeError):
        dptune.no_such_name  # noqa: B018
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, dptune; print(sorted({'torch', 'ray', 'pandas'} & set(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "[]"


def test_a_model_takes_every_kind_of_input_and_names_its_score_plainly(tmp_path: Path) -> None:
    """A head on 4-d embeddings (W = 4·I, b = 0: the softmax score of a one-hot row is e⁴/(e⁴ + 3)), fed
    as numpy, lists and pandas, polars and pyarrow tables and series; ``python -m dptune.predict`` without
    ``--column`` reads the model's input column and writes ``softmax_score``."""
    from dptune.predict import main
    from test_owner_evaluation import CLASSES, PAIRS, _model, _rows

    model = dptune.load_model(_model(tmp_path / "model", CLASSES))
    assert model.input_column == "embedding" and model.classes == CLASSES
    frame = _rows([CLASSES[truth] for truth, _ in PAIRS])
    expected = [CLASSES[chosen] for _, chosen in PAIRS]
    vectors = np.array(frame["embedding"].tolist(), dtype=np.float32)
    for inputs in (
        frame,
        pl.from_pandas(frame),
        pa.Table.from_pandas(frame),
        frame["embedding"],
        pl.Series(frame["embedding"].tolist()),
        vectors,
        vectors.tolist(),
    ):
        assert model.predict(inputs).tolist() == expected, type(inputs)
    score = np.exp(4) / (np.exp(4) + 3)
    scored = model.predict_frame(frame.set_index("ticket"))
    assert scored.index.equals(frame.set_index("ticket").index)
    np.testing.assert_allclose(scored["softmax_score"], score, rtol=1e-6)
    np.testing.assert_allclose(model.predict_proba(vectors).to_numpy().max(axis=1), score, rtol=1e-6)
    with pytest.raises(dptune.DptuneError, match="no column 'embedding'"):
        model.predict(frame.rename(columns={"embedding": "vector"}))
    with pytest.raises(dptune.DptuneError, match="no inputs"):
        model.predict([])
    with pytest.raises(dptune.DptuneError, match="pass rows, not one str"):
        model.predict("billing")
    rows, out = tmp_path / "rows.parquet", tmp_path / "labelled.parquet"
    frame.to_parquet(rows)
    main(["--model", str(model.folder), "--input", str(rows), "--output", str(out)])
    labelled = pd.read_parquet(out)
    assert list(labelled.columns) == [*frame.columns, "prediction", "softmax_score"]
    assert labelled["prediction"].tolist() == expected
    np.testing.assert_allclose(labelled["softmax_score"], score, rtol=1e-6)
