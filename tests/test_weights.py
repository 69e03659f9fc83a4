"""Every run that finishes ``ok`` writes the parameters it trained; they reproduce its recorded
accuracies (``dptune.records.weights``), for both runners."""

from __future__ import annotations

import json
import stat
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dptune.contract import TrainedModel
from dptune.records import compact_records, owner_only
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


def _model(value: float) -> TrainedModel:
    """A small model whose every parameter holds ``value`` (its bias counts up from it)."""
    weight, bias = np.full((3, 4), value, np.float32), np.arange(3, dtype=np.float32) + value
    return TrainedModel({"weight": weight, "bias": bias}, {"seed": str(value)}, "augmented")


def _same(saved: TrainedModel | None, model: TrainedModel) -> bool:
    return (
        saved is not None
        and sorted(saved.parameters) == sorted(model.parameters)
        and all(np.array_equal(saved.parameters[n], model.parameters[n]) for n in model.parameters)
        and (saved.provenance, saved.logits) == (model.provenance, model.logits)
    )


def test_a_units_weights_are_bundled_owner_only_and_each_run_reads_back_its_own(tmp_path: Path) -> None:
    runs, folder = str(tmp_path), tmp_path / "weights"
    with owner_only():  # as a private search writes them
        for n in range(6):
            write_weights(runs, f"t{n}-r0", _model(n))
        for unit in ((0, 1), (2,), (3,)):  # three units end: a bundle each
            compact_records(runs, [f"t{n}-r0" for n in unit])
        assert sorted(p.name[:7] for p in folder.iterdir()) == ["bundle-"] * 3 + ["t4-r0.s", "t5-r0.s"]
        compact_records(runs)  # the finishing step: a fourth bundle, and the four (one tier) merge into one
    (bundle,) = folder.iterdir()
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o600
    assert all(_same(read_weights(runs, f"t{n}-r0"), _model(n)) for n in range(6))
    write_weights(runs, "t1-r0", _model(9))  # written again: its own file wins over the bundle
    assert _same(read_weights(runs, "t1-r0"), _model(9))
    compact_records(runs, ["t1-r0"])  # then the newer bundle holding it wins
    assert len(list(folder.iterdir())) == 2 and _same(read_weights(runs, "t1-r0"), _model(9))
    assert _same(read_weights(runs, "t2-r0"), _model(2)) and read_weights(runs, "absent-r0") is None
