"""The one-trial runner: :func:`run`, the implementation of :func:`dptune.runners.trial.run_trial`.

Order of work, so that bad input fails before compute: (1) the config's values and names are
checked against the registries; (2) the workload is loaded, B ≤ N checked and the run's mechanism read
from its config: σ, q = B/N and T = ``plan.total_steps`` as the planner calibrated them, once
(``config.mechanism``, :mod:`dptune.plan.mechanism`), checked against this workload's N
(``common.planned_mechanism``; the runner never calibrates σ); (3) the model is built and checked for
DP (BatchNorm only with frozen running statistics); then (4) exactly T Poisson steps run in one pass of
the sampler, cut into E epochs by ``plan.epoch_steps``, with evaluation after each epoch, diagnostics at
epochs 0, ⌈E/2⌉ and E, and the test set after the last.

Where the privacy unit is a person (``config.workload.person_unit``, user-level DP-SGD: McMahan et al.
2018; Levy et al. 2021) N is the training split's people (``Workload.num_units``): q = B/N_people, the
Poisson batches sample people (:class:`dptune.dp.sampling.PersonPoissonLoader`, each bringing all their
rows or ``max_rows`` of them), the engines clip each person's mean gradient (:mod:`dptune.dp.engine`)
and the selection score counts people (:class:`dptune.runners.common.PersonScore`). The diagnostics
probe still holds rows.

A non-finite training or validation loss ends the trial with status ``"diverged"`` (recorded, no
exception). With a DP selection score (``score_noise_multiplier``) the trial decides divergence
only from its DP outputs (non-finite parameters after an epoch), never from the exact losses of
private rows, and releases the noisy validation count; the release run of a subsample tuning
(``release_run``) never stops on anything it computes. ε spent is the PRV accountant's for the
steps actually taken (≤ ε by calibration), except for a diverged trial: its stop depends on the
data (an exact, non-private loss, or with a DP score a data-dependent stopping rule), so it is
charged its planned ``steps`` (ε of the whole plan), as a lost trial process is;
``steps_taken`` still says how many ran.

Coins: every random draw of the mechanism (initialisation, Poisson masks, Gaussian noise, score
noise) comes from ``np.random.SeedSequence(config.seed)``, which with ``seed=None`` (the default)
takes 128 bits of fresh OS entropy: independent across trials and never stored. It is split into
four child seed sequences (``SeedSequence.spawn``, :func:`dptune.dp.coins.trial_coins`). The Poisson
masks come from a CPU generator whose whole MT19937 state (624 32-bit words, 19,937 bits) is set
from its child sequence (:func:`dptune.dp.coins.cpu_generator`), so they are a function of all 128
bits of the seed's entropy, not of the 32 bits ``manual_seed`` keeps on the CPU; so does the
Gaussian noise of a CPU trial. The score noise is exact discrete Gaussian noise on the integer
validation count (:func:`dptune.runners.common.noisy_count`), drawn with integer arithmetic from a
numpy ``PCG64`` of its child sequence (:func:`dptune.dp.coins.score_generator`). On CUDA the
noise comes from torch's Philox generator (64-bit key, 64-bit offset in multiples of 4), given a
fresh key and offset (126 bits) before every step from a PCG64 stream of the noise sequence
(:class:`dptune.dp.coins.DeviceCoins`).
Initialisation uses ``torch.manual_seed`` of 64 bits of its stream (no guarantee rests on it).
These are statistical generators, not cryptographically secure ones (Opacus' ``secure_mode`` needs
torchcsprng, which is not installed), and the floating-point sampling of the training noise is not
hardened against attacks on the Gaussian sampler's low bits (the score's integer noise has none).
With an integer seed (reproducibility opt-in) the same seed and device give the same result (CPU:
bit-identical).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, default_collate

from dptune.contract import (
    ClassDiagnostics,
    Diagnostics,
    EpochMetrics,
    Reporter,
    TrainedModel,
    TrialConfig,
    TrialResult,
)
from dptune.data import Workload
from dptune.data.features import weights_fingerprint
from dptune.data.spec import People, Split
from dptune.dp.clipping import update_scale
from dptune.dp.coins import DeviceCoins, cpu_generator, init_seed, score_generator, trial_coins
from dptune.dp.diagnostics import diagnose, probe_gradients
from dptune.dp.engine import DPEngine, DPStepSpec, PhysicalBatch, summed_cross_entropy
from dptune.dp.engine_registry import select_engine
from dptune.dp.optimizers import build_optimizer
from dptune.dp.precision import autocast
from dptune.dp.sampling import PersonPoissonLoader, person_physical_batches, physical_batches, poisson_loader
from dptune.errors import TrialFailed
from dptune.models import build_model, check_dp_compatible, new_head, trainable_parameter_count
from dptune.privacy import epsilon_spent
from dptune.runners.checkpoint import RunCheckpoint
from dptune.runners.common import (
    Evaluation,
    PersonScore,
    StepObserver,
    cached_workload,
    check_config,
    check_fits_workload,
    diagnostic_epochs,
    diverged_charge,
    model_provenance,
    noisy_score,
    planned_mechanism,
    probe_indices,
    torch_threads,
)

if TYPE_CHECKING:
    from opacus.data_loader import DPDataLoader


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Split,
    num_classes: int,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    people: np.ndarray | None = None,
) -> Evaluation:
    """Evaluate ``model`` (eval mode) on ``dataset`` in batches of ``batch_size``; with ``people`` (the
    split's person index of each row, :class:`dptune.data.spec.People`) also its
    :class:`~dptune.runners.common.PersonScore`."""
    model.eval()
    loss = 0.0
    correct = torch.zeros(num_classes, dtype=torch.int64)
    total = torch.zeros(num_classes, dtype=torch.int64)
    row_hits: list[torch.Tensor] = []
    for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        *inputs, labels = (t.to(device, non_blocking=True) for t in batch)
        with autocast(device.type, autocast_dtype):
            logits = model(*inputs)
        loss += float(summed_cross_entropy(logits, labels))
        labels = labels.cpu()
        hits = (logits.argmax(dim=1).cpu() == labels).long()
        correct += torch.bincount(labels, weights=hits, minlength=num_classes).long()
        total += torch.bincount(labels, minlength=num_classes)
        row_hits.append(hits)
    examples = int(total.sum())
    score = None if people is None else PersonScore.of(torch.cat(row_hits).numpy() > 0, people)
    return Evaluation.of(loss / examples, correct.numpy(), total.numpy(), score)


class Trial:
    """State of one running trial (built by :func:`run` after every check has passed)."""

    def __init__(
        self, config: TrialConfig, device: torch.device, workload: Workload, observer: StepObserver | None = None
    ) -> None:
        self.config = config
        self.observer = observer
        self.device = device
        self.workload = workload
        self.autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
        coins = trial_coins(config.seed)
        torch.manual_seed(init_seed(coins.init))
        self.score_generator = score_generator(coins.score)
        self.steps_taken = 0
        num_units = workload.num_units  # N: the training split's people, or rows
        self.model = (
            new_head(workload.feature_dim, workload.num_classes)  # on features: the head alone
            if workload.modality == "features" and workload.feature_dim is not None
            else build_model(config.workload.backbone, config.workload.peft, workload.num_classes)
        ).to(device)
        check_dp_compatible(self.model)
        engine_factory = select_engine(config.engine, self.model, config.workload.peft)  # refuses before any step
        mechanism = planned_mechanism(config, num_units)  # the planner's σ, q, T: never calibrated here
        self.sample_rate = mechanism.sample_rate
        self.steps = mechanism.steps
        self.epoch_steps = list(mechanism.epoch_steps)
        self.noise_multiplier = mechanism.noise_multiplier
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(config.optimizer, self.trainable, config.learning_rate)
        self.spec = DPStepSpec(
            noise_multiplier=self.noise_multiplier,
            clip_bound=config.clip_bound,
            rule=config.clipping,
            expected_batch_size=mechanism.expected_batch_size,  # q·N of the schedule it plans (B units)
            autocast_dtype=self.autocast_dtype,
            person_level=workload.people is not None,
        )
        self.noise_coins = DeviceCoins(coins.noise, device)
        self.engine: DPEngine = engine_factory(self.model, self.spec, self.noise_coins.generator)
        self.sampling_generator = cpu_generator(coins.sampling)
        self.loader = self._loader(workload.people)
        self.probe = self._probe(trainable_parameter_count(self.model)) if config.diagnostics else ()

    def _loader(self, people: People | None) -> DPDataLoader | PersonPoissonLoader:
        """The T Poisson batches of one pass, drawn from the sampling generator: of rows, or of people
        (``people``, with the person unit's ``max_rows``)."""
        if people is None:
            return poisson_loader(self.workload.train, self.sample_rate, self.steps, self.sampling_generator)
        unit = self.config.workload.person_unit
        return PersonPoissonLoader(
            self.workload.train,
            people.train,
            self.sample_rate,
            self.steps,
            self.sampling_generator,
            max_rows=None if unit is None else unit.max_rows,
        )

    def _physical_batches(self, batch: tuple[torch.Tensor, ...]) -> Iterator[PhysicalBatch]:
        """One Poisson batch as physical batches on the device (person-level: never splitting a person)."""
        cut = person_physical_batches if self.spec.person_level else physical_batches
        return cut(batch, self.config.max_physical_batch_size, self.device)

    def _probe(self, dimension: int) -> tuple[torch.Tensor, ...]:
        """The batch of :func:`probe_indices` training examples."""
        indices = probe_indices(self.config, len(self.workload.train), dimension)
        return tuple(default_collate([self.workload.train[int(i)] for i in indices]))

    def new_result(self) -> TrialResult:
        workload = self.workload
        return TrialResult(
            config=self.config,
            status="ok",
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate,
            steps=self.steps,
            num_train=workload.units("train"),  # the privacy units: N of q = B/N, and the scores' counts
            num_val=workload.units("val"),
            num_test=workload.units("test"),
            num_classes=workload.num_classes,
            trainable_parameters=trainable_parameter_count(self.model),
            device=str(self.device),
            engine=self.engine.name,
            class_names=dict(enumerate(workload.class_names)),
        )

    def diagnose(self, epoch: int) -> Diagnostics:
        """The paper's diagnostics on the probe, without disturbing the training RNG streams."""
        start = time.perf_counter()
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            self.model.train()
            gradients = probe_gradients(
                self.model,
                physical_batches(self.probe, self.config.max_physical_batch_size, self.device),
                self.autocast_dtype,
            )
        record = diagnose(
            gradients,
            epoch=epoch,
            clip_bound=self.config.clip_bound,
            noise_multiplier=self.noise_multiplier,
            expected_batch_size=self.spec.expected_batch_size,
        )
        record.wall_time_s = time.perf_counter() - start
        return record

    def evaluate(self, dataset: Split) -> Evaluation:
        """:func:`evaluate` on ``dataset``, the workload's ``val`` or ``test`` split (with its people's
        :class:`~dptune.runners.common.PersonScore` where the privacy unit is a person)."""
        people = self.workload.people
        split_people = None
        if people is not None:
            split_people = people.val if dataset is self.workload.val else people.test
        return evaluate(
            self.model,
            dataset,
            self.workload.num_classes,
            self.config.max_physical_batch_size,
            self.device,
            self.autocast_dtype,
            split_people,
        )

    def _observe(self, observer: StepObserver) -> None:
        """Show ``observer`` the step's released gradient of the head (a head on features only), as one
        (1, classes, dim + 1) [W | b], and keep what it adds to it."""
        if not isinstance(self.model, nn.Linear) or self.model.weight.grad is None or self.model.bias.grad is None:
            raise TypeError("a step observer sees a linear head on cached features (peft 'head') only")
        weight, bias = self.model.weight.grad, self.model.bias.grad
        released = torch.cat([weight, bias.unsqueeze(1)], dim=1).unsqueeze(0)
        spec = self.spec
        scale = update_scale(spec.clip_bound, spec.rule, spec.expected_batch_size)
        device = released.device
        observer(
            released, torch.tensor([spec.clip_bound], device=device), torch.tensor([scale], device=device), spec.rule
        )
        weight.copy_(released[0, :, :-1])
        bias.copy_(released[0, :, -1])

    def run(self, report: Reporter | None, checkpoint: RunCheckpoint | None = None) -> TrialResult:
        """Train (from ``checkpoint``'s state when it holds one; saving it before the first step and
        after every epoch but the last, ``dptune.runners.checkpoint``) and return the result."""
        config = self.config
        result = self.new_result()
        probe_epochs = diagnostic_epochs(config.epochs) if config.diagnostics else []
        private_score = config.score_noise_multiplier is not None
        start = time.perf_counter()
        examples_seen = 0
        train_time = 0.0
        epochs_done = 0
        # all T Poisson batches, one pass; iter() draws the loader's base seed from the sampling generator,
        # so a restore sets that generator's state (and the batches left) after it, before the first batch
        batches = iter(self.loader)
        kept = None if checkpoint is None else checkpoint.load()
        if kept is not None:
            epochs_done, examples_seen, train_time, elapsed = self._restore(kept, result)
            start -= elapsed
        elif 0 in probe_epochs:
            result.diagnostics.append(self.diagnose(0))
        if checkpoint is not None and kept is None:
            checkpoint.save(self._state(result, 0, 0, 0.0, time.perf_counter() - start))
        for epoch, epoch_length in enumerate(self.epoch_steps, start=1):
            if epoch <= epochs_done:
                continue
            epoch_start = time.perf_counter()
            self.model.train()
            epoch_loss = 0.0
            epoch_examples = 0
            for batch in itertools.islice(batches, epoch_length):
                self.noise_coins.refresh()  # CUDA: a fresh secret Philox key and offset; CPU: nothing
                loss = self.engine.noisy_gradient(self._physical_batches(batch))
                if self.observer is not None:
                    self._observe(self.observer)
                self.steps_taken += 1
                if not math.isfinite(loss) and config.stops_on_exact_loss:
                    result.status = "diverged"
                    result.reason = f"non-finite training loss ({loss}) at step {self.steps_taken} (epoch {epoch})"
                    break
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                epoch_loss += loss
                epoch_examples += len(batch[-1])
            epoch_train_time = time.perf_counter() - epoch_start
            train_time += epoch_train_time
            examples_seen += epoch_examples
            if private_score and not self._parameters_finite():
                result.status = "diverged"
                result.reason = f"non-finite parameters after epoch {epoch}"
            if result.status == "diverged":
                break
            val = self.evaluate(self.workload.val)
            if not math.isfinite(val.loss) and config.stops_on_exact_loss:
                result.status = "diverged"
                result.reason = f"non-finite validation loss ({val.loss}) after epoch {epoch}"
                break
            test = self.evaluate(self.workload.test) if epoch == config.epochs else None
            metrics = EpochMetrics(
                epoch=epoch,
                steps=self.steps_taken,
                train_loss=epoch_loss / max(epoch_examples, 1),
                val_loss=val.loss,
                val_accuracy=val.accuracy,
                wall_time_s=time.perf_counter() - epoch_start,
                examples_per_s=epoch_examples / epoch_train_time,
                test_accuracy=None if test is None else test.accuracy,
            )
            result.epochs.append(metrics)
            if test is not None:
                result.val_accuracy = val.accuracy
                result.test_accuracy = test.accuracy
                result.train_loss = metrics.train_loss
                result.class_accuracy = test.class_accuracy()
                result.class_val_accuracy = val.class_accuracy()
                if private_score:
                    result.noisy_val_accuracy = self.noisy_score(val)
            if report is not None:
                report(metrics)
            if epoch in probe_epochs:
                result.diagnostics.append(self.diagnose(epoch))
            if checkpoint is not None and epoch < config.epochs:
                checkpoint.save(self._state(result, epoch, examples_seen, train_time, time.perf_counter() - start))
        result.wall_time_s = time.perf_counter() - start
        result.examples_per_s = examples_seen / train_time if train_time > 0 else 0.0
        result.diagnostics_wall_time_s = sum(d.wall_time_s for d in result.diagnostics)
        result.steps_taken = self.steps_taken
        if result.status == "diverged":
            result.reason += diverged_charge(self.steps, private_score)
            result.epsilon_spent = self.epsilon_spent(self.steps)
        else:
            result.epsilon_spent = self.epsilon_spent()
            result.trained = self.trained()
        return result

    def _run_key(self) -> str:
        """The run a checkpoint belongs to: the config without its seed (a lost run's seed is None)."""
        return json.dumps({k: v for k, v in self.config.row().items() if k != "seed"}, sort_keys=True, default=str)

    def _state(
        self, result: TrialResult, epochs_done: int, examples_seen: int, train_time: float, elapsed: float
    ) -> dict[str, Any]:
        """The run's whole state after ``epochs_done`` epochs (``dptune.runners.checkpoint``)."""
        measured = {
            "epochs": [asdict(m) for m in result.epochs],
            "diagnostics": [asdict(d) for d in result.diagnostics],
        }
        return {
            "run": self._run_key(),
            "epochs_done": epochs_done,
            "steps_taken": self.steps_taken,
            "examples_seen": examples_seen,
            "train_time_s": train_time,
            "elapsed_s": elapsed,
            "parameters": [p.detach().cpu().clone() for p in self.trainable],
            "optimizer": self.optimizer.state_dict(),
            "sampling": self.sampling_generator.get_state(),
            "noise": self.noise_coins.state(),
            "score": json.dumps(self.score_generator.bit_generator.state),
            "torch": torch.get_rng_state(),
            "measured": json.dumps(measured),
        }

    def _restore(self, kept: dict[str, Any], result: TrialResult) -> tuple[int, int, float, float]:
        """Continue from a :meth:`_state`: parameters, optimizer, every generator, the steps taken and
        what was measured; the loader yields the remaining T − steps_taken batches. Returns (epochs
        done, examples seen, training seconds, seconds elapsed)."""
        if kept["run"] != self._run_key():
            raise ValueError("the checkpoint holds another run's state (its configuration differs)")
        with torch.no_grad():
            for parameter, saved in zip(self.trainable, kept["parameters"], strict=True):
                parameter.copy_(saved)
        self.optimizer.load_state_dict(kept["optimizer"])
        self.sampling_generator.set_state(kept["sampling"])
        self.noise_coins.set_state(kept["noise"])
        self.score_generator.bit_generator.state = json.loads(kept["score"])
        torch.set_rng_state(kept["torch"])
        self.steps_taken = int(kept["steps_taken"])
        if isinstance(self.loader, PersonPoissonLoader):
            self.loader.steps = self.steps - self.steps_taken
        else:
            self.loader.batch_sampler.steps = self.steps - self.steps_taken
        measured = json.loads(kept["measured"])
        result.epochs = [EpochMetrics(**m) for m in measured["epochs"]]
        result.diagnostics = [
            Diagnostics(**{**d, "classes": [ClassDiagnostics(**c) for c in d["classes"]]})
            for d in measured["diagnostics"]
        ]
        return (
            int(kept["epochs_done"]),
            int(kept["examples_seen"]),
            float(kept["train_time_s"]),
            float(kept["elapsed_s"]),
        )

    def trained(self) -> TrainedModel:
        """The parameters this run trained (float32, by name) and what the frozen rest is: the
        workload's provenance and, for a backbone model, the digest of its frozen state."""
        parameters = {
            name: p.detach().cpu().float().numpy() for name, p in self.model.named_parameters() if p.requires_grad
        }
        provenance = model_provenance(self.workload)
        if not isinstance(self.model, nn.Linear):  # a backbone model: its frozen part is the public backbone
            provenance["frozen_sha256"] = weights_fingerprint(self.model, exclude=parameters)
        return TrainedModel(parameters=parameters, provenance=provenance, logits="module")

    def epsilon_spent(self, steps: int | None = None) -> float:
        """ε of ``steps`` of the trial's steps (default: those taken so far; 0 for none)."""
        steps = self.steps_taken if steps is None else steps
        if not steps:
            return 0.0
        return epsilon_spent(self.noise_multiplier, self.sample_rate, steps, self.config.delta)

    def _parameters_finite(self) -> bool:
        """Whether every trainable parameter is finite: a function of the DP outputs only."""
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters() if p.requires_grad)

    def noisy_score(self, val: Evaluation) -> float:
        """:func:`noisy_score` of ``val`` with the trial's σ_s and score coins."""
        sigma = self.config.score_noise_multiplier
        assert sigma is not None
        return noisy_score(val, sigma, self.score_generator)


def run(
    config: TrialConfig,
    report: Reporter | None = None,
    checkpoint: RunCheckpoint | None = None,
    *,
    workload: Workload | None = None,
    observer: StepObserver | None = None,
) -> TrialResult:
    """Check ``config``, load and build everything, then train (continuing ``checkpoint``'s state
    when it holds one); see the module docstring. ``workload``: the splits to train on (an audit's
    own), else the config's workload spec's; ``observer``: an auditor's view of a head's steps
    (:class:`~dptune.runners.common.StepObserver`; a search passes none)."""
    device = check_config(config)
    with torch_threads(config.threads):
        workload = cached_workload(config.workload) if workload is None else workload
        check_fits_workload(config, workload)
        planned_mechanism(config, workload.num_units)  # before the model is built
        trial = Trial(config, device, workload, observer)
        try:
            return trial.run(report, checkpoint)
        except Exception as error:  # once training may have begun: say what was spent
            raise TrialFailed(
                f"{type(error).__name__}: {error} (after {trial.steps_taken} of {trial.steps} steps)",
                noise_multiplier=trial.noise_multiplier,
                sample_rate=trial.sample_rate,
                steps=trial.steps,
                steps_taken=trial.steps_taken,
                epsilon_spent=trial.epsilon_spent(),
            ) from error
