"""The private third-party API dptune uses (``dptune._thirdparty``): version check and the behaviour relied on."""

from __future__ import annotations

import ast
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import torch

from dptune import _thirdparty
from dptune._thirdparty import TESTED_VERSIONS, UnsupportedVersionError, version_problem

PACKAGE = Path(_thirdparty.__file__).parent


@pytest.mark.parametrize("distribution", sorted(TESTED_VERSIONS))
def test_installed_versions_are_the_tested_ones(distribution: str) -> None:
    assert version_problem(distribution, version(distribution)) is None
    _thirdparty.check_version(distribution)  # no error


def test_a_version_outside_the_tested_range_is_refused_naming_library_version_and_range() -> None:
    assert version_problem("opacus", "1.6.3") is None
    assert version_problem("opacus", "1.5.9") is not None
    problem = version_problem("opacus", "1.7.0")
    assert problem is not None
    assert problem.startswith("opacus 1.7.0 is installed; dptune calls its private API (")
    assert "_generate_noise" in problem and ">= 1.6, < 1.7" in problem
    assert version_problem("torchvision", "0.30.0") is not None
    assert version_problem("dp-accounting", "nightly") is not None  # unparseable: refused, not guessed


def test_a_missing_library_is_refused_with_a_dptune_error() -> None:
    _thirdparty.TESTED_VERSIONS["no-such-distribution-dptune"] = ((0, 1), (0, 2))
    try:
        with pytest.raises(UnsupportedVersionError, match="no-such-distribution-dptune is not installed"):
            _thirdparty.check_version("no-such-distribution-dptune")
    finally:
        del _thirdparty.TESTED_VERSIONS["no-such-distribution-dptune"]


def test_only_the_thirdparty_module_reaches_into_private_names_of_opacus_dp_accounting_torchvision_ray() -> None:
    private = {
        "_private",
        "_generate_noise",
        "_mark_as_processed",
        "_check_processed_flag",
        "_compute_rdp_repeat_and_select",
        "_rdp",
        "_image_files",
        "_labels",
        "_local_tuner",
        "_tune_config",
        "_pmf_remove",
        "_pmf_add",
        "_symmetric",
        "_probs",
        "_lower_loss",
        "_infinity_mass",
    }
    users = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                {node.attr}
                if isinstance(node, ast.Attribute)
                else {alias.name for alias in node.names}
                if isinstance(node, ast.ImportFrom)
                else {part for alias in node.names for part in alias.name.split(".")}
                if isinstance(node, ast.Import)
                else set()
            )
            if names & private:
                users.add(path.name)
    assert users == {"_thirdparty.py"}


