"""The empirical privacy audit (dptune.audit): the one-run theorem's numbers, and real audits of the
embedded workload through the fused runner, correct and deliberately broken (dptune.dp.faults)."""

from __future__ import annotations

import ast
import json
import math
import stat
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

import dptune
from conftest import TINY_EVAL_EXAMPLES, TINY_TRAIN_EXAMPLES
from dptune.audit import BLACK_BOX, WHITE_BOX, AuditError, ceiling, epsilon_lower_bound, p_value
from dptune.audit.bound import best_bound, correct_guesses
from dptune.audit.cli import main
from dptune.dp import faults
from dptune.dp.faults import FAULTS

PACKAGE = Path(dptune.__file__).resolve().parent
#: The suite's audits train on the tiny space's data with the suite's caps (one small feature cache entry):
#: its cells are ε ∈ {1, 8} at E = 3, the middle of its ranges C = 1, B = 64, η₀ = 0.01.
SPACE = Path(__file__).resolve().parent / "spaces" / "tiny.yaml"
CAPS = {"max_train_examples": TINY_TRAIN_EXAMPLES, "max_eval_examples": TINY_EVAL_EXAMPLES}
#: Canaries of the suite's audits (the benchmark's are in bench/bench_audit.py).
CANARIES = 1000

pytestmark = pytest.mark.usefixtures("dptune_cache_dir")


def reference_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The paper's p-value, written as its loop (Steinke, Nasr & Jagielski 2023, §5)."""
    q = 1 / (1 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += stats.binom.pmf(v - i, r, q)
        alpha = max(alpha, total / i)
    return min(beta + alpha * delta * 2 * m, 1.0)


@pytest.mark.parametrize(
    ("m", "r", "v", "eps", "delta"),
    [(1000, 500, 500, 4.0, 1e-5), (1000, 100, 80, 0.5, 1e-5), (5000, 2500, 1500, 0.3, 1e-6), (200, 20, 3, 0.0, 0)],
)
def test_p_value_is_the_papers(m: int, r: int, v: int, eps: float, delta: float) -> None:
    assert p_value(m, r, v, eps, delta) == pytest.approx(reference_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


def test_pure_dp_bound_is_the_binomial_tail_and_the_lower_bound_inverts_it() -> None:
    """At δ = 0 the p-value is P[Binomial(r, e^ε/(1+e^ε)) ≥ v]; the lower bound is where it crosses 5 %."""
    assert p_value(1000, 200, 150, 1.0, 0.0) == pytest.approx(stats.binom.sf(149, 200, 1 / (1 + math.exp(-1.0))))
    bound = epsilon_lower_bound(1000, 200, 150, 0.0)
    assert p_value(1000, 200, 150, bound * 0.999, 0.0) < 0.05 <= p_value(1000, 200, 150, bound * 1.001, 0.0)
    assert epsilon_lower_bound(1000, 200, 100, 1e-5) == 0.0  # chance: nothing refuted


def test_the_ceiling_grows_with_m_until_delta_caps_it() -> None:
    """Every guess right among m = 1,000 certifies ε ≈ 5.78 at δ = 1e-5 (the paper's code gives 5.78),
    about ln(m/3); m = 20,000 gives 8.20, and beyond that the 2mδ term lowers it again (8.13 at
    m = 100,000, where δ = 0 would allow 10.4): no one-run audit at δ = 1e-5 certifies ε = 10."""
    assert ceiling(1000, 1e-5) == pytest.approx(5.782, abs=2e-3)
    assert epsilon_lower_bound(1000, 500, 500, 1e-5) == pytest.approx(5.088, abs=2e-3)
    assert ceiling(1000, 1e-5) < ceiling(20_000, 1e-5) == pytest.approx(8.197, abs=2e-3)
    assert (
        ceiling(100_000, 1e-5)
        < ceiling(20_000, 1e-5)
        < ceiling(20_000, 0.0)
        == pytest.approx(math.log(20_000 / 3), abs=0.05)
    )


def test_guesses_break_ties_at_random_and_a_family_is_corrected() -> None:
    rng = np.random.default_rng(0)
    included = rng.random(4000) < 0.5
    flat = correct_guesses(np.zeros(4000), included, 2000, rng)
    assert abs(flat - 1000) < 100  # equal scores carry no information
    assert correct_guesses(included.astype(float), included, 2000, rng) == 2000
    bound = best_bound({"perfect": included.astype(float)}, included, 1.0, 1e-5, rng)
    assert len(bound.family) == 3 and bound.claim_refuted
    assert correct_guesses(included.astype(float), included, 1000, rng, "in") == 1000
    lone = epsilon_lower_bound(4000, bound.best.guesses, bound.best.correct, 1e-5)
    assert bound.epsilon_lower_bound < lone  # held to 5 %/3 per guessing
    assert bound.epsilon_lower_bound == bound.ceiling < ceiling(4000, 1e-5)  # every guess right


def test_faults_reach_no_space_and_are_read_only_by_the_engines() -> None:
    """The broken mechanisms are a test's: no module but the engines' clipping and the fused runner's
    coins reads dptune.dp.faults, and none but faults itself names ``injected``."""
    readers, injecting = set(), set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "dptune.dp"
                and any(a.name == "faults" for a in node.names)
            ):
                readers.add(name)
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "injected"
                or isinstance(node, ast.Name)
                and node.id == "injected"
            ):
                injecting.add(name)
    assert readers == {"dptune.dp.clipping", "dptune.runners.fused_group"}
    assert injecting <= {"dptune.dp.faults"}
    with pytest.raises(ValueError, match="unknown"), faults.injected("no_noise"):  # type: ignore[arg-type]
        pass


