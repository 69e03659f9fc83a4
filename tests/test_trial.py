"""run_trial end to end on the embedded 20 Newsgroups + MiniLM workload (small subsets, real weights)."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dptune.contract import WorkloadSpec
from dptune.data import load_workload
from dptune.paths import CACHE_ENV
from dptune.plan import epoch_steps, sample_rate, total_steps
from dptune.privacy import calibrate_noise_multiplier, epsilon_spent
from dptune.runners import trainer
from dptune.runners.checkpoint import RunCheckpoint
from dptune.runners.common import cached_workload
from dptune.runners.trainer import Trial
from dptune.runners.trial import EpochMetrics, TrialConfig, TrialConfigError, TrialFailed, TrialResult, run_trial
from trial_configs import planned

BASE = TrialConfig(
    workload=WorkloadSpec(
        dataset="20newsgroups", backbone="minilm", peft="head", max_train_examples=100, max_eval_examples=60
    ),
    epsilon=8.0,
    delta=1e-5,
    epochs=4,
    clip_bound=0.5,
    batch_size=30,  # N/B = 10/3: epochs of 3, 4, 3, 3 steps, T = round(E·N/B) = 13
    learning_rate=0.05,
    base_learning_rate=0.05,
    optimizer="adam",
    clipping="normalized",
    seed=3,
    engine="opacus",
    max_physical_batch_size=16,
    threads=1,
    diagnostic_examples=40,
)

# Its module fixtures are costly: under pytest-xdist the whole module runs on one worker.
pytestmark = pytest.mark.xdist_group("trial")


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One fresh dptune cache (features, σ calibrations) shared by this module's trials."""
    folder = tmp_path_factory.mktemp("dptune-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(folder))
        yield folder


@pytest.fixture(scope="module")
def reported() -> list[EpochMetrics]:
    return []


@pytest.fixture(scope="module")
def result(reported: list[EpochMetrics]) -> TrialResult:
    return run_trial(planned(BASE), reported.append)


def test_trial_runs_the_planned_poisson_steps_at_the_calibrated_noise(
    result: TrialResult, reported: list[EpochMetrics]
) -> None:
    n = result.num_train
    assert result.status == "ok", result.reason
    assert result.sample_rate == pytest.approx(sample_rate(n, BASE.batch_size))
    assert result.steps == total_steps(n, BASE.batch_size, BASE.epochs)
    assert result.noise_multiplier == calibrate_noise_multiplier(
        BASE.epsilon, BASE.delta, result.sample_rate, result.steps
    )
    assert [m.steps for m in result.epochs] == list(itertools.accumulate(epoch_steps(n, BASE.batch_size, BASE.epochs)))
    assert result.epochs[-1].steps == result.steps  # exactly the T steps σ was calibrated for
    assert result.epsilon_spent == epsilon_spent(result.noise_multiplier, result.sample_rate, result.steps, BASE.delta)
    assert 0.9 * BASE.epsilon < result.epsilon_spent <= BASE.epsilon
    assert result.engine == "opacus"


def test_trial_records_epochs_test_accuracy_and_classes(result: TrialResult, reported: list[EpochMetrics]) -> None:
    assert reported == result.epochs and len(reported) == BASE.epochs
    assert all(m.test_accuracy is None for m in reported[:-1])
    assert reported[-1].test_accuracy == result.test_accuracy
    assert result.val_accuracy == reported[-1].val_accuracy
    assert all(m.examples_per_s > 0 and m.wall_time_s > 0 and math.isfinite(m.train_loss) for m in reported)
    assert result.trainable_parameters == (384 + 1) * result.num_classes
    test_labels = load_workload(BASE.workload).test.tensors[-1]
    counts = torch.bincount(test_labels, minlength=result.num_classes)
    assert result.num_test == len(test_labels)
    assert set(result.class_accuracy) == {c for c in range(result.num_classes) if counts[c] > 0}
    weighted = sum(accuracy * int(counts[c]) for c, accuracy in result.class_accuracy.items()) / len(test_labels)
    assert weighted == pytest.approx(result.test_accuracy)  # per-class accuracies add up to the overall one
    assert len(result.class_names) == result.num_classes
    # a DP linear probe on 100 documents learns something: validation loss falls below log(k)
    assert reported[-1].val_loss < math.log(result.num_classes)


def test_trial_diagnoses_a_fixed_probe_before_during_and_after_training(result: TrialResult) -> None:
    assert [d.epoch for d in result.diagnostics] == [0, 2, 4]
    first, *_, last = result.diagnostics
    assert len(first.grad_norms) == BASE.diagnostic_examples
    assert first.labels == last.labels  # the same probe examples every time
    assert first.grad_norms != last.grad_norms  # ... whose gradients training changed
    for record in result.diagnostics:
        assert record.dimension == result.trainable_parameters
        assert record.noise_multiplier == result.noise_multiplier
        assert record.expected_batch_size == pytest.approx(BASE.batch_size)
        assert record.mse_variance == pytest.approx(
            result.noise_multiplier**2 * BASE.clip_bound**2 * record.dimension / BASE.batch_size**2
        )
        # the clipping bias at C: zero exactly when no probe gradient is clipped, and never above the
        # square of the mean norm removed by clipping (triangle inequality over (min(1, C/‖g‖) − 1)·g)
        clipped = [norm - BASE.clip_bound for norm in record.grad_norms if norm > BASE.clip_bound]
        assert (record.mse_bias > 0) == bool(clipped)
        assert record.mse_bias <= (sum(clipped) / len(record.grad_norms)) ** 2 * (1 + 1e-6)
        # C* minimises bias + σ²C²d/B², so its noise term alone is at most the MSE at C; and beyond the
        # largest norm nothing is clipped, so a larger C only adds noise
        assert 0 < record.optimal_clip_bound <= max(record.grad_norms)
        assert record.mse_variance * (record.optimal_clip_bound / BASE.clip_bound) ** 2 <= (
            (record.mse_bias + record.mse_variance) * (1 + 1e-9)
        )
        assert sum(c.examples for c in record.classes) == len(record.grad_norms)
    assert result.diagnostics_wall_time_s == pytest.approx(sum(d.wall_time_s for d in result.diagnostics))
    assert result.diagnostics_wall_time_s < result.wall_time_s


def test_same_seed_same_result_on_cpu(result: TrialResult) -> None:
    """The reproducibility opt-in (BASE has seed=3): same seed, same result, bit for bit."""
    again = run_trial(planned(BASE))
    timing = ("wall_time_s", "examples_per_s", "diagnostics_wall_time_s", "epochs", "diagnostics", "trained")
    strip = {k: v for k, v in asdict(again).items() if k not in timing}
    assert strip == {k: v for k, v in asdict(result).items() if k not in timing}
    for a, b in zip(again.epochs, result.epochs, strict=True):
        assert (a.train_loss, a.val_loss, a.val_accuracy) == (b.train_loss, b.val_loss, b.val_accuracy)
    assert [d.grad_norms for d in again.diagnostics] == [d.grad_norms for d in result.diagnostics]
    assert again.trained is not None and result.trained is not None
    assert again.trained.parameters.keys() == result.trained.parameters.keys()
    assert all(np.array_equal(again.trained.parameters[k], v) for k, v in result.trained.parameters.items())
    undiagnosed = run_trial(planned(replace(BASE, diagnostics=False)))  # the probe leaves the training RNG alone
    assert [m.val_loss for m in undiagnosed.epochs] == [m.val_loss for m in result.epochs]
    assert undiagnosed.diagnostics == []


def _first_coins(config: TrialConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A trial's first draws: its first Poisson batch and one step's noise (the noisy gradient of an
    empty batch is the noise alone). (The head starts at zero: its initialisation draws nothing.)"""
    trial = Trial(planned(config), torch.device("cpu"), cached_workload(config.workload))
    trainable = [p for p in trial.model.parameters() if p.requires_grad]
    features = next(iter(trial.loader))[0]
    trial.engine.noisy_gradient(iter(()))
    return features, torch.cat([p.grad.flatten() for p in trainable])


COINS = replace(BASE, engine="film", diagnostics=False, batch_size=50)


def test_fresh_coins_by_default_differ_between_trials_and_are_uncorrelated() -> None:
    assert TrialConfig.__dataclass_fields__["seed"].default is None
    fresh = replace(COINS, seed=None)
    (b1, z1), (b2, z2) = _first_coins(fresh), _first_coins(fresh)
    assert b1.shape != b2.shape or not torch.equal(b1, b2)  # Poisson batch (q = 1/2 of 100 examples)
    assert not torch.equal(z1, z2)
    # independent N(0, s²) vectors of d = 385·k entries: sample correlation ~ N(0, 1/d), |r| < 5/√d
    correlation = float(torch.corrcoef(torch.stack([z1, z2]))[0, 1])
    assert abs(correlation) < 5 / math.sqrt(z1.numel())
    first, second = run_trial(planned(fresh)), run_trial(planned(fresh))
    assert [m.train_loss for m in first.epochs] != [m.train_loss for m in second.epochs]


def test_an_explicit_seed_reproduces_every_coin() -> None:
    seeded = replace(COINS, seed=12345)
    for a, b in zip(_first_coins(seeded), _first_coins(seeded), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(_first_coins(seeded)[1], _first_coins(replace(seeded, seed=12346))[1])


def test_an_error_after_training_began_says_what_it_spent() -> None:
    def fail_in_second_epoch(metrics: EpochMetrics) -> None:
        if metrics.epoch == 2:
            raise RuntimeError("injected fault")

    with pytest.raises(TrialFailed, match="injected fault") as caught:
        run_trial(planned(COINS), fail_in_second_epoch)
    failure = caught.value
    n = 100
    assert failure.steps_taken == sum(epoch_steps(n, COINS.batch_size, COINS.epochs)[:2]) < failure.steps
    assert failure.epsilon_spent == epsilon_spent(
        failure.noise_multiplier, failure.sample_rate, failure.steps_taken, COINS.delta
    )
    assert 0 < failure.epsilon_spent < COINS.epsilon
    assert isinstance(failure.__cause__, RuntimeError)


@pytest.mark.parametrize("engine", ["opacus", "film"])
def test_a_checkpointed_run_lost_mid_training_continues_to_the_same_result_bit_for_bit(
    result: TrialResult, tmp_path: Path, engine: str
) -> None:
    config = replace(BASE, engine=engine)
    whole = result if engine == "opacus" else run_trial(planned(config))
    checkpoint = RunCheckpoint(str(tmp_path), "run.pt")

    def lost_in_third_epoch(metrics: EpochMetrics) -> None:
        if metrics.epoch == 3:
            raise RuntimeError("process lost")

    with pytest.raises(TrialFailed, match="process lost"):
        run_trial(planned(config), lost_in_third_epoch, checkpoint)
    kept = checkpoint.load()
    assert kept is not None and kept["epochs_done"] == 2
    assert kept["steps_taken"] == sum(epoch_steps(100, BASE.batch_size, BASE.epochs)[:2])
    # the continuation draws nothing of its own: another seed's coins give way to the kept state
    continued = run_trial(planned(replace(config, seed=99)), None, checkpoint)
    assert (continued.status, continued.steps_taken, continued.test_accuracy) == (
        "ok",
        whole.steps_taken,
        whole.test_accuracy,
    )
    assert [(m.epoch, m.steps, m.train_loss, m.val_loss) for m in continued.epochs] == [
        (m.epoch, m.steps, m.train_loss, m.val_loss) for m in whole.epochs
    ]
    assert [(d.epoch, d.grad_norms) for d in continued.diagnostics] == [
        (d.epoch, d.grad_norms) for d in whole.diagnostics
    ]
    assert continued.trained is not None and whole.trained is not None
    assert all(np.array_equal(continued.trained.parameters[k], v) for k, v in whole.trained.parameters.items())
    with pytest.raises(TrialFailed, match="another run's state"):  # a checkpoint continues its own run only
        run_trial(planned(replace(config, clip_bound=0.25)), None, checkpoint)
    checkpoint.remove()
    assert checkpoint.load() is None and not list(tmp_path.iterdir())


def test_dp_selection_score_is_the_correct_count_plus_gaussian_noise() -> None:
    sigma = 4.0
    config = replace(COINS, score_noise_multiplier=sigma)
    trial = Trial(planned(config), torch.device("cpu"), cached_workload(config.workload))
    val = trial.evaluate(trial.workload.val)
    count, correct = val.examples_per_class.sum(), val.correct_per_class.sum()
    noise = torch.tensor([trial.noisy_score(val) for _ in range(4000)], dtype=torch.float64) * count - correct
    assert abs(float(noise.mean())) < 5 * sigma / math.sqrt(4000)
    assert float(noise.std()) == pytest.approx(sigma, rel=0.06)
    result = run_trial(planned(config))
    assert result.status == "ok" and math.isfinite(result.noisy_val_accuracy)
    noisy_count = result.noisy_val_accuracy * result.num_val  # an integer count (the noise may be 0) over N_val
    assert round(noisy_count) / result.num_val == result.noisy_val_accuracy
    assert math.isnan(run_trial(planned(COINS)).noisy_val_accuracy)  # no score noise asked: no noisy score


def test_film_engine_is_chosen_automatically_for_a_head(result: TrialResult) -> None:
    film = run_trial(planned(replace(BASE, engine="auto", diagnostics=False)))
    assert film.engine == "film"
    assert film.status == "ok"
    assert film.noise_multiplier == result.noise_multiplier  # same (ε, δ, q, T)
    assert film.epochs[-1].val_loss < math.log(film.num_classes)


def test_huge_learning_rate_is_recorded_as_diverged_without_raising() -> None:
    # plain DP-SGD with an enormous step: weights overflow float32 after the first step, logits turn inf/nan
    config = replace(BASE, optimizer="sgd", clipping="standard", clip_bound=1e6, learning_rate=1e36, diagnostics=False)
    diverged = run_trial(planned(config))
    assert diverged.status == "diverged"
    assert "non-finite" in diverged.reason
    assert len(diverged.epochs) < BASE.epochs
    assert 0 < diverged.steps_taken < diverged.steps
    # the stop read an exact, non-private loss: the run is charged its planned steps, not those it took
    assert diverged.epsilon_spent == epsilon_spent(
        diverged.noise_multiplier, diverged.sample_rate, diverged.steps, BASE.delta
    )
    assert diverged.epsilon_spent > epsilon_spent(
        diverged.noise_multiplier, diverged.sample_rate, diverged.steps_taken, BASE.delta
    )
    assert "charged its 13 planned steps" in diverged.reason and "exact" in diverged.reason
    assert math.isnan(diverged.test_accuracy)
    private = run_trial(
        planned(replace(config, score_noise_multiplier=5.0))
    )  # decided from the parameters: charged all too
    assert private.status == "diverged" and private.reason.startswith("non-finite parameters after epoch 1")
    assert private.steps_taken < private.steps and "charged its 13 planned steps" in private.reason
    assert private.epsilon_spent == diverged.epsilon_spent
    # the release of a subsample tuning trains every step and is published whatever its loss
    release = run_trial(planned(replace(config, release_run=True)))
    assert release.status == "ok" and release.steps_taken == release.steps and len(release.epochs) == BASE.epochs
    assert math.isnan(release.epochs[-1].val_loss) and 0 <= release.test_accuracy <= 1
    assert release.epsilon_spent == diverged.epsilon_spent


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any attempt to read the run's σ (its planned mechanism, the step before training) fail the test."""

    def forbidden(*args: object) -> float:
        raise AssertionError("bad input reached the run's mechanism / training")

    monkeypatch.setattr(trainer, "planned_mechanism", forbidden)


def test_a_run_needs_the_mechanism_planned_for_it() -> None:
    """The runner never calibrates σ: a config without the planner's mechanism, or with another run's
    (another B, so another q and T, or another ε), is refused before any compute."""
    with pytest.raises(TrialConfigError, match="has no mechanism.*dptune.plan.mechanism"):
        run_trial(BASE)
    with pytest.raises(TrialConfigError, match="planned for another run: q = 0.3, T = 13"):
        run_trial(replace(planned(BASE), batch_size=50))
    with pytest.raises(TrialConfigError, match="planned for another run"):
        run_trial(replace(planned(BASE), epsilon=4.0))
    with pytest.raises(TrialConfigError, match="planned for another run"):
        run_trial(planned(BASE, num_train=90))  # planned for another N than the workload's 100 rows


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"workload": replace(BASE.workload, dataset="imagenet")},
            "dataset 'imagenet' is unknown; choose one of 20newsgroups, ",
        ),
        (
            {"workload": replace(BASE.workload, backbone="resnet50")},
            "backbone 'resnet50' is unknown; choose one of .*minilm",
        ),
        (
            {"workload": replace(BASE.workload, peft="prompt")},
            "peft 'prompt' is unknown; choose one of film, full, head, lora",
        ),
        ({"clipping": "hard"}, "standard, normalized, auto_s"),
        ({"optimizer": "lion"}, "adam, sgd"),
        ({"engine": "jax"}, "auto, opacus, film"),
        ({"batch_size": 0}, "batch_size must be > 0"),
        ({"delta": 1.5}, r"delta must be in \(0, 1\)"),
        ({"device": "tpu"}, "device 'tpu'"),
        ({"batch_size": 101}, "batch_size 101 exceeds the 100 training examples"),
    ],
)
def test_bad_input_is_refused_before_training(change: dict, message: str, no_training: None) -> None:
    with pytest.raises(TrialConfigError, match=message):
        run_trial(replace(BASE, **change))


