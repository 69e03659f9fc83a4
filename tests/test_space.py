"""Search-space files: shipped spaces load; bad specs fail with the file, the key and the rule."""

import shutil
from pathlib import Path

import pytest

from dptune.space import SpaceError, load_space, parse_override, parse_space, spec_differences

ROOT = Path(__file__).resolve().parent.parent
SPACES = sorted((ROOT / "search_spaces").glob("*.yaml"))
DEFAULT = (ROOT / "search_spaces" / "default.yaml").read_text()


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.name)
def test_shipped_spaces_load(path: Path, tmp_path: Path) -> None:
    shutil.copytree(ROOT / "search_spaces", tmp_path / "search_spaces")
    (tmp_path / "data").mkdir()  # own_data.yaml's files, which `python -m dptune.data.example data` writes
    for name in ("tickets.csv", "tickets_test.csv"):
        (tmp_path / "data" / name).write_text("text,label\n")
    loaded = load_space(tmp_path / "search_spaces" / path.name)
    # a space has at least one (ε, E) cell, or a total budget whose one cell the planner finds
    assert loaded.space.cells() or loaded.space.privacy.private_selection is not None
    assert len(loaded.spec_hash) == 16


def test_default_cells_are_the_product_of_budgets() -> None:
    space = load_space(ROOT / "search_spaces" / "default.yaml").space
    cells = [(c.epsilon, c.epochs) for c in space.cells()]
    assert cells == [(e, n) for e in sorted(space.privacy.epsilons) for n in sorted(space.epochs)]
    assert space.cells()[0].cell_id == f"eps={min(space.privacy.epsilons):g}|epochs={min(space.epochs)}"


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("low: 0.01", "lo: 0.01"), "clip_bound.lo: unknown key"),
        (("peft: head", "peft: prefix"), "task.peft: not allowed; expected 'head', 'film', 'lora' or 'full'"),
        (("epsilons: [1, 8]", "epsilons: [0, 8]"), "privacy.epsilons.0"),
        (("delta: 1.0e-5", "delta: 1.5"), "privacy.delta"),
        (("name: random", "name: cmaes"), "sampler.name: not allowed"),
        (("trials_per_cell: 40", "trials_per_cell: zero"), "sampler.trials_per_cell"),
        (("high: 10.0", "high: 0.001"), "must not exceed high"),
        (("epochs: [5, 20]", "epochs: []"), "epochs"),
        (("clipping: normalized", "clipping: per_layer"), "training.clipping"),
    ],
)
def test_bad_spec_names_file_key_and_rule(edit: tuple[str, str], expected: str) -> None:
    old, new = edit
    assert old in DEFAULT, f"default.yaml changed: {old!r} not found"
    with pytest.raises(SpaceError) as info:
        parse_space(DEFAULT.replace(old, new), "bad.yaml")
    message = str(info.value)
    assert message.startswith("bad.yaml: invalid search space")
    assert expected in message


def test_grid_sampler_needs_value_lists() -> None:
    text = DEFAULT.replace("name: random", "name: grid")
    with pytest.raises(SpaceError, match="sampler 'grid' needs clip_bound.values"):
        parse_space(text, "grid.yaml")


def test_missing_file_lists_shipped_spaces(tmp_path: Path) -> None:
    with pytest.raises(SpaceError, match="no such search-space file; shipped spaces: .*default.yaml"):
        load_space(tmp_path / "nope.yaml")


def test_not_a_mapping() -> None:
    with pytest.raises(SpaceError, match="must be a YAML mapping"):
        parse_space("- 1\n- 2\n", "list.yaml")


def test_overrides_are_validated_and_hashed() -> None:
    loaded = parse_space(DEFAULT, "d.yaml", {"privacy.epsilons": [2], "sampler.trials_per_cell": 3})
    assert loaded.space.privacy.epsilons == [2]
    assert loaded.space.sampler.trials_per_cell == 3
    assert loaded.spec_hash != parse_space(DEFAULT, "d.yaml").spec_hash
    with pytest.raises(SpaceError, match="privacy.epsilons.0"):
        parse_space(DEFAULT, "d.yaml", {"privacy.epsilons": [-1]})


def test_batch_size_candidates_drop_values_above_n() -> None:
    space = parse_space(DEFAULT, "d.yaml").space
    assert space.batch_size.candidates(100) == [32, 64]
    pow2 = parse_space(
        DEFAULT.replace(
            "values: [32, 64, 128, 256, 512, 1024, 2048]", "powers_of_two: {min: 16, max: 64, full_batch: true}"
        ),
        "p.yaml",
    ).space
    assert pow2.batch_size.candidates(100) == [16, 32, 64, 100]


