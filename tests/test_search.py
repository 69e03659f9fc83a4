"""The search service end to end: real Ray, real trials, Parquet rows checked value by value."""

from __future__ import annotations

import html
import json
import math
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import ray
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

from conftest import (
    REPO_ROOT,
    SHORT_PRIVATE,
    TINY_EVAL_EXAMPLES,
    TINY_TRAIN_EXAMPLES,
    SearchRun,
    ray_processes_below,
    run_search,
    search_command,
)
from dptune import privacy, search
from dptune.plan import coupled_learning_rate, sample_rate, total_steps
from dptune.plan.mechanism import wrapped
from dptune.records import SCHEMA_VERSION, TRUST_BOUNDARY, read_table
from dptune.report import build_report
from dptune.runners import fused
from dptune.search.planning.sampler import CellSampler
from dptune.search.runs import execution
from dptune.space import Cell, load_space
from expected import opacus_rdp, papernot_steinke_geometric, pld_epsilon
from hidden_runs import assert_nothing_of_the_hidden_runs_outside, assert_owner_only, private_search

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"


# --------------------------------------------------------------------------- before any compute


def main_exit(capsys: pytest.CaptureFixture, *args: str) -> str:
    """Run the CLI in this process (nothing here may start Ray); return stderr of a refusal."""
    with pytest.raises(SystemExit) as info:
        search.main(list(args))
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trials-per-cell", "0"], "--trials-per-cell must be ≥ 1"),
        (["--set", "privacy"], "expected KEY=VALUE"),
        (["--space", "nowhere.yaml"], "no such search-space file; shipped spaces: "),
        (["--set", "sampler.name=cmaes"], "sampler.name: not allowed"),
        (["--set", "privacy.epsilons=[0]"], "privacy.epsilons.0"),
        (["--name", "../escape"], "use letters, digits"),
        (["--max-train-examples", "-3"], "--max-train-examples must be ≥ 1"),
    ],
)
def test_bad_flags_fail_fast_with_a_clear_message(
    capsys: pytest.CaptureFixture, tmp_path: Path, args: list[str], message: str
) -> None:
    assert message in main_exit(capsys, "--storage", str(tmp_path), *args)
    assert not ray.is_initialized()
    assert not list(tmp_path.iterdir())


def test_storage_that_is_a_file_is_refused(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert "exists and is not a folder" in main_exit(capsys, "--storage", str(blocker / "sub"))


def test_unknown_dataset_and_infeasible_min_steps_fail_before_ray(
    capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test_cache_dir: Path
) -> None:
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(test_cache_dir))
    caps = ("--max-train-examples", str(TINY_TRAIN_EXAMPLES), "--max-eval-examples", str(TINY_EVAL_EXAMPLES))
    unknown = main_exit(capsys, "--storage", str(tmp_path), "--set", "task.dataset=cifar1000", *caps)
    assert "cifar1000" in unknown and "20newsgroups" in unknown
    infeasible = main_exit(capsys, "--space", str(TINY), "--storage", str(tmp_path), "--set", "min_steps=100000", *caps)
    assert "no batch size gives T ≥ min_steps = 100000" in infeasible
    assert not ray.is_initialized()


def test_bad_replicates_units_and_runners_fail_before_ray(
    capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test_cache_dir: Path
) -> None:
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(test_cache_dir))
    caps = ("--max-train-examples", str(TINY_TRAIN_EXAMPLES), "--max-eval-examples", str(TINY_EVAL_EXAMPLES))
    tiny = ("--space", str(TINY), "--storage", str(tmp_path), *caps)
    assert "replicates: must be at least 1 (got 0)" in main_exit(capsys, *tiny, "--set", "replicates=0")
    assert "resources.configurations_per_trial" in main_exit(
        capsys, *tiny, "--set", "resources.configurations_per_trial=0"
    )
    asha = main_exit(capsys, *tiny, "--set", "replicates=2", "--set", "scheduler={name: asha}")
    assert "replicates must be 1" in asha
    # one configuration of the largest B does not fit a (here tiny) memory budget of the fused runner
    monkeypatch.setattr(fused, "FUSED_MEMORY_BYTES", 1 << 20)
    unfit = main_exit(capsys, *tiny, "--set", "training.runner=fused")
    assert "does not fit the fused runner's memory budget" in unfit and "use training.runner 'trial'" in unfit
    assert not ray.is_initialized()


