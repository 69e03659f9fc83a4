"""dptune.plan: steps and sampling rate, the batch-size rule, the plan on real PRV accounting, the CLI."""

from __future__ import annotations

import itertools
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dptune import __version__, privacy
from dptune.plan import (
    RECOMMENDED_MARK,
    PlanRow,
    coupled_learning_rate,
    default_batch_sizes,
    epoch_steps,
    main,
    plan,
    recommended_batch_size,
    sample_rate,
    total_steps,
)
from dptune.plan import mechanism as mechanism_module
from dptune.privacy import calibration, prv

pytestmark = pytest.mark.usefixtures("dptune_cache_dir")

# The paper-sized case on real accounting: N = 50000, E = 10, ε ∈ {1, 8}, δ = 1e-5, a grid of B that
# spans the plateau and ends at full batch (T = 10 < T_min = 20).
N, EPOCHS, DELTA = 50_000, 10, 1e-5
EPSILONS = [1.0, 8.0]
BATCH_SIZES = [256, 1024, 4096, 16384, 50_000]
CLI_ARGS = ["--n", str(N), "--eps", "1", "8", "--epochs", str(EPOCHS), "--batch-sizes", *map(str, BATCH_SIZES)]


def test_steps_round_the_whole_epoch_budget_once() -> None:
    assert total_steps(50_000, 16, 10) == 31_250
    assert total_steps(50_000, 256, 10) == 1953  # round(1953.125); per-epoch rounding gave 10·195 = 1950
    assert total_steps(50_000, 32_768, 10) == 15  # round(15.26); per-epoch rounding gave 10·round(1.53) = 20
    assert total_steps(100, 40, 1) == 2  # round(2.5): half to even
    assert total_steps(100, 40, 3) == 8  # round(7.5): half to even
    assert total_steps(10, 7, 1) == 1  # round(1.43)
    assert total_steps(10, 10, 5) == 5  # full batch: one step per epoch
    assert sample_rate(50_000, 256) == 256 / 50_000


def test_epoch_steps_examples() -> None:
    assert epoch_steps(10, 4, 4) == [2, 3, 3, 2]  # epochs end at round(2.5), 5, round(7.5), 10 = 2, 5, 8, 10
    assert epoch_steps(50_000, 32_768, 10) == [2, 1] * 5  # 15 steps, 9.83 passes (2 steps per epoch: 13.1)
    assert epoch_steps(300, 32, 3) == [9, 10, 9]  # the tiny test search: N = 300, E = 3
    assert epoch_steps(300, 64, 3) == [5, 4, 5]
    assert epoch_steps(300, 256, 3) == [1, 1, 2]
    assert epoch_steps(1000, 100, 3) == [10, 10, 10]  # B divides N


@pytest.mark.parametrize("num_examples", [1, 7, 300, 1000, 50_000])
def test_full_batch_is_one_step_per_epoch_and_batch_of_one_is_n(num_examples: int) -> None:
    assert epoch_steps(num_examples, num_examples, 4) == [1, 1, 1, 1]
    assert total_steps(num_examples, num_examples, 4) == 4
    assert epoch_steps(num_examples, 1, 3) == [num_examples] * 3
    assert total_steps(num_examples, 1, 3) == 3 * num_examples


# (N, B) with B dividing N, not dividing it, B > N/2, B = 1, B = N; E from 1 to 30.
SWEEP = [
    (n, b, e)
    for n, b in [
        (7, 2),
        (7, 3),
        (7, 5),
        (50, 20),
        (300, 32),
        (300, 64),
        (300, 256),
        (1000, 999),
        (50_000, 16),
        (50_000, 256),
        (50_000, 32_768),
        (50_000, 50_000),
        (11_293, 1),
    ]
    for e in (1, 2, 3, 10, 30)
]


def test_epoch_steps_sum_to_total_steps_and_keep_the_expected_passes_on_budget() -> None:
    """Every epoch has ≥ 1 step, ⌊N/B⌋ or ⌈N/B⌉ of them; the steps sum to T; after each epoch e the
    expected passes over the data (steps so far · q) are within q/2 of e, so |T·B/N − E| ≤ B/(2N)."""
    for num_examples, batch_size, epochs in SWEEP:
        steps = epoch_steps(num_examples, batch_size, epochs)
        ratio = num_examples / batch_size
        assert len(steps) == epochs and sum(steps) == total_steps(num_examples, batch_size, epochs)
        assert all(s >= 1 and math.floor(ratio) <= s <= math.ceil(ratio) for s in steps)
        for epoch, taken in enumerate(itertools.accumulate(steps), start=1):
            assert abs(taken * batch_size - epoch * num_examples) <= batch_size / 2  # |passes − e| ≤ q/2


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: total_steps(100, 101, 1), "batch_size"),
        (lambda: epoch_steps(100, 0, 1), "batch_size"),
        (lambda: sample_rate(0, 1), "num_examples"),
        (lambda: total_steps(100, 10, 0), "epochs"),
        (lambda: total_steps(100, 10, 2.0), "epochs"),
        (lambda: epoch_steps(100, 10, 0), "epochs"),
        (lambda: epoch_steps(100, 10, True), "epochs"),
        (lambda: coupled_learning_rate(0.0, 64, 256), "base_learning_rate"),
    ],
)
def test_step_helpers_reject_bad_sizes(call: object, named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named}"):
        call()  # type: ignore[operator]


