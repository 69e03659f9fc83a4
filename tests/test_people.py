"""The privacy unit as a person: the space's ``privacy.unit``, a file's person column read and refused
before any compute, splits that keep people whole, the person-level selection count, group privacy and
the statement's words. The training of people is tested with the runners (test_person_engines.py,
test_person_fused.py); searches end to end in test_people_search.py."""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import REPO_ROOT
from dptune.contract import DatasetFile, PersonUnit, WorkloadSpec
from dptune.data import load_workload
from dptune.data.spec import WorkloadError
from dptune.data.workload import check_spec
from dptune.privacy.checks import group_privacy
from dptune.runners.common import PersonScore
from dptune.search.finish.statement import statement_of_cells, statement_of_unit
from dptune.space import SpaceError, load_space
from people_data import GROUPS, MAX_ROWS, newsgroup_people

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"


def _embedded(frame: pd.DataFrame, dim: int = 6) -> pd.DataFrame:
    """``frame`` with its texts replaced by a small embedding (cheap to train on with backbone none): a
    hash of the row's words, so rows keep their own content."""
    vectors = [
        np.random.default_rng(list(hashlib.sha256(text.encode()).digest())).normal(size=dim).astype(np.float32)
        for text in frame["text"]
    ]
    return frame.drop(columns="text").assign(vector=vectors)


@pytest.fixture(scope="module")
def people_frame() -> pd.DataFrame:
    """Real 20 Newsgroups posts cut into rows, one person per post (heavy-tailed: 1 to 50 rows)."""
    return newsgroup_people(30)


def _spec(path: Path, column: str = "user", **file: object) -> WorkloadSpec:
    source = DatasetFile(path=str(path), input_column="vector", label_column="label", **file)  # type: ignore[arg-type]
    return WorkloadSpec(
        dataset=source.display_name, backbone="none", peft="head", dataset_file=source, person_unit=PersonUnit(column)
    )


def test_splits_keep_every_person_whole_and_count_people(people_frame: pd.DataFrame, tmp_path: Path) -> None:
    path = tmp_path / "people.parquet"
    _embedded(people_frame).to_parquet(path)
    workload = load_workload(_spec(path))
    people = workload.people
    assert people is not None and people.column == "user"
    sizes = people_frame.groupby("user").size()
    assert sizes.max() == MAX_ROWS and sizes.min() == 1  # heavy-tailed: the test data is what it claims
    # every row of a person is in one split: the people of the three splits add up to the file's
    counts = [people.count(split) for split in ("train", "val", "test")]
    assert sum(counts) == len(sizes) and min(counts) > 0
    assert len(workload.train) + len(workload.val) + len(workload.test) == len(people_frame)
    assert workload.num_units == counts[0] < len(workload.train)  # N is people, not rows
    for split in ("train", "val", "test"):  # dense indices, every index used
        index = getattr(people, split)
        assert set(np.unique(index)) == set(range(people.count(split)))
    # which split a person lands in depends on that person alone: another person's removal moves nobody
    fewer = people_frame[people_frame["user"] != people_frame["user"].iloc[0]]
    _embedded(fewer).to_parquet(tmp_path / "fewer.parquet")
    again = load_workload(_spec(tmp_path / "fewer.parquet"))
    assert again.people is not None
    assert again.num_units + again.people.count("val") + again.people.count("test") == len(sizes) - 1
    assert abs(again.num_units - workload.num_units) + abs(again.people.count("val") - counts[1]) <= 1


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing column", "privacy.unit.column 'customer' is not a column of"),
        ("empty id", "row 3 has no 'user' (an empty or missing id)"),
        ("missing id", "row 5 has no 'user'"),
        ("float ids", "holds double; a person's id is an int or a string"),
        ("one person per class", "held by fewer than 2 people"),
        ("registry dataset", "the registry dataset 'mnist5k' has rows only"),
        ("person in both files", "people of privacy.unit.column 'user' also have rows in the training file"),
        ("examples per class", "examples_per_class counts rows"),
    ],
)
def test_a_bad_person_column_is_refused_in_about_a_second_naming_it(
    people_frame: pd.DataFrame, tmp_path: Path, case: str, message: str
) -> None:
    frame = _embedded(people_frame)
    spec = _spec(tmp_path / "bad.parquet", column="customer" if case == "missing column" else "user")
    if case == "empty id":
        frame.loc[3, "user"] = "  "
    elif case == "missing id":
        frame.loc[5, "user"] = None
    elif case == "float ids":
        frame["user"] = np.arange(len(frame), dtype=np.float64)
    elif case == "one person per class":
        lonely = frame.iloc[:2].assign(label="lonely", user="only-one")
        frame = pd.concat([frame, lonely], ignore_index=True)
    elif case == "registry dataset":
        spec = WorkloadSpec(dataset="mnist5k", backbone="none", peft="head", person_unit=PersonUnit("user"))
    elif case == "person in both files":
        frame.iloc[-5:].to_parquet(tmp_path / "test.parquet")  # the last person's rows, also in the training file
        spec = _spec(tmp_path / "bad.parquet", test_path=str(tmp_path / "test.parquet"))
    elif case == "examples per class":
        spec = replace(spec, examples_per_class=3)
    frame.to_parquet(tmp_path / "bad.parquet")
    start = time.perf_counter()
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_spec(spec)
    assert time.perf_counter() - start < 5


