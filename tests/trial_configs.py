"""Trial configurations that several test modules train: small, CPU, one thread."""

from __future__ import annotations

from dptune.contract import TrialConfig, WorkloadSpec
from dptune.plan.mechanism import with_mechanism

#: A DP linear head on 100 training and 60 validation/test rows of 20 Newsgroups (MiniLM features),
#: two epochs, reproducible coins (seed 1), the FiLM engine.
HEAD_TRIAL = TrialConfig(
    workload=WorkloadSpec(
        dataset="20newsgroups", backbone="minilm", peft="head", max_train_examples=100, max_eval_examples=60
    ),
    epsilon=8.0,
    delta=1e-5,
    epochs=2,
    clip_bound=1.0,
    batch_size=50,
    learning_rate=0.05,
    base_learning_rate=0.05,
    optimizer="adam",
    clipping="normalized",
    seed=1,
    engine="film",
    threads=1,
    diagnostics=False,
)


def planned(config: TrialConfig, num_train: int | None = None) -> TrialConfig:
    """``config`` with the mechanism the planner calibrates for it (``dptune.plan.mechanism``), as a search
    hands every run its σ, q and T: on ``num_train`` training rows (default: its workload's, loaded
    through the runners' per-process cache). A runner refuses a config without one."""
    if num_train is None:
        from dptune.runners.common import cached_workload

        num_train = len(cached_workload(config.workload).train)
    return with_mechanism(config, num_train)
