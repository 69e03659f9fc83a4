"""The Parquet results dataset: atomic parts, idempotent trials, readable by pandas/polars/duckdb."""

from pathlib import Path

import duckdb
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dptune import records
from dptune.contract import ClassDiagnostics, Diagnostics, EpochMetrics, TrialConfig, TrialResult, WorkloadSpec
from dptune.records import (
    SCHEMAS,
    TABLES,
    RecordsError,
    ResultsStore,
    compact_records,
    compaction,
    read_table,
    trial_rows,
)
from dptune.records.store import PER_TRIAL_TABLES

NOW = pd.Timestamp("2026-11-30T12:00:00Z")


def make_result(val_accuracy: float = 0.5, epochs: int = 2) -> TrialResult:
    config = TrialConfig(
        workload=WorkloadSpec(dataset="20newsgroups", backbone="minilm", peft="head"),
        epsilon=1.0,
        delta=1e-5,
        epochs=epochs,
        clip_bound=0.5,
        batch_size=64,
        learning_rate=2e-3,
        base_learning_rate=1e-3,
    )
    diag = Diagnostics(
        epoch=epochs,
        clip_bound=0.5,
        noise_multiplier=1.1,
        dimension=7700,
        grad_norms=[0.2, 0.9, 1.4],
        labels=[0, 1, 1],
        mse_bias=0.1,
        mse_variance=0.2,
        optimal_clip_bound=0.8,
        classes=[
            ClassDiagnostics(0, 1, {"q05": 0.2, "q25": 0.2, "q50": 0.2, "q75": 0.2, "q95": 0.2}, 0.0, 1.0),
            ClassDiagnostics(1, 2, {"q05": 0.9, "q25": 1.0, "q50": 1.15, "q75": 1.3, "q95": 1.4}, 1.0, 0.45),
        ],
    )
    return TrialResult(
        config=config,
        status="ok",
        noise_multiplier=1.1,
        sample_rate=0.01,
        steps=200,
        epsilon_spent=0.99,
        num_train=6400,
        num_val=700,
        num_test=800,
        num_classes=2,
        val_accuracy=val_accuracy,
        test_accuracy=0.45,
        epochs=[EpochMetrics(e, 100 * e, 1.0 / e, 1.1 / e, val_accuracy, 1.0, 500.0) for e in range(1, epochs + 1)],
        class_accuracy={0: 0.6, 1: 0.3},
        class_names={0: "alt.atheism", 1: "comp.graphics"},
        diagnostics=[diag],
    )


def write(store: ResultsStore, trial_id: str, result: TrialResult) -> None:
    rows = trial_rows(
        result,
        search_id="s1",
        trial_id=trial_id,
        cell_id="eps=1|epochs=2",
        reference_batch_size=256,
        versions={"torch": "2.14.1"},
        finished_at=NOW,
    )
    store.write_trial(rows, trial_id)


def test_round_trip_values(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path))
    write(store, "t1", make_result())
    trials = read_table(str(tmp_path), "trials")
    assert list(trials.columns) == SCHEMAS["trials"].names
    row = trials.iloc[0]
    assert (row.trial_id, row.clip_bound, row.batch_size, row.learning_rate, row.reference_batch_size) == (
        "t1",
        0.5,
        64,
        2e-3,
        256,
    )
    assert row.epsilon_spent <= row.epsilon
    epochs = read_table(str(tmp_path), "epochs")
    assert epochs["epoch"].tolist() == [1, 2] and epochs["steps"].tolist() == [100, 200]
    classes = read_table(str(tmp_path), "classes").set_index("label")
    assert classes.loc[1, "retention_weight"] == 0.45 and classes.loc[1, "class_name"] == "comp.graphics"
    assert classes.loc[0, "test_accuracy"] == 0.6 and classes.loc[1, "grad_norm_q50"] == 1.15
    diagnostics = read_table(str(tmp_path), "diagnostics")
    assert list(diagnostics.loc[0, "grad_norms"]) == [0.2, 0.9, 1.4]


def test_rewriting_a_trial_replaces_it(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path))
    write(store, "t1", make_result(0.5))
    write(store, "t1", make_result(0.7, epochs=3))
    trials = read_table(str(tmp_path), "trials")
    assert trials["trial_id"].tolist() == ["t1"] and trials["val_accuracy"].tolist() == [0.7]
    assert read_table(str(tmp_path), "epochs")["epoch"].tolist() == [1, 2, 3]


