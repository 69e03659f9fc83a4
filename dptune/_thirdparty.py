"""Every call dptune makes into a third-party library's private API, one small function each.

Private names (Opacus' gradient bookkeeping and noise, dp_accounting's RDP internals, torchvision's
SUN397 file listing, the printer of Ray's driver, a restored Tuner's configs, Tune's interrupt signal)
may change in any release, so each is used only
here, and only after the installed version is checked once against the minor releases it was read
and tested against
(``TESTED_VERSIONS``): another version fails at first use with :class:`UnsupportedVersionError`
naming the library, its version and the range, instead of a wrong result or an ``AttributeError``
deep inside a trial. ``tests/test_thirdparty.py`` pins the behaviour each function relies on.

Torch-free at import: each library is imported inside the function that uses it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dptune.errors import DptuneError

if TYPE_CHECKING:
    import numpy as np
    import torch

#: Distribution → (lowest, first unsupported) (major, minor) release: the private names used below
#: were read in, and are tested against, the pinned release of ``pyproject.toml``.
TESTED_VERSIONS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "opacus": ((1, 6), (1, 7)),
    "dp-accounting": ((0, 6), (0, 7)),
    "torchvision": ((0, 29), (0, 30)),
    "ray": ((2, 60), (2, 61)),
}
#: What dptune uses of each, for the error message.
PRIVATE_NAMES: dict[str, str] = {
    "opacus": "opacus.optimizers.optimizer._generate_noise, _mark_as_processed, _check_processed_flag",
    "dp-accounting": (
        "RdpAccountant._rdp, rdp_privacy_accountant._compute_rdp_repeat_and_select, "
        "PrivacyLossDistribution._pmf_remove/_pmf_add/_symmetric, DensePLDPmf's fields"
    ),
    "torchvision": "SUN397._image_files, SUN397._labels",
    "ray": "ray._private.worker.print_to_stdstream, Tuner._local_tuner._tune_config, tune.run's SIGUSR1 handler",
}

Result = TypeVar("Result")


class UnsupportedVersionError(DptuneError, ImportError):
    """An installed library's version is outside the range whose private API dptune was tested with."""


def version_problem(distribution: str, installed: str) -> str | None:
    """Why ``installed`` (a version string) of ``distribution`` is unsupported, or ``None`` if it is in range."""
    low, high = TESTED_VERSIONS[distribution]
    match = re.match(r"(\d+)\.(\d+)", installed)
    if match is not None and low <= (int(match[1]), int(match[2])) < high:
        return None
    return (
        f"{distribution} {installed} is installed; dptune calls its private API ({PRIVATE_NAMES[distribution]}), "
        f"tested with versions >= {low[0]}.{low[1]}, < {high[0]}.{high[1]}: "
        "install the version pyproject.toml pins"
    )


@functools.cache
def check_version(distribution: str) -> None:
    """Raise :class:`UnsupportedVersionError` unless the installed ``distribution`` is in ``TESTED_VERSIONS``
    (checked once per process)."""
    try:
        installed = version(distribution)
    except PackageNotFoundError as error:
        raise UnsupportedVersionError(f"{distribution} is not installed; dptune needs it") from error
    problem = version_problem(distribution, installed)
    if problem is not None:
        raise UnsupportedVersionError(problem)


def _checked(distribution: str) -> Callable[[Callable[..., Result]], Callable[..., Result]]:
    """Decorate a function that uses ``distribution``'s private API: check its version on every call (cached)."""

    def decorate(function: Callable[..., Result]) -> Callable[..., Result]:
        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Result:
            check_version(distribution)
            return function(*args, **kwargs)

        return checked

    return decorate


# --------------------------------------------------------------------------- Opacus


@_checked("opacus")
def check_processed_flag(tensor: torch.Tensor) -> None:
    """Opacus' guard: raise ``ValueError`` if ``tensor`` (a grad sample or summed gradient) was
    already used in this step (gradients not cleared since the last optimizer step)."""
    from opacus.optimizers.optimizer import _check_processed_flag

    _check_processed_flag(tensor)


@_checked("opacus")
def mark_as_processed(tensor: torch.Tensor) -> None:
    """Flag ``tensor`` as used in this step (what :func:`check_processed_flag` refuses to use twice)."""
    from opacus.optimizers.optimizer import _mark_as_processed

    _mark_as_processed(tensor)