def _audit(tmp_path: Path, name: str, epsilon: float, **kwargs: object) -> pd.DataFrame:
    kwargs = {"canaries": CANARIES, **CAPS, **kwargs}
    report = dptune.audit(SPACE, out=tmp_path / name, epsilon=epsilon, seed=7, progress=False, **kwargs)
    return report.rows.set_index("threat_model")


@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_the_correct_mechanism_stays_below_the_claim(tmp_path: Path, epsilon: float) -> None:
    """The tiny space's cells at ε ∈ {1, 8}, E = 3, at the middle of its ranges."""
    rows = _audit(tmp_path, "audit", epsilon)
    assert set(rows.index) == {WHITE_BOX, BLACK_BOX}
    for threat in (WHITE_BOX, BLACK_BOX):
        row = rows.loc[threat]
        assert row.epsilon == epsilon and row.delta == 1e-5 and row.canaries == CANARIES
        assert 0 <= row.epsilon_lower_bound < epsilon and not row.claim_refuted
        assert row.ceiling < ceiling(CANARIES, 1e-5)  # six guessings, each at 5 %/6
        assert (row.ceiling > epsilon) == (epsilon == 1.0)  # no one-run audit at m = 1,000 can refute ε = 8
    folder = tmp_path / "audit"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # the inclusion coins are the owner's
    canaries = pd.read_parquet(folder / "canaries.parquet")
    assert len(canaries) == CANARIES and 0.4 < canaries["included"].mean() < 0.6
    summary = json.loads((folder / "audit.json").read_text())
    assert [r["epsilon_lower_bound"] for r in summary["rows"]] == list(rows["epsilon_lower_bound"])
    text = (folder / "summary.txt").read_text()
    assert text.count("empirical ε lower bound") == 2 and "below the claim" in text
    assert ("cannot refute ε = 8" in text) == (epsilon == 8.0)
    assert (folder / "scores.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("fault", FAULTS)
def test_each_broken_mechanism_is_caught(tmp_path: Path, fault: str) -> None:
    """Noise off, σ/10 and one step's noise reused are refuted by the white-box audit (its gradient
    canaries see the noise); clipping bypassed by the black-box one (its input canaries' gradients are
    the engine's to clip, a gradient canary's already is): the bound exceeds twice the claimed ε = 1."""
    with faults.injected(fault):  # type: ignore[arg-type]
        rows = _audit(tmp_path, fault, 1.0)
    caught = rows.loc[BLACK_BOX if fault == "no_clipping" else WHITE_BOX]
    assert caught.claim_refuted and caught.epsilon_lower_bound > 2.0, caught.to_dict()
    assert caught.claim_p_value < 0.01
    if fault == "reused_noise":  # the sum of a noise that never changes hides nothing: its variation shows it
        assert caught.score == "variation"
    if fault == "no_clipping":  # the white-box audit cannot see clipping: its canaries are clipped already
        assert not rows.loc[WHITE_BOX].claim_refuted


def test_an_audit_folder_is_its_own(tmp_path: Path) -> None:
    """An existing folder holding other files is refused before any compute (an audit's files and coins
    are not mixed with anything); an earlier audit's folder is replaced whole."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("mine")
    with pytest.raises(AuditError, match="not an empty folder or an earlier audit's"):
        dptune.audit(SPACE, out=shared, canaries=100, progress=False, **CAPS)
    assert sorted(p.name for p in shared.iterdir()) == ["notes.txt"] and stat.S_IMODE(shared.stat().st_mode) != 0o700
    own = tmp_path / "own"
    first = dptune.audit(SPACE, out=own, canaries=100, progress=False, **CAPS)
    second = dptune.audit(SPACE, out=own, canaries=200, progress=False, **CAPS)  # an earlier audit is replaced
    assert first.rows["canaries"].tolist() == [100, 100] and second.rows["canaries"].tolist() == [200, 200]
    assert len(pd.read_parquet(own / "canaries.parquet")) == 200
    assert json.loads((own / "audit.json").read_text())["rows"][0]["canaries"] == 200


def test_configurations_of_two_batch_sizes_are_audited_together(tmp_path: Path) -> None:
    configurations = [(0.3, 32, 3e-3), (1.0, 32, 1e-2), (0.3, 64, 3e-3)]
    report = dptune.audit(
        SPACE, out=tmp_path / "three", configurations=configurations, canaries=300, seed=3, progress=False, **CAPS
    )
    white = report.rows[report.rows["threat_model"] == WHITE_BOX]
    assert list(zip(white.clip_bound, white.batch_size, white.base_learning_rate, strict=True)) == configurations
    assert (white["epsilon_lower_bound"] < white["epsilon"]).all()
    assert white["sample_rate"].iloc[2] == pytest.approx(2 * white["sample_rate"].iloc[0])
    assert "empirical ε lower bound" in str(report)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configuration", "0.3,abc,0.01"], "expected C,B,ETA0"),
        (["--canaries", "99"], "canaries must be an integer ≥ 100"),
        (["--configuration", "inf,64,0.01"], "a finite C > 0"),
        (["--out", "s3://bucket/audit"], "give a local folder"),
        (["--set", "task.peft=film"], "peft 'head'"),
        (["--configuration", "0.3,256,-1"], "η₀ > 0"),
        (["--epsilon", "3"], "no cell with ε 3"),
        (["--cite"], "give the model with --model DIR"),
        (["--runner", "opacus"], "invalid choice"),
    ],
)
def test_bad_input_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--space", str(SPACE), "--out", str(tmp_path / "audit"), *argv])
    assert exit_.value.code != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "audit" / "audit.json").exists()


@pytest.mark.parametrize("engine", ["film", "opacus"])
def test_the_trial_runner_is_audited_with_the_spaces_engine(tmp_path: Path, engine: str) -> None:
    """One run at a time through run_trial, with the FiLM or the Opacus engine: below the claim, and
    with the noise off refuted (the observer sees the head's released gradient from either engine)."""
    kwargs = {"runner": "trial", "overrides": {"training.engine": engine}, "canaries": 500}
    fine = _audit(tmp_path, "fine", 1.0, **kwargs).loc[WHITE_BOX]
    with faults.injected("noise_off"):
        broken = _audit(tmp_path, "broken", 1.0, **kwargs).loc[WHITE_BOX]
    assert fine.epsilon_lower_bound < 1.0 < broken.epsilon_lower_bound
    assert broken.correct >= broken.guesses - 2
