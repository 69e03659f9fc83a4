"""Trial configurations that several test modules train: small, CPU, one thread."""

from __future__ import annotations

from dptune.contract import TrialConfig, WorkloadSpec

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