def test_dry_run_prints_the_plan_and_runs_nothing(
    capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test_cache_dir: Path
) -> None:
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(test_cache_dir))
    before = ray_processes_below()
    search.main(search_command("--space", str(TINY), "--storage", str(tmp_path), "--dry-run")[3:])  # the CLI's argv
    out = capsys.readouterr().out
    assert f"N_train = {TINY_TRAIN_EXAMPLES}" in out
    assert "pruned by min-step rule (T < 10): B = [256]" in out
    assert "total: 12 configurations = 12 trials in 4 cell runs" in out
    privacy.clear_memory_cache()
    steps = total_steps(TINY_TRAIN_EXAMPLES, 32, 3)
    sigma = privacy.calibrate_noise_multiplier(1.0, 1e-5, sample_rate(TINY_TRAIN_EXAMPLES, 32), steps)
    assert f"     32 {steps:>6}   {sigma:<8.4f} {sigma * math.sqrt(steps):.2f}" in out
    assert not (tmp_path / "tiny").exists()
    assert not ray.is_initialized() and ray_processes_below() <= before  # no Ray started


# --------------------------------------------------------------------------- a real search


def test_tiny_search_records_every_grid_point_once(tiny_search: SearchRun) -> None:
    trials = read_table(str(tiny_search.root), "trials")
    assert trials["trial_id"].is_unique
    ran = trials[trials["status"] != "pruned_min_steps"]
    # per cell: normalized C × B = 2 × 2, AUTO-S B = 2; two cells (ε = 1, 8)
    assert len(ran) == 12
    assert set(ran["status"]) == {"ok"}, ran[["status", "reason"]]
    normalized = ran[ran["clipping"] == "normalized"]
    assert sorted(map(tuple, normalized[["epsilon", "clip_bound", "batch_size"]].values.tolist())) == sorted(
        (e, c, b) for e in (1.0, 8.0) for c in (0.1, 1.0) for b in (32, 64)
    )
    assert (ran[ran["clipping"] == "auto_s"].groupby("epsilon").size() == 2).all()


PROGRESS = re.compile(
    r"^\[(?P<cell>[^\]]+) (?P<clipping>\w+)\] (?P<done>\d+)/(?P<budget>\d+) configurations"
    r"(?: × (?P<replicates>\d+) replicates)?: runs (?P<runs>[^(;]+?)(?: \(|;|$)"
)


def test_progress_lines_count_every_run_of_a_cell_as_the_summary_does(tiny_search: SearchRun) -> None:
    last = {}
    for line in tiny_search.stdout.splitlines():
        if match := PROGRESS.match(line):
            last[match["cell"], match["clipping"]] = match
    trials = read_table(str(tiny_search.root), "trials")
    ran = trials[trials["status"] != "pruned_min_steps"]
    assert len(last) == 4  # ε ∈ {1, 8} × {normalized, AUTO-S}
    for (cell, clipping), match in last.items():
        runs = {status: int(count) for count, status in (part.split(" ") for part in match["runs"].split(", "))}
        own = ran[(ran["cell_id"] == cell) & (ran["clipping"] == clipping)]
        assert int(match["done"]) == int(match["budget"]) == own["configuration_id"].nunique()
        assert runs == own["status"].value_counts().to_dict()  # cumulative: what the records and summary count
    # Tune's own console counts its units (one Tune trial carries many runs) and points at TensorBoard
    assert "Number of trials" not in tiny_search.stdout and "TensorBoard" not in tiny_search.stdout


