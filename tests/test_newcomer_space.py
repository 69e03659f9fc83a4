"""A newcomer's space: every message in the user's keys (no validator internals, "did you mean"), one rule
for relative paths (the space file's folder, as ``extends``; ``--set`` and mappings from the working
folder), an inherited ``max_tokens`` that does not break an embeddings dataset, and the ``sep`` key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pandas as pd
import pytest
import yaml
from pydantic import BaseModel

from conftest import REPO_ROOT
from dptune.contract import DatasetFile
from dptune.data import load_workload
from dptune.search.planning.cells import task_workload
from dptune.space import SearchSpace, SpaceError, load_space, parse_space

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"
DEFAULT = REPO_ROOT / "search_spaces/default.yaml"
#: What no message of a space may show: pydantic's union tags, its wording, its types and links.
INTERNALS = re.compile(
    r"function-(after|before|wrap|plain)|literal\[|constrained-|Input should|Value error|Assertion failed|\[type="
    r"|pydantic|For further information|input_value|input_type|[A-Z][a-z]+Spec\b|SearchSpace|model_type"
)


def _problems(data: dict[str, Any], where: Path) -> list[str]:
    """The message lines of validating the space ``data`` written to the file ``where`` (none: it is valid)."""
    where.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        load_space(where)
    except SpaceError as error:
        return str(error).splitlines()
    return []


@pytest.fixture
def valid(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Two valid spaces that hold every section between them: per-trial budgets (with a person unit, an own
    file, a scheduler and tracking) and a private selection on a subsample."""
    (tmp_path / "tickets.csv").write_text("text,label,user\na,x,1\nb,y,2\n")
    common: dict[str, Any] = {
        "name": "fuzz",
        "description": "every section",
        "task": {
            "dataset": {"path": "tickets.csv", "input_column": "text", "label_column": "label"},
            "backbone": "minilm",
            "peft": "head",
            "max_tokens": 64,
        },
        "epochs": [3],
        "clip_bound": {"low": 0.1, "high": 1.0},
        "batch_size": {"powers_of_two": {"min": 16, "max": 64}},
        "base_learning_rate": {"values": [0.01]},
        "coupling": {"rule": "sqrt", "reference_batch_size": 64},
        "training": {"optimizer": "adam", "diagnostics": False},
        "sampler": {"name": "random", "trials_per_cell": 4},
        "resources": {"cpus": 1, "gpu": 0},
        "seed": 0,
    }
    per_trial = {
        **common,
        "privacy": {"epsilons": [1, 8], "delta": 1e-5, "unit": {"column": "user", "max_rows": 4}},
        "scheduler": {"name": "asha", "grace_period": 1},
        "tracking": {"mlflow": "http://127.0.0.1:5000", "registered_model": "fuzz"},
    }
    private = {
        **common,
        "privacy": {"delta": 1e-5, "private_selection": {"epsilon": 8, "tuning_subsample": {"fraction": 0.5}}},
    }
    for data in (per_trial, private):
        assert _problems(data, tmp_path / "valid.yaml") == []
    return {"per_trial": per_trial, "private": private}


def _sections(
    data: dict[str, Any], model: type[BaseModel], at: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], type[BaseModel]]]:
    """Every section (a mapping) of ``data`` with the model that validates it, found through the models' fields."""
    found = [(at, model)]
    for name, info in model.model_fields.items():
        value = data.get(name)
        if not isinstance(value, dict):
            continue
        inner = _models(info.annotation) or _backbone_forms(name)
        for candidate in inner:
            if set(value) <= set(candidate.model_fields):
                found += _sections(value, candidate, (*at, name))
                break
    return found


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for argument in get_args(annotation) for m in _models(argument)]


def _backbone_forms(name: str) -> list[type[BaseModel]]:
    """The mappings ``task.backbone`` takes (its field is a name: its validator reads them)."""
    from dptune.space.spec import HfBackboneSpec, TimmBackboneSpec

    return [HfBackboneSpec, TimmBackboneSpec] if name == "backbone" else []


def _literals(annotation: Any) -> bool:
    return get_origin(annotation) is Literal or any(_literals(argument) for argument in get_args(annotation))


