"""A trial's coins: torch generators whose whole state comes from a ``np.random.SeedSequence``.

``torch.Generator().manual_seed(s)`` keeps only the low 32 bits of ``s`` on the CPU (torch's
MT19937 is initialised from one 32-bit word), so a trial whose noise came from ``manual_seed``
drew one of 2³² streams: enumerable, and two trials in ~77,000 collide. Here every stream of the
mechanism comes instead from a child of the trial's ``SeedSequence`` (:func:`trial_coins`, by
``SeedSequence.spawn``), and:

- CPU (Poisson masks, Gaussian noise of a CPU trial): :func:`cpu_generator` sets
  torch's MT19937 state word for word to numpy's ``np.random.MT19937(seed_sequence)`` (624
  32-bit words from ``seed_sequence.generate_state(624, np.uint32)``, the first replaced by
  0x80000000 as numpy does; 19,937 bits of state), so torch's draws continue exactly numpy's
  MT19937 stream for that seed sequence. The state is a function of the seed sequence's whole
  entropy: 128 bits of OS entropy for ``seed=None``, the integer itself (< 2¹²⁸) when given.
- CUDA (Gaussian noise of a trial on the GPU): torch's Philox4x32-10 generator has a 64-bit key
  (``manual_seed`` keeps all 64 bits on CUDA) and a 64-bit offset that must be a multiple of 4.
  :class:`DeviceCoins` sets key and offset from a numpy ``PCG64`` stream seeded by the seed
  sequence (128-bit state and 128-bit increment): 64 + 62 = 126 bits per setting, and it resets
  them before every step (:meth:`DeviceCoins.refresh`), so each step's noise is drawn at a fresh
  secret (key, offset) and the run's noise is a function of the PCG64 state, itself a function of
  the seed sequence's 128 bits of entropy. (Untested on a GPU in this project's CI; written from
  torch's ``Generator.manual_seed``/``set_offset`` API.)

- Score noise (the DP selection score): :func:`score_generator`, a numpy ``Generator`` on
  ``PCG64(seed_sequence)`` (128-bit state and increment from the sequence's entropy), whose uniform
  integers feed the exact discrete Gaussian sampler of :mod:`dptune.dp.discrete_gaussian`.

Initialisation (and dropout) draw from torch's global generators under ``torch.manual_seed`` of
64 bits of the initialisation stream (:func:`init_seed`): no privacy guarantee rests on them.

Not cryptographic: MT19937, PCG64 and Philox are statistical generators (an observer of enough raw
outputs could reconstruct MT19937's state; the mechanism releases only noised sums), and Opacus'
``secure_mode`` (torchcsprng) is not used. An integer seed reproduces every draw (CPU: bit for
bit; CUDA: same device and kernels).
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

import numpy as np
import torch

#: Words of MT19937's state.
MT_WORDS = 624
#: numpy's ``MT19937(seed_sequence)`` sets the first word to this (a non-zero state) ...
MT_FIRST_WORD = 0x80000000
#: ... and its position to 623: the next output is word 623, then the state twists.
MT_POSITION = MT_WORDS - 1

# Byte layout of torch's CPU generator state (``CPUGeneratorImplState`` in
# aten/src/ATen/CPUGeneratorImpl.cpp, 5,056 bytes on 64-bit platforms): uint64 the_initial_seed @0,
# int32 left @8, int32 seeded @12, uint64 next @16, uint64 state[624] @24 (32-bit words widened),
# double normal_x, normal_y, normal_rho @5016.., int32 normal_is_valid @5040, float
# next_float_normal_sample @5048, bool is_next_float_normal_sample_valid @5052. torch's engine
# step is ``if (--left == 0) twist(); return temper(state[next++])``.
_STATE_BYTES = 5056
_LEFT, _SEEDED, _NEXT, _WORDS = 8, 12, 16, 24
_NORMAL_VALID, _FLOAT_NORMAL_VALID = 5040, 5052
#: Philox offsets advance in multiples of 4 (torch refuses others).
_PHILOX_OFFSET_STEP = 4


class TrialCoins(NamedTuple):
    """The four independent coin streams of one trial (or fused configuration), as child seed
    sequences of ``np.random.SeedSequence(seed)``."""

    init: np.random.SeedSequence
    sampling: np.random.SeedSequence
    noise: np.random.SeedSequence
    score: np.random.SeedSequence


def trial_coins(seed: int | None) -> TrialCoins:
    """Spawn the four streams (initialisation, Poisson sampling, Gaussian noise, score noise) of
    ``np.random.SeedSequence(seed)`` (``None``: 128 bits of fresh OS entropy)."""
    return TrialCoins(*np.random.SeedSequence(seed).spawn(4))


def init_seed(coins: np.random.SeedSequence) -> int:
    """A 64-bit ``torch.manual_seed`` for initialisation (no secret coin; see the module docstring)."""
    (seed,) = coins.generate_state(1, dtype=np.uint64)
    return int(seed)


def mt19937_state(coins: np.random.SeedSequence) -> torch.Tensor:
    """torch's CPU generator state (uint8) holding numpy's ``MT19937(coins)`` state."""
    state = np.zeros(_STATE_BYTES, dtype=np.uint8)
    words = coins.generate_state(MT_WORDS, dtype=np.uint32).astype(np.uint64)
    words[0] = MT_FIRST_WORD
    state[_WORDS : _WORDS + 8 * MT_WORDS] = words.astype("<u8").view(np.uint8)
    state[_LEFT : _LEFT + 4] = np.array([MT_WORDS - MT_POSITION + 1], dtype="<i4").view(np.uint8)  # left = 2
    state[_SEEDED : _SEEDED + 4] = np.array([1], dtype="<i4").view(np.uint8)
    state[_NEXT : _NEXT + 8] = np.array([MT_POSITION], dtype="<u8").view(np.uint8)
    # the_initial_seed (@0) stays 0: Generator.initial_seed() reports no part of the secret state;
    # the cached normal samples stay invalid (zeros at _NORMAL_VALID and _FLOAT_NORMAL_VALID).
    return torch.from_numpy(state)


@functools.cache
def _check_state_layout() -> None:
    """Refuse (rather than mis-seed) a torch whose CPU generator state has another size."""
    size = torch.Generator().get_state().numel()
    if size != _STATE_BYTES:
        raise RuntimeError(
            f"torch's CPU generator state has {size} bytes, expected {_STATE_BYTES}; "
            f"dptune.dp.coins must be updated for this torch version"
        )


def cpu_generator(coins: np.random.SeedSequence) -> torch.Generator:
    """A CPU ``torch.Generator`` whose MT19937 state is numpy's ``MT19937(coins)`` (all 624 words)."""
    _check_state_layout()
    generator = torch.Generator()
    generator.set_state(mt19937_state(coins))
    return generator


