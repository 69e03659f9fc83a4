"""Broken mechanisms for the privacy audit's tests: a fault injected into every engine's DP step.

An audit (:mod:`dptune.audit`) must catch a broken mechanism, so its tests break one on purpose,
through the code a search runs: with :func:`injected` active, :func:`~dptune.dp.clipping.noise_std`
scales the noise, :func:`~dptune.dp.clipping.clip_factors` returns factor 1, or the fused runner
reuses one step's noise at every step. No space, flag, configuration or API argument reaches this
module: only ``with injected(fault):`` in the process that trains, and it ends with the block.

- ``noise_off``: s = 0 (no Gaussian noise at all);
- ``noise_tenth``: s = σ·C/10, the noise of σ divided by 10;
- ``no_clipping``: f_i = 1, per-example clipping bypassed (‖g_i‖ unbounded);
- ``reused_noise``: the fused runner draws one step's Gaussian noise and adds that same draw at
  every step of the run (coins reused across steps).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, get_args

Fault = Literal["noise_off", "noise_tenth", "no_clipping", "reused_noise"]
#: Every fault :func:`injected` knows.
FAULTS: tuple[Fault, ...] = get_args(Fault)
#: The noise factor of each fault that scales the noise.
_NOISE_FACTORS: dict[str, float] = {"noise_off": 0.0, "noise_tenth": 0.1}

_active: Fault | None = None


@contextmanager
def injected(fault: Fault) -> Iterator[None]:
    """Break the mechanism with ``fault`` (module docstring) until the block ends (not re-entrant)."""
    global _active
    if fault not in FAULTS:
        raise ValueError(f"fault {fault!r} is unknown; choose one of {', '.join(FAULTS)}")
    if _active is not None:
        raise RuntimeError(f"fault {_active!r} is already injected")
    _active = fault
    try:
        yield
    finally:
        _active = None


def noise_factor() -> float:
    """The factor on the Gaussian noise's standard deviation: 1 unless a noise fault is injected."""
    return 1.0 if _active is None else _NOISE_FACTORS.get(_active, 1.0)


def clipping_bypassed() -> bool:
    """Whether per-example clipping is bypassed (fault ``no_clipping``)."""
    return _active == "no_clipping"


def noise_reused() -> bool:
    """Whether one step's noise is added at every step (fault ``reused_noise``)."""
    return _active == "reused_noise"