def test_threads_setting_applies_during_the_trial_only() -> None:
    seen: list[int] = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_trial(planned(replace(BASE, threads=1, diagnostics=False)), lambda m: seen.append(torch.get_num_threads()))
        assert seen == [1] * BASE.epochs
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


#: Modules that must stay importable without torch and Ray (readers of results, the report, the
#: search space): a notebook or the report CLI must not pay for them, nor need a GPU build.
TORCH_FREE_MODULES = (
    "dptune.contract",
    "dptune.runners",
    "dptune.runners.trial",
    "dptune.records",
    "dptune.analysis",
    "dptune.report",
    "dptune.space",
)


def test_result_and_report_modules_import_neither_torch_nor_ray() -> None:
    # one fresh interpreter; after each import, the torch/Ray modules loaded so far (the first
    # module that pulls one in is the culprit); then a module that does use torch, as a control
    # that the check sees it
    code = (
        "import importlib, json, sys\n"
        "heavy = {}\n"
        f"for name in {(*TORCH_FREE_MODULES, 'dptune.dp.engine')!r}:\n"
        "    importlib.import_module(name)\n"
        "    heavy[name] = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray'})\n"
        "print(json.dumps(heavy))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1]
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert loaded == {**{name: [] for name in TORCH_FREE_MODULES}, "dptune.dp.engine": ["torch"]}


def test_a_deleted_working_directory_does_not_kill_the_trial_process(tmp_path: Path) -> None:
    """oneMKL aborts `import torch` in a process whose working directory was deleted (the cause of
    trials dying on a Ray worker node started from a removed temp folder); run_trial moves away first."""
    script = (
        "import os, sys\n"
        f"os.mkdir({str(tmp_path / 'gone')!r}); os.chdir({str(tmp_path / 'gone')!r}); "
        f"os.rmdir({str(tmp_path / 'gone')!r})\n"
        "if sys.argv[1] == 'guarded':\n"
        "    from dptune.runners.trial import leave_deleted_working_directory\n"
        "    leave_deleted_working_directory()\n"
        "import torch\n"
        "a = torch.randn(64, 64)\n"
        "print('matmul', float((a @ a).abs().sum()) > 0)\n"
    )
    unguarded = subprocess.run([sys.executable, "-c", script, "plain"], capture_output=True, text=True, timeout=120)
    assert unguarded.returncode != 0 and "oneMKL FATAL ERROR" in unguarded.stdout + unguarded.stderr
    guarded = subprocess.run([sys.executable, "-c", script, "guarded"], capture_output=True, text=True, timeout=120)
    assert guarded.returncode == 0 and "matmul True" in guarded.stdout, guarded.stderr
