"""Every run that finishes ``ok`` writes the parameters it trained; they reproduce its recorded
accuracies (``dptune.records.weights``), for both runners."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from dptune.records.weights import read_weights, trained_model, weights_bytes, write_weights
from dptune.runners.common import cached_workload
from dptune.runners.fused import run_fused
from dptune.runners.heads import augment
from dptune.runners.trial import run_trial
from trial_configs import HEAD_TRIAL, planned


def _test_accuracy(parameters: dict, logits_rule: str) -> float:
    features, labels = cached_workload(HEAD_TRIAL.workload).test.tensors
    weight, bias = (torch.from_numpy(parameters[name]) for name in ("weight", "bias"))
    if logits_rule == "augmented":
        logits = augment(features) @ torch.cat([weight, bias[:, None]], 1).T
    else:
        logits = torch.nn.functional.linear(features, weight, bias)
    return float((logits.argmax(1) == labels).double().mean())


def test_a_trial_writes_the_head_it_trained_and_it_scores_the_recorded_test_accuracy(tmp_path: Path) -> None:
    result = run_trial(planned(HEAD_TRIAL))
    assert result.status == "ok" and result.trained is not None
    write_weights(str(tmp_path), "t-r0", result.trained)
    saved = read_weights(str(tmp_path), "t-r0")
    assert saved is not None and saved.logits == "module"
    assert saved.parameters["weight"].shape == (result.num_classes, 384)
    assert _test_accuracy(saved.parameters, saved.logits) == result.test_accuracy
    assert saved.provenance["backbone"] == "minilm" and len(saved.provenance["data_sha256"]) == 64
    assert json.loads(saved.provenance["class_names"])[0] == result.class_names[0]
    assert read_weights(str(tmp_path), "absent-r0") is None


def test_fused_runs_write_their_heads_and_each_scores_its_recorded_test_accuracy() -> None:
    configs = [planned(replace(HEAD_TRIAL, seed=None, learning_rate=lr, base_learning_rate=lr)) for lr in (0.01, 0.2)]
    results = run_fused(configs)
    for result in results:
        assert result.status == "ok" and result.trained is not None and result.trained.logits == "augmented"
        again = trained_model(weights_bytes(result.trained))
        assert _test_accuracy(again.parameters, again.logits) == result.test_accuracy
    assert results[0].trained.parameters["weight"].tolist() != results[1].trained.parameters["weight"].tolist()


def test_a_diverged_run_keeps_no_weights() -> None:
    result = run_trial(planned(replace(HEAD_TRIAL, learning_rate=1e36, base_learning_rate=1e36)))
    assert result.status == "diverged" and result.trained is None
