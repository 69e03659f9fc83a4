"""Person-level (user-level) DP-SGD in the fused head runner (McMahan et al. 2018; Levy et al. 2021).

A tiny cached-features workload with heavy-tailed people (many with one row, a few with ~50 rows of
near-identical features) on which clipping per example and clipping per person differ: the released
sum must change by at most C when one person's rows all leave, agree with a direct per-person
autograd computation, sample people Binomial(N_people, q) with min(k_u, max_rows) rows each, and a
whole run must account and score over people.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch
from torch import nn

from dptune.contract import PersonUnit, TrialConfig, WorkloadSpec
from dptune.data.spec import People, Workload
from dptune.dp.clipping import clip_factors
from dptune.errors import TrialConfigError
from dptune.plan.mechanism import with_mechanism
from dptune.runners import fused
from dptune.runners.batches import BatchRows, DeviceWorkload, PersonIndex, feature_tensors, person_draws
from dptune.runners.common import PersonScore
from dptune.runners.fused import run_fused
from dptune.runners.fused_group import FusedGroup
from dptune.runners.person_heads import head_person_noisy_gradients, person_norms
from people_data import clustered_people, people_workload

DIM, CLASSES = 6, 3
#: Rows per training person: heavy-tailed, 50 people.
TRAIN_SIZES = [1] * 25 + [2, 2, 3, 3, 4, 5, 6, 8, 10, 12, 15, 20] + [30] * 5 + [40, 45, 50, 50, 55, 60, 48, 52]
EVAL_SIZES = [1] * 10 + [2, 3, 5, 8, 20, 30]
CPU = torch.device("cpu")


def _spec(max_rows: int | None) -> WorkloadSpec:
    return WorkloadSpec(
        dataset="20newsgroups", backbone="minilm", peft="head", person_unit=PersonUnit("user", max_rows)
    )


def _workload(max_rows: int | None = None, train_sizes: list[int] = TRAIN_SIZES, seed: int = 0) -> Workload:
    splits = tuple(
        clustered_people(sizes, (DIM,), CLASSES, seed + i)
        for i, sizes in enumerate((train_sizes, EVAL_SIZES, EVAL_SIZES))
    )
    return people_workload(_spec(max_rows), splits, CLASSES)  # type: ignore[arg-type]


def _config(max_rows: int | None = None, **changes: object) -> TrialConfig:
    config = TrialConfig(
        workload=_spec(max_rows),
        epsilon=8.0,
        delta=1e-4,
        epochs=2,
        clip_bound=0.3,
        batch_size=10,
        learning_rate=0.1,
        base_learning_rate=0.1,
        optimizer="adam",
        clipping="standard",
        seed=1,
        threads=1,
        diagnostics=False,
    )
    return replace(config, **changes)  # type: ignore[arg-type]


def _heads(k: int, seed: int = 3) -> torch.Tensor:
    """K trained-looking heads (K, classes, dim + 1)."""
    return torch.randn(k, CLASSES, DIM + 1, generator=torch.Generator().manual_seed(seed)) * 0.5


# --------------------------------------------------------------------------- sensitivity


def _clipped_sum(data: DeviceWorkload, index: PersonIndex, units: list[int], bound: float, rule: str) -> torch.Tensor:
    """Σ_u f_u G_u of one configuration's step on the people ``units`` of ``index`` (no noise, scale 1)."""
    sample = index.sample(torch.zeros(len(units), dtype=torch.int64), torch.tensor(units), torch.Generator())
    rows, counts, persons, bands = person_draws([sample], 1, data.num_train, CPU)
    batch = BatchRows.of(data, rows, persons).step(0, max(1, int(counts.max())), int(bands[0]))
    assert batch.persons is not None
    released = head_person_noisy_gradients(
        _heads(1),
        data.features[batch.index],
        (batch.labels, batch.row_weights, batch.feature_norms),
        batch.persons,
        torch.tensor([bound]),
        rule,  # type: ignore[arg-type]
        torch.zeros(1, CLASSES, DIM + 1),
        torch.ones(1),
    )
    return released.heads[0]