def test_a_table_read_again_shows_every_part_written_replaced_or_removed_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, root = ResultsStore(str(tmp_path)), str(tmp_path)
    write(store, "t1", make_result(0.5))
    datasets = []
    real_dataset = pq.ParquetDataset
    monkeypatch.setattr(pq, "ParquetDataset", lambda parts, **kw: datasets.append(parts) or real_dataset(parts, **kw))
    assert read_table(root, "trials")["val_accuracy"].tolist() == [0.5]
    assert read_table(root, "trials")["val_accuracy"].tolist() == [0.5]
    assert len(datasets) == 1  # unchanged parts are read once
    assert read_table(root, "trials", columns=["trial_id"])["trial_id"].tolist() == ["t1"]  # other columns: read
    assert len(datasets) == 2
    write(store, "t2", make_result(0.6))
    assert read_table(root, "trials")["val_accuracy"].tolist() == [0.5, 0.6]
    write(store, "t1", make_result(0.7))  # the same part, replaced: the same size, a new file
    assert read_table(root, "trials")["val_accuracy"].tolist() == [0.7, 0.6]
    (tmp_path / "trials" / "part-t2.parquet").unlink()
    assert read_table(root, "trials")["trial_id"].tolist() == ["t1"]
    assert len(datasets) == 5
    frame = read_table(root, "trials")
    frame.loc[0, "val_accuracy"] = 0.0  # a reader's changes stay in its own frame
    assert read_table(root, "trials")["val_accuracy"].tolist() == [0.7]


def test_crash_mid_write_leaves_no_part_and_readers_ignore_orphans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ResultsStore(str(tmp_path))
    write(store, "t1", make_result())
    real_write = pq.write_table

    def crash_on_trials(table, where, **kwargs):
        if "/trials/" in str(where):
            Path(where).write_bytes(b"PAR1 half a file")  # what a killed writer leaves behind
            raise KeyboardInterrupt("killed while writing")
        return real_write(table, where, **kwargs)

    monkeypatch.setattr(pq, "write_table", crash_on_trials)
    with pytest.raises(KeyboardInterrupt):
        write(store, "t2", make_result())
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "trials").glob("part-*")) == ["part-t1.parquet"]
    # t2's epochs part exists but its trial never completed: readers do not show it
    assert (tmp_path / "epochs" / "part-t2.parquet").exists()
    assert set(read_table(str(tmp_path), "epochs")["trial_id"]) == {"t1"}
    assert store.completed_trial_ids() == {"t1"}


def test_empty_dataset_reads_with_schema(tmp_path: Path) -> None:
    for table in TABLES:
        frame = read_table(str(tmp_path / "nothing"), table)
        assert frame.empty and list(frame.columns) == SCHEMAS[table].names


def test_unknown_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RecordsError, match="unknown table 'trial'; tables are trials, epochs"):
        read_table(str(tmp_path), "trial")


def test_polars_and_duckdb_read_the_dataset(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path))
    write(store, "t1", make_result(0.5))
    write(store, "t2", make_result(0.6))
    frame = pl.read_parquet(tmp_path / "trials" / "*.parquet")
    assert sorted(frame["val_accuracy"].to_list()) == [0.5, 0.6]
    best = duckdb.sql(f"select max(val_accuracy) from read_parquet('{tmp_path}/trials/*.parquet')").fetchall()
    assert best == [(0.6,)]


def test_replicates_share_a_configuration_id(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path))
    for replicate, accuracy in enumerate((0.5, 0.6)):
        trial_id = records.replicate_trial_id("eps1-E2-abc", replicate)
        rows = trial_rows(
            make_result(accuracy),
            search_id="s1",
            trial_id=trial_id,
            cell_id="eps=1|epochs=2",
            reference_batch_size=256,
            versions={},
            finished_at=NOW,
            configuration_id="eps1-E2-abc",
            replicate=replicate,
        )
        store.write_trial(rows, trial_id)
    trials = read_table(str(tmp_path), "trials").sort_values("replicate")
    assert trials["trial_id"].tolist() == ["eps1-E2-abc-r0", "eps1-E2-abc-r1"]
    assert trials["configuration_id"].tolist() == ["eps1-E2-abc"] * 2 and trials["replicate"].tolist() == [0, 1]
    assert trials["replicate"].dtype == "int64" and records.SCHEMA_VERSION == 8
    only = read_table(str(tmp_path), "trials", columns=["configuration_id", "replicate"])
    assert list(only.columns) == ["configuration_id", "replicate"] and len(only) == 2
    for bad in (-1, 1.0, True):
        with pytest.raises(RecordsError, match=r"replicate must be an integer ≥ 0 \(0-based\), got"):
            trial_rows(
                make_result(),
                search_id="s1",
                trial_id="t",
                cell_id="c",
                reference_batch_size=256,
                versions={},
                finished_at=NOW,
                configuration_id="c",
                replicate=bad,
            )