def score_generator(coins: np.random.SeedSequence) -> np.random.Generator:
    """The score noise's generator: numpy's ``PCG64(coins)``, for :mod:`dptune.dp.discrete_gaussian`."""
    return np.random.Generator(np.random.PCG64(coins))


class DeviceCoins:
    """The Gaussian-noise generator of a trial on ``device``, refreshed before every step.

    CPU: :func:`cpu_generator` (``refresh`` does nothing). CUDA: a Philox generator whose 64-bit key
    and offset (a multiple of 4 below 2⁶⁴) ``refresh`` sets from a PCG64 stream of ``coins``.
    """

    def __init__(self, coins: np.random.SeedSequence, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.type == "cpu":
            self.generator = cpu_generator(coins)
            self._stream: np.random.Generator | None = None
        else:
            self.generator = torch.Generator(device=self.device)
            self._stream = np.random.Generator(np.random.PCG64(coins))
            self.refresh()

    def refresh(self) -> None:
        """Give the CUDA generator a fresh secret key and offset (126 bits) from the PCG64 stream."""
        if self._stream is None:
            return
        key, offset = (int(x) for x in self._stream.integers(0, 2**64, size=2, dtype=np.uint64))
        self.generator.manual_seed(key)
        self.generator.set_offset(offset - offset % _PHILOX_OFFSET_STEP)

    def state(self) -> torch.Tensor | str:
        """The whole state the next step's noise depends on: the CPU generator's (a byte tensor), or on
        CUDA the PCG64 stream's (JSON; ``refresh`` sets the Philox key and offset from it before a step)."""
        if self._stream is None:
            return self.generator.get_state()
        return json.dumps(self._stream.bit_generator.state)

    def set_state(self, state: torch.Tensor | str) -> None:
        """Continue from ``state`` (what :meth:`state` returned, on the same kind of device)."""
        if isinstance(state, torch.Tensor) and self._stream is None:
            self.generator.set_state(state)
        elif isinstance(state, str) and self._stream is not None:
            self._stream.bit_generator.state = json.loads(state)
        else:
            raise ValueError(f"a noise state saved on another kind of device than {self.device.type}")