@_checked("opacus")
def generate_noise(
    std: float, reference: torch.Tensor, generator: torch.Generator | None, secure_mode: bool
) -> torch.Tensor:
    """N(0, std² I) shaped like ``reference``, drawn from ``generator`` (Opacus' noise, including its
    ``secure_mode`` that sums several draws against floating-point attacks)."""
    from opacus.optimizers.optimizer import _generate_noise

    return _generate_noise(std=std, reference=reference, generator=generator, secure_mode=secure_mode)


# --------------------------------------------------------------------------- dp_accounting


@_checked("dp-accounting")
def rdp_of_event(orders: np.ndarray, event: Any) -> np.ndarray:
    """RDP ε(λ) at each order λ of ``orders`` of one dp_accounting ``DpEvent`` (``RdpAccountant``'s
    private curve: its public API only converts it to (ε, δ))."""
    from dp_accounting.rdp import RdpAccountant

    return RdpAccountant(orders).compose(event)._rdp


@_checked("dp-accounting")
def rdp_repeat_and_select(orders: np.ndarray, rdp: np.ndarray, mean_trials: float, shape: float) -> np.ndarray:
    """RDP curve of running a mechanism with curve ``rdp`` a truncated-negative-binomial number of
    times (mean ``mean_trials``, shape η = ``shape``) and releasing the best (Papernot & Steinke,
    ICLR 2022, Thm 2), minimised over λ̂ by dp_accounting."""
    from dp_accounting.rdp.rdp_privacy_accountant import _compute_rdp_repeat_and_select

    return _compute_rdp_repeat_and_select(orders, rdp, mean_trials, shape)


@_checked("dp-accounting")
def pld_pmfs(pld: Any) -> list[tuple[float, int, np.ndarray, float]]:
    """The probability mass functions of a dp_accounting ``PrivacyLossDistribution`` (the remove
    direction, then the add direction unless the PLD is symmetric), each as (grid interval, index of its
    lowest loss, probabilities from the lowest loss up, mass at an infinite loss): the PLD's public
    ``get_epsilon_for_delta`` reads them in float64 ratios that overflow past ε ≈ 700."""
    pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
    dense = [pmf.to_dense_pmf() for pmf in pmfs]
    return [(pmf._discretization, pmf._lower_loss, pmf._probs, pmf._infinity_mass) for pmf in dense]


# --------------------------------------------------------------------------- torchvision


@_checked("torchvision")
def sun397_listing(dataset: Any) -> tuple[Sequence[Path], Sequence[int]]:
    """The image files of a ``torchvision.datasets.SUN397`` and their labels (indices into
    ``dataset.classes``), aligned; torchvision keeps both private."""
    return dataset._image_files, dataset._labels


# --------------------------------------------------------------------------- Ray


@contextlib.contextmanager
@_checked("ray")
def without_raylet_messages() -> Iterator[None]:
    """In the ``with`` block the driver prints none of the error messages the cluster publishes to it
    (``pid`` ``raylet``: a worker died, with its lease, worker and node ids and address), which Ray's
    listener thread prints through ``ray._private.worker.print_to_stdstream``; every other line it
    prints (a worker's output, when forwarded) passes."""
    import ray._private.worker as worker

    printing = worker.print_to_stdstream

    def quiet(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            printing(data, ignore_prefix)

    worker.print_to_stdstream = quiet
    try:
        yield
    finally:
        worker.print_to_stdstream = printing


@_checked("ray")
def restored_configs(tuner: Any) -> tuple[Any, Any] | None:
    """The ``TuneConfig`` and ``RunConfig`` of a ``tune.Tuner.restore`` answer, as it unpickled them from the
    experiment (its searcher and its callbacks, as the search's first driver made them), so the driver can
    bind them to its own state before ``fit``: ``Tuner.restore`` takes a new trainable and ``param_space`` but
    neither configuration. None for a Ray Client Tuner (``ray://``), which runs on the cluster."""
    internal = tuner._local_tuner
    return None if internal is None else (internal._tune_config, internal.get_run_config())


@_checked("ray")
def interrupt_tune_run() -> None:
    """Make the ``tune.run`` loop running in this process stop as Ctrl+C would: Tune checks an event its
    SIGUSR1 handler sets (installed while ``Tuner.fit`` runs), then saves its experiment state with the
    running trials still unfinished, so a ``Tuner.restore(..., resume_unfinished=True)`` runs them again.
    Tune has no public call for this: a ``Stopper``'s ``stop_all`` (and ``TuneConfig.time_budget_s``) stop
    every running trial as *terminated*, which a restore treats as finished. Nothing is sent when no
    handler is installed (no Tune run)."""
    if callable(signal.getsignal(signal.SIGUSR1)):
        os.kill(os.getpid(), signal.SIGUSR1)