def test_schema_2_trials_read_as_replicate_0_of_their_own_configuration(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path))
    write(store, "new", make_result(0.7))  # schema 3, no configuration given: its own configuration
    old_schema = pa.schema([f for f in SCHEMAS["trials"] if f.name not in ("configuration_id", "replicate")])
    row = trial_rows(
        make_result(0.4),
        search_id="s0",
        trial_id="old",
        cell_id="eps=1|epochs=2",
        reference_batch_size=256,
        versions={},
        finished_at=NOW,
    )["trials"][0]
    old = {k: v for k, v in row.items() if k in old_schema.names}
    pq.write_table(pa.Table.from_pylist([old], schema=old_schema), tmp_path / "trials" / "part-old.parquet")
    assert records.part_problem(store, "trials", str(tmp_path / "trials" / "part-old.parquet")) is None
    trials = read_table(str(tmp_path), "trials").set_index("trial_id")
    assert trials.loc["old", "configuration_id"] == "old" and trials.loc["new", "configuration_id"] == "new"
    assert trials["replicate"].tolist() == [0, 0] and trials["replicate"].dtype == "int64"
    assert trials.loc["old", "val_accuracy"] == 0.4
    only = read_table(str(tmp_path), "trials", columns=["configuration_id"])
    assert sorted(only["configuration_id"]) == ["new", "old"] and list(only.columns) == ["configuration_id"]


def _old_part(root: Path, table: str, key: str, row: dict, dropped: tuple[str, ...]) -> None:
    """A part of ``table`` as an older dptune wrote it: without the columns a later schema added."""
    schema = pa.schema([f for f in SCHEMAS[table] if f.name not in dropped])
    (root / table).mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([row], schema=schema), root / table / f"part-{key}.parquet")


def test_older_search_and_release_rows_read_as_the_current_schema(tmp_path: Path) -> None:
    from dptune.records.migrations import BEFORE_SCHEMA_2_GUARANTEE, GENERAL_WITHHELD_REASON

    _old_part(tmp_path, "search", "s1", {"search_id": "s1", "schema_version": 1}, ("guarantee",))
    _old_part(tmp_path, "search", "s2", {"search_id": "s2", "schema_version": 2}, ())  # recorded no guarantee
    ResultsStore(str(tmp_path)).write_part("search", "s7", [{"search_id": "s7", "schema_version": 7, "guarantee": "g"}])
    search = read_table(str(tmp_path), "search").set_index("search_id")["guarantee"]
    assert search["s1"] == BEFORE_SCHEMA_2_GUARANTEE and pd.isna(search["s2"]) and search["s7"] == "g"
    only = read_table(str(tmp_path), "search", columns=["guarantee"])  # schema_version is read for it
    assert list(only.columns) == ["guarantee"] and sorted(only["guarantee"].fillna("")) == sorted(
        ["", "g", search["s1"]]
    )

    release = {"search_id": "s", "cell_id": "c", "epsilon_total": 8.0}
    _old_part(tmp_path, "release", "r3", {**release, "search_id": "r3"}, ("test_split_public", "test_withheld"))
    _old_part(tmp_path, "release", "r6", {**release, "search_id": "r6", "test_split_public": False}, ("test_withheld",))
    store = ResultsStore(str(tmp_path))
    store.write_part(
        "release", "r7", [{**release, "search_id": "r7", "test_split_public": False, "test_withheld": "w"}]
    )
    store.write_part("release", "p7", [{**release, "search_id": "p7", "test_split_public": True}])
    rows = read_table(str(tmp_path), "release").set_index("search_id")
    assert rows["test_split_public"].dtype == bool
    assert rows["test_split_public"].to_dict() == {"p7": True, "r3": True, "r6": False, "r7": False}
    withheld = rows["test_withheld"].to_dict()
    assert withheld["r6"] == GENERAL_WITHHELD_REASON and withheld["r7"] == "w"
    assert pd.isna(withheld["r3"]) and pd.isna(withheld["p7"])  # public: nothing withheld
    only = read_table(str(tmp_path), "release", columns=["search_id", "test_withheld"]).set_index("search_id")
    assert list(only.columns) == ["test_withheld"] and only.loc["r6", "test_withheld"] == GENERAL_WITHHELD_REASON


