"""The command line as a newcomer meets it (issue 53): ``--dry-run`` plans from row counts and encodes
nothing, saying what the search would encode; every ``--help`` is plain text; ``plan --help`` states the
bounds its checks use; the model card's JSON fields have their JSON types."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import REPO_ROOT, TINY_EVAL_EXAMPLES, TINY_TRAIN_EXAMPLES, SearchRun
from dptune import search
from dptune.data.encoding_plan import REFERENCE_ROWS_PER_S, _duration
from dptune.data.example import write_example
from dptune.data.features import candidate_precisions, choose_precision, encoding_device
from dptune.data.workload import load_workload
from dptune.plan import main as plan_main
from dptune.privacy import MAX_EPSILON, MIN_EPSILON
from dptune.records import read_table
from dptune.records.weights import CARD_JSON, read_weights, write_weights
from dptune.search.finish.publish import publish_search_models
from dptune.search.modes import mode_of
from dptune.search.planning.cells import task_workload
from dptune.space import load_space

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"
DEFAULT = REPO_ROOT / "search_spaces/default.yaml"
#: Rows of 20 Newsgroups (training and test split): what the default space would encode.
NEWSGROUPS_ROWS = 18_821
#: A dry run's whole wall time (s) in this process: data loaded, split and planned, nothing encoded. (An
#: encoding of the default's 18,821 documents took minutes on the 2-core machine of these tests.)
DRY_RUN_SECONDS = 60


def _dry_run(capsys: pytest.CaptureFixture, *args: str) -> tuple[str, float]:
    """``python -m dptune.search ... --dry-run`` in this process: its stdout and wall time (s)."""
    start = time.monotonic()
    search.main([*args, "--dry-run"])
    return capsys.readouterr().out, time.monotonic() - start


def _cache_files(cache: Path) -> list[Path]:
    """The files of the feature cache and of the encoding precision's records under ``cache``."""
    return [path for part in ("features", "precision") for path in (cache / part).rglob("*") if path.is_file()]


def _plan_block(printed: str) -> str:
    """The plan a search prints: from its ``search '<name>' from`` line through its ``total:`` line."""
    match = re.search(r"^search '.*?^total: [^\n]*$", printed, re.MULTILINE | re.DOTALL)
    assert match, printed
    return match.group(0)


@pytest.fixture
def cold_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``DPTUNE_CACHE_DIR`` pointed at an empty folder: no features, no recorded encoding precision."""
    cache = tmp_path / "cold-cache"
    cache.mkdir()
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(cache))
    monkeypatch.delenv("DPTUNE_ENCODE_PRECISION", raising=False)
    return cache


# --------------------------------------------------------------------------- --dry-run


def test_a_dry_run_of_the_default_space_encodes_nothing_and_says_what_it_would(
    capsys: pytest.CaptureFixture, tmp_path: Path, cold_cache: Path
) -> None:
    out, seconds = _dry_run(capsys, "--space", str(DEFAULT), "--storage", str(tmp_path / "results"))
    assert _cache_files(cold_cache) == [] and seconds < DRY_RUN_SECONDS
    assert (
        f"dry run: features: not cached; the search would encode {NEWSGROUPS_ROWS:,} rows of 20newsgroups by "
        "minilm (max_tokens 128) on the cpu, precision chosen on first use by timing" in out
    )
    slowest, fastest = REFERENCE_ROWS_PER_S["minilm"]  # no speed recorded here: the reference machines' range
    assert (
        f"roughly {_duration(NEWSGROUPS_ROWS / fastest)} to {_duration(NEWSGROUPS_ROWS / slowest)}: no encoding "
        "speed is recorded on this machine, and minilm encoded 16–125 rows/s on 2-core reference machines" in out
    )
    assert "total: 160 configurations × 2 replicates = 320 trials in 4 cell runs" in out
    assert not (tmp_path / "results").exists()


def test_a_dry_run_estimates_the_encoding_from_the_speed_this_machine_recorded(
    capsys: pytest.CaptureFixture, tmp_path: Path, cold_cache: Path
) -> None:
    """Where this machine has recorded the encoding's speed for the backbone, the dry run estimates the time
    from it: the rows to encode over the recorded rows per second. The record is written by the function
    that times the precisions on first use, here of a stand-in encoder (timing MiniLM would take a minute)."""
    device = encoding_device()
    candidates = candidate_precisions(device, "text")
    choice = choose_precision(device, "minilm", lambda precision: np.ones((32, 384), np.float32), 32, candidates)
    out, _ = _dry_run(capsys, "--space", str(DEFAULT), "--storage", str(tmp_path / "results"))
    speed = choice.rows_per_s[choice.precision]
    seconds = NEWSGROUPS_ROWS / speed
    shown = f"{max(seconds, 1):.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
    assert (
        f"in {choice.precision} (this machine's recorded choice); about {shown} at {speed:,.0f} rows/s, the speed "
        "this machine measured on 32 probe rows when it chose the precision (loading the model not included)" in out
    )
    assert [path.parent.name for path in _cache_files(cold_cache)] == ["precision"]  # the record written above


def test_the_dry_runs_plan_is_the_real_runs_plan(
    capsys: pytest.CaptureFixture,
    tmp_path: Path,
    cold_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    tiny_search: SearchRun,
    test_cache_dir: Path,
) -> None:
    """The tiny search's plan (N, and per cell and B its T and σ), planned from row counts on a cold cache,
    is the one its real run printed after encoding; once its features are cached, the dry run says so."""
    caps = ("--max-train-examples", str(TINY_TRAIN_EXAMPLES), "--max-eval-examples", str(TINY_EVAL_EXAMPLES))
    out, _ = _dry_run(capsys, "--space", str(TINY), "--storage", str(tmp_path), *caps)
    assert _cache_files(cold_cache) == []
    assert f"N_train = {TINY_TRAIN_EXAMPLES}" in out
    assert _plan_block(out) == _plan_block(tiny_search.stdout)
    rows = TINY_TRAIN_EXAMPLES + 2 * TINY_EVAL_EXAMPLES
    assert f"the search would encode {rows:,} rows of 20newsgroups by minilm (max_tokens 64)" in out
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(test_cache_dir))
    warm, _ = _dry_run(capsys, "--space", str(TINY), "--storage", str(tmp_path), *caps)
    assert re.search(rf"dry run: features: cached \((\S+)\), nothing to encode: {rows:,} rows of 20newsgroups", warm)


def _people_space(folder: Path) -> Path:
    """A per-cell search of a data owner's CSV (the example's tickets) whose privacy unit is a person: each
    ticket's ``customer``, 700 customers with their tickets spread over the file."""
    train, _ = write_example(str(folder))
    tickets = pd.read_csv(train)
    tickets["customer"] = [f"c{row * 7919 % 700}" for row in range(len(tickets))]
    tickets.to_csv(train, index=False)
    space = folder / "people.yaml"
    space.write_text(
        f"extends: {DEFAULT}\n"
        "name: people\n"
        f"task:\n  dataset: {{path: {train}, input_column: text, label_column: label}}\n"
        "privacy:\n  epsilons: [8]\n  unit: {column: customer, max_rows: 4}\n"
        "epochs: [5]\nbatch_size:\n  values: [8, 16]\nsampler:\n  trials_per_cell: 2\n"
        "training:\n  diagnostics: false\n"
    )
    return space