def test_extends_deep_merges_the_base(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(DEFAULT)
    (tmp_path / "child.yaml").write_text(
        "extends: base.yaml\nname: child\ntask: {fraction: 0.5}\nprivacy: {epsilons: [2]}\n"
    )
    loaded = load_space(tmp_path / "child.yaml")
    assert loaded.space.name == "child"
    assert (loaded.space.task.fraction, loaded.space.task.dataset) == (0.5, "20newsgroups")  # merged, not replaced
    assert loaded.space.privacy.epsilons == [2] and loaded.space.privacy.delta == 1e-5
    assert "extends" not in loaded.text and "fraction: 0.5" in loaded.text  # the hash covers the resolved spec


def test_extends_cycle_and_missing_base_are_reported(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(SpaceError, match="is a cycle"):
        load_space(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: gone.yaml\n")
    with pytest.raises(SpaceError, match="c.yaml: extends: 'gone.yaml' is no such file"):
        load_space(tmp_path / "c.yaml")


def test_paper_spaces_are_the_papers_grid() -> None:
    for path in SPACES:
        if path.name.startswith("paper_") and path.name != "paper_grid.yaml":
            space = load_space(path).space
            assert space.privacy.epsilons == [1, 2, 4, 8] and space.privacy.delta == 1e-5
            assert space.sampler.name == "grid" and space.coupling.rule == "sqrt"


def test_duplicate_keys_tags_and_alias_bombs_are_refused_with_the_line() -> None:
    with pytest.raises(
        SpaceError,
        match=r"dup.yaml: not valid YAML: line 3, column 1: key 'seed' is given twice "
        r"\(first on line 1\)",
    ):
        parse_space("seed: 1\nname: x\nseed: 2\n", "dup.yaml")
    with pytest.raises(SpaceError, match=r"tag.yaml: line 1: YAML tag '!env' is not allowed"):
        parse_space("seed: !env HOME\n", "tag.yaml")
    nested = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"b{i}: &b{i} [{', '.join(['*' + ('a' if i == 0 else f'b{i - 1}')] * 10)}]\n" for i in range(4)
    )
    with pytest.raises(SpaceError, match="bomb.yaml: expands to more than 10000 YAML nodes"):
        parse_space(nested, "bomb.yaml")


def test_overrides_that_do_not_fit_name_the_flag() -> None:
    with pytest.raises(SpaceError, match=r"--set 'seed.x': seed is a value \(0\), not a section"):
        parse_space(DEFAULT, "default.yaml", {"seed": 0, "seed.x": 1})
    with pytest.raises(SpaceError, match=r"--set 'a..b': a key is dot-separated names"):
        parse_space(DEFAULT, "default.yaml", {"a..b": 1})
    with pytest.raises(SpaceError, match=r"--set 'epochs': not valid YAML: line 1, column 3: expected ',' or ']'"):
        parse_override("epochs", "[1")


def test_spec_differences_name_every_changed_key() -> None:
    changed = DEFAULT.replace("epsilons: [1, 8]", "epsilons: [1]")
    assert spec_differences(DEFAULT, changed) == ["privacy.epsilons: [1, 8] → [1]"]
    assert spec_differences(DEFAULT, DEFAULT + "\n# a comment\n") == []


def test_batch_sizes_above_n_are_reported_apart() -> None:
    space = parse_space(DEFAULT, "default.yaml", {"batch_size": {"values": [16, 64, 4096]}}).space
    assert (space.batch_size.candidates(1000), space.batch_size.oversized(1000)) == ([16, 64], [4096])


PRIVATE = ROOT / "search_spaces" / "private.yaml"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"privacy.epsilons": [1.0]}, "give exactly one of epsilons"),
        ({"privacy.private_selection": None, "privacy.epsilons": None}, "give exactly one of epsilons"),
        ({"epochs": [5, 10]}, "epochs must hold one epoch budget"),
        ({"training.compare_auto_s": True}, "training.compare_auto_s must be false"),
        (
            {"sampler.name": "grid", "clip_bound": {"values": [1.0]}, "base_learning_rate": {"values": [0.01]}},
            "sampler.name 'grid' must be 'random'",
        ),
        ({"sampler.trials_per_cell": 1}, "sampler.trials_per_cell must be ≥ 2"),
        ({"privacy.private_selection.score_noise_multiplier": 0}, "score_noise_multiplier"),
    ],
)
def test_private_selection_refuses_what_voids_its_bound(overrides: dict, expected: str) -> None:
    with pytest.raises(SpaceError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_space(PRIVATE, overrides)


def test_private_space_has_no_per_trial_cells_and_secret_coins() -> None:
    space = load_space(PRIVATE).space
    assert space.cells() == [] and space.privacy.epsilons is None
    assert not space.reproducible and space.sampler.name == "random" and space.scheduler is None
    assert load_space(ROOT / "search_spaces" / "default.yaml").space.reproducible is False