def test_learning_rate_scales_with_square_root_of_batch_size() -> None:
    assert coupled_learning_rate(1e-3, 1024, 256) == pytest.approx(2e-3)
    assert coupled_learning_rate(1e-3, 64, 256) == pytest.approx(5e-4)
    assert coupled_learning_rate(3e-4, 256, 256) == 3e-4


def test_default_grid_is_powers_of_two_from_16_plus_full_batch() -> None:
    assert default_batch_sizes(100) == [16, 32, 64, 100]
    assert default_batch_sizes(64) == [16, 32, 64]
    assert default_batch_sizes(10) == [10]
    assert default_batch_sizes(50_000)[-3:] == [16_384, 32_768, 50_000]


# --------------------------------------------------------------------------- the rule on constructed cases

SIZES = [16, 32, 64, 128, 256]
STEPS = [100, 50, 25, 12, 6]
NOISE = [2.0, 1.5, 1.04, 1.0, 0.9]  # σ√T keeps falling up to full batch


def test_min_step_rule_excludes_large_batches_with_lower_noise() -> None:
    assert recommended_batch_size(SIZES, NOISE, STEPS, min_steps=20, tolerance=0.05) == 64
    assert recommended_batch_size(SIZES, NOISE, STEPS, min_steps=5, tolerance=0.0) == 256


def test_rule_picks_the_smallest_batch_on_the_plateau() -> None:
    assert recommended_batch_size(SIZES, NOISE, STEPS, min_steps=1, tolerance=0.05) == 256  # only 0.9 ≤ 0.945
    assert recommended_batch_size(SIZES, NOISE, STEPS, min_steps=1, tolerance=0.12) == 128  # 1.0 ≤ 1.008
    assert recommended_batch_size(SIZES, NOISE, STEPS, min_steps=1, tolerance=0.16) == 64  # 1.04 ≤ 1.044
    assert recommended_batch_size(SIZES, NOISE, STEPS, min_steps=1, tolerance=0.7) == 32  # 1.5 ≤ 1.53


def test_no_batch_size_meets_the_min_step_rule() -> None:
    assert recommended_batch_size(SIZES, NOISE, STEPS, min_steps=101, tolerance=0.05) is None


# --------------------------------------------------------------------------- the plan on real accounting


@pytest.fixture(scope="module")
def rows() -> list[PlanRow]:
    privacy.clear_memory_cache()  # so that this module's disk cache holds every σ and ε of the plan
    return plan(N, EPSILONS, DELTA, EPOCHS, BATCH_SIZES)


def test_rows_agree_with_the_step_helpers_and_the_accountant(rows: list[PlanRow]) -> None:
    assert [(row.epsilon, row.batch_size) for row in rows] == [(e, b) for e in EPSILONS for b in BATCH_SIZES]
    for row in rows:
        steps = round(EPOCHS * N / row.batch_size)
        assert (row.sample_rate, row.steps) == (row.batch_size / N, steps)
        assert row.passes == pytest.approx(steps * row.batch_size / N, rel=1e-12)
        assert abs(row.passes - EPOCHS) <= row.sample_rate / 2
        assert row.noise_multiplier == privacy.calibrate_noise_multiplier(row.epsilon, DELTA, row.batch_size / N, steps)
        assert privacy.epsilon_spent(row.noise_multiplier, row.sample_rate, row.steps, DELTA) <= row.epsilon
        assert row.cumulative_noise == pytest.approx(row.noise_multiplier * math.sqrt(steps), rel=1e-12)
        assert row.noise_std_per_step == pytest.approx(row.noise_multiplier / row.batch_size, rel=1e-12)
        assert row.meets_min_steps == (steps >= 20)
        assert row.learning_rate == pytest.approx(1e-3 * math.sqrt(row.batch_size / 256))


