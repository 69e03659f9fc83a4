"""One DP fine-tuning trial: ``run_trial(config, report)``, the one place a DP fine-tune happens.

Plain Python, no Ray: Ray Tune calls it through ``dptune.search``; tests call it directly.
The types it takes and returns live in :mod:`dptune.contract` (plain data, no torch; re-exported
here) and its errors in :mod:`dptune.errors`; the training itself lives in
:mod:`dptune.runners.trainer`, the checks and helpers it shares with the fused runner in
:mod:`dptune.runners.common`. This module imports torch only inside its functions, so the driver
and Ray's worker setup hook can import it before torch.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from dptune.contract import ClassDiagnostics, Diagnostics, EpochMetrics, Reporter, TrialConfig, TrialResult, TrialStatus
from dptune.errors import TrialConfigError, TrialFailed
from dptune.runners.checkpoint import RunCheckpoint

if TYPE_CHECKING:  # torch-free at import: the driver imports this module before torch
    from dptune.data import Workload
    from dptune.runners.common import StepObserver

#: The contract types are re-exported here for callers that import them with ``run_trial``.
__all__ = [
    "ClassDiagnostics",
    "Diagnostics",
    "EpochMetrics",
    "Reporter",
    "TrialConfig",
    "TrialConfigError",
    "TrialFailed",
    "TrialResult",
    "TrialStatus",
    "check_trial_can_run",
    "leave_deleted_working_directory",
    "run_trial",
]


def run_trial(
    config: TrialConfig,
    report: Reporter | None = None,
    checkpoint: RunCheckpoint | None = None,
    *,
    workload: Workload | None = None,
    observer: StepObserver | None = None,
) -> TrialResult:
    """Fine-tune ``config.workload``'s backbone on its dataset with DP; call ``report`` per epoch.

    Raises ``ValueError`` (:class:`TrialConfigError`, ``WorkloadError``, ``ModelError``,
    ``PrivacyParameterError``) for bad input, always before training; any error once training
    has begun is raised as :class:`TrialFailed` (with the steps taken). A run whose loss turns
    non-finite returns status ``"diverged"``. With ``checkpoint`` the run keeps its whole state there
    between epochs and continues from it when a lost process left one (:mod:`dptune.runners.checkpoint`).
    ``workload`` and ``observer``: an audit's own splits (on which a public schedule, ``config.schedule``,
    is the audited model's q and T) and its view of the head's steps (:mod:`dptune.audit`; a search
    passes neither).
    Implementation: :mod:`dptune.runners.trainer` (imported here on first use, so that importing this
    module stays torch-free).
    """
    leave_deleted_working_directory()
    if workload is None:  # on its spec's workload a public schedule is a tuning run's, on a subsample
        _refuse_public_schedule(config)
    from dptune.runners.trainer import run

    return run(config, report, checkpoint, workload=workload, observer=observer)


def _refuse_public_schedule(config: TrialConfig) -> None:
    if config.schedule is not None:
        raise TrialConfigError(
            "a run with a public schedule (tuning on a private subsample) trains with the fused runner only "
            "(peft 'head', training.runner auto or fused); this runner takes q and T from its training split"
        )


def check_trial_can_run(config: TrialConfig) -> None:
    """Raise ``ValueError`` (the same errors :func:`run_trial` raises) if ``config`` cannot run,
    from the config, the registries and the model's structure alone: no weight is loaded, and no
    data is read but a data owner's own file (once per process, to check it and know its classes).

    Checked: names and values (:class:`TrialConfigError`); dataset × backbone × PEFT and the
    workload knobs (``WorkloadError``); that DP can train the model (``ModelError``, e.g.
    BatchNorm that would use batch statistics) and that the requested engine can run it. The
    model is built with random weights on PyTorch's ``meta`` device (no memory, no compute).
    ``dptune.search`` calls this once in the driver, before Ray starts, when its runs train through
    :func:`run_trial` (a fused search checks its configurations with ``dptune.runners.fused.check_fusable``).
    """
    leave_deleted_working_directory()
    import torch

    from dptune.contract import NO_BACKBONE
    from dptune.data.workload import check_spec
    from dptune.dp.engine_registry import select_engine
    from dptune.models import build_model, check_dp_compatible
    from dptune.runners.common import check_config

    check_config(config)
    _refuse_public_schedule(config)
    spec = config.workload
    info = check_spec(spec)
    if spec.backbone == NO_BACKBONE:  # a linear head on the rows' own embeddings: nothing more to check
        return
    classes = len(spec.classes) if spec.classes is not None else info.num_classes
    with torch.device("meta"):
        model = build_model(spec.backbone, spec.peft, classes, feature_input=spec.peft == "head", pretrained=False)
    check_dp_compatible(model)
    try:
        select_engine(config.engine, model, spec.peft)
    except ValueError as error:
        raise TrialConfigError(str(error)) from error


def leave_deleted_working_directory() -> None:
    """Move to the temp folder if this process's working directory no longer exists.

    oneMKL inside ``libtorch_cpu.so`` aborts the whole process at ``import torch`` ("Intel oneMKL
    FATAL ERROR: Cannot load .../libtorch_cpu.so") when the working directory has been deleted,
    and Ray Tune's ``Trainable`` fails on ``os.getcwd()``. Ray's worker processes inherit the
    working directory of the ``ray start`` that launched their node, so a worker node started
    from a temporary folder that is later removed kills every trial scheduled on it.
    ``dptune.search`` installs this as Ray's ``worker_process_setup_hook``; ``run_trial`` calls it
    too. It must run before torch is first imported.
    """
    try:
        os.getcwd()
    except FileNotFoundError:
        os.chdir(tempfile.gettempdir())
