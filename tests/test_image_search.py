"""The image search space end to end, and what the search does before Ray and after failures.

- A model/PEFT/engine combination that cannot run, or a dataset that is not there, fails in the
  driver before Ray starts (no Ray in this process, no Ray process below it), with one message.
- A cell whose trials all failed is summarised with the count and the most common reason.
- One tiny FiLM search on ``search_spaces/mnist5k_efficientnet_film.yaml`` (real EfficientNet-Lite0
  weights, MNIST-5k, embedded Ray), two cells: every trial of one fails (fault injected) and is
  recorded with its reason and no privacy spent, and the summary says so; the other cell's trials
  finish ``ok``, better than chance, with ε spent ≤ target; ``python -m dptune.report`` draws its
  figures.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import ray

from conftest import REPO_ROOT, fault_injection_env, ray_processes_below, search_command
from dptune import search
from dptune.records import read_table

IMAGE_SPACE = REPO_ROOT / "search_spaces/mnist5k_efficientnet_film.yaml"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["training.engine=film", "task.peft=full"],
            "engine 'film' cannot run this model: peft 'full' is not one of film, head; use engine 'opacus' or 'auto'",
        ),
        (
            ["task.peft=lora"],
            "peft 'lora' adapts attention projections and backbone 'efficientnet_lite0' has no attention",
        ),
        (["task.dataset=cifar100", "task.backbone=wrn16_4", "task.peft=full"], "dataset 'cifar100' not found under"),
    ],
)
def test_a_combination_that_cannot_run_fails_before_ray_starts(
    overrides: list[str],
    message: str,
    capsys: pytest.CaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dptune_cache_dir: Path,
) -> None:
    monkeypatch.setenv("DPTUNE_DATA_DIR", str(tmp_path / "no-data"))
    before = ray_processes_below()
    assert not ray.is_initialized()
    args = [
        "--space",
        str(IMAGE_SPACE),
        "--storage",
        str(tmp_path / "results"),
        "--max-train-examples",
        "300",
        "--set",
        "min_steps=5",
    ]
    with pytest.raises(SystemExit) as exit_info:
        search.main(args + [item for override in overrides for item in ("--set", override)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    lines = [
        line
        for line in captured.err.replace("\r", "\n").splitlines()
        if line.strip() and not line.startswith("calibrating σ")
    ]
    assert lines == [lines[-1]] and lines[-1].startswith("error: ") and message in lines[-1]  # one message
    assert "started embedded local Ray" not in captured.out
    assert not ray.is_initialized() and ray_processes_below() <= before


def test_a_cell_whose_trials_all_failed_says_so_and_why() -> None:
    trials = pd.DataFrame(
        {
            "cell_id": ["eps=1|epochs=3"] * 4 + ["eps=8|epochs=3"] * 3,
            "clipping": ["normalized"] * 7,
            "status": ["error", "error", "diverged", "pruned_min_steps", "ok", "error", "pruned_min_steps"],
            "reason": [
                "ModelError: BatchNorm cannot be trained",
                "ModelError: BatchNorm cannot be trained",
                "non-finite training loss (nan) at step 3 (epoch 1)",
                "T = 5 steps < min_steps = 20",
                "",
                "out of memory",
                "T = 5 steps < min_steps = 20",
            ],
        }
    )
    assert search.format_failed_cells(trials) == [
        "cell eps=1|epochs=3 [normalized]: every trial that ran failed (2 error, 1 diverged); most common reason "
        "(2 of 3): ModelError: BatchNorm cannot be trained"
    ]


def assert_better_than_chance(classes: pd.DataFrame, trials: pd.DataFrame) -> None:
    """The trials learned the digits: each scores above 1/k (k classes; a guess that ignores the image
    scores 1/k in expectation on balanced digits) and recognises more than one class (a model that
    always answers one class scores 1 on it and 0 on every other), and the best one lies more than
    3 binomial standard errors above 1/k on its ``num_test`` test examples (150 here: 1/k + 3 SE =
    0.17; the two trials of this search scored 0.32 and 0.43 after their 5 DP steps in one run)."""
    for trial in trials.itertuples():
        assert trial.test_accuracy > 1 / trial.num_classes, (trial.trial_id, trial.test_accuracy)
        own = classes[classes["trial_id"] == trial.trial_id]
        assert len(own) == trial.num_classes and (own["test_accuracy"] > 0).sum() >= 2, own
    best = trials.loc[trials["test_accuracy"].idxmax()]
    chance = 1 / best["num_classes"]
    margin = 3 * math.sqrt(chance * (1 - chance) / best["num_test"])
    assert best["test_accuracy"] > chance + margin, (best["test_accuracy"], chance + margin)


def test_a_tiny_film_search_finishes_records_a_failing_cell_and_reports(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    """One real search of the image space, two cells: every trial of ε = 8 fails (fault injected
    inside ``run_trial``), ε = 2 trains FiLM for real. The failing cell is recorded and summarised;
    the search goes on and the other cell's trials finish; the report draws its figures."""
    env = fault_injection_env(search_env, tmp_path / "hook", "config.epsilon == 8", "injected fault: the disk is full")
    command = search_command(
        "--space",
        str(IMAGE_SPACE),
        "--storage",
        str(tmp_path),
        "--name",
        "images",
        "--no-report",
        "--set",
        "privacy.epsilons=[2,8]",
        "--set",
        "epochs=[1]",
        "--set",
        "batch_size.values=[64]",
        "--set",
        "min_steps=2",
        "--trials-per-cell",
        "2",
        "--set",
        "training.diagnostic_examples=16",
    )
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    # the cell whose trials all failed: its count and most common reason, and no other cell
    summary = done.stdout.split(search.SUMMARY_HEADER + "\n")[1]
    failed_lines = [line for line in summary.splitlines() if "every trial that ran failed" in line]
    assert failed_lines == [
        "cell eps=8|epochs=1 [normalized]: every trial that ran failed (2 error); most common reason (2 of 2): "
        "RuntimeError: injected fault: the disk is full"
    ], summary
    assert "no finished trials yet" not in done.stdout
    trials = read_table(str(tmp_path / "images"), "trials")
    assert len(trials) == 4 and trials["trial_id"].is_unique
    # each failing trial is recorded with its reason, charged nothing (it failed before a step)
    failed = trials[trials["epsilon"] == 8]
    assert len(failed) == 2 and set(failed["status"]) == {"error"}, failed[["status", "reason"]]
    assert failed["reason"].str.contains("injected fault: the disk is full").all()
    assert (failed["steps_taken"] == 0).all() and (failed["epsilon_spent"] == 0).all()
    # ... and the search went on: the other cell's trials trained FiLM and finished
    trained = trials[trials["epsilon"] == 2]
    assert len(trained) == 2 and (trained["status"] == "ok").all(), trained[["status", "reason"]]
    assert (trained["epsilon_spent"] > 0).all() and (trained["epsilon_spent"] <= trained["epsilon"]).all()
    assert set(trained["peft"]) == {"film"} and set(trained["engine"]) == {"film"}
    assert_better_than_chance(read_table(str(tmp_path / "images"), "classes"), trained)
    report = subprocess.run(
        [sys.executable, "-m", "dptune.report", str(tmp_path / "images"), "--out", str(tmp_path / "report")],
        cwd=REPO_ROOT,
        env=search_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert report.returncode == 0, report.stderr[-3000:]
    figures = {path.name for path in (tmp_path / "report").glob("*.png")}
    assert {"fig2-optimal-c-b.png", "fig3-grad-norms.png", "fig4a-retention-weights.png"} <= figures
    assert "fig1-accuracy-heatmaps-mnist5k-efficientnet-lite0-film.png" in figures