def test_every_migration_fills_a_column_of_its_table_added_by_its_version() -> None:
    from dptune.records.migrations import MIGRATIONS, columns_to_read

    assert MIGRATIONS and max(MIGRATIONS) <= records.SCHEMA_VERSION and min(MIGRATIONS) >= 2
    for migrations in MIGRATIONS.values():
        for migration in migrations:
            names = SCHEMAS[migration.table].names
            assert migration.column in names and set(migration.needs) <= set(names)
    assert columns_to_read("trials", ["replicate"]) == ["replicate"]
    assert columns_to_read("trials", ["configuration_id"]) == ["configuration_id", "trial_id"]
    assert columns_to_read("release", ["test_withheld"]) == ["test_withheld", "test_split_public"]


# --------------------------------------------------------------------------- compaction


def _frames(root: Path) -> dict[str, pd.DataFrame]:
    return {table: read_table(str(root), table) for table in PER_TRIAL_TABLES}


def _written(root: Path, count: int, unfinished: str | None = None) -> ResultsStore:
    """``count`` trials ``t00``, ``t01``, ... (each its own accuracy and epochs), and ``unfinished``: a trial
    whose epochs part is written and its trials part not (a write in progress, or killed)."""
    store = ResultsStore(str(root))
    for n in range(count):
        write(store, f"t{n:02d}", make_result(n / 100, epochs=1 + n % 3))
    if unfinished is not None:
        rows = trial_rows(
            make_result(),
            search_id="s1",
            trial_id=unfinished,
            cell_id="c",
            reference_batch_size=1,
            versions={},
            finished_at=NOW,
        )
        store.write_part("epochs", unfinished, rows["epochs"])
    return store


def _old_scan(root: Path) -> set[str]:
    """Completed trial ids as dptune read them before compaction: the trial_id column of every trials part."""
    return {i for part in (root / "trials").glob("part-*.parquet") for i in pq.read_table(part)["trial_id"].to_pylist()}


def test_compaction_keeps_every_row_exactly_once_and_the_index_equals_the_old_scan(tmp_path: Path) -> None:
    store = _written(tmp_path, 12, unfinished="t99")
    before, scanned = _frames(tmp_path), _old_scan(tmp_path)
    assert store.completed_trial_ids() == scanned == {f"t{n:02d}" for n in range(12)}
    assert set(before["epochs"]["trial_id"]) == scanned  # the unfinished trial's rows never count
    compact_records(str(tmp_path), ["t00", "t01", "t02", "t99"])  # a unit's end: its own trials only
    assert sorted(p.name for p in (tmp_path / "trials").iterdir())[1] == "part-t03.parquet"
    assert len(list((tmp_path / "trials").glob("part-c-*"))) == 1
    for table, frame in _frames(tmp_path).items():
        pd.testing.assert_frame_equal(frame, before[table])
    compact_records(str(tmp_path))  # the finishing step: everything
    for table in PER_TRIAL_TABLES:
        assert [p.name[:7] for p in (tmp_path / table).iterdir()] == ["part-c-"], table
        pd.testing.assert_frame_equal(read_table(str(tmp_path), table), before[table])
    assert store.completed_trial_ids() == _old_scan(tmp_path) == scanned
    assert store.has_trial("t05") and not store.has_trial("t99")
    compacted = pq.ParquetFile(next((tmp_path / "epochs").iterdir()))
    ids = compacted.read(columns=["trial_id"])["trial_id"].to_pylist()
    assert ids == sorted(ids) and compacted.metadata.num_rows == len(before["epochs"]) + 2  # t99's rows are kept
    listing = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    compact_records(str(tmp_path))  # an already compact folder: nothing written or removed
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == listing


def test_a_trial_written_again_reads_as_its_last_write_before_and_after_compaction(tmp_path: Path) -> None:
    store = _written(tmp_path, 3)
    compact_records(str(tmp_path))
    write(store, "t01", make_result(0.9, epochs=4))  # its own part overrides its rows in the compacted file
    for _ in range(2):
        trials = read_table(str(tmp_path), "trials")
        assert trials["trial_id"].tolist() == ["t00", "t01", "t02"] and trials["val_accuracy"].tolist()[1] == 0.9
        epochs = read_table(str(tmp_path), "epochs")
        assert epochs[epochs["trial_id"] == "t01"]["epoch"].tolist() == [1, 2, 3, 4] and len(epochs) == 1 + 4 + 3
        compact_records(str(tmp_path), ["t01"])  # then a newer compacted file holds it, and wins
    assert len(list((tmp_path / "trials").iterdir())) == 2