def _removal_changes(
    data: DeviceWorkload, index: PersonIndex, people: list[list[int]], bound: float, rule: str
) -> np.ndarray:
    """‖S − S₋ᵤ‖ for each person u: ``people[u]`` are u's units in ``index``, removed together."""
    everyone = sorted(unit for units in people for unit in units)
    whole = _clipped_sum(data, index, everyone, bound, rule)
    changes = []
    for units in people:
        rest = [unit for unit in everyone if unit not in units]
        changes.append(float(torch.linalg.matrix_norm(whole - _clipped_sum(data, index, rest, bound, rule))))
    return np.array(changes)


SAMPLED = [0, 3, 7, 20, 26, 30, 33, 37, 38, 42, 45, 47, 49]  # people of several sizes, the largest among them


@pytest.mark.parametrize("rule", ["standard", "normalized", "auto_s"])
def test_removing_one_person_moves_the_clipped_sum_by_at_most_the_sensitivity(rule: str) -> None:
    workload = _workload()
    data = DeviceWorkload.build(_config(), workload, CPU)
    assert data.people is not None
    bound = 0.3
    sensitivity = 1.0 if rule == "auto_s" else bound
    people = [[u] for u in SAMPLED]
    changes = _removal_changes(data, data.people, people, bound, rule)
    assert changes.max() <= sensitivity * (1 + 1e-5), changes
    assert changes.max() > 0.5 * sensitivity  # the check can fail


def test_per_example_clipping_fails_the_person_sensitivity_check() -> None:
    """The broken variant: every row clipped as its own person, while a neighbour drops a whole person."""
    workload = _workload()
    data = DeviceWorkload.build(_config(), workload, CPU)
    assert workload.people is not None
    rows_as_people = PersonIndex(np.arange(data.num_train), None)
    people = [np.flatnonzero(workload.people.train == u).tolist() for u in SAMPLED]
    changes = _removal_changes(data, rows_as_people, people, 0.3, "standard")
    assert changes.max() > 0.3 * (1 + 1e-5) * 5  # a 50-row person moves it by ~50 C


@pytest.mark.parametrize("head_shape, max_rows", [(None, None), (None, 4), ((1, 1), None), (None, 1)])
def test_person_norms_by_bands_and_blocks_equal_the_norms_of_the_formed_means(
    head_shape: tuple[int, int] | None, max_rows: int | None
) -> None:
    """‖G_u‖ from the banded Grams (``head_shape`` None: every person in the band, tiles and their edges
    included) and from G_u formed outright (a head of one product: band 0, every multi-row person a block) equal the
    norms of the means formed directly, for K configurations at once."""
    workload = _workload(max_rows)
    assert workload.people is not None
    index = PersonIndex(workload.people.train, max_rows, head_shape)
    data = DeviceWorkload.build(_config(max_rows), workload, CPU)
    generator = torch.Generator().manual_seed(5)
    samples = [index.sample(torch.zeros(len(SAMPLED), dtype=torch.int64), torch.tensor(SAMPLED), generator)] * 2
    rows, counts, persons, bands = person_draws(samples, 1, data.num_train, CPU)
    assert (int(bands[0]) > 0) == (head_shape is None and max_rows != 1)
    assert (len(persons.blocks) > 0) == (head_shape is not None)
    batch = BatchRows.of(data, rows, persons).step(0, int(counts.max()), int(bands[0]))
    assert batch.persons is not None
    deltas = torch.randn(2, batch.index.shape[1], CLASSES, generator=generator) * (
        batch.index < data.num_train
    ).unsqueeze(2)
    features = data.features[batch.index]
    norms = person_norms(deltas, features, batch.feature_norms, batch.persons)
    for k in range(2):
        segments, weights = batch.persons.segments[k], batch.persons.weights[k]
        for u in range(len(SAMPLED)):
            mine = segments == u
            mean = (deltas[k][mine] * weights[mine].unsqueeze(1)).T.double() @ features[k][mine].double()
            assert float(norms[k, u]) == pytest.approx(float(torch.linalg.matrix_norm(mean)), rel=1e-5)


