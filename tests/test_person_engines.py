"""Person-level (user-level) DP-SGD in the one-trial runner: the person sampler, the cut into physical
batches, both engines' per-person clipping and a whole trial (McMahan et al. 2018; Levy et al. 2021).

The workloads are built here, tiny and heavy-tailed (people with 1 to 50 rows, the rows of one person
close together), so that clipping people differs from clipping rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import TensorDataset

from dptune.contract import EngineName, EpochMetrics, PersonUnit, TrialConfig, WorkloadSpec
from dptune.data.spec import Workload
from dptune.dp.engine import DPStepSpec, EngineFactory, summed_cross_entropy
from dptune.dp.film import FilmEngine
from dptune.dp.opacus_engine import OpacusEngine
from dptune.dp.sampling import PersonPoissonLoader, person_physical_batches, physical_batches
from dptune.errors import TrialFailed
from dptune.plan.mechanism import with_mechanism
from dptune.runners import trainer
from dptune.runners.checkpoint import RunCheckpoint
from dptune.runners.common import PersonScore
from dptune.runners.trainer import Trial
from people_data import clustered_people, dense_people, people_workload

CPU = torch.device("cpu")
Batch = tuple[torch.Tensor, ...]
ClippedSum = Callable[[Batch], torch.Tensor]
ENGINES: dict[str, EngineFactory] = {"film": FilmEngine, "opacus": OpacusEngine}
#: Rows per training person: a heavy tail (one person with 50 rows, many with one).
TRAIN_SIZES = [50, 30, 20, 12, 8, 5, 4, 3, 3, 2, 2, 2] + [1] * 18
FEATURES, TOKENS, CLASSES = 16, 4, 3
CLIP = 0.5


class MeanTokens(nn.Module):
    """(n, T, d) → (n, d): the mean over tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def build(name: str) -> nn.Module:
    """A small model whose trainable modules both engines support, off its initial values."""
    torch.manual_seed(7)
    models = {
        "head": lambda: nn.Linear(FEATURES, CLASSES),
        "film": lambda: nn.Sequential(
            nn.LayerNorm(FEATURES), nn.Linear(FEATURES, 64), nn.Tanh(), nn.LayerNorm(64), nn.Linear(64, CLASSES)
        ),
        "tokens": lambda: nn.Sequential(
            nn.LayerNorm(FEATURES), nn.Linear(FEATURES, 64), nn.Tanh(), MeanTokens(), nn.Linear(64, CLASSES)
        ),
    }
    model = models[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape), alpha=0.5)
    return model


def sampled_batch(name: str, sample_rate: float = 0.5, seed: int = 3) -> Batch:
    """One person-level Poisson batch ``(inputs, labels, people)`` of the training people."""
    shape = (TOKENS, FEATURES) if name == "tokens" else (FEATURES,)
    inputs, labels, people = clustered_people(TRAIN_SIZES, shape, CLASSES, seed=0)
    loader = PersonPoissonLoader(
        TensorDataset(inputs, labels), people, sample_rate, 1, torch.Generator().manual_seed(seed)
    )
    return next(iter(loader))


def clipped_sum(
    engine: str, model: nn.Module, person_level: bool = True, max_physical_batch_size: int = 16
) -> ClippedSum:
    """The pre-noise clipped sum S = Σ_u f_u G_u (or Σ_i f_i g_i) of a batch, rule ``standard``,
    σ = 0: the released gradient times the expected batch size."""
    spec = DPStepSpec(
        noise_multiplier=0.0, clip_bound=CLIP, rule="standard", expected_batch_size=2.5, person_level=person_level
    )
    cut = person_physical_batches if person_level else physical_batches

    def of(batch: Batch) -> torch.Tensor:
        ENGINES[engine](model, spec, torch.Generator().manual_seed(0)).noisy_gradient(
            cut(batch, max_physical_batch_size, CPU)
        )
        flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        flat = flat * spec.expected_batch_size
        model.zero_grad(set_to_none=True)
        return flat

    return of