def test_compacted_files_merge_by_tiers_and_their_count_stays_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compaction, "TIER_BYTES", 1)  # tiers by factors of FANOUT from a byte up
    store = _written(tmp_path, 40)
    before = _frames(tmp_path)
    counts = []
    for unit in range(20):
        compact_records(str(tmp_path), [f"t{2 * unit:02d}", f"t{2 * unit + 1:02d}"])
        counts.append(len(list((tmp_path / "trials").glob("part-c-*"))))
    # FANOUT unit files of one tier merge into one of the next; 16 = FANOUT² units' files: one file of tier 2
    assert counts[:4] == [1, 2, 3, 1] and counts[15] == 1 and max(counts) <= 2 * (compaction.FANOUT - 1)
    for table, frame in _frames(tmp_path).items():
        pd.testing.assert_frame_equal(frame, before[table])
    assert store.completed_trial_ids() == {f"t{n:02d}" for n in range(40)}
    assert compaction.tier_group([("a", 10), ("b", 20), ("c", 10**9)], 100, final=True) == ["a", "b"]
    assert compaction.tier_group([("a", 10), ("c", 10**9)], 100, final=True) == []


def test_a_read_of_some_columns_reads_those_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _written(tmp_path, 3)
    compact_records(str(tmp_path), ["t00"])
    asked = []
    real_read = pq.ParquetDataset.read
    monkeypatch.setattr(
        pq.ParquetDataset,
        "read",
        lambda self, columns=None, **kw: asked.append(columns) or real_read(self, columns, **kw),
    )
    frame = ResultsStore(str(tmp_path), cache=None).read("epochs", ["epoch"])
    assert list(frame.columns) == ["epoch"] and len(frame) == 1 + 2 + 3
    assert asked and all(columns == ["epoch", "trial_id"] for columns in asked)  # the trial filter needs its id


def test_search_rows_before_schema_8_name_the_accountant_their_composition_used(tmp_path: Path) -> None:
    """Schema 8 records which accountant gave each composed ε; a per-cell search written before it composed
    with the PLD (or took a single trial's own PRV ε); a private search's row composes nothing and stays null."""
    _old_part(
        tmp_path,
        "search",
        "s7",
        {"search_id": "s7", "schema_version": 7, "epsilon_search": 12.5},
        ("accountant_cell", "accountant_search"),
    )
    _old_part(
        tmp_path, "search", "p7", {"search_id": "p7", "schema_version": 7}, ("accountant_cell", "accountant_search")
    )
    ResultsStore(str(tmp_path)).write_part(
        "search",
        "s8",
        [
            {
                "search_id": "s8",
                "schema_version": 8,
                "epsilon_search": 1094.3,
                "accountant_cell": "PLD",
                "accountant_search": "RDP",
            }
        ],
    )
    rows = read_table(str(tmp_path), "search").set_index("search_id")
    assert rows.loc["s7", "accountant_search"] == rows.loc["s7", "accountant_cell"] == "PLD (or PRV for a single trial)"
    assert rows.loc["s8", "accountant_search"] == "RDP" and rows.loc["s8", "accountant_cell"] == "PLD"
    assert pd.isna(rows.loc["p7", "accountant_search"])


def test_reading_some_trials_reads_only_theirs_from_single_parts_and_compacted_files(tmp_path: Path) -> None:
    """``read(..., trial_ids=...)`` returns exactly the rows of those trials, wherever they are (a single part, a
    compacted file), the same as filtering the whole table; asking for none, or unknown ids, reads no row."""
    from dptune.records import compact_records

    store = ResultsStore(str(tmp_path), cache=None)
    for index in range(6):
        trial_id = f"t{index}"
        store.write_trial(
            {"epochs": [{"trial_id": trial_id, "epoch": e} for e in (1, 2)], "trials": [{"trial_id": trial_id}]},
            trial_id,
        )
        if index == 3:
            compact_records(str(tmp_path))  # t0…t3 compacted, t4 and t5 single parts
    files = store.table_files("epochs")
    assert len(files.compacted) == 1 and sorted(files.singles) == ["t4", "t5"]
    whole = store.read("epochs")
    for asked in ({"t1", "t4"}, {"t0", "t2", "t3"}, {"t5"}):
        some = store.read("epochs", trial_ids=asked)
        expected_rows = whole[whole["trial_id"].isin(asked)].reset_index(drop=True)
        pd.testing.assert_frame_equal(some.reset_index(drop=True), expected_rows)
    assert store.read("epochs", trial_ids=set()).empty and store.read("epochs", trial_ids={"nobody"}).empty