def test_full_batch_has_least_noise_but_too_few_steps(rows: list[PlanRow]) -> None:
    for epsilon in EPSILONS:
        block = [row for row in rows if row.epsilon == epsilon]
        full = block[-1]
        assert full.batch_size == N and full.steps == 10 and not full.meets_min_steps
        assert full.cumulative_noise == min(row.cumulative_noise for row in block)
        assert full.noise_std_per_step == min(row.noise_std_per_step for row in block)  # the old per-step rule's pick
        assert not full.recommended


def test_exactly_one_recommendation_per_epsilon_and_it_follows_the_rule(rows: list[PlanRow]) -> None:
    for epsilon in EPSILONS:
        block = [row for row in rows if row.epsilon == epsilon]
        (pick,) = [row for row in block if row.recommended]
        floor = min(row.cumulative_noise for row in block if row.meets_min_steps)
        assert pick.meets_min_steps and pick.cumulative_noise <= 1.05 * floor
        assert all(row.cumulative_noise > 1.05 * floor for row in block if row.batch_size < pick.batch_size)


def test_tighter_privacy_recommends_a_smaller_or_equal_batch(rows: list[PlanRow]) -> None:
    picks = {row.epsilon: row.batch_size for row in rows if row.recommended}
    assert picks[1.0] <= picks[8.0]
    assert picks == {1.0: 4096, 8.0: 16384}  # from σ√T on this grid, as computed by the PRV accountant


def test_plan_of_the_tiny_search_calibrates_every_cell() -> None:
    """N = 300, B ∈ {32, 64, 256}, E = 3 (tests/spaces/tiny.yaml) at the paper's ε: large ε, q ≈ 0.1–0.85
    and few steps, where the PRV discretisation used to fail (ε = 8, q = 32/300)."""
    rows = plan(300, [1.0, 2.0, 4.0, 8.0], DELTA, 3, [32, 64, 256], min_steps=10)
    assert [(row.batch_size, row.steps) for row in rows[:3]] == [(32, 28), (64, 14), (256, 4)]
    for row in rows:
        assert privacy.epsilon_spent(row.noise_multiplier, row.sample_rate, row.steps, DELTA) <= row.epsilon
        assert abs(row.passes - 3) <= row.sample_rate / 2
        assert row.meets_min_steps == (row.batch_size != 256)
    assert len([row for row in rows if row.recommended]) == 4


def test_repeated_plan_is_served_from_the_cache(rows: list[PlanRow], monkeypatch: pytest.MonkeyPatch) -> None:
    privacy.clear_memory_cache()  # the disk cache remains

    def accountant_called(*args: object) -> float:
        raise AssertionError(f"the accountant ran again for {args}: the plan was not served from the cache")

    monkeypatch.setattr(calibration, "_calibrate", accountant_called)
    monkeypatch.setattr(prv, "certified_epsilon", accountant_called)
    assert plan(N, EPSILONS, DELTA, EPOCHS, BATCH_SIZES) == rows


# --------------------------------------------------------------------------- the command line


def test_cli_prints_one_block_per_epsilon_with_the_recommended_row_marked(
    rows: list[PlanRow], capsys: pytest.CaptureFixture[str]
) -> None:
    main(CLI_ARGS)
    out = capsys.readouterr().out
    marked = [line for line in out.splitlines() if line.endswith(RECOMMENDED_MARK)]
    assert [line.split()[0] for line in marked] == ["4096", "16384"]
    assert "ε = 1, δ = 1e-05, N = 50000, E = 10: recommended B = 4096" in out
    assert "ε = 8, δ = 1e-05, N = 50000, E = 10: recommended B = 16384" in out
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 3  # ε = 1, ε = 8, the legend
    for block in blocks[:2]:
        table = block.splitlines()[1:]  # header and one row per B, columns right-aligned
        assert len(table) == 1 + len(BATCH_SIZES)
        assert len({len(line.removesuffix(RECOMMENDED_MARK).rstrip()) for line in table}) == 1


