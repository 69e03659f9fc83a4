"""Searches whose privacy unit is a person, end to end on the embedded Ray: a CSV of real 20 Newsgroups
posts cut into rows (one person per post, 1 to 50 rows each) tuned per cell, by private selection and by
subsample tuning; each prints its person-level (ε, δ) and N_people, hands back a model whose card states
the unit, and ``dptune.predict`` labels rows with it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import ONE_CELL, REPO_ROOT
from dptune.records import read_table
from expected import pld_epsilon
from hidden_runs import assert_nothing_of_the_hidden_runs_outside, private_search
from people_data import newsgroup_people


@pytest.fixture(scope="module")
def people_csv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CSV: texts, string labels and a ``user`` column (heavy-tailed rows per person)."""
    path = tmp_path_factory.mktemp("people") / "posts.csv"
    newsgroup_people(40).to_csv(path, index=False)
    return path


def _flags(csv: Path, *extra: str) -> list[str]:
    dataset = {"path": str(csv), "input_column": "text", "label_column": "label"}
    settings = {
        "task.dataset": json.dumps(dataset),
        "privacy.unit": json.dumps({"column": "user", "max_rows": 8}),
        "batch_size": json.dumps({"values": [8, 16]}),
        "epochs": "[3]",
        "min_steps": "5",
    }
    flags = [part for name, value in settings.items() for part in ("--set", f"{name}={value}")]
    return flags + list(extra)


def _search(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    completed = subprocess.run(
        [sys.executable, "-m", "dptune.search", "--no-report", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed


def _people(stdout: str) -> int:
    (count,) = {int(n) for n in re.findall(r"N_people = (\d+)", stdout)}
    return count


def _card_and_predict(model: Path, csv: Path, tmp_path: Path, people: int) -> None:
    card = json.loads((model / "model_card.json").read_text())
    said = card["privacy"]["search_guarantee"]
    assert "The privacy unit is a person" in said and "'user'" in said and f"{people} people" in said
    assert "The privacy unit is a person" in (model / "model_card.md").read_text()
    labelled = tmp_path / f"{model.name}.jsonl"
    argv = ["--model", str(model), "--input", str(csv), "--column", "text", "--output", str(labelled)]
    done = subprocess.run([sys.executable, "-m", "dptune.predict", *argv], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    predicted = pd.read_json(labelled, lines=True)
    assert len(predicted) == len(pd.read_csv(csv)) and set(predicted["prediction"]) <= set(card["data"]["class_names"])


def test_a_per_cell_search_of_people_prints_person_level_epsilon_and_hands_back_its_models(
    search_env: dict[str, str], people_csv: Path, tmp_path: Path
) -> None:
    flags = _flags(people_csv, *ONE_CELL)
    done = _search(search_env, "--space", str(REPO_ROOT / "tests/spaces/tiny.yaml"), "--storage", str(tmp_path), *flags)
    out = " ".join(done.stdout.split())
    people = _people(done.stdout)
    trials = read_table(str(tmp_path / "tiny"), "trials")
    assert 20 < people == trials["num_train"].iloc[0]  # N is people (fewer than their rows: test_people.py)
    assert set(trials["status"]) == {"ok"} and (trials["epsilon_spent"] <= 8).all()
    # q = B/N_people: every run's sample rate counts people
    assert sorted(set((trials["sample_rate"] * people).round(6))) == [8.0, 16.0]
    search_rows = read_table(str(tmp_path / "tiny"), "search")
    (search,) = set(search_rows["guarantee"])
    assert "The privacy unit is a person" in search and f"{people} people" in search and search in out
    # independently: dp_accounting's PLD of each run's sampled Gaussian at q = B/N_people (B and N_people
    # as planned and printed, not as recorded) meets the per-run ε, and their composition is the search's
    ran = trials[trials["steps_taken"] > 0]
    mechanisms = [(r.noise_multiplier, r.batch_size / people, r.steps) for r in ran.itertuples()]
    for mechanism in mechanisms:
        assert 7 < pld_epsilon([mechanism], 1e-5) <= 8 * 1.01
    assert search_rows["epsilon_search"].iloc[0] == pytest.approx(pld_epsilon(mechanisms, 1e-5), rel=1e-6)
    models = sorted((tmp_path / "tiny" / "models").iterdir())
    assert models
    _card_and_predict(models[0], people_csv, tmp_path, people)


@pytest.mark.parametrize("space", ["private.yaml", "private_subsample.yaml"])
def test_private_searches_of_people_release_one_person_level_model(
    search_env: dict[str, str], people_csv: Path, tmp_path: Path, space: str
) -> None:
    flags = _flags(people_csv, "--set", "sampler.trials_per_cell=3")
    name = space.removesuffix(".yaml")
    done = private_search(search_env, tmp_path, REPO_ROOT / "search_spaces" / space, name, *flags)
    people = _people(done.stdout)
    root = tmp_path / name
    (release,) = read_table(str(root), "release").itertuples()
    assert release.epsilon_total == 8 and "The privacy unit is a person" in release.guarantee
    assert f"{people} people" in release.guarantee
    if space == "private_subsample.yaml":
        assert "keeps each training and validation person (with all their rows)" in release.guarantee
    assert_nothing_of_the_hidden_runs_outside(
        root, done.stdout, (tmp_path / f"{name}-tmp").resolve(), os.cpu_count() or 1
    )
    (model,) = (root / "models").iterdir()
    _card_and_predict(model, people_csv, tmp_path, people)
