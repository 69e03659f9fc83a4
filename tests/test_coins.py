"""The mechanism's coins carry the seed's whole entropy, not the 32 bits torch's manual_seed keeps.

Seeds below agree in their low 32 bits (and, for 128-bit seeds, in their low 64): under
``torch.Generator().manual_seed`` of 64-bit words such trials could share streams; here they must
draw different noise and different Poisson masks, in run_trial's path and in the fused runner's.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from dptune.contract import TrialConfig
from dptune.dp.coins import DeviceCoins, cpu_generator, trial_coins
from dptune.runners.batches import DeviceWorkload, Draws
from dptune.runners.common import cached_workload
from dptune.runners.fused_group import FusedGroup
from dptune.runners.trainer import Trial
from trial_configs import HEAD_TRIAL as BASE
from trial_configs import planned

CPU = torch.device("cpu")
LOW32 = 0x1234_5678
#: Pairs of seeds equal in their low 32 bits, and in their low 64 bits.
SAME_LOW_32 = (LOW32, LOW32 + (1 << 32))
SAME_LOW_64 = (LOW32 + (5 << 64), LOW32 + (6 << 64))
#: Seeds whose old 64-bit noise words (``SeedSequence(seed).generate_state(4, np.uint64)[2]``)
#: agree in their low 32 bits, and seeds whose old sampling words ([1]) do: found by a birthday
#: search over seeds 1..92,670 (a collision is expected after ~77,000 trials). Under
#: ``manual_seed`` of those words such trials drew the same noise, resp. the same Poisson masks.
OLD_NOISE_COLLISION = (14375, 53572)
OLD_SAMPLING_COLLISION = (92369, 92670)


def test_torch_manual_seed_keeps_only_32_bits_on_the_cpu() -> None:
    """The defect this module fixes (if torch ever keeps more, the test says so)."""
    a, b = (torch.rand(8, generator=torch.Generator().manual_seed(s)) for s in SAME_LOW_32)
    assert torch.equal(a, b)


@pytest.mark.parametrize(("pair", "stream"), [(OLD_NOISE_COLLISION, 2), (OLD_SAMPLING_COLLISION, 1)])
def test_the_old_64_bit_coin_words_of_these_seeds_collide_under_manual_seed(pair: tuple[int, int], stream: int) -> None:
    words = [int(np.random.SeedSequence(s).generate_state(4, dtype=np.uint64)[stream]) for s in pair]
    assert words[0] != words[1] and words[0] % 2**32 == words[1] % 2**32
    a, b = (torch.randn(8, generator=torch.Generator().manual_seed(w)) for w in words)
    assert torch.equal(a, b)


def test_the_cpu_generator_is_numpys_mt19937_of_the_seed_sequence() -> None:
    """torch's draws continue numpy's MT19937(seed_sequence) word for word: all 624 words are used."""
    sequence = np.random.SeedSequence(2**100 + 17)
    raw = np.random.MT19937(sequence).random_raw(4000).astype(np.uint64)
    doubles = torch.rand(2000, generator=cpu_generator(sequence), dtype=torch.float64).numpy()
    bits53 = ((raw[0::2] << np.uint64(32)) | raw[1::2]) & np.uint64((1 << 53) - 1)  # torch's random64 → [0, 1)
    assert np.array_equal(doubles, bits53.astype(np.float64) * 2.0**-53)
    floats = torch.rand(4000, generator=cpu_generator(sequence)).numpy()
    assert np.array_equal(floats, (raw & np.uint64((1 << 24) - 1)).astype(np.float32) * np.float32(2.0**-24))


def test_the_generator_state_is_not_a_function_of_32_or_64_bits() -> None:
    for pair in (SAME_LOW_32, SAME_LOW_64):
        a, b = (cpu_generator(np.random.SeedSequence(s)) for s in pair)
        assert not torch.equal(a.get_state(), b.get_state())
        assert not torch.equal(torch.rand(64, generator=a), torch.rand(64, generator=b))
    # the state round-trips through set_state / get_state, and its 624 words are not torch's own
    # 32-bit seeding of any word: at least 19,937 bits of the state vary with the seed sequence
    generator = cpu_generator(np.random.SeedSequence(99))
    state = generator.get_state()
    copy = torch.Generator()
    copy.set_state(state)
    assert torch.equal(copy.get_state(), state)
    assert torch.equal(torch.randn(32, generator=copy), torch.randn(32, generator=generator))
    words = state[24 : 24 + 8 * 624].view(torch.int64)
    assert len(set(words.tolist())) == 624 and int(words.max()) < 2**32 and int(words[1:].max()) > 2**31
    assert generator.initial_seed() == 0  # no part of the secret is reported as a "seed"


def test_same_seed_same_draws_and_the_four_streams_differ() -> None:
    first, again = trial_coins(2**127 + 3), trial_coins(2**127 + 3)
    draws = [torch.rand(16, generator=cpu_generator(c)) for c in first]
    assert all(torch.equal(d, torch.rand(16, generator=cpu_generator(c))) for d, c in zip(draws, again, strict=True))
    assert len({tuple(d.tolist()) for d in draws}) == 4
    cpu = DeviceCoins(first.noise, CPU)
    cpu.refresh()  # on the CPU nothing changes: the MT19937 state is the whole secret
    assert torch.equal(torch.randn(8, generator=cpu.generator), torch.randn(8, generator=cpu_generator(first.noise)))


def _trial_coins(config: TrialConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """run_trial's first Poisson mask (N,) and first step's noise (the gradient of an empty batch)."""
    trial = Trial(planned(config), CPU, cached_workload(config.workload))
    sampler = trial.loader.batch_sampler
    mask = torch.zeros(len(trial.workload.train), dtype=torch.bool)
    mask[next(iter(sampler))] = True
    trial.noise_coins.refresh()
    trial.engine.noisy_gradient(iter(()))
    return mask, torch.cat([p.grad.flatten() for p in trial.model.parameters() if p.requires_grad])


PAIRS = [SAME_LOW_32, SAME_LOW_64, OLD_NOISE_COLLISION, OLD_SAMPLING_COLLISION]
PAIR_IDS = ["low32", "low64", "old-noise-collision", "old-sampling-collision"]


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_trials_whose_seeds_share_low_bits_draw_different_masks_and_noise(pair: tuple[int, int]) -> None:
    (mask_a, noise_a), (mask_b, noise_b) = (_trial_coins(replace(BASE, seed=s)) for s in pair)
    assert not torch.equal(mask_a, mask_b)
    assert not torch.equal(noise_a, noise_b)
    mask_again, noise_again = _trial_coins(replace(BASE, seed=pair[0]))
    assert torch.equal(mask_again, mask_a) and torch.equal(noise_again, noise_a)


def _masks(draws: Draws, num_train: int) -> torch.Tensor:
    """(K, steps, N) inclusion masks of a fused group's draws."""
    steps, k, _ = draws.index.shape
    mask = torch.zeros(k, steps, num_train + 1, dtype=torch.bool)
    mask[torch.arange(k)[None, :, None], torch.arange(steps)[:, None, None], draws.index] = True
    return mask[..., :num_train]


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_fused_configurations_whose_seeds_share_low_bits_draw_different_masks_and_noise(pair: tuple[int, int]) -> None:
    data = DeviceWorkload.build(BASE, cached_workload(BASE.workload), CPU)
    group = FusedGroup(data, [replace(BASE, seed=s) for s in pair], noise_multiplier=1.0)
    draws = group.coins.draw(10)
    masks = _masks(draws, data.num_train)
    assert not torch.equal(masks[0], masks[1])
    assert not torch.equal(draws.noise[:, 0], draws.noise[:, 1])
    again = FusedGroup(data, [replace(BASE, seed=pair[0])], noise_multiplier=1.0).coins.draw(10)
    assert torch.equal(again.noise[:, 0], draws.noise[:, 0])
    assert torch.equal(_masks(again, data.num_train)[0], masks[0])


