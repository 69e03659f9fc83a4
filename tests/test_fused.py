"""Fused trials (dptune.runners.fused) on the embedded 20 Newsgroups + MiniLM head workload (small subsets).

Each fused configuration must be the mechanism run_trial runs: the same DP step as the FiLM and
Opacus engines, torch's optimizers, its own independent coins, and the same accuracies in
distribution.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dptune.contract import WorkloadSpec
from dptune.dp.clipping import CLIPPING_RULES, noise_std, update_scale
from dptune.dp.engine import DPStepSpec
from dptune.dp.film import FilmEngine
from dptune.dp.opacus_engine import OpacusEngine
from dptune.plan import epoch_steps, sample_rate, total_steps
from dptune.privacy import calibrate_noise_multiplier, epsilon_spent
from dptune.runners import fused, fused_group
from dptune.runners.batches import BatchRows, DeviceWorkload, Draws, PoissonSteps
from dptune.runners.common import cached_workload
from dptune.runners.fused import FusedTrialsFailed, fused_refusal, max_fused_configurations, run_fused
from dptune.runners.fused_group import FusedGroup
from dptune.runners.heads import StackedOptimizer, augment, head_noisy_gradients, stack_heads
from dptune.runners.trial import TrialConfig, TrialConfigError, TrialResult, run_trial
from trial_configs import planned

BASE = TrialConfig(
    workload=WorkloadSpec(
        dataset="20newsgroups", backbone="minilm", peft="head", max_train_examples=200, max_eval_examples=120
    ),
    epsilon=8.0,
    delta=1e-5,
    epochs=3,
    clip_bound=1.0,
    batch_size=40,
    learning_rate=0.05,
    base_learning_rate=0.05,
    optimizer="adam",
    clipping="normalized",
    seed=1,
    threads=1,
    diagnostics=False,
    diagnostic_examples=40,
)

# Its module fixtures are costly: under pytest-xdist the whole module runs on one worker.
pytestmark = pytest.mark.xdist_group("fused")


@pytest.fixture(scope="module", autouse=True)
def cache(dptune_cache_dir: Path) -> Path:
    """A private dptune cache (features and σ calibrations) for this module's trials."""
    return dptune_cache_dir


@pytest.fixture(scope="module")
def train() -> tuple[torch.Tensor, torch.Tensor]:
    """The training features (N, 384) and labels of BASE's workload (real MiniLM features)."""
    features, labels = cached_workload(BASE.workload).train.tensors
    return features.float(), labels


# --------------------------------------------------------------------------- one step, exactly


def _engine_gradient(
    engine: type,
    weight: torch.Tensor,
    bias: torch.Tensor,
    features: torch.Tensor,
    labels: torch.Tensor,
    clip_bound: float,
    rule: str,
    batch_size: float,
) -> torch.Tensor:
    """The clipped, unnoised, scaled gradient a dptune engine releases for one head (σ = 0), flat."""
    head = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    spec = DPStepSpec(noise_multiplier=0.0, clip_bound=clip_bound, rule=rule, expected_batch_size=batch_size)
    engine(head, spec, torch.Generator()).noisy_gradient([(features, labels)])
    return torch.cat([head.weight.grad.flatten(), head.bias.grad.flatten()])