def per_row_clipping(person_sum: ClippedSum) -> ClippedSum:
    """A broken mechanism: every row its own person (per-example clipping) where people are asked for."""
    return lambda batch: person_sum((*batch[:-1], torch.arange(len(batch[-1]))))


def person_sensitivities(of: ClippedSum, batch: Batch) -> dict[int, float]:
    """‖S − S₋ᵤ‖ for every person u of ``batch``: S with all of them, S₋ᵤ without u's rows."""
    whole = of(batch)
    people = batch[-1]
    return {
        int(u): float(torch.linalg.vector_norm(whole - of(tuple(t[people != u] for t in batch))))
        for u in people.unique()
    }


def assert_person_sensitivity(of: ClippedSum, batch: Batch, clip_bound: float) -> None:
    """Removing any one person moves the clipped sum by ≤ C, and by > C/2 for some (the check can fail)."""
    moved = person_sensitivities(of, batch)
    worst = max(moved, key=moved.__getitem__)
    assert moved[worst] <= clip_bound * (1 + 1e-5), f"person {worst} moves the clipped sum by {moved[worst]} > C"
    assert moved[worst] > 0.5 * clip_bound


def rows_of_largest_person(batch: Batch) -> int:
    return int(torch.bincount(batch[-1]).max())


@pytest.mark.parametrize("engine", ["film", "opacus"])
@pytest.mark.parametrize("name", ["head", "film"])
def test_one_person_moves_the_clipped_sum_by_at_most_c(engine: str, name: str) -> None:
    batch = sampled_batch(name)
    assert rows_of_largest_person(batch) > 16  # a person larger than a physical batch is cut out whole
    assert_person_sensitivity(clipped_sum(engine, build(name)), batch, CLIP)


@pytest.mark.parametrize("engine", ["film", "opacus"])
def test_per_example_clipping_fails_the_person_sensitivity_check(engine: str) -> None:
    batch = sampled_batch("film")
    broken = per_row_clipping(clipped_sum(engine, build("film")))
    moved = person_sensitivities(broken, batch)
    rows = torch.bincount(batch[-1])
    assert max(moved[u] for u in range(len(rows)) if rows[u] > 1) > 2 * CLIP
    with pytest.raises(AssertionError, match="moves the clipped sum"):
        assert_person_sensitivity(broken, batch, CLIP)


def reference_clipped_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Σ_u min(1, C/‖G_u‖) G_u by plain autograd, one person at a time: G_u = ∇ of u's mean loss."""
    *inputs, labels, people = batch
    total = torch.zeros(sum(p.numel() for p in model.parameters()))
    for u in people.unique():
        mine = people == u
        loss = summed_cross_entropy(model(*(x[mine] for x in inputs)), labels[mine]) / int(mine.sum())
        mean = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])
        total += mean * min(1.0, CLIP / float(torch.linalg.vector_norm(mean)))
    return total


@pytest.mark.parametrize("engine", ["film", "opacus"])
@pytest.mark.parametrize("name", ["head", "film", "tokens"])
def test_the_clipped_sum_clips_each_persons_mean_gradient(engine: str, name: str) -> None:
    model = build(name)
    batch = sampled_batch(name)
    expected = reference_clipped_sum(model, batch)  # before any engine attaches hooks
    torch.testing.assert_close(clipped_sum(engine, model)(batch), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["head", "film", "tokens"])