def test_opacus_noise_is_gaussian_with_the_given_std_and_follows_the_generator() -> None:
    reference = torch.zeros(200, 100)
    draws = [_thirdparty.generate_noise(0.5, reference, torch.Generator().manual_seed(3), False) for _ in range(2)]
    assert draws[0].shape == reference.shape
    assert torch.equal(draws[0], draws[1])
    # N(0, 0.25) over 20,000 values: standard errors 0.0035 (mean) and 0.0025 (std); bounds at 4 of them
    assert abs(draws[0].std().item() - 0.5) < 0.01 and abs(draws[0].mean().item()) < 0.014
    # exactly torch's Gaussian from the same generator state (not secure mode)
    expected = torch.normal(0.0, 0.5, reference.shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(draws[0], expected)


def test_opacus_processed_flag_refuses_a_gradient_used_twice_in_one_step() -> None:
    summed = torch.ones(3)
    _thirdparty.check_processed_flag(summed)
    _thirdparty.mark_as_processed(summed)
    with pytest.raises(ValueError, match="cleared"):
        _thirdparty.check_processed_flag(summed)


def test_rdp_of_full_batch_gaussian_steps_is_the_closed_form() -> None:
    from dp_accounting.dp_event import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent

    orders = np.array([2.0, 8.0, 32.0])
    event = SelfComposedDpEvent(PoissonSampledDpEvent(1.0, GaussianDpEvent(2.0)), 10)
    # T Gaussian mechanisms of σ = 2 on sensitivity 1: ε(λ) = T·λ/(2σ²)
    np.testing.assert_allclose(_thirdparty.rdp_of_event(orders, event), 10 * orders / 8, rtol=1e-12)


def test_repeat_and_select_of_one_trial_costs_at_least_the_trial_and_grows_with_the_mean() -> None:
    orders = np.array([2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    rdp = orders / 8  # one Gaussian mechanism, σ = 2
    few, many = (_thirdparty.rdp_repeat_and_select(orders, rdp, mean, 1.0) for mean in (2.0, 20.0))
    assert few.shape == orders.shape
    assert np.all(few >= rdp) and np.all(many >= few) and np.any(many > few)


def test_pld_pmfs_are_the_two_directions_of_a_subsampled_gaussian_and_one_of_a_plain_one() -> None:
    """A Poisson-subsampled Gaussian's PLD has a remove and an add direction; a full-batch one is symmetric. Each
    pmf is (grid interval, lowest loss index, masses, mass at ∞): its masses sum to 1 less the mass at ∞, and
    its mean loss is the PLD's (the KL divergence σ⁻²/2 of the Gaussian: 0.125 at σ = 2)."""
    from dp_accounting.pld import privacy_loss_distribution

    subsampled = privacy_loss_distribution.from_gaussian_mechanism(
        1.0, value_discretization_interval=1e-3, sampling_prob=0.1
    )
    assert len(_thirdparty.pld_pmfs(subsampled)) == 2
    (interval, lowest, probs, infinity), *_ = _thirdparty.pld_pmfs(
        privacy_loss_distribution.from_gaussian_mechanism(2.0, value_discretization_interval=1e-3)
    )
    assert interval == 1e-3 and infinity < 1e-12
    assert float(np.sum(probs)) == pytest.approx(1.0 - infinity, abs=1e-9)  # pessimistic: a little above
    mean = float(np.sum((lowest + np.arange(len(probs))) * interval * probs))
    assert mean == pytest.approx(0.125, abs=2e-3)


def test_sun397_listing_aligns_files_and_labels(tmp_path: Path) -> None:
    import torchvision

    data = tmp_path / "SUN397"
    (data / "ClassName.txt").parent.mkdir()
    (data / "ClassName.txt").write_text("/a/abbey\n/b/bakery/shop\n")
    for folder, count in (("a/abbey", 2), ("b/bakery/shop", 1)):
        (data / folder).mkdir(parents=True)
        for i in range(count):
            (data / folder / f"sun_{i}.jpg").write_bytes(b"")
    dataset = torchvision.datasets.SUN397(str(tmp_path), download=False)
    files, labels = _thirdparty.sun397_listing(dataset)
    by_file = {Path(path).relative_to(data).parent.as_posix(): label for path, label in zip(files, labels, strict=True)}
    assert len(files) == 3
    assert by_file == {"a/abbey": 0, "b/bakery/shop": 1}


def test_without_raylet_messages_the_driver_prints_no_cluster_error_and_everything_else(
    capsys: pytest.CaptureFixture,
) -> None:
    import ray._private.worker as worker

    def show(pid: str, line: str) -> None:
        worker.print_to_stdstream({"lines": [line], "pid": pid, "is_err": False}, ignore_prefix=False)

    with _thirdparty.without_raylet_messages():
        show("raylet", "A worker died or was killed while executing a task")
        show("4242", "a worker's own output")
    show("raylet", "after the block: shown again")
    printed = capsys.readouterr().out
    assert "A worker died" not in printed and "a worker's own output" in printed and "shown again" in printed


def _unit(config: dict[str, object]) -> None:
    """A Tune function trainable that does nothing (the Tuner below is only built and restored, never fit)."""


def test_a_restored_tuner_hands_its_unpickled_searcher_and_callbacks_to_the_driver(tmp_path: Path) -> None:
    """``Tuner.restore`` unpickles the searcher and callbacks the first driver gave (it takes neither anew);
    ``restored_configs`` reaches the very objects its ``fit`` runs with, so the driver can bind them."""
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    class Marked(tune.Callback):
        def __init__(self) -> None:
            self.bound: str | None = None

    tune.Tuner(
        _unit,
        tune_config=tune.TuneConfig(search_alg=BasicVariantGenerator(), num_samples=1),
        run_config=tune.RunConfig(name="search", storage_path=str(tmp_path), callbacks=[Marked()]),
    )  # a fresh Tuner writes its state (tuner.pkl) at once
    restored = tune.Tuner.restore(str(tmp_path / "search"), trainable=_unit)
    configs = _thirdparty.restored_configs(restored)
    assert configs is not None
    tune_config, run_config = configs
    assert isinstance(tune_config.search_alg, BasicVariantGenerator)
    (callback,) = run_config.callbacks
    assert type(callback).__name__ == "Marked" and callback.bound is None  # unpickled, as the first driver made it
    callback.bound = "this driver"
    assert restored._local_tuner.get_run_config().callbacks[0].bound == "this driver"  # what fit uses


def test_interrupt_tune_run_signals_tunes_handler_once_and_nothing_without_one() -> None:
    import signal

    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: received.append(number))
    try:
        _thirdparty.interrupt_tune_run()
        assert received == [signal.SIGUSR1]
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # no Tune run: no handler, nothing sent (SIG_DFL would kill)
        _thirdparty.interrupt_tune_run()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [signal.SIGUSR1]


def test_tune_run_stops_its_loop_on_sigusr1_and_a_stopper_ends_running_trials_as_terminated() -> None:
    """Why ``interrupt_tune_run`` signals instead of a ``Stopper``: Tune's SIGUSR1 handler sets the event its
    loop checks (running trials stay RUNNING in the saved state: a restore with ``resume_unfinished`` runs
    them again), while a ``stop_all`` Stopper stops every live trial, which ends TERMINATED."""
    import inspect
    import signal

    from ray.tune import tune as tune_module
    from ray.tune.execution.tune_controller import TuneController

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        event = tune_module._setup_signal_catching()
        assert callable(signal.getsignal(signal.SIGUSR1)) and not event.is_set()
        _thirdparty.interrupt_tune_run()
        assert event.is_set()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    stopping = inspect.getsource(TuneController._stop_experiment_if_needed)
    assert "stop_all()" in stopping and "_schedule_trial_stop" in stopping
    assert "Trial.TERMINATED" in inspect.getsource(TuneController._schedule_trial_stop)