@pytest.mark.parametrize("rule", CLIPPING_RULES)
def test_a_fused_step_releases_what_the_film_and_opacus_engines_release(
    rule: str, train: tuple[torch.Tensor, torch.Tensor]
) -> None:
    features, labels = train
    classes, dim = int(labels.max()) + 1, features.shape[1]
    clip_bounds = [0.05, 2.5, 1.0, 30.0]  # below, inside and above the spread of ‖g_i‖ (~1.5 to 4 here)
    sizes = [40, 33, 25, 1]  # four Poisson batches of different sizes, padded to 40
    k, batch_size, sigma = len(clip_bounds), 37.5, 1.3
    generator = torch.Generator().manual_seed(0)
    weight = 0.5 * torch.randn(k, classes, dim, generator=generator)
    bias = 0.5 * torch.randn(k, classes, generator=generator)
    rows = torch.stack([torch.randperm(len(labels), generator=generator)[:40] for _ in range(k)])
    mask = torch.arange(40) < torch.tensor(sizes)[:, None]
    noise = torch.randn(k, classes, dim + 1, generator=generator)  # one draw per parameter: [W | b]
    stds = [noise_std(sigma, c, rule) for c in clip_bounds]
    scales = [update_scale(c, rule, batch_size) for c in clip_bounds]
    padded = augment(features[rows]) * mask.unsqueeze(2)  # padding rows are zero rows
    released = head_noisy_gradients(
        stack_heads(weight, bias),
        padded,
        labels[rows],
        mask.float(),
        torch.linalg.vector_norm(padded, dim=2),
        torch.tensor(clip_bounds),
        rule,
        torch.tensor([s * c for s, c in zip(scales, stds, strict=True)]).view(k, 1, 1) * noise,
        torch.tensor(scales),
    )

    def linear_layout(heads: torch.Tensor) -> torch.Tensor:  # [W | b] → nn.Linear's flat (weight, then bias)
        return torch.cat([heads[:, :, :dim].flatten(1), heads[:, :, dim]], dim=1)

    flat, noise = linear_layout(released.heads), linear_layout(noise)
    for i in range(k):
        batch = rows[i, : sizes[i]]
        for engine in (FilmEngine, OpacusEngine):
            expected = (
                _engine_gradient(
                    engine, weight[i], bias[i], features[batch], labels[batch], clip_bounds[i], rule, batch_size
                )
                + scales[i] * stds[i] * noise[i]
            )
            torch.testing.assert_close(
                flat[i], expected, rtol=1e-5, atol=1e-5, msg=f"{engine.__name__}, C={clip_bounds[i]}"
            )
    inside = released.norms[1, mask[1]]
    assert inside.min() < clip_bounds[1] < inside.max() < clip_bounds[3]  # C = 2.5 clips some examples, not all
    assert torch.all(released.norms[~mask] == 0)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_stacked_optimizer_steps_like_torch_optimizers_and_freezes_inactive_rows(name: str) -> None:
    generator = torch.Generator().manual_seed(1)
    rates = [1e-3, 0.05, 0.7]
    weight, bias = torch.randn(3, 5, 4, generator=generator), torch.randn(3, 5, generator=generator)
    references = [[weight[i].clone().requires_grad_(), bias[i].clone().requires_grad_()] for i in range(3)]
    optimizers = [
        getattr(torch.optim, {"adam": "Adam", "sgd": "SGD"}[name])(p, lr=r)
        for p, r in zip(references, rates, strict=True)
    ]
    stacked = StackedOptimizer(name, [weight, bias], torch.tensor(rates))
    active = torch.ones(3, dtype=torch.bool)
    for step in range(6):
        grads = [10.0 ** (step - 3) * torch.randn(3, 5, 4, generator=generator), torch.randn(3, 5, generator=generator)]
        if step == 4:
            active[1] = False  # configuration 1 diverged: no update from here on
        stacked.step(grads, active)
        for i in range(3):
            if active[i]:
                references[i][0].grad, references[i][1].grad = grads[0][i].clone(), grads[1][i].clone()
                optimizers[i].step()
    for i in range(3):
        torch.testing.assert_close(weight[i], references[i][0].detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(bias[i], references[i][1].detach(), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- coins


def test_poisson_steps_include_each_example_independently_with_probability_q() -> None:
    num_examples, rate, steps = 500, 0.04, 400
    step, example = PoissonSteps(num_examples, rate, torch.Generator().manual_seed(5)).draw(steps)
    mask = torch.zeros(steps, num_examples, dtype=torch.bool)
    mask[step, example] = True
    assert int(mask.sum()) == len(step)  # no example twice in one step
    assert torch.all(torch.diff(step * num_examples + example) > 0)  # in order of step, then example
    trials = steps * num_examples
    assert abs(len(step) - rate * trials) < 5 * math.sqrt(trials * rate * (1 - rate))
    per_example = mask.sum(0).double()  # Binomial(steps, q) each
    assert float(per_example.var()) == pytest.approx(steps * rate * (1 - rate), rel=0.25)
    per_step = mask.sum(1).double()  # Binomial(N, q) each
    assert float(per_step.var()) == pytest.approx(num_examples * rate * (1 - rate), rel=0.3)
    first, second = mask[:-1].flatten().double(), mask[1:].flatten().double()  # consecutive steps: independent
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 5 / math.sqrt(len(first))
    everything = PoissonSteps(num_examples, 1.0, torch.Generator()).draw(2)  # q = 1: full batches
    assert torch.equal(everything[1], torch.arange(num_examples).repeat(2))


def _group(seeds: list[int | None]) -> FusedGroup:
    data = DeviceWorkload.build(BASE, cached_workload(BASE.workload), torch.device("cpu"))
    return FusedGroup(data, [replace(BASE, seed=s) for s in seeds], noise_multiplier=1.0)


def _masks(draws: Draws, num_train: int) -> torch.Tensor:
    """(K, steps, N) inclusion masks of a group's draws."""
    steps, k, _ = draws.index.shape
    mask = torch.zeros(k, steps, num_train + 1, dtype=torch.bool)
    mask[torch.arange(k)[None, :, None], torch.arange(steps)[:, None, None], draws.index] = True
    return mask[..., :num_train]


def test_each_fused_configuration_draws_its_own_independent_coins() -> None:
    steps = 40
    group = _group([None, None, 7])
    n = group.data.num_train
    draws = group.coins.draw(steps)
    masks = _masks(draws, n)
    assert torch.equal(masks.sum(2), torch.from_numpy(draws.counts.T))
    trials = steps * n
    q = group.schedule.sample_rate
    for mask in masks:
        assert abs(int(mask.sum()) - q * trials) < 5 * math.sqrt(trials * q * (1 - q))
    for a in range(3):
        for b in range(a + 1, 3):
            assert not torch.equal(masks[a], masks[b])
            overlap = int((masks[a] & masks[b]).sum())  # independent masks overlap on ~q² of the pairs
            assert abs(overlap - q * q * trials) < 5 * math.sqrt(trials * q * q)
            z = draws.noise[:, [a, b]].transpose(0, 1).flatten(1)
            assert abs(float(torch.corrcoef(z)[0, 1])) < 5 / math.sqrt(z.shape[1])
    # drawn at the released scale r_k = update_scale(C_k)·noise_std(σ, C_k): N(0, r_k²) per parameter
    rule, expected_batch = BASE.clipping, group.schedule.expected_batch_size
    released_std = update_scale(BASE.clip_bound, rule, expected_batch) * noise_std(1.0, BASE.clip_bound, rule)
    assert group.coins.noise_stds == pytest.approx([released_std] * 3, rel=1e-12)
    for k in range(3):
        z = draws.noise[:, k]
        assert float(z.mean()) == pytest.approx(0.0, abs=5 * released_std / math.sqrt(z.numel()))
        assert float(z.std()) == pytest.approx(released_std, rel=0.01)
    # the same explicit seed gives the same coins, whatever the configuration's companions
    again = _group([8, 7]).coins.draw(steps)
    assert torch.equal(_masks(again, n)[1], masks[2]) and torch.equal(again.noise[:, 1], draws.noise[:, 2])
    fresh = _group([None, None]).coins.draw(steps)
    assert not torch.equal(_masks(fresh, n)[0], masks[0]) and not torch.equal(fresh.noise[:, 0], draws.noise[:, 0])


def test_a_step_gathered_in_blocks_of_configurations_releases_what_one_gather_releases(monkeypatch):
    group = _group([None, None, 3, 4, 5])
    lock_step, data = group.lock_step, group.data
    lock_step.heads.normal_(std=0.3, generator=torch.Generator().manual_seed(2))  # a trained-looking head
    draws = group.coins.draw(2)
    width = int(draws.counts[1].max())
    rows = BatchRows.of(data, draws.index).step(1, width)
    whole = lock_step._gradients(data, rows, draws.noise[1])
    assert fused_group.gather_block_configurations(width, data.features.shape[1]) >= 5  # one block
    monkeypatch.setattr(fused_group, "GATHER_BLOCK_BYTES", 4 * 2 * width * data.features.shape[1])
    assert fused_group.gather_block_configurations(width, data.features.shape[1]) == 2
    blocks = lock_step._gradients(data, rows, draws.noise[1])  # blocks of 2, 2 and 1 configurations
    for name in ("heads", "losses", "norms"):
        torch.testing.assert_close(getattr(blocks, name), getattr(whole, name), rtol=1e-6, atol=1e-6)
    assert whole.heads.shape == (5, *lock_step.heads.shape[1:]) and bool(whole.heads.abs().sum(dim=(1, 2)).min() > 0)


# --------------------------------------------------------------------------- fused runs against run_trial


SEEDS = range(6)
CELL = [
    replace(BASE, clip_bound=0.5, batch_size=20, learning_rate=0.3),  # ~.18 validation accuracy
    replace(BASE, clip_bound=2.0, batch_size=80, learning_rate=0.1),
]  # ~.30


@pytest.fixture(scope="module")
def fused_runs() -> list[TrialResult]:
    configs = [planned(replace(c, seed=s)) for s in SEEDS for c in CELL]
    done: list[list[int]] = []
    results = run_fused(configs, on_done=lambda indices, group: done.append(indices))
    assert sorted(i for indices in done for i in indices) == list(range(len(configs)))  # each group reported once
    assert len(done) == 2  # one group per batch size
    return results


@pytest.fixture(scope="module")
def trial_runs() -> list[TrialResult]:
    return [run_trial(planned(replace(c, seed=s))) for s in SEEDS for c in CELL]


def test_fused_runs_plan_and_account_like_run_trial(
    fused_runs: list[TrialResult], trial_runs: list[TrialResult]
) -> None:
    for result, trial in zip(fused_runs, trial_runs, strict=True):
        n, b = result.num_train, result.config.batch_size
        assert result.status == "ok" and result.engine == "fused" and result.device == "cpu"
        assert (result.sample_rate, result.steps) == (sample_rate(n, b), total_steps(n, b, BASE.epochs))
        sigma, q = result.noise_multiplier, result.sample_rate
        assert sigma == calibrate_noise_multiplier(BASE.epsilon, BASE.delta, q, result.steps)
        assert [m.steps for m in result.epochs] == list(np.cumsum(epoch_steps(n, b, BASE.epochs)))
        assert result.steps_taken == result.steps
        assert result.epsilon_spent == epsilon_spent(sigma, q, result.steps, BASE.delta)
        same = (
            "noise_multiplier",
            "sample_rate",
            "steps",
            "steps_taken",
            "epsilon_spent",
            "num_train",
            "num_val",
            "num_test",
            "num_classes",
            "trainable_parameters",
            "class_names",
        )
        assert {f: getattr(result, f) for f in same} == {f: getattr(trial, f) for f in same}
        assert set(result.class_accuracy) == set(trial.class_accuracy)
        last = result.epochs[-1]
        assert (last.test_accuracy, last.val_accuracy) == (result.test_accuracy, result.val_accuracy)
        assert all(m.wall_time_s > 0 and m.examples_per_s > 0 for m in result.epochs)


def _final(runs: list[TrialResult], position: int, metric: str) -> np.ndarray:
    """``metric`` after the last epoch of CELL[position] over the seeds."""
    return np.array([getattr(r.epochs[-1], metric) for r in runs[position :: len(CELL)]])


def _within_sampling_error(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the means of two samples differ by at most 3 standard errors (+ 0.01 slack)."""
    error = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return abs(a.mean() - b.mean()) <= 3 * error + 0.01


def test_fused_accuracies_match_run_trial_within_sampling_error(
    fused_runs: list[TrialResult], trial_runs: list[TrialResult]
) -> None:
    for position in range(len(CELL)):
        for metric in ("val_accuracy", "test_accuracy", "val_loss"):
            ours, theirs = _final(fused_runs, position, metric), _final(trial_runs, position, metric)
            assert _within_sampling_error(ours, theirs), (CELL[position].batch_size, metric, ours, theirs)
    # the comparison has power: it tells the two settings apart, in either runner
    for runs in (fused_runs, trial_runs):
        assert not _within_sampling_error(_final(runs, 0, "val_loss"), _final(runs, 1, "val_loss"))


def test_a_diverging_configuration_stops_while_the_others_train_on() -> None:
    # plain DP-SGD with an enormous step: weights overflow float32 after the first step (as in test_trial)
    wild = planned(replace(BASE, optimizer="sgd", clipping="standard", clip_bound=1e6, learning_rate=1e36))
    tame = replace(wild, learning_rate=0.05)
    diverged, ok = run_fused([wild, tame])
    assert diverged.status == "diverged" and "non-finite training loss" in diverged.reason
    assert 0 < diverged.steps_taken < diverged.steps and len(diverged.epochs) < BASE.epochs
    # the stop read an exact, non-private loss: charged ε of its planned steps, not of those it took
    assert diverged.epsilon_spent == epsilon_spent(
        diverged.noise_multiplier, diverged.sample_rate, diverged.steps, BASE.delta
    )
    assert diverged.epsilon_spent > epsilon_spent(
        diverged.noise_multiplier, diverged.sample_rate, diverged.steps_taken, BASE.delta
    )
    assert f"charged its {diverged.steps} planned steps" in diverged.reason and "exact" in diverged.reason
    assert math.isnan(diverged.test_accuracy)
    assert ok.status == "ok" and len(ok.epochs) == BASE.epochs and ok.steps_taken == ok.steps
    assert ok.epsilon_spent == diverged.epsilon_spent  # same plan, same charge
    private = run_fused([replace(wild, score_noise_multiplier=5.0)])[0]  # DP score: decided from the parameters
    assert private.status == "diverged" and private.reason.startswith("non-finite parameters after epoch 1")
    assert private.steps_taken < private.steps and f"charged its {private.steps} planned steps" in private.reason
    assert private.epsilon_spent == diverged.epsilon_spent
    # the release of a subsample tuning trains every step and is published whatever its loss
    release = run_fused([replace(wild, release_run=True)])[0]
    assert release.status == "ok" and release.steps_taken == release.steps and len(release.epochs) == BASE.epochs
    assert math.isnan(release.epochs[-1].val_loss) and 0 <= release.test_accuracy <= 1
    assert release.epsilon_spent == diverged.epsilon_spent


def test_diagnostics_and_the_dp_score_follow_the_trial() -> None:
    config = planned(replace(BASE, diagnostics=True, score_noise_multiplier=2.0, epochs=4))
    result, trial = run_fused([config])[0], run_trial(config)
    assert [d.epoch for d in result.diagnostics] == [d.epoch for d in trial.diagnostics] == [0, 2, 4]
    assert [d.labels for d in result.diagnostics] == [d.labels for d in trial.diagnostics]  # the trial's probe
    first = result.diagnostics[0]  # at epoch 0 both heads are zero: the same exact gradients
    assert first.grad_norms == pytest.approx(trial.diagnostics[0].grad_norms, rel=1e-5)
    assert first.optimal_clip_bound == pytest.approx(trial.diagnostics[0].optimal_clip_bound, rel=1e-4)
    assert first.dimension == result.trainable_parameters
    # the noisy score is an integer count (discrete Gaussian noise can be 0) over the public N_val
    noisy_count = result.noisy_val_accuracy * result.num_val
    assert math.isfinite(noisy_count) and round(noisy_count) / result.num_val == result.noisy_val_accuracy
    assert result.diagnostics_wall_time_s == pytest.approx(sum(d.wall_time_s for d in result.diagnostics))
    assert result.diagnostics_wall_time_s < result.wall_time_s


def test_a_failing_group_reports_what_every_configuration_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    configs = [
        planned(replace(BASE, batch_size=100)),
        planned(replace(BASE, batch_size=20)),
        planned(replace(BASE, batch_size=20, seed=2)),
        planned(replace(BASE, batch_size=50)),
    ]
    real_step = StackedOptimizer.step
    calls = []

    def fail_in_second_group(self: StackedOptimizer, grads: list[torch.Tensor], active: torch.Tensor) -> None:
        calls.append(len(self.learning_rates))
        if len(self.learning_rates) == 2 and calls.count(2) == 5:  # the fifth step of the B = 20 group
            raise RuntimeError("injected fault")
        real_step(self, grads, active)

    monkeypatch.setattr(StackedOptimizer, "step", fail_in_second_group)
    with pytest.raises(FusedTrialsFailed, match="injected fault") as failure:
        run_fused(configs)
    first, *failed, unstarted = failure.value.results
    assert first.status == "ok" and first.steps_taken == first.steps
    for result in failed:
        assert result.status == "error" and "injected fault" in result.reason
        assert result.steps_taken == 5
        assert result.epsilon_spent == epsilon_spent(result.noise_multiplier, result.sample_rate, 5, BASE.delta)
    assert unstarted.status == "error" and unstarted.reason.startswith("not run")
    assert "injected fault" in unstarted.reason
    assert (unstarted.steps_taken, unstarted.epsilon_spent, unstarted.steps) == (0, 0.0, 12)  # T = 3·200/50


def test_a_configuration_that_diverged_before_its_group_failed_keeps_its_planned_charge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wild = planned(replace(BASE, optimizer="sgd", clipping="standard", clip_bound=1e6, learning_rate=1e36))
    tame = replace(wild, learning_rate=0.05)
    real_step = StackedOptimizer.step
    calls = []

    def fail_at_the_fifth_step(self: StackedOptimizer, grads: list[torch.Tensor], active: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected fault")
        real_step(self, grads, active)

    monkeypatch.setattr(StackedOptimizer, "step", fail_at_the_fifth_step)
    with pytest.raises(FusedTrialsFailed, match="injected fault") as failure:
        run_fused([wild, tame])
    diverged, failed = failure.value.results
    assert diverged.status == "diverged" and diverged.steps_taken < 5
    assert diverged.epsilon_spent == epsilon_spent(
        diverged.noise_multiplier, diverged.sample_rate, diverged.steps, BASE.delta
    )
    assert failed.status == "error" and failed.steps_taken == 5  # its noisy gradient was drawn: the step counts
    assert failed.epsilon_spent == epsilon_spent(failed.noise_multiplier, failed.sample_rate, 5, BASE.delta)


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make reading the runs' σ (their planned mechanisms) and any fused step fail the test."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("bad input reached the runs' mechanisms or training")

    monkeypatch.setattr(fused, "planned_mechanism", forbidden)
    monkeypatch.setattr(fused_group, "head_noisy_gradients", forbidden)


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ([], "no configurations"),
        (
            [BASE, replace(BASE, epsilon=2.0)],
            (
                "configuration 1 differs from configuration 0 in epsilon .*clip_bound, "
                "batch_size, learning_rate, base_learning_rate, seed"
            ),
        ),
        ([BASE, replace(BASE, clipping="auto_s")], "differs from configuration 0 in clipping"),
        (
            [replace(BASE, workload=replace(BASE.workload, peft="film"))],
            "configuration 0 cannot be fused: peft 'film'.*peft 'head'",
        ),
        ([BASE, replace(BASE, engine="opacus")], "configuration 1 cannot be fused: engine 'opacus'.*'auto' or 'film'"),
        ([replace(BASE, optimizer="lion")], "adam, sgd"),
        ([BASE, replace(BASE, workload=replace(BASE.workload, seed=1))], "differs from configuration 0 in split_seed"),
        ([BASE, replace(BASE, batch_size=1000)], "batch_size 1000 exceeds the 200 training examples"),
    ],
)
def test_bad_input_is_refused_before_compute(configs: list[TrialConfig], message: str, no_training: None) -> None:
    with pytest.raises(TrialConfigError, match=message):
        run_fused(configs)


def test_a_group_that_cannot_fit_is_refused_before_compute(no_training: None) -> None:
    replicas = [replace(BASE, seed=s) for s in range(3)] + [replace(BASE, batch_size=200, seed=s) for s in range(3)]
    fits = max_fused_configurations(replicas[-1], 200, 384, 20, 50 << 20)
    assert fits >= 1 and max_fused_configurations(replicas[-1], 200, 384, 20, 1 << 20) == 0
    with pytest.raises(TrialConfigError, match="not one configuration at batch_size 40 fits the fused memory budget"):
        run_fused(replicas, memory_bytes=1 << 20)
    assert fused_refusal(BASE) is None


def test_a_fused_run_needs_the_mechanism_planned_for_it() -> None:
    """σ is never calibrated in the runner: a config without the planner's mechanism, or with another
    run's (another B: another q and T), is refused before compute."""
    with pytest.raises(TrialConfigError, match="has no mechanism"):
        run_fused([BASE])
    with pytest.raises(TrialConfigError, match="planned for another run"):
        run_fused([planned(BASE), replace(planned(BASE), batch_size=50)])


def test_groups_are_chunked_to_the_configurations_that_fit() -> None:
    configs = [planned(replace(BASE, epochs=1, seed=s)) for s in range(5)]
    budget = 1 << 24
    fits = max_fused_configurations(BASE, 200, 384, 20, budget)
    assert 1 <= fits < 5
    done: list[list[int]] = []
    results = run_fused(configs, on_done=lambda indices, group: done.append(indices), memory_bytes=budget)
    assert done == [list(range(i, min(i + fits, 5))) for i in range(0, 5, fits)]
    assert all(r.status == "ok" for r in results)


def test_a_fused_unit_on_cached_features_imports_no_opacus_timm_or_transformers(
    train: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """A Ray worker that trains heads on cached features imports only what they need: Opacus, timm
    (with torchvision) and transformers (a feature-cache hit builds no encoder) cost seconds per
    process, more where bytecode is not cached."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from dataclasses import replace\n"
        "import dptune.search.runs.execution, dptune.search.scheduling.tune_adapters\n"
        "from dptune.contract import TrialConfig, WorkloadSpec\n"
        "from dptune.plan.mechanism import with_mechanism\n"
        "from dptune.runners.fused import run_fused\n"
        f"BASE = {BASE!r}\n"
        "done = []\n"
        "configs = [with_mechanism(replace(BASE, diagnostics=True, epochs=1, clip_bound=c), 200) for c in (1.0, 0.1)]\n"
        "run_fused(configs, on_done=lambda positions, results: done.extend(r.status for r in results))\n"
        "print(done, sorted(m for m in ('opacus', 'timm', 'torchvision', 'transformers') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "['ok', 'ok'] []"
