"""One audit training: the configurations' runs on the workload with the canaries, through a runner a
search uses (the fused runner, :func:`dptune.runners.fused.run_fused`, all of them at once; or the
trial runner, :func:`dptune.runners.trial.run_trial`, one at a time with the space's engine, FiLM or
Opacus), and each run's canary scores and :class:`~dptune.audit.bound.AuditBound` under both threat
models."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

import numpy as np

from dptune.audit.bound import AuditBound, best_bound
from dptune.audit.canaries import Canaries, GradientCanaries
from dptune.contract import TrialConfig, TrialResult
from dptune.data import Workload
from dptune.errors import DptuneError
from dptune.plan import full_schedule
from dptune.plan.mechanism import with_mechanism
from dptune.runners.fused import run_fused
from dptune.runners.trial import run_trial

#: The runners an audit trains through: ``fused`` (what a search of heads uses by default) or ``trial``.
Runner = Literal["fused", "trial"]
RUNNERS: tuple[Runner, ...] = get_args(Runner)
#: The threat models, as the output names them.
BLACK_BOX = "black-box"
WHITE_BOX = "white-box"


class AuditError(DptuneError, ValueError):
    """An audit cannot run as asked: the message names the problem and what is allowed."""


class AuditInterrupted(DptuneError):
    """An audit stopped by a signal before it finished; its exit status is 128 + the signal's number."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.exit_status = 128 + signal_number


@dataclass(frozen=True)
class AuditedRun:
    """One audited configuration: its run's record, its canaries' scores (name → (m,), higher meaning
    "more likely in") per threat model, and each threat model's bound."""

    config: TrialConfig
    result: TrialResult
    scores: dict[str, dict[str, np.ndarray]]
    bounds: dict[str, AuditBound]


def audited_configs(configs: Sequence[TrialConfig], num_train: int) -> list[TrialConfig]:
    """Each config with the mechanism its model has on the task's ``num_train`` rows: the public
    schedule q = B/N, T = round(E·N/B) (``dptune.plan.full_schedule``) and σ for it, fixed before the
    inclusion coins are drawn, so no coin changes the mechanism another canary sees (the training split
    adds the included input canaries to the N rows and samples each of them at that q); with no
    diagnostics (no probe of training rows) and no selection score."""
    return [
        with_mechanism(
            replace(
                c,
                diagnostics=False,
                score_noise_multiplier=None,
                schedule=full_schedule(num_train, c.batch_size, c.epochs),
            ),
            num_train,
        )
        for c in configs
    ]


def _train(
    configs: Sequence[TrialConfig],
    workload: Workload,
    canaries: Canaries,
    runner: Runner,
    progress: Callable[[float], None] | None,
) -> tuple[list[TrialResult], list[tuple[GradientCanaries, int]]]:
    """Each config's result and its gradient canaries' observer with its row in it."""
    positions = canaries.positions(workload.feature_dim or 0, workload.num_classes)
    children = canaries.coins.spawn(len(configs))
    audited = canaries.workload(workload)
    if runner == "trial":
        results, observers = [], []
        for index, config in enumerate(configs):
            assert config.mechanism is not None
            observer = GradientCanaries(canaries, positions, [children[index]], config.mechanism.sample_rate)
            results.append(run_trial(config, workload=audited, observer=observer))
            observers.append((observer, 0))
            if progress is not None:
                progress(index + 1)
        return results, observers
    groups: dict[int, tuple[GradientCanaries, int]] = {}

    def observe(members: Sequence[int], sample_rate: float) -> GradientCanaries:
        group = GradientCanaries(canaries, positions, [children[i] for i in members], sample_rate)
        groups.update({i: (group, row) for row, i in enumerate(members)})
        return group

    results = run_fused(configs, workload=audited, progress=progress, observers=observe)
    return results, [groups[i] for i in range(len(configs))]


def run_audit(
    configs: Sequence[TrialConfig],
    workload: Workload,
    canaries: Canaries,
    confidence: float,
    runner: Runner = "fused",
    progress: Callable[[float], None] | None = None,
) -> list[AuditedRun]:
    """Train ``configs`` (one cell's, differing only in C, B, η) on ``workload`` with ``canaries`` through
    ``runner`` and audit each run (:mod:`dptune.audit.canaries`); ``progress(runs)`` after each epoch
    (fused) or run (trial)."""
    if workload.people is not None:
        raise AuditError(
            "the audit's canaries are rows: auditing a person-level workload is not built yet; "
            "audit a space with privacy.unit row"
        )
    if workload.feature_dim is None:
        raise AuditError("the audit trains heads on cached features: the space's task must have peft 'head'")
    planned = audited_configs(configs, len(workload.train))
    results, observers = _train(planned, workload, canaries, runner, progress)
    ties = np.random.default_rng(canaries.coins.spawn(1)[0])
    scored = []
    for result, (observer, row) in zip(results, observers, strict=True):
        scores = {WHITE_BOX: {"sum": observer.sums[row].numpy(), "variation": observer.variation[row].numpy()}}
        if result.status == "ok" and result.trained is not None:
            parameters = result.trained.parameters
            scores[BLACK_BOX] = {"loss": -canaries.input_losses(parameters["weight"], parameters["bias"])}
        scored.append(scores)
    reported = sum(map(len, scored))  # every bound of the audit holds at once at ``confidence``
    return [
        AuditedRun(
            config=config,
            result=result,
            scores=scores,
            bounds={
                threat: best_bound(
                    named, canaries.included, config.epsilon, config.delta, ties, confidence, bounds=reported
                )
                for threat, named in scores.items()
            },
        )
        for config, result, scores in zip(planned, results, scored, strict=True)
    ]