def test_min_step_pruning_records_without_compute(tiny_search: SearchRun) -> None:
    trials = read_table(str(tiny_search.root), "trials")
    pruned = trials[trials["status"] == "pruned_min_steps"]
    assert set(pruned["batch_size"]) == {256}
    assert len(pruned) == 2 * (2 + 1)  # per cell: 2 C values (normalized) + 1 (AUTO-S)
    assert (pruned["steps"] == total_steps(TINY_TRAIN_EXAMPLES, 256, 3)).all()
    assert (pruned["wall_time_s"] == 0).all() and (pruned["epsilon_spent"] == 0).all()
    assert pruned["reason"].str.contains("< min_steps = 10").all()
    epochs = read_table(str(tiny_search.root), "epochs")
    assert not set(pruned["trial_id"]) & set(epochs["trial_id"])


def test_trials_use_calibrated_sigma_coupled_lr_and_stay_within_budget(
    tiny_search: SearchRun, monkeypatch: pytest.MonkeyPatch, test_cache_dir: Path
) -> None:
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(test_cache_dir))
    privacy.clear_memory_cache()
    trials = read_table(str(tiny_search.root), "trials")
    ran = trials[trials["status"] == "ok"]
    for row in ran.itertuples():
        q, steps = sample_rate(row.num_train, row.batch_size), total_steps(row.num_train, row.batch_size, row.epochs)
        assert (row.sample_rate, row.steps) == (q, steps)
        sigma = privacy.calibrate_noise_multiplier(row.epsilon, row.delta, q, steps)
        assert row.noise_multiplier == pytest.approx(sigma)
        assert row.epsilon_spent <= row.epsilon
        assert row.learning_rate == pytest.approx(coupled_learning_rate(row.base_learning_rate, row.batch_size, 64))
        assert 0 <= row.val_accuracy <= 1 and 0 <= row.test_accuracy <= 1
    assert (ran["num_train"] == TINY_TRAIN_EXAMPLES).all()


def test_per_trial_tables_are_complete(tiny_search: SearchRun) -> None:
    root = str(tiny_search.root)
    trials = read_table(root, "trials").set_index("trial_id")
    ran = trials[trials["status"] == "ok"]
    epochs = read_table(root, "epochs")
    assert (epochs.groupby("trial_id")["epoch"].apply(list) == pd.Series({t: [1, 2, 3] for t in ran.index})).all()
    last = epochs[epochs["epoch"] == 3].set_index("trial_id")
    assert (last.loc[ran.index, "val_accuracy"] == ran["val_accuracy"]).all()
    classes = read_table(root, "classes")
    assert (classes.groupby("trial_id").size().loc[ran.index] == ran["num_classes"]).all()
    assert classes["retention_weight"].between(0, 1).all()
    diagnostics = read_table(root, "diagnostics")
    assert set(diagnostics["trial_id"]) == set(ran.index)


def _pld_epsilon(trials: pd.DataFrame, delta: float) -> float:
    """PLD over the recorded (σ, q, steps taken) of the trials that took a step."""
    took = trials[trials["steps_taken"] > 0]
    return pld_epsilon(
        list(zip(took["noise_multiplier"], took["sample_rate"], took["steps_taken"].astype(int), strict=True)), delta
    )