def test_a_dry_run_counts_a_data_owners_people_as_the_real_workload_does(
    capsys: pytest.CaptureFixture, tmp_path: Path, cold_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file dataset with a person unit: the dry run (cold cache, nothing encoded) plans N_people, and every
    split's people, as the workload the real run encodes has them; its printed plan is that workload's."""
    space_path = _people_space(tmp_path)
    caps = ("--max-train-examples", "120", "--max-eval-examples", "60")
    out, _ = _dry_run(capsys, "--space", str(space_path), "--storage", str(tmp_path / "results"), *caps)
    assert _cache_files(cold_cache) == []
    from dptune.data.workload import planned_workload  # what the dry run planned from

    loaded = load_space(space_path, {})
    spec = task_workload(loaded.space, 120, 60)
    planned, encoding = planned_workload(spec)
    assert encoding is not None and encoding.cached is None and encoding.dataset.endswith("tickets.csv")
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(tmp_path / "warm-cache"))
    monkeypatch.setenv("DPTUNE_ENCODE_PRECISION", "fp32")  # one precision: nothing timed
    real = load_workload(spec)
    assert real.people is not None and planned.people is not None
    for split in ("train", "val", "test"):
        assert planned.units(split) == real.units(split) > 0
        assert np.array_equal(getattr(planned.people, split), getattr(real.people, split))
        assert torch.equal(planned.labels(split), real.labels(split))
    assert planned.train.tensors[0].device.type == "meta" and real.train.tensors[0].device.type == "cpu"
    assert encoding.rows == len(real.train) + len(real.val) + len(real.test)
    assert f"N_people = {real.num_units} (B counts people)" in out
    mode = mode_of(loaded.space)
    assert mode.format_plan(loaded, mode.plan(loaded.space, real.num_units)) in out


# --------------------------------------------------------------------------- --help


@pytest.mark.parametrize(
    "module", ["dptune.search", "dptune.plan", "dptune.report", "dptune.data.example", "dptune.predict"]
)
def test_every_commands_help_is_plain_text(module: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).main(["--help"])
    assert info.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"usage: python -m {module} ")
    assert "``" not in shown, shown
    assert not re.search(r":(mod|func|class|meth|attr|data|obj|exc):`", shown), shown


def test_plan_help_states_the_bounds_its_check_refuses_outside(capsys: pytest.CaptureFixture, cold_cache: Path) -> None:
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    bounds = re.search(r"--eps EPS \[EPS \.\.\.\] .*?each in \[([\d.]+), ([\d.]+)\]", shown)
    assert bounds, shown
    low, high = map(float, bounds.groups())
    assert (low, high) == (MIN_EPSILON, MAX_EPSILON)
    flags = ["--n", "1000", "--epochs", "1", "--batch-sizes", "50"]
    plan_main([*flags, "--eps", str(low), str(high)])
    assert "ε = 0.05" in capsys.readouterr().out
    for outside in (low * 0.99, high * 1.01):
        with pytest.raises(SystemExit) as info:
            plan_main([*flags, "--eps", str(outside)])
        assert info.value.code == 2
        assert f"must be one or more values in [{low:g}, {high:g}]" in capsys.readouterr().err


# --------------------------------------------------------------------------- the model card's JSON types

#: Every field of a model card of the tiny search (a registry dataset on MiniLM features), by its path, with
#: the JSON types it may have.
CARD_TYPES: dict[str, tuple[type, ...]] = {
    "dptune_version": (str,),
    "peft": (str,),
    "logits": (str,),
    "model.cell_id": (str,),
    "model.clipping": (str,),
    "model.trial_id": (str,),
    "data.dataset": (str,),
    "data.class_names": (list,),
    "data.data_sha256": (str,),
    "data.backbone": (str,),
    "data.max_tokens": (int,),
    "data.pooling": (str,),
    "data.precision": (str,),
    "data.weights_sha256": (str,),
    "data.privacy_unit": (str,),
    "data.notes": (str,),
    "parameters.weight": (list,),
    "parameters.bias": (list,),
    "configuration.clip_bound": (float, type(None)),  # AUTO-S has no clip bound
    "configuration.batch_size": (int,),
    "configuration.base_learning_rate": (float,),
    "configuration.learning_rate": (float,),
    "configuration.reference_batch_size": (int,),
    "configuration.epochs": (int,),
    "configuration.optimizer": (str,),
    "configuration.clipping": (str,),
    "configuration.noise_multiplier": (float,),
    "configuration.sample_rate": (float,),
    "configuration.steps": (int,),
    "privacy.epsilon": (float,),
    "privacy.delta": (float,),
    "privacy.covers": (str,),
    "privacy.search_guarantee": (str,),
    "accuracy.val_accuracy": (float,),
    "accuracy.val_interval": (list,),
    "accuracy.num_val": (int,),
    "accuracy.test_accuracy": (float,),
    "accuracy.test_interval": (list,),
    "accuracy.num_test": (int,),
    "accuracy.configuration_val_mean": (float,),
    "accuracy.configuration_val_interval": (list,),
    "accuracy.configuration_test_mean": (float,),
    "accuracy.configuration_test_interval": (list,),
    "accuracy.configuration_interval_source": (str,),
    "accuracy.configuration_replicates": (int,),
}


def _fields(card: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``card``'s fields by dotted path (a section's fields, not the section)."""
    fields = {}
    for name, value in card.items():
        if isinstance(value, dict):
            fields.update(_fields(value, f"{prefix}{name}."))
        else:
            fields[f"{prefix}{name}"] = value
    return fields


def test_every_field_of_a_model_card_has_its_json_type(tiny_search: SearchRun) -> None:
    cards = sorted((tiny_search.root / "models").glob(f"*/{CARD_JSON}"))
    assert len(cards) == 4
    for path in cards:
        fields = _fields(json.loads(path.read_text()))
        assert fields.keys() == CARD_TYPES.keys(), path
        wrong = {name: value for name, value in fields.items() if type(value) not in CARD_TYPES[name]}
        assert not wrong, f"{path}: {wrong}"
        assert fields["data.max_tokens"] == 64  # tests/spaces/tiny.yaml's, as the features were encoded
        assert all(type(n) is int for n in fields["parameters.weight"] + fields["parameters.bias"])
        intervals = ("val_interval", "test_interval", "configuration_val_interval", "configuration_test_interval")
        assert all(type(x) is float for name in intervals for x in fields[f"accuracy.{name}"])
        assert all(type(name) is str for name in fields["data.class_names"])


def test_a_card_says_max_tokens_null_where_the_model_file_says_none(tiny_search: SearchRun, tmp_path: Path) -> None:
    """An image backbone's features record ``max_tokens`` as the string ``"None"`` in the model file's
    header (str → str); the card publishes null. The tiny search's results are copied, each published
    run's weights re-saved with that provenance, and its models published again."""
    root = tmp_path / "tiny"
    shutil.copytree(tiny_search.root, root)
    shutil.rmtree(root / "models")
    rows = read_table(str(root), "search").to_dict("records")
    for path in sorted((tiny_search.root / "models").glob(f"*/{CARD_JSON}")):
        trial_id = json.loads(path.read_text())["model"]["trial_id"]
        trained = read_weights(str(root), trial_id)
        assert trained is not None and trained.provenance["max_tokens"] == "64"
        write_weights(str(root), trial_id, replace(trained, provenance={**trained.provenance, "max_tokens": "None"}))
    folders = publish_search_models(str(root), str(root), rows, adaptive=False)
    assert len(folders) == 4
    for folder in folders:
        card = json.loads((Path(folder) / CARD_JSON).read_text())
        assert card["data"]["max_tokens"] is None