def _set(data: dict[str, Any], keys: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A deep copy of ``data`` with the key path ``keys`` set to ``value``."""
    copy = yaml.safe_load(yaml.safe_dump(data))
    node = copy
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return copy


def _typo(field: str) -> str:
    return field[:-1] if len(field) > 4 else field + "s"


def test_no_message_of_a_bad_space_shows_validator_internals_and_each_names_the_key_as_written(
    valid: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Unknown keys at every nesting level, a mapping, a list and an unknown name where each key of every
    section takes something else, and a value of no union's form: every line is plain, and one names the
    key as the user wrote it."""
    where, cases = tmp_path / "bad.yaml", 0
    for data in valid.values():
        for at, model in _sections(data, SearchSpace):
            section = data
            for key in at:
                section = section[key]
            for field, info in model.model_fields.items():
                if field not in section and not at:
                    continue
                dotted = ".".join((*at, field))
                bad = {
                    "unknown key": (
                        _set(data, (*at, _typo(field)), 1),
                        f"  - {'.'.join((*at, _typo(field)))}: unknown key; did you mean {field}?",
                    ),
                    "a list": (_set(data, (*at, field), [["x"]]), f"  - {dotted}"),
                    "a mapping": (
                        _set(data, (*at, field), {"x": 1})
                        if not isinstance(section.get(field), dict)
                        else _set(data, (*at, field), 5),
                        f"  - {dotted}",
                    ),
                }
                if _literals(info.annotation):
                    bad["an unknown name"] = (_set(data, (*at, field), "nonesuch"), f"  - {dotted}: ")
                for what, (space, expected) in bad.items():
                    lines = _problems(space, where)
                    cases += 1
                    assert lines and lines[0].startswith(f"{where}: invalid search space"), (what, dotted, lines)
                    assert any(line.startswith(expected) for line in lines), (what, dotted, expected, lines)
                    for line in lines:
                        assert not INTERNALS.search(line), (what, dotted, line)
                        if line.startswith("  - "):
                            key = line[4:].split(": ", 1)[0]
                            assert re.fullmatch(r"[a-z0-9_.]+|\(top level\)", key), (what, dotted, line)
    assert cases > 150


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"task.dataset": {"path": "x.csv", "input_colum": "text", "label_column": "label"}},
            "  - task.dataset.input_colum: unknown key; did you mean input_column?",
        ),
        ({"task.dataset": 5}, "  - task.dataset: expected a string or a mapping {format, input_column,"),
        ({"privacy.unit": "person"}, "  - privacy.unit: expected 'row' or a mapping {column, max_rows} (got 'person')"),
        (
            {"resources.configurations_per_trial": 0},
            "  - resources.configurations_per_trial: must be at least 1, or 'auto' (got 0)",
        ),
        (
            {"resources.configurations_per_trial": "many"},
            "  - resources.configurations_per_trial: expected 'auto' or a whole number (got 'many')",
        ),
        (
            {"task.backbone": {"hf": "x", "poling": "cls"}},
            "  - task.backbone.poling: unknown key; did you mean pooling?",
        ),
        ({"scheduler": 3}, "  - scheduler: expected a mapping {grace_period, name, reduction_factor} (got 3)"),
        ({"epoch": [3]}, "  - epoch: unknown key; did you mean epochs?"),
        ({"extend": "x.yaml"}, "  - extend: unknown key; did you mean extends?"),
        ({"seed": 1.5}, "  - seed: expected a whole number, not a fraction (got 1.5)"),
        (
            {"tracking.mlflow": "x"},
            "  - tracking.mlflow: expected the http:// or https:// URL of an MLflow tracking server",
        ),
        ({"sampler.zzz": 1}, "  - sampler.zzz: unknown key; allowed here: name, random_trial_count, trials_per_cell"),
    ],
)
def test_a_bad_key_is_told_in_the_users_words(
    overrides: dict[str, Any], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.csv").write_text("text,label\n")
    with pytest.raises(SpaceError) as error:
        load_space(TINY, overrides)
    lines = str(error.value).splitlines()
    assert any(line.startswith(expected) for line in lines), lines
    assert len(lines) == 2, lines  # one problem: a union's other forms are not told as problems of their own


@pytest.fixture
def digits_embeddings(tmp_path: Path) -> Path:
    """Real MNIST-5k digits (every 10th) as 784-long embeddings with int labels, in a Parquet file."""
    from dptune.data.sources import load_mnist5k

    raw = load_mnist5k()
    pixels = raw.inputs.reshape(len(raw.labels), -1)[::10].float().div(255).numpy()
    path = tmp_path / "digits.parquet"
    pd.DataFrame({"pixels": list(pixels), "digit": raw.labels[::10]}).to_parquet(path)
    return path


def test_an_embeddings_space_extending_default_ignores_its_max_tokens_with_one_note(
    digits_embeddings: Path, tmp_path: Path
) -> None:
    """default.yaml's ``max_tokens: 128`` is inherited, not written: with backbone none it is ignored (one
    note) and the workload builds; a max_tokens the user writes (in the file or by --set) is refused,
    naming the fix."""
    space = tmp_path / "digits.yaml"
    dataset = {"path": digits_embeddings.name, "input_column": "pixels", "label_column": "digit"}
    child = {"extends": str(DEFAULT), "name": "digits", "task": {"dataset": dataset, "backbone": "none"}}
    space.write_text(yaml.safe_dump(child))
    loaded = load_space(space)
    assert loaded.space.task.max_tokens is None
    assert len(loaded.notes) == 1 and "task.max_tokens: 128, inherited through extends" in loaded.notes[0]
    assert "ignored" in loaded.notes[0] and "backbone none reads no text" in loaded.notes[0]
    assert "max_tokens: null" in loaded.text  # the recorded space says what was validated
    workload = load_workload(task_workload(loaded.space, None, None))
    assert workload.modality == "features" and workload.num_classes == 10
    explicit = {**child, "task": {**child["task"], "max_tokens": 64}}
    space.write_text(yaml.safe_dump(explicit))
    with pytest.raises(
        SpaceError,
        match=r"task\.max_tokens: applies to a text backbone; backbone none reads no "
        r"text: set task\.max_tokens: null \(got 64\)",
    ):
        load_space(space)
    space.write_text(yaml.safe_dump(child))
    with pytest.raises(SpaceError, match=r"set task\.max_tokens: null"):
        load_space(space, {"task.max_tokens": 64})
    assert load_space(space, {"task.max_tokens": None}).notes == ()  # written: nothing to note


def test_relative_paths_are_taken_from_the_space_files_folder_and_overrides_from_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule for every path key: the folder of the file that writes it (as extends), wherever the command
    runs; ``--set`` from the working folder."""
    for folder in ("data", "spaces", "bases", "elsewhere", "elsewhere/data", "models/enc"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    for csv in ("data/t.csv", "data/test.csv", "elsewhere/data/t.csv", "bases/b.csv"):
        (tmp_path / csv).write_text("text,label\n")
    (tmp_path / "models/lite.safetensors").write_bytes(b"")
    dataset = {
        "path": "../data/t.csv",
        "test_path": "../data/test.csv",
        "input_column": "text",
        "label_column": "label",
    }
    (tmp_path / "spaces/own.yaml").write_text(
        yaml.safe_dump({"extends": str(TINY), "task": {"dataset": dataset, "backbone": {"hf": "../models/enc"}}})
    )
    monkeypatch.chdir(tmp_path / "elsewhere")  # holds a data/t.csv of its own, which must not be taken
    loaded = load_space(tmp_path / "spaces/own.yaml")
    own = loaded.space.task.dataset_file
    assert own == DatasetFile(str(tmp_path / "data/t.csv"), "text", "label", test_path=str(tmp_path / "data/test.csv"))
    assert loaded.space.task.backbone == f"hf:{tmp_path / 'models/enc'}"
    monkeypatch.chdir(tmp_path)
    assert load_space(tmp_path / "spaces/own.yaml").spec_hash == loaded.spec_hash  # the id: any folder
    for recorded_from in (tmp_path, tmp_path / "spaces"):  # the recorded text means the same anywhere (--resume)
        monkeypatch.chdir(recorded_from)
        assert parse_space(loaded.text, "the recorded space").spec_hash == loaded.spec_hash
    monkeypatch.chdir(tmp_path / "elsewhere")
    overridden = load_space(tmp_path / "spaces/own.yaml", {"task.dataset.path": "data/t.csv"})
    assert overridden.space.task.dataset_file.path == str(tmp_path / "elsewhere/data/t.csv")  # --set: from here
    (tmp_path / "bases/base.yaml").write_text(
        yaml.safe_dump(
            {
                "extends": str(TINY),
                "task": {"dataset": {"path": "b.csv", "input_column": "text", "label_column": "label"}},
            }
        )
    )
    (tmp_path / "spaces/child.yaml").write_text("extends: ../bases/base.yaml\nname: child\n")
    assert load_space(tmp_path / "spaces/child.yaml").space.task.dataset_file.path == str(tmp_path / "bases/b.csv")
    timm = {"timm": "tf_efficientnet_lite0", "weights": "../models/lite.safetensors"}
    (tmp_path / "spaces/timm.yaml").write_text(
        yaml.safe_dump({"extends": str(TINY), "task": {"backbone": timm, "max_tokens": None}})
    )
    named = load_space(tmp_path / "spaces/timm.yaml").space.task.backbone
    assert named == f"timm:tf_efficientnet_lite0:{tmp_path / 'models/lite.safetensors'}"
    (tmp_path / "spaces/base.yaml").write_text(TINY.read_text())
    moved = load_space(tmp_path / "spaces/child.yaml", {"extends": "../spaces/base.yaml"})  # --set: from here
    assert moved.space.name == "child" and moved.space.task.dataset == "20newsgroups"


def test_a_relative_path_that_does_not_exist_is_told_as_written_with_its_folder_and_the_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "spaces").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data/tickets.csv").write_text("text,label\n")
    dataset = {"path": "data/tickets.csv", "input_column": "text", "label_column": "label"}
    (tmp_path / "spaces/own.yaml").write_text(yaml.safe_dump({"extends": str(TINY), "task": {"dataset": dataset}}))
    monkeypatch.chdir(tmp_path)  # the old rule would find data/tickets.csv from here
    with pytest.raises(SpaceError) as error:
        load_space(tmp_path / "spaces/own.yaml")
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'spaces/own.yaml'}: task.dataset.path: 'data/tickets.csv' ")
    assert f"(relative to the folder of the space file own.yaml, {tmp_path / 'spaces'})" in message
    assert f"is {tmp_path / 'spaces/data/tickets.csv'}, which does not exist" in message
    assert message.endswith(
        "A relative path written in a space file is taken from that file's folder (as extends is); one given by "
        "--set or in a Python mapping, from the working folder."
    )
    with pytest.raises(SpaceError) as error:
        load_space(TINY, {"task.dataset": {**dataset, "path": "nowhere.csv"}})
    assert (
        f"task.dataset.path: 'nowhere.csv' (relative to the working folder {tmp_path}) is {tmp_path / 'nowhere.csv'}"
        in str(error.value)
    )


def test_the_shipped_own_data_space_reads_the_files_beside_its_folder_from_any_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``own_data.yaml`` names ``../data/``: the files ``python -m dptune.data.example data`` writes from
    the repository, wherever the search is then started."""
    import shutil

    shutil.copytree(REPO_ROOT / "search_spaces", tmp_path / "search_spaces")
    (tmp_path / "data").mkdir()
    for name in ("tickets.csv", "tickets_test.csv"):
        (tmp_path / "data" / name).write_text("text,label\n")
    monkeypatch.chdir(tmp_path / "search_spaces")
    own = load_space(tmp_path / "search_spaces/own_data.yaml").space.task.dataset_file
    assert own is not None and (own.path, own.test_path) == (
        str(tmp_path / "data/tickets.csv"),
        str(tmp_path / "data/tickets_test.csv"),
    )


def test_sep_is_a_key_of_a_delimited_file_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("t.csv", "t.parquet"):
        (tmp_path / name).write_text("")
    dataset = {"path": "t.csv", "input_column": "text", "label_column": "label"}
    assert load_space(TINY, {"task.dataset": {**dataset, "sep": ";"}}).space.task.dataset_file.sep == ";"
    plain = load_space(TINY, {"task.dataset": dataset})
    assert plain.space.task.dataset_file.sep is None and "sep" not in plain.space.model_dump()["task"]["dataset"]
    with pytest.raises(
        SpaceError, match=r"  - task.dataset: sep applies to csv and tsv files; this dataset is parquet"
    ):
        load_space(TINY, {"task.dataset": {**dataset, "path": "t.parquet", "format": "parquet", "sep": ";"}})
    with pytest.raises(SpaceError, match=r"  - task.dataset.sep: expected one character .* \(got ';;'\)"):
        load_space(TINY, {"task.dataset": {**dataset, "sep": ";;"}})
    pinned = {"path": "/data/tickets.csv", "input_column": "text", "label_column": "label"}
    assert load_space(TINY, {"task.dataset": pinned}).spec_hash == "3cb0888da7cba247"  # as before the key