def test_search_table_reports_the_whole_search_cost(
    tiny_search: SearchRun, monkeypatch: pytest.MonkeyPatch, test_cache_dir: Path
) -> None:
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(test_cache_dir))
    search = read_table(str(tiny_search.root), "search")
    trials = read_table(str(tiny_search.root), "trials")
    delta = load_space(TINY).space.privacy.delta
    assert len(search) == 4 and set(search["schema_version"]) == {SCHEMA_VERSION} == {8}
    ran = trials[trials["steps_taken"] > 0]
    assert len(ran) == 12 and ran["epsilon_spent"].notna().all() and (ran["epsilon_spent"] > 0).all()
    # the whole search: every trial of every cell and variant, composed by dp_accounting's PLD accountant
    expected = _pld_epsilon(trials, delta)
    assert search["epsilon_search"].nunique() == 1
    assert search["epsilon_search"].iloc[0] == pytest.approx(expected, rel=1e-9)
    assert search["epsilon_search_basic"].iloc[0] == pytest.approx(ran["epsilon_spent"].sum())
    assert search["delta_search_basic"].iloc[0] == pytest.approx(len(ran) * delta)
    assert search["epsilon_search"].iloc[0] < search["epsilon_search_basic"].iloc[0]
    for row in search.itertuples():  # per cell and clipping variant: its own trials
        own = ran[(ran["cell_id"] == row.cell_id) & (ran["clipping"] == row.clipping)]
        assert row.trials_with_steps == len(own)
        assert row.epsilon_composition == pytest.approx(own["epsilon_spent"].sum())
        pld = _pld_epsilon(own, delta)  # one trial: its own ε spent where that is the tighter bound
        assert row.epsilon_cell == pytest.approx(
            pld if len(own) > 1 else min(pld, own["epsilon_spent"].iloc[0]), rel=1e-9
        )
    assert not search["selection_bound_holds"].any() and search["epsilon_selection"].isna().all()
    assert search["guarantee"].str.contains("NOT covered by \\(ε, δ\\): validation accuracies").all()
    assert "whole search: ε =" in tiny_search.stdout and "what (ε, δ) covers" in tiny_search.stdout
    assert "best configuration per cell" in tiny_search.stdout


def test_trials_draw_secret_coins_that_the_results_cannot_regenerate(tiny_search: SearchRun) -> None:
    trials = read_table(str(tiny_search.root), "trials")
    assert trials["seed"].isna().all()  # nothing stored from which noise or batches could be regenerated
    assert all(json.loads(config)["seed"] is None for config in trials["config"])
    assert (trials["split_seed"] == 0).all() and not trials["released"].any()  # no run record is a DP release
    ok = trials[trials["status"] == "ok"]
    assert (ok["steps_taken"] == ok["steps"]).all()


def test_reproducible_opt_in_gives_each_trial_its_own_seed_and_repeats_it() -> None:
    loaded = load_space(TINY, {"reproducible": True})
    plan = search.mode_of(loaded.space).plan(loaded.space, TINY_TRAIN_EXAMPLES, progress=False)[0]

    def context(reproducible_seed: int | None) -> execution.TrialContext:
        return execution.TrialContext(
            base=search.base_trial_config(loaded.space, plan, None, None),
            results_root="r",
            search_id="s",
            cell_id=plan.cell.cell_id,
            cell_key=plan.cell_key,
            coupling="sqrt",
            reference_batch_size=64,
            reproducible_seed=reproducible_seed,
        )

    first = {"batch_size": 32, "base_learning_rate": 0.01, "clip_bound": 0.1}
    second = {**first, "clip_bound": 1.0}
    seeded = context(0)
    assert execution.run_spec(seeded, first).config.seed == execution.run_spec(seeded, first).config.seed  # repeats
    assert (
        execution.run_spec(seeded, first).config.seed != execution.run_spec(seeded, second).config.seed
    )  # never shared
    assert execution.run_spec(context(None), first).config.seed is None  # the default: fresh OS entropy
    assert "REPRODUCIBLE from seed 0" in search.format_cell_plans(loaded, [plan])


def test_existing_results_need_resume(
    tiny_search: SearchRun, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, test_cache_dir: Path
) -> None:
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(test_cache_dir))
    refusal = main_exit(capsys, "--space", str(TINY), "--storage", str(tiny_search.root.parent))
    assert "pass --resume to continue" in refusal
    assert not ray.is_initialized()


# --------------------------------------------------------------------------- end-to-end private tuning

PRIVATE = REPO_ROOT / "search_spaces/private.yaml"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("sampler.name=tpe", "sampler.name 'tpe' must be 'random'"),
        ("scheduler={name: asha}", "scheduler must be absent: ASHA"),
        ("training.diagnostics=true", "training.diagnostics must be false"),
        ("reproducible=true", "reproducible must be false: reproducible coins"),
    ],
)
def test_private_search_refuses_what_voids_the_bound_before_ray(
    capsys: pytest.CaptureFixture, tmp_path: Path, override: str, named: str
) -> None:
    message = main_exit(capsys, "--space", str(PRIVATE), "--storage", str(tmp_path), "--set", override)
    assert "privacy.private_selection" in message and named in message
    assert not ray.is_initialized() and not list(tmp_path.iterdir())


