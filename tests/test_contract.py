"""The trial's contract module and the name registries: one source, no import cycles.

Import structure is read from the source files (``ast``), so a cycle or a stray import fails here
by name, without importing torch.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from dptune import contract
from dptune.contract import (
    CLIPPING_RULES,
    ENGINE_NAMES,
    OPTIMIZER_NAMES,
    PEFT_NAMES,
    DatasetFile,
    PersonUnit,
    TrialConfig,
    WorkloadSpec,
    check_registry,
)

PACKAGE = Path(contract.__file__).parent


def dptune_imports(module: str) -> set[str]:
    """The dptune modules ``module`` (dotted name) imports anywhere in its source, lazily or not."""
    path = PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {name for name in imported if name == "dptune" or name.startswith("dptune.")}


def test_contract_imports_nothing_from_dptune_and_errors_nothing_either() -> None:
    assert dptune_imports("dptune.contract") == set()
    assert dptune_imports("dptune.errors") == set()


def test_trial_and_its_implementation_do_not_import_each_other() -> None:
    assert "dptune.runners.trial" not in dptune_imports("dptune.runners.trainer")
    assert "dptune.runners.trial" not in dptune_imports("dptune.dp.diagnostics")
    assert "dptune.runners.trainer" in dptune_imports("dptune.runners.trial")  # the one direction: trial → trainer


def test_film_engine_does_not_import_the_opacus_engine() -> None:
    assert "dptune.dp.opacus_engine" not in dptune_imports("dptune.dp.film")


def test_engines_are_registered_by_contract_name_and_import_neither_the_registry_nor_each_other() -> None:
    from dptune.dp.engine_registry import ENGINES

    assert set(ENGINES) == set(ENGINE_NAMES) - {"auto"}
    for entry in ENGINES.values():
        assert "dptune.dp.engine_registry" not in dptune_imports(entry.module)
    assert not {"dptune.dp.film", "dptune.dp.opacus_engine"} & dptune_imports("dptune.dp.engine")


def test_trial_re_exports_the_contract_types_unchanged() -> None:
    import dptune.runners.trial as trial

    for name in (
        "TrialConfig",
        "EpochMetrics",
        "ClassDiagnostics",
        "Diagnostics",
        "TrialResult",
        "TrialStatus",
        "Reporter",
    ):
        assert getattr(trial, name) is getattr(contract, name)
        assert name in trial.__all__


def test_a_config_row_is_flat_and_names_the_workload_fields_as_result_rows_do() -> None:
    workload = WorkloadSpec("20newsgroups", "minilm", "head", seed=3, classes=(1, 2), max_train_examples=50)
    config = TrialConfig(
        workload=workload,
        epsilon=1.0,
        delta=1e-5,
        epochs=2,
        clip_bound=0.5,
        batch_size=16,
        learning_rate=1e-3,
        base_learning_rate=1e-3,
        seed=7,
    )
    row = config.row()
    assert set(row) == {  # the fields of the flat TrialConfig the Parquet schema and config JSON were made for
        "dataset",
        "backbone",
        "peft",
        "epsilon",
        "delta",
        "epochs",
        "clip_bound",
        "batch_size",
        "learning_rate",
        "base_learning_rate",
        "optimizer",
        "clipping",
        "seed",
        "split_seed",
        "score_noise_multiplier",
        "fraction",
        "examples_per_class",
        "classes",
        "max_tokens",
        "validation_fraction",
        "max_train_examples",
        "max_eval_examples",
        "device",
        "max_physical_batch_size",
        "threads",
        "engine",
        "diagnostics",
        "diagnostic_examples",
        "tuning_rows",
        "schedule",
        "release_run",
        "dataset_file",
        "person_unit",
    }
    assert row["dataset_file"] is None and row["release_run"] is False and row["person_unit"] is None
    people = replace(config, workload=replace(workload, person_unit=PersonUnit("customer_id", 8))).row()
    assert people["person_unit"] == {"column": "customer_id", "max_rows": 8}
    own = DatasetFile("/data/tickets.csv", "text", "label")
    flat = replace(config, workload=replace(workload, dataset="file:tickets.csv", dataset_file=own)).row()
    assert flat["dataset_file"] == {
        "path": "/data/tickets.csv",
        "input_column": "text",
        "label_column": "label",
        "format": "auto",
        "test_path": None,
        "test_public": False,
        "sep": None,
    }
    assert (row["split_seed"], row["seed"], row["classes"], row["max_train_examples"]) == (3, 7, (1, 2), 50)
    assert (row["dataset"], row["backbone"], row["peft"], row["epsilon"]) == ("20newsgroups", "minilm", "head", 1.0)


def test_implementation_tables_are_keyed_by_the_contract_names() -> None:
    from dptune.dp.clipping import CLIPPING_RULES as clipping_rules
    from dptune.dp.engine import ENGINE_NAMES as engine_names
    from dptune.dp.optimizers import OPTIMIZERS
    from dptune.models import PEFTS

    assert tuple(PEFTS) == PEFT_NAMES == ("head", "film", "lora", "full")
    assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES == ("adam", "sgd")
    assert engine_names is ENGINE_NAMES == ("auto", "opacus", "film")
    assert clipping_rules is CLIPPING_RULES == ("standard", "normalized", "auto_s")


def test_a_table_that_misses_or_adds_a_name_fails_when_built() -> None:
    with pytest.raises(TypeError, match=r"optimizer implementations \('adam',\) do not match"):
        check_registry("optimizer", OPTIMIZER_NAMES, {"adam": object})
    with pytest.raises(TypeError, match="do not match"):
        check_registry("optimizer", OPTIMIZER_NAMES, {"adam": object, "sgd": object, "lamb": object})
    table = {"adam": 1, "sgd": 2}
    assert check_registry("optimizer", OPTIMIZER_NAMES, table) is table


@pytest.mark.parametrize(
    ("key", "names"),
    [
        ("task.peft", PEFT_NAMES),
        ("training.optimizer", OPTIMIZER_NAMES),
        ("training.engine", ENGINE_NAMES),
        ("training.clipping", CLIPPING_RULES),
    ],
)
def test_the_space_refuses_a_name_outside_the_registry_naming_every_allowed_one(
    key: str, names: tuple[str, ...]
) -> None:
    from dptune.space import SpaceError, load_space

    with pytest.raises(SpaceError) as info:
        load_space(PACKAGE.parent / "search_spaces" / "default.yaml", {key: "nonesuch"})
    line = next(line for line in str(info.value).splitlines() if line.strip().startswith(f"- {key}:"))
    assert "not allowed; expected" in line and "(got 'nonesuch')" in line
    assert all(f"'{name}'" in line for name in names)


def error_classes() -> list[tuple[str, str]]:
    """(module, class) of every class dptune defines whose name ends in Error or Failed."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found += [
            (module, node.name)
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Failed"))
        ]
    return found


def test_every_dptune_error_derives_from_the_one_root() -> None:
    import importlib

    from dptune.errors import DptuneError, TrialFailed

    classes = {name: getattr(importlib.import_module(module), name) for module, name in error_classes()}
    assert {"DptuneError", "SpaceError", "TrialConfigError", "TrialFailed", "RecordsError"} <= set(classes)
    assert [name for name, cls in classes.items() if not issubclass(cls, DptuneError)] == []
    # a ValueError means "refused before anything was spent"; a trial that failed later is not one
    assert issubclass(TrialFailed, RuntimeError) and not issubclass(TrialFailed, ValueError)
    assert DptuneError.__bases__ == (Exception,)