def test_engines_agree_on_the_person_level_clipped_sum(name: str) -> None:
    model = build(name)
    batch = sampled_batch(name)
    film = clipped_sum("film", model)(batch)
    # the cut into physical batches changes nothing: a person is never split
    torch.testing.assert_close(clipped_sum("film", model, max_physical_batch_size=1000)(batch), film)
    # clipping people is not clipping rows on this batch
    rows = clipped_sum("film", model, person_level=False)(batch[:-1])
    assert float(torch.linalg.vector_norm(rows - film)) > 0.1
    torch.testing.assert_close(clipped_sum("opacus", model)(batch), film, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("engine", ["film", "opacus"])
@pytest.mark.parametrize("name", ["head", "tokens"])
def test_one_row_per_person_is_the_row_level_step(engine: str, name: str) -> None:
    model = build(name)
    *data, _ = sampled_batch(name)
    alone = (*data, torch.arange(len(data[-1])))
    torch.testing.assert_close(
        clipped_sum(engine, model)(alone), clipped_sum(engine, model, person_level=False)(tuple(data))
    )


def test_physical_batches_cut_only_between_people() -> None:
    people = torch.repeat_interleave(torch.arange(6), torch.tensor([3, 9, 2, 2, 1, 4]))
    rows = torch.arange(len(people))
    chunks = list(person_physical_batches((rows, people), 5, CPU))
    assert [chunk[0].tolist() for chunk in chunks] == [
        [0, 1, 2],
        list(range(3, 12)),
        [12, 13, 14, 15, 16],
        [17, 18, 19, 20],
    ]
    assert [chunk[1].tolist() for chunk in chunks] == [[0, 0, 0], [0] * 9, [0, 0, 1, 1, 2], [0, 0, 0, 0]]
    assert not list(person_physical_batches((rows[:0], people[:0]), 5, CPU))


def binned_chisquare(observed: np.ndarray, probabilities: np.ndarray, draws: int) -> float:
    """χ² goodness-of-fit p-value, the tails merged into bins of ≥ 5 expected counts."""
    expected = probabilities * draws
    edges = [0]
    for k in range(len(expected)):
        if expected[edges[-1] : k + 1].sum() >= 5 and expected[k + 1 :].sum() >= 5:
            edges.append(k + 1)
    edges.append(len(expected))
    binned = [(observed[a:b].sum(), expected[a:b].sum()) for a, b in zip(edges, edges[1:], strict=False) if b > a]
    seen, wanted = np.array(binned, dtype=np.float64).T
    return float(stats.chisquare(seen, wanted * seen.sum() / wanted.sum()).pvalue)


def test_people_per_step_are_binomial_and_each_brings_min_k_m_distinct_rows_of_their_own() -> None:
    people_count, sample_rate, steps, max_rows = 50, 0.1, 2000, 3
    sizes = TRAIN_SIZES + [1] * (people_count - len(TRAIN_SIZES))
    owner = dense_people(clustered_people(sizes, (1,), CLASSES, seed=1)[2])
    loader = PersonPoissonLoader(
        TensorDataset(torch.zeros(len(owner))), owner, sample_rate, steps, torch.Generator().manual_seed(11), max_rows
    )
    per_step = np.zeros(people_count + 1, dtype=np.int64)
    largest = int(np.argmax(np.bincount(owner)))
    picked = np.zeros(len(owner), dtype=np.int64)
    for _ in range(steps):
        rows, people = loader.sample()
        joined = torch.unique_consecutive(people).numel()
        per_step[joined] += 1
        for u in range(joined):
            mine = rows[people == u].numpy()
            assert len(np.unique(owner[mine])) == 1  # one person's rows only
            k = int((owner == owner[mine[0]]).sum())
            assert len(np.unique(mine)) == len(mine) == min(k, max_rows)
        chosen = rows.numpy()
        picked += np.bincount(chosen[owner[chosen] == largest], minlength=len(owner))
    binomial = stats.binom.pmf(np.arange(people_count + 1), people_count, sample_rate)
    assert binned_chisquare(per_step, binomial, steps) > 1e-3
    mine = picked[owner == largest]  # the 50-row person's rows are picked uniformly
    assert stats.chisquare(mine).pvalue > 1e-3


def person_workload(config: TrialConfig) -> Workload:
    """A features workload of heavy-tailed people: train as :data:`TRAIN_SIZES` twice, val and test of
    15 people each (1 to 6 rows)."""
    sizes = [TRAIN_SIZES * 2, [1, 2, 3, 4, 5, 6] * 2 + [2, 3, 1], [3, 1, 2, 6, 5, 4] * 2 + [1, 1, 2]]
    train, val, test = (clustered_people(split, (FEATURES,), CLASSES, seed=seed) for seed, split in enumerate(sizes))
    return people_workload(config.workload, (train, val, test), CLASSES)


PERSON_TRIAL = TrialConfig(
    workload=WorkloadSpec(
        dataset="20newsgroups", backbone="minilm", peft="head", person_unit=PersonUnit("user", max_rows=8)
    ),
    epsilon=4.0,
    delta=1e-3,
    epochs=3,
    clip_bound=1.0,
    batch_size=10,  # people
    learning_rate=0.1,
    base_learning_rate=0.1,
    optimizer="adam",
    clipping="normalized",
    seed=5,
    max_physical_batch_size=16,
    threads=1,
    diagnostics=True,
    diagnostic_examples=20,
    score_noise_multiplier=2.0,
)


@pytest.fixture
def person_trial(monkeypatch: pytest.MonkeyPatch) -> Workload:
    """The runner loads :func:`person_workload` for any spec."""
    workload = person_workload(PERSON_TRIAL)
    monkeypatch.setattr(trainer, "cached_workload", lambda spec: workload)
    return workload


@pytest.mark.parametrize("engine", ["film", "opacus"])
def test_a_person_level_trial_samples_people_and_scores_people(engine: EngineName, person_trial: Workload) -> None:
    people = person_trial.num_units
    assert people == 2 * len(TRAIN_SIZES) < len(person_trial.train)
    config = with_mechanism(replace(PERSON_TRIAL, engine=engine), people)
    result = trainer.run(config)
    assert result.status == "ok" and result.engine == engine
    assert result.sample_rate == PERSON_TRIAL.batch_size / people
    assert result.steps_taken == result.steps and 0 < result.epsilon_spent <= PERSON_TRIAL.epsilon
    val_people = person_trial.people.count("val")  # type: ignore[union-attr]
    assert val_people != len(person_trial.val)
    assert round(result.noisy_val_accuracy * val_people) / val_people == result.noisy_val_accuracy


def test_the_noisy_score_counts_validation_people(person_trial: Workload) -> None:
    trial = Trial(with_mechanism(PERSON_TRIAL, person_trial.num_units), CPU, person_trial)
    assert isinstance(trial.loader, PersonPoissonLoader) and trial.spec.person_level
    assert trial.spec.expected_batch_size == pytest.approx(trial.sample_rate * person_trial.num_units)
    val = trial.evaluate(person_trial.val)
    assert person_trial.people is not None and val.person_score is not None
    assert val.person_score.people == person_trial.people.count("val")
    assert trial.evaluate(person_trial.test).person_score.people == person_trial.people.count("test")  # type: ignore[union-attr]
    noise = np.array([trial.noisy_score(val) for _ in range(2000)]) * val.person_score.people - val.person_score.count
    assert np.allclose(noise, np.round(noise)) and abs(noise.mean()) < 5 * 2.0 / math.sqrt(2000)
    assert isinstance(val.person_score, PersonScore)


def test_a_lost_person_level_run_continues_to_the_same_result(person_trial: Workload, tmp_path: Path) -> None:
    config = with_mechanism(PERSON_TRIAL, person_trial.num_units)
    whole = trainer.run(config)
    checkpoint = RunCheckpoint(str(tmp_path), "run.pt")

    def lost_in_second_epoch(metrics: EpochMetrics) -> None:
        if metrics.epoch == 2:
            raise RuntimeError("process lost")

    with pytest.raises(TrialFailed, match="process lost"):
        trainer.run(config, lost_in_second_epoch, checkpoint)
    continued = trainer.run(replace(config, seed=99), None, checkpoint)
    assert [(m.steps, m.train_loss, m.val_loss) for m in continued.epochs] == [
        (m.steps, m.train_loss, m.val_loss) for m in whole.epochs
    ]
    assert continued.trained is not None and whole.trained is not None
    assert all(np.array_equal(continued.trained.parameters[k], v) for k, v in whole.trained.parameters.items())