def test_private_search_releases_one_run_within_the_total_budget_and_shows_nothing_else(
    search_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test_cache_dir: Path
) -> None:
    # a busy machine, injected: Tune warns, with a time, of every step slower than TUNE_WARN_THRESHOLD_S once a
    # minute has passed since its import (made to have passed); a private search's console shows none of it
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "sitecustomize.py").write_text("import ray.tune.utils.util as u\nu.START_OF_TIME -= 3600\n")
    pythonpath = os.pathsep.join(filter(None, [str(busy), search_env.get("PYTHONPATH", "")]))
    slow = {**search_env, "TUNE_WARN_THRESHOLD_S": "0", "PYTHONPATH": pythonpath}
    with ThreadPoolExecutor(2) as pool:  # two independent searches, at once
        first, second = pool.map(
            lambda name: private_search(slow, tmp_path, PRIVATE, name, *SHORT_PRIVATE), ("private", "again")
        )
    root = tmp_path / "private"
    inside = root / TRUST_BOUNDARY
    trials, release = read_table(str(inside), "trials"), read_table(str(root), "release")
    (row,) = read_table(str(root), "search").itertuples()
    space = load_space(PRIVATE, {"sampler.trials_per_cell": 3, "epochs": [5]}).space
    selection = space.privacy.private_selection
    assert row.selection_bound_holds and row.epsilon_selection <= selection.epsilon
    # independent check: Opacus' RDP of every feasible batch size at the per-trial ε and the score's
    # Gaussian, Papernot–Steinke Thm 2 by hand
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(test_cache_dir))
    feasible = [
        b
        for b in space.batch_size.candidates(TINY_TRAIN_EXAMPLES)
        if total_steps(TINY_TRAIN_EXAMPLES, b, 5) >= space.min_steps
    ]
    orders = np.array(DEFAULT_RDP_ORDERS, dtype=float)
    curves = []
    for b in feasible:
        q, steps = sample_rate(TINY_TRAIN_EXAMPLES, b), total_steps(TINY_TRAIN_EXAMPLES, b, 5)
        curves.append(
            opacus_rdp(
                orders,
                privacy.calibrate_noise_multiplier(row.epsilon_per_trial, space.privacy.delta, q, steps),
                q,
                steps,
            )
        )
    rdp = np.max(curves, axis=0) + orders / (2 * selection.score_noise_multiplier**2)
    assert papernot_steinke_geometric(rdp, orders, 3, space.privacy.delta) <= selection.epsilon
    # one release: the configuration of the best noisy validation score, and nothing that orders it
    # among the runs (no trial id, no time)
    ok = trials[trials["status"] == "ok"]
    assert len(ok) >= 1 and len(release) == 1
    best = ok.loc[ok["noisy_val_accuracy"].idxmax()]
    for column in ("clip_bound", "batch_size", "base_learning_rate", "noisy_val_accuracy", "test_accuracy"):
        assert release[column].iloc[0] == best[column]
    assert release["test_split_public"].iloc[0]  # 20 Newsgroups ships its test split
    assert not {"trial_id", "configuration_id", "created_at", "finished_at", "replicate"} & set(release.columns)
    assert release["epsilon_total"].iloc[0] == selection.epsilon
    assert not trials["released"].any()
    # each noisy score is an integer count (the count plus discrete Gaussian noise) over the public N_val
    noisy_counts = ok["noisy_val_accuracy"] * ok["num_val"]
    assert (noisy_counts.round() / ok["num_val"] == ok["noisy_val_accuracy"]).all()
    # the per-run records live inside the trust boundary only; the public tables count no run
    assert (inside / "README.txt").read_text().count("voids the guarantee") == 1
    assert not (root / "trials").exists() and not (root / "_tune").exists() and (inside / "_tune").is_dir()
    assert math.isnan(row.trials_planned) and math.isnan(row.trials_with_steps) and math.isnan(row.epsilon_search)
    assert pd.isna(row.created_at)
    kept = json.loads((inside / search.TRIAL_COUNT_FILE).read_text())
    ran = trials[trials["status"] != "pruned_min_steps"]  # proposals of a pruned B are recorded, never run
    assert list(kept.values()) == [ran["configuration_id"].nunique()]
    # the console shows the release and nothing that reveals K: no per-run line, no count, no Σε
    out = first.stdout + first.stderr  # the console: both streams
    assert "the release of this end-to-end private search" in out and "Only the release is covered" in out
    assert "max of noisy scores" in out and "biased upward" in out
    assert not [line for line in out.splitlines() if PROGRESS.match(line)]
    for revealing in (
        "configurations:",
        "best so far",
        "trials with steps",
        "Σε",
        "whole search: ε",
        "search finished in",
        f"{len(trials)} configurations",
        "best configuration per cell",
    ):
        assert revealing not in out, revealing
    # the report of the results shows the release, and counts no run
    page = (build_report([str(root)], tmp_path / "report")).read_text()
    assert "The release: what may be published" in page and "Left out for lack of data" not in page
    # the report opens with the decision: the release, its model file and the one (ε, δ) that covers it
    (model,) = (root / "models").iterdir()
    decision = html.unescape(page).split("Release of the private search ")[1].split("Sources:")[0]
    assert f"model {model}/model.safetensors; one (ε, δ) = (8, 1e-05) covers the tuning, the selection" in decision
    assert "Trials per search cell" not in page
    assert " built " not in page  # the build follows the search's end: its time would date the search
    # named by its own total (ε, δ), never the per-run ε of the cell its runs were planned in
    assert model.name == "eps=8_delta=1e-05_epochs=5-normalized", model.name
    assert (model / "model_card.md").read_text().startswith("# dptune model: eps=8|delta=1e-05|epochs=5 [normalized]")
    assert "(eps=8|delta=1e-05|epochs=5): C = " in decision and f"{row.epsilon_per_trial:g}" not in str(model)
    assert_nothing_of_the_hidden_runs_outside(root, out, (tmp_path / "private-tmp").resolve(), os.cpu_count() or 1)
    assert_owner_only(root)
    # the hidden runs' ε at their own mechanisms is cached inside the boundary, not in the user's cache
    hidden = {(run.noise_multiplier, run.sample_rate) for run in ok.itertuples()}

    def epsilon_entries(folder: Path) -> set[tuple[float, float]]:
        keys = [json.loads(path.read_text())["key"] for path in folder.glob("epsilon-*.json")]
        return {(key["noise_multiplier"], key["sample_rate"]) for key in keys}

    assert not hidden & epsilon_entries(test_cache_dir / "accounting")
    assert hidden <= epsilon_entries(inside / "accounting")
    # a second search of the same space proposes other configurations: the proposals are secret
    again = read_table(str(tmp_path / "again" / TRUST_BOUNDARY), "trials")
    proposed = {tuple(r) for r in trials[["clip_bound", "batch_size", "base_learning_rate"]].to_numpy().tolist()}
    proposed_again = {tuple(r) for r in again[["clip_bound", "batch_size", "base_learning_rate"]].to_numpy().tolist()}
    assert proposed and proposed_again and not proposed & proposed_again
    assert not [line for line in second.stdout.splitlines() if PROGRESS.match(line)]