# --------------------------------------------------------------------------- agreement


def _direct_clipped_sum(
    head: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, owners: np.ndarray, bound: float, rule: str
) -> torch.Tensor:
    """Σ_u f_u G_u with per-example gradients from autograd (torch.func) and G_u their mean per person."""
    linear = nn.Linear(DIM, CLASSES)
    params = {"weight": head[:, :-1].double(), "bias": head[:, -1].double()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(linear, p, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, y.unsqueeze(0), reduction="sum")

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, features.double(), labels)
    per_row = torch.cat([grads["weight"], grads["bias"].unsqueeze(2)], dim=2)  # (n, classes, dim + 1)
    total = torch.zeros(CLASSES, DIM + 1, dtype=torch.float64)
    for u in np.unique(owners):
        mean = per_row[torch.from_numpy(owners == u)].mean(0)
        total += clip_factors(torch.linalg.matrix_norm(mean), bound, rule) * mean  # type: ignore[arg-type]
    return total


@pytest.mark.parametrize("max_rows", [None, 4])
def test_a_fused_person_step_releases_the_direct_per_person_clipped_sum(max_rows: int | None) -> None:
    workload = _workload(max_rows)
    assert workload.people is not None
    configs = [_config(max_rows, clip_bound=c, seed=s) for c, s in ((0.3, 1), (1.0, 2), (5.0, 3))]
    group = FusedGroup(DeviceWorkload.build(configs[0], workload, CPU), configs, noise_multiplier=1.0)
    lock_step, data = group.lock_step, group.data
    lock_step.heads.copy_(_heads(3))
    draws = group.coins.draw(3)
    assert draws.persons is not None and draws.bands is not None
    rows = BatchRows.of(data, draws.index, draws.persons)
    features, labels = feature_tensors(workload.train)
    for t in range(3):
        batch = rows.step(t, int(draws.counts[t].max()), int(draws.bands[t]))
        released = lock_step._gradients(data, batch, torch.zeros_like(draws.noise[t])).heads
        for k, config in enumerate(configs):
            used = draws.index[t, k][draws.index[t, k] < data.num_train]
            owners = workload.people.train[used.numpy()]
            direct = _direct_clipped_sum(
                lock_step.heads[k], features[used], labels[used], owners, config.clip_bound, config.clipping
            )
            expected = float(lock_step.scales[k]) * direct
            torch.testing.assert_close(released[k].double(), expected, rtol=1e-5, atol=1e-6)