def test_python_dash_m_on_a_warm_cache_computes_nothing(
    rows: list[PlanRow], dptune_cache_dir: Path, tmp_path: Path
) -> None:
    # a copy of the cache that ``rows`` warmed: other tests (other xdist workers) write to the shared one
    cache = tmp_path / "cache"
    shutil.copytree(dptune_cache_dir, cache)

    def entries() -> dict[Path, int]:
        return {path: path.stat().st_mtime_ns for path in cache.rglob("*.json")}

    before = entries()
    result = subprocess.run(
        [sys.executable, "-m", "dptune.plan", *CLI_ARGS],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DPTUNE_CACHE_DIR": str(cache)},
        check=True,
    )
    assert before and entries() == before  # every σ and ε was read from the cache: none computed and written
    assert result.stdout.count(RECOMMENDED_MARK) == 2
    assert "calibrating σ" in result.stderr  # the tqdm bar (on stderr)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_out_writes_a_readable_table(
    rows: list[PlanRow], tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"plan{suffix}"
    main([*CLI_ARGS, "--out", str(path)])
    assert f"wrote 10 rows to {path}" in capsys.readouterr().out
    table = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
    assert list(table.columns) == list(PlanRow.__dataclass_fields__)
    assert table["batch_size"].tolist() == [row.batch_size for row in rows]
    assert table["noise_multiplier"].tolist() == pytest.approx([row.noise_multiplier for row in rows], rel=1e-12)
    assert table["recommended"].tolist() == [row.recommended for row in rows]


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"dptune {__version__}"
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for flag in (
        "--n",
        "--eps",
        "--delta",
        "--epochs",
        "--batch-sizes",
        "--min-steps",
        "--tolerance",
        "--base-lr",
        "--reference-batch-size",
        "--out",
    ):
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--n", "0", "--eps", "1", "--epochs", "10"], "--n"),
        (["--n", "1000", "--eps", "0", "--epochs", "10"], "--eps"),
        (["--n", "1000", "--eps", "1", "-2", "--epochs", "10"], "--eps"),
        (["--n", "1000", "--eps", "1", "--epochs", "0"], "--epochs"),
        (["--n", "1000", "--eps", "1", "--epochs", "10", "--batch-sizes", "64", "2000"], "--batch-sizes"),
        (["--n", "1000", "--eps", "1", "--epochs", "10", "--tolerance", "-0.1"], "--tolerance"),
        (["--n", "1000", "--eps", "1", "--epochs", "10", "--delta", "1"], "--delta"),
        (["--n", "1000", "--eps", "1", "--epochs", "10", "--min-steps", "0"], "--min-steps"),
        (["--n", "1000", "--eps", "1", "--epochs", "10", "--base-lr", "0"], "--base-lr"),
        (["--n", "1000", "--eps", "1", "--epochs", "10", "--out", "plan.txt"], "--out"),
        (["--n", "1000", "--eps", "one", "--epochs", "10"], "--eps"),
    ],
)
def test_bad_flags_exit_nonzero_before_any_accounting(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def forbidden(*args: object) -> float:
        raise AssertionError(f"accounting ran for {args}")

    monkeypatch.setattr(mechanism_module, "calibrate_noise_multiplier", forbidden)  # σ is calibrated there only
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_delta_above_one_over_n_is_warned_about() -> None:
    with pytest.warns(UserWarning, match="1/num_examples"):
        (row,) = plan(
            1000, [1.0, 1.0], 1e-2, 1, [1000], min_steps=1
        )  # one full-batch step; ε listed twice, planned once
    assert row.steps == 1 and row.recommended


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (
            ["--n", "100", "--epochs", "3", "--batch-sizes", "100"],
            "the most steps are T = 3, at B = 100). Lower --min-steps to 3 or less, raise --epochs to 20 or more, or "
            "give batch sizes B ≤ 15 (--batch-sizes)",
        ),
        (  # the default grid (16, 32, ..., N): B = 16 gives round(2·50/16) = 6 steps; B = 5 would give 20
            ["--n", "50", "--epochs", "2"],
            "the most steps are T = 6, at B = 16). Lower --min-steps to 6 or less, raise --epochs to 7 or more, or "
            "give batch sizes B ≤ 5 (--batch-sizes)",
        ),
        (  # no B can: T ≤ E·N = 30 < 40
            ["--n", "10", "--epochs", "3", "--batch-sizes", "10", "--min-steps", "40"],
            "the most steps are T = 3, at B = 10). Lower --min-steps to 3 or less, raise --epochs to 40 or more",
        ),
    ],
)
def test_cli_refuses_a_plan_in_which_no_batch_size_meets_the_min_step_rule(
    argv: list[str], fix: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every B has T < T_min: the command says so and what would let a B qualify, and exits 2 before any
    accounting (it used to print a table of nan and exit 0)."""

    def forbidden(*args: object) -> float:
        raise AssertionError(f"accounting ran for {args}")

    monkeypatch.setattr(mechanism_module, "calibrate_noise_multiplier", forbidden)  # σ is calibrated there only
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--eps", "2"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""
    (line,) = captured.err.splitlines()
    min_steps = argv[argv.index("--min-steps") + 1] if "--min-steps" in argv else "20"
    assert line.startswith(
        f"error: --min-steps {min_steps}: no batch size qualifies: T = round(E·N/B) < {min_steps} for every B "
    ), line
    assert line.endswith(fix), line