def _plan(configurations: int) -> search.CellPlan:
    """A cell plan without calibration (the sampler reads only its keys, batch sizes and budget)."""
    return search.CellPlan(
        Cell(epsilon=3.5, epochs=10),
        "normalized",
        TINY_TRAIN_EXAMPLES,
        (32, 64),
        (),
        wrapped({32: 1.0, 64: 1.0}, 3.5, 1e-5, TINY_TRAIN_EXAMPLES, 10),
        configurations,
    )


def test_private_cell_samplers_propose_from_secret_coins_and_default_ones_from_the_public_seed() -> None:
    plan = _plan(configurations=10)

    def proposals(path: Path) -> list[list[tuple]]:
        loaded = load_space(path)
        samplers = [CellSampler(search.cell_spec(loaded.space, plan)) for _ in range(2)]
        return [[tuple(sorted(p.items())) for p in sampler.ask(5, lambda _: None)] for sampler in samplers]

    public, again = proposals(REPO_ROOT / "search_spaces/default.yaml")
    assert public == again  # the default space's proposals follow its public seed
    secret, other = proposals(PRIVATE)
    assert not set(secret) & set(other)  # two private searches share no proposal


def test_a_resumed_private_search_keeps_its_secret_trial_count(tmp_path: Path) -> None:
    plans = [_plan(configurations=4)]
    first = search.kept_trial_counts(str(tmp_path), plans)
    redrawn = [replace(plan, configurations=plan.configurations + 7) for plan in plans]
    assert [p.configurations for p in search.kept_trial_counts(str(tmp_path), redrawn)] == [
        p.configurations for p in first
    ]
    assert [f.name for f in tmp_path.iterdir()] == [search.TRIAL_COUNT_FILE]  # written whole, no temporary left
    # a cell the kept file lacks keeps the count drawn now, and a second resume reads that one back
    other = replace(plans[0], cell=Cell(epsilon=1.0, epochs=10))
    (_, added) = search.kept_trial_counts(str(tmp_path), [*redrawn, other])
    again = replace(other, configurations=other.configurations + 5)
    assert [p.configurations for p in search.kept_trial_counts(str(tmp_path), [*redrawn, again])] == [
        4,
        added.configurations,
    ]