def test_one_row_per_person_is_the_row_level_step() -> None:
    rows_workload = _workload()
    rows_workload.people = None
    n = len(rows_workload.train)
    people = People(
        "user", train=np.arange(n), val=np.arange(len(rows_workload.val)), test=np.arange(len(rows_workload.test))
    )
    person_workload = replace(rows_workload, people=people)
    configs = [_config(clip_bound=c, seed=s, batch_size=40) for c, s in ((0.3, 1), (1.0, 2))]
    steps = []
    for workload in (rows_workload, person_workload):
        group = FusedGroup(DeviceWorkload.build(configs[0], workload, CPU), configs, noise_multiplier=1.0)
        assert group.data.num_units == n and group.schedule.sample_rate == 40 / n
        group.lock_step.heads.copy_(_heads(2))
        draws = group.coins.draw(2)
        batch = BatchRows.of(group.data, draws.index, draws.persons)
        band = 0 if draws.bands is None else int(draws.bands[1])
        assert band == 0
        step = batch.step(1, int(draws.counts[1].max()), band)
        steps.append((draws.index, group.lock_step._gradients(group.data, step, draws.noise[1])))
    (row_index, row_step), (person_index, person_step) = steps
    assert torch.equal(row_index, person_index)  # the same coins draw the same batches
    torch.testing.assert_close(person_step.heads, row_step.heads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(person_step.norms, row_step.norms, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- sampling


def test_people_per_step_are_binomial_and_each_brings_min_k_max_rows_of_its_own_rows() -> None:
    max_rows, steps = 4, 2000
    workload = _workload(max_rows)
    assert workload.people is not None
    owners = workload.people.train
    sizes = np.bincount(owners)
    config = _config(max_rows, batch_size=5)  # q = 5/50 = 0.1
    group = FusedGroup(DeviceWorkload.build(config, workload, CPU), [config], noise_multiplier=1.0)
    assert group.schedule.sample_rate == pytest.approx(0.1)
    index = group.coins.draw(steps).index[:, 0]
    sampled = np.zeros((steps, len(sizes)), dtype=np.int64)  # rows each person brings to each step
    for t in range(steps):
        used = index[t][index[t] < group.data.num_train].numpy()
        assert len(np.unique(used)) == len(used)  # distinct rows
        np.add.at(sampled[t], owners[used], 1)
    present = sampled > 0
    assert np.array_equal(sampled[present], np.minimum(sizes, max_rows)[np.nonzero(present)[1]])
    people_per_step = present.sum(1)
    expected = scipy.stats.binom.pmf(np.arange(len(sizes) + 1), len(sizes), 0.1) * steps
    low, high = 1, 9  # merged tails: every bin expects ≥ 5 steps
    observed = np.bincount(np.clip(people_per_step, low, high), minlength=high + 1)[low:]
    bins = np.concatenate([[expected[: low + 1].sum()], expected[low + 1 : high], [expected[high:].sum()]])
    assert scipy.stats.chisquare(observed, bins).pvalue > 1e-3
    # a large person's rows are each chosen with probability max_rows / k_u when it is sampled
    largest = int(np.argmax(sizes))
    chosen = np.zeros(sizes[largest])
    for step in np.flatnonzero(present[:, largest]).tolist():
        used = index[step][index[step] < group.data.num_train].numpy()
        rows = np.sort(used[owners[used] == largest])
        chosen += np.isin(np.flatnonzero(owners == largest), rows)
    times, p = present[:, largest].sum(), max_rows / sizes[largest]
    assert np.all(np.abs(chosen - times * p) < 5 * math.sqrt(times * p * (1 - p)) + 1)


# --------------------------------------------------------------------------- a whole run


@pytest.fixture
def person_run(dptune_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Workload:
    """``run_fused`` reads the tiny person-level workload instead of loading one."""
    workload = _workload(max_rows=8)
    monkeypatch.setattr(fused, "cached_workload", lambda spec: workload)
    return workload


def test_a_person_level_fused_run_accounts_and_scores_over_people(person_run: Workload) -> None:
    people = person_run.people
    assert people is not None
    num_people = people.count("train")
    configs = [
        with_mechanism(_config(8, clip_bound=c, seed=s, score_noise_multiplier=1.0), num_people)
        for c, s in ((0.3, 1), (2.0, 2))
    ]
    results = run_fused(configs)
    val_features, val_labels = feature_tensors(person_run.val)
    for result, config in zip(results, configs, strict=True):
        assert result.status == "ok", result.reason
        assert result.num_train == num_people and result.sample_rate == pytest.approx(10 / num_people)
        assert 0 < result.epsilon_spent <= config.epsilon
        assert result.trained is not None
        weight, bias = (torch.from_numpy(result.trained.parameters[name]) for name in ("weight", "bias"))
        correct = ((val_features @ weight.T + bias).argmax(1) == val_labels).numpy()
        score = PersonScore.of(correct, people.val)
        assert score.people == people.count("val") != len(val_labels)
        count = result.noisy_val_accuracy * score.people  # the noisy count over the validation people
        assert count == pytest.approx(round(count), abs=1e-9)
        assert abs(round(count) - score.count) <= 6 * 1.0


def test_a_batch_of_more_people_than_the_workload_has_is_refused(person_run: Workload) -> None:
    assert len(person_run.train) > 60 > 50
    with pytest.raises(TrialConfigError, match="batch_size 60"):
        run_fused([_config(8, batch_size=60)])