def test_the_space_takes_a_person_unit_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    dataset = {"path": str(tmp_path / "t.csv"), "input_column": "text", "label_column": "label"}
    rows_off = {"task.dataset": dataset, "training.diagnostics": False}  # diagnostics measure rows
    space = load_space(TINY, {**rows_off, "privacy.unit": {"column": "customer_id"}}).space
    assert space.privacy.person_unit == PersonUnit("customer_id", 16)  # the measured default
    capped = load_space(TINY, {**rows_off, "privacy.unit": {"column": "c", "max_rows": 4}}).space
    assert capped.privacy.person_unit == PersonUnit("c", 4)
    assert load_space(TINY, {}).space.privacy.person_unit is None  # row, the default
    with pytest.raises(SpaceError, match="max_rows_per_person_known goes with unit: row"):
        load_space(TINY, {"privacy.unit": {"column": "c"}, "privacy.max_rows_per_person_known": 5})
    with pytest.raises(SpaceError, match="unit"):
        load_space(TINY, {"privacy.unit": "people"})
    with pytest.raises(SpaceError, match="max_rows"):
        load_space(TINY, {"privacy.unit": {"column": "c", "max_rows": 0}})
    with pytest.raises(SpaceError, match="training.diagnostics must be false with privacy.unit a person"):
        load_space(TINY, {"task.dataset": dataset, "privacy.unit": {"column": "c"}})


def test_the_person_count_is_exact_and_moves_by_at_most_one_per_person() -> None:
    rng = np.random.default_rng(3)
    rows = rng.zipf(1.8, size=400).clip(max=60)
    people = np.repeat(np.arange(400), rows)
    correct = rng.random(len(people)) < 0.7
    score = PersonScore.of(correct, people)
    exact = sum(correct[people == u].mean() for u in range(400))
    assert score.people == 400 and score.count == math.floor(exact + 1e-9)
    assert score.accuracy == pytest.approx(exact / 400, rel=1e-12)  # each person weighs one
    for u in rng.choice(400, size=60, replace=False):  # add/remove one person: the count moves ≤ 1
        kept = people != u
        without = PersonScore.of(correct[kept], np.unique(people[kept], return_inverse=True)[1])
        assert 0 <= score.count - without.count <= 1 and without.people == 399
    # floors are exact: three people at 1/3 each sum to exactly 1, which float addition misses
    assert PersonScore.of(np.array([1, 0, 0] * 3, bool), np.repeat(np.arange(3), 3)).count == 1


def test_group_privacy_of_k_rows() -> None:
    assert group_privacy(1.0, 1e-5, 1) == (1.0, pytest.approx(1e-5))
    epsilon_k, delta_k = group_privacy(0.5, 1e-6, 4)
    assert epsilon_k == 2.0 and delta_k == pytest.approx(1e-6 * (1 + math.e**0.5 + math.e + math.e**1.5))
    assert delta_k <= 4 * math.exp(3 * 0.5) * 1e-6  # within the lemma's k·e^((k−1)ε)·δ
    assert group_privacy(8.0, 1e-5, 50)[1] >= 1  # nothing is left for a person with 50 rows at ε = 8


def test_the_statement_names_the_unit_the_people_and_what_rows_imply(tmp_path: Path) -> None:
    dataset = {"path": str(tmp_path / "t.csv"), "input_column": "text", "label_column": "label"}
    unit = {"column": "customer_id", "max_rows": None}
    people = load_space(TINY, {"task.dataset": dataset, "privacy.unit": unit, "training.diagnostics": False}).space
    text = statement_of_cells(people, official_test_split=False, num_units=1234)
    assert "The privacy unit is a person" in text and "'customer_id'" in text and "1234 people" in text
    assert "mean over all their rows" in text and "One row of" not in text
    rows = load_space(
        TINY, {"task.dataset": dataset, "privacy.epsilons": [1.0, 8.0], "privacy.max_rows_per_person_known": 3}
    ).space
    said = statement_of_unit(rows, 900)
    epsilon_k, delta_k = group_privacy(1.0, rows.privacy.delta, 3)
    assert "protected per row, not as a person" in said and "At most 3 rows".lower() in said.lower()
    assert f"row-level ε = 1 → ({epsilon_k:.3g}," in said and "row-level ε = 8 → no guarantee (δ_k ≥ 1)" in said
    assert statement_of_unit(load_space(TINY, {}).space, 900) == ""  # a registry dataset's rows: nothing to add
    assert set(GROUPS) == set(newsgroup_people(1)["label"])


def test_fraction_and_caps_keep_whole_people_each_by_its_own_hash(people_frame: pd.DataFrame, tmp_path: Path) -> None:
    path = tmp_path / "people.parquet"
    frame = _embedded(people_frame)
    frame.to_parquet(path)
    owner = {np.asarray(v, np.float32).tobytes(): user for v, user in zip(frame["vector"], frame["user"], strict=True)}

    def users(split: object) -> pd.Series:  # the user of each row of a split, found by its vector
        features = split.tensors[0].numpy()  # type: ignore[attr-defined]
        return pd.Series([owner[row.tobytes()] for row in features])

    full = load_workload(_spec(path))
    half = load_workload(replace(_spec(path), fraction=0.5, max_eval_examples=40))
    assert 0 < half.num_units < full.num_units and 0 < len(half.val) < len(full.val)
    # every kept person keeps all their rows of the split: their row counts are those of the full split
    for kept, whole in ((half.train, full.train), (half.val, full.val)):
        counts, all_counts = users(kept).value_counts(), users(whole).value_counts()
        assert (counts == all_counts[counts.index]).all()