# --------------------------------------------------------------------------- crash, kill, resume


def _ran(root: Path) -> pd.DataFrame:
    trials = read_table(str(root), "trials")
    return trials[trials["status"] != "pruned_min_steps"]


# Only in Ray's worker processes (Ray's own Python processes must not import torch at start-up).
_HOLD_LATER_GROUPS = """
import os, pathlib, sys, time
if sys.argv and sys.argv[0].endswith("default_worker.py"):
    import dptune.runners.fused as fused
    _real = fused.run_fused
    marks = pathlib.Path(os.environ["DPTUNE_TEST_MARKS"])
    def run_fused(configs, on_done=None, **kwargs):
        def done(positions, results):
            try:
                (marks / "first").touch(exist_ok=False)  # atomic: one group, in any process, goes first
            except FileExistsError:
                time.sleep(300)  # the test kills the search meanwhile
            if on_done is not None:
                on_done(positions, results)
        return _real(configs, on_done=done, **kwargs)
    fused.run_fused = run_fused
"""


def test_sigkill_then_resume_runs_every_trial_exactly_once(search_env: dict[str, str], tmp_path: Path) -> None:
    # fused units (3 configurations × 2 replicates each): a kill between two fused groups' writes
    args = (
        "--space",
        str(TINY),
        "--storage",
        str(tmp_path),
        "--no-report",
        "--set",
        "privacy.epsilons=[2]",
        "--set",
        "training.compare_auto_s=false",
        "--set",
        "clip_bound.values=[0.1,0.3,1.0]",
        "--set",
        "replicates=2",
    )
    # The first fused group to finish records at once; every later one waits before recording, so
    # the kill lands between two groups' writes however fast the machine is.
    hook, marks = tmp_path / "hook", tmp_path / "marks"
    hook.mkdir()
    marks.mkdir()
    (hook / "sitecustomize.py").write_text(_HOLD_LATER_GROUPS)
    held = {
        **search_env,
        "DPTUNE_TEST_MARKS": str(marks),
        "PYTHONPATH": os.pathsep.join(p for p in (str(hook), search_env.get("PYTHONPATH", "")) if p),
    }
    process = subprocess.Popen(
        search_command(*args),
        cwd=REPO_ROOT,
        env=held,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    root = tmp_path / "tiny"
    deadline = time.monotonic() + 600
    try:
        while len(_ran(root)) < 2:
            assert process.poll() is None, "the search ended before it could be killed"
            assert time.monotonic() < deadline, "no trial finished within 10 minutes"
            time.sleep(0.5)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    before = _ran(root).set_index("trial_id")["finished_at"]
    assert 2 <= len(before) < 12
    resumed = run_search(search_env, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _ran(root)
    assert after["trial_id"].is_unique and len(after) == 12  # 3 C × 2 feasible B × 2 replicates
    assert sorted(map(tuple, after[["clip_bound", "batch_size", "replicate"]].values.tolist())) == sorted(
        (c, b, r) for c in (0.1, 0.3, 1.0) for b in (32, 64) for r in (0, 1)
    )
    assert set(after["engine"]) == {"fused"}
    # trials finished before the kill were not run again
    assert (after.set_index("trial_id").loc[before.index, "finished_at"] == before).all()
    assert not list(root.rglob(".tmp-*")), "a half-written part was left behind"


# --------------------------------------------------------------------------- on a Ray cluster


def _tiny_on_cluster_args(storage: Path) -> list[str]:
    return [
        "--space",
        str(TINY),
        "--storage",
        str(storage),
        "--no-report",
        "--set",
        "privacy.epsilons=[2]",
        "--set",
        "training.compare_auto_s=false",
        "--set",
        "clip_bound.values=[1.0]",
    ]


def test_search_runs_trials_on_a_second_node(search_env: dict[str, str], tmp_path: Path) -> None:
    """A head with no CPUs for trials and a worker node on this machine: every trial runs on the worker."""
    from conftest import start_two_node_cluster

    with start_two_node_cluster(search_env) as address:
        completed = run_search(search_env, *_tiny_on_cluster_args(tmp_path), "--address", address)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    ran = _ran(tmp_path / "tiny")
    assert sorted(ran["batch_size"]) == [32, 64] and set(ran["status"]) == {"ok"}, ran[["status", "reason"]]


def test_asha_stops_weak_trials_early_and_records_them(search_env: dict[str, str], tmp_path: Path) -> None:
    completed = run_search(
        search_env,
        "--space",
        str(TINY),
        "--storage",
        str(tmp_path),
        "--no-report",
        "--set",
        "privacy.epsilons=[2]",
        "--set",
        "training.compare_auto_s=false",
        "--set",
        "epochs=[4]",
        "--set",
        "clip_bound.values=[0.01,0.1,1.0]",
        "--set",
        "base_learning_rate.values=[0.00001,0.03]",
        "--set",
        "scheduler={name: asha, grace_period: 1, reduction_factor: 2}",
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    ran = _ran(tmp_path / "tiny")
    assert len(ran) == 12 and ran["trial_id"].is_unique
    stopped = ran[ran["status"] == "stopped_early"]
    assert len(stopped) >= 1 and set(ran["status"]) <= {"ok", "stopped_early"}
    assert (stopped["reason"] == "stopped by the ASHA scheduler").all()
    epochs = read_table(str(tmp_path / "tiny"), "epochs")
    last_epoch = epochs.groupby("trial_id")["epoch"].max()
    assert (last_epoch.loc[stopped["trial_id"]] < 4).all()
    assert (last_epoch.loc[ran[ran["status"] == "ok"]["trial_id"]] == 4).all()
    # a stopped trial spent the steps it took before its last report, and the search counts them
    last_steps = epochs.sort_values("epoch").groupby("trial_id")["steps"].last()
    assert (stopped.set_index("trial_id")["steps_taken"] == last_steps.loc[stopped["trial_id"]]).all()
    assert ((stopped["epsilon_spent"] > 0) & (stopped["epsilon_spent"] < stopped["epsilon"])).all()
    search_row = read_table(str(tmp_path / "tiny"), "search").iloc[0]
    assert search_row["trials_with_steps"] == 12
    assert search_row["epsilon_composition"] == pytest.approx(ran["epsilon_spent"].sum())
    (model,) = (tmp_path / "tiny" / "models").iterdir()  # its card claims nothing for an adaptive search
    assert json.loads((model / "model_card.json").read_text())["privacy"]["covers"].startswith("NOTHING as released")