class _RecordingPhilox:
    """Stands in for a CUDA generator (none here): records what DeviceCoins sets."""

    def __init__(self) -> None:
        self.settings: list[tuple[int, int]] = []

    def manual_seed(self, key: int) -> _RecordingPhilox:
        self.settings.append((key, -1))
        return self

    def set_offset(self, offset: int) -> _RecordingPhilox:
        self.settings[-1] = (self.settings[-1][0], offset)
        return self


def _cuda_settings(seed: int, refreshes: int) -> list[tuple[int, int]]:
    coins = DeviceCoins.__new__(DeviceCoins)  # the CUDA branch without a GPU: a recording generator
    coins.device, coins.generator = torch.device("cuda"), _RecordingPhilox()
    coins._stream = np.random.Generator(np.random.PCG64(trial_coins(seed).noise))
    for _ in range(refreshes):
        coins.refresh()
    return coins.generator.settings


def test_the_cuda_noise_generator_gets_a_fresh_64_bit_key_and_offset_every_step() -> None:
    settings = _cuda_settings(2**90 + 1, 200)
    keys, offsets = [k for k, _ in settings], [o for _, o in settings]
    assert len(set(keys)) == len(set(offsets)) == 200
    assert all(0 <= k < 2**64 for k in keys) and max(keys) >= 2**63  # all 64 bits of the key vary
    assert all(0 <= o < 2**64 and o % 4 == 0 for o in offsets) and max(offsets) >= 2**63
    assert _cuda_settings(2**90 + 1, 200) == settings  # an integer seed reproduces them
    assert _cuda_settings(2**90 + 1 + (1 << 64), 1) != settings[:1]  # the seed's high bits matter
    torch.Generator().manual_seed(max(keys))  # torch's binding takes keys ≥ 2⁶³ (unsigned 64 bits)
