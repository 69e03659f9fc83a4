"""One fused group: K configurations of one batch size B trained in lock-step (the fused runner's
unit of work; :mod:`dptune.runners.fused` plans the groups and runs them).

A :class:`FusedGroup` is put together from named parts (what it trains on, the training split on
the device and the Poisson batches, is :mod:`dptune.runners.batches`):

- :class:`~dptune.runners.batches.DeviceWorkload`: what every group of one ``run_fused`` call
  shares, the augmented training features, labels and the probe on the device;
- :class:`GroupSchedule`: what the group's configurations share because they share B: q = B/N,
  T, the epoch split, σ, and the ε of a number of steps (N counts privacy units: rows, or people);
- :class:`GroupCoins`: each configuration's own coins (initial head, Poisson sampler, Gaussian
  noise, score noise), and :meth:`GroupCoins.draw`, the
  :class:`~dptune.runners.batches.Draws` of the next steps;
- :class:`LockStep`: the stacked heads and their optimizer, stepping every configuration that has
  not diverged, and how many steps each took;
- :class:`FusedGroup` itself: the epochs (train, then evaluate and record, then diagnose), the
  divergence rules and the :class:`~dptune.contract.TrialResult` of each configuration.

Where the privacy unit is a person (user-level DP-SGD: McMahan et al. 2018; Levy et al. 2021), a
step samples each of the N_people training people with probability q = B/N_people, trains on the
rows :class:`~dptune.runners.batches.PersonIndex` expands them into, clips each person's mean gradient
(:func:`~dptune.runners.person_heads.head_person_noisy_gradients`) and scales by the expected q·N_people;
ε is of q over people, and the selection score counts validation people
(:class:`~dptune.runners.common.PersonScore`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dptune.contract import ClippingRule, Diagnostics, EpochMetrics, TrainedModel, TrialConfig, TrialResult
from dptune.dp import faults
from dptune.dp.clipping import update_scale
from dptune.dp.coins import DeviceCoins, cpu_generator, init_seed, score_generator, trial_coins
from dptune.dp.diagnostics import diagnose
from dptune.models import new_head
from dptune.plan import run_schedule
from dptune.privacy import epsilon_spent
from dptune.runners.batches import (
    BatchRows,
    DeviceWorkload,
    Draws,
    PoissonSteps,
    batch_counts,
    chunk_steps,
    feature_tensors,
    padded,
    person_draws,
)
from dptune.runners.common import (
    Evaluation,
    StepObserver,
    diagnostic_epochs,
    diverged_charge,
    model_provenance,
    noisy_score,
)
from dptune.runners.heads import (
    HeadGradients,
    StackedOptimizer,
    head_noisy_gradients,
    head_probe_gradients,
    released_noise_stds,
    stack_heads,
    stacked_evaluations,
)
from dptune.runners.person_heads import head_person_noisy_gradients

#: The ``TrialResult.engine`` of a fused configuration.
FUSED_ENGINE = "fused"
#: Gathered training rows (bytes, float32) a step computes on at once: a group of large batches is
#: gathered and differentiated a few configurations at a time. Measured on the 2-core AMX Xeon of
#: bench/RESULTS.md, one thread: 36 configurations at B = 2048 (2,100 padded rows of 385 values
#: each) took 86 ms a step gathered all at once (116 MB), 59 ms in blocks of 12, 56 ms in blocks
#: of 4 (13 MB) and 67 ms one at a time; at B ≤ 256 one block of all 36 was the fastest.
GATHER_BLOCK_BYTES = 16 << 20


#: Builds a group's :class:`StepObserver` from the positions of its configurations (in the list given
#: to ``run_fused``) and its Poisson sample rate q.
ObserverFactory = Callable[[Sequence[int], float], StepObserver]


def gather_block_configurations(width: int, row_values: int) -> int:
    """Configurations whose ``width`` padded rows of ``row_values`` float32 values fit
    :data:`GATHER_BLOCK_BYTES` (at least one)."""
    return max(1, GATHER_BLOCK_BYTES // (4 * width * row_values))


@dataclass(frozen=True)
class GroupSchedule:
    """What a group's configurations share because they share B: q = B/N (``sample_rate``), the T
    planned steps (``steps``) cut into epochs (``epoch_steps``), σ (``noise_multiplier``) and the
    expected batch size q·N (privacy units: examples, or people) of every step; δ for the ε they
    spend. N is the training split's privacy units (``Workload.num_units``)."""

    sample_rate: float
    steps: int
    epoch_steps: tuple[int, ...]
    noise_multiplier: float
    expected_batch_size: float
    delta: float

    @classmethod
    def of(cls, config: TrialConfig, num_units: int, noise_multiplier: float) -> GroupSchedule:
        """The schedule of ``config``'s batch size on ``num_units`` privacy units with σ =
        ``noise_multiplier`` (``config``'s public schedule where it has one: ``dptune.plan.run_schedule``)."""
        schedule = run_schedule(config, num_units)
        return cls(
            sample_rate=schedule.sample_rate,
            steps=schedule.steps,
            epoch_steps=schedule.epoch_steps,
            noise_multiplier=noise_multiplier,
            expected_batch_size=schedule.expected_batch_size,
            delta=config.delta,
        )

    def epsilon_spent(self, steps_taken: int) -> float:
        """ε of ``steps_taken`` of these steps (0 before the first)."""
        if not steps_taken:
            return 0.0
        return epsilon_spent(self.noise_multiplier, self.sample_rate, steps_taken, self.delta)


class GroupCoins:
    """Each configuration's own coins, as a trial draws them (:func:`~dptune.dp.coins.trial_coins`
    of its seed): its initial head (built under ``torch.manual_seed`` of its init stream, without
    touching the global generator), its Poisson sampler (of rows, or of people, whose rows its
    sampling coins also choose: :meth:`~dptune.runners.batches.PersonIndex.sample`), its Gaussian
    noise and its score noise.
    The Gaussian noise is drawn at the scale it has in the released gradient,
    r_k = update_scale(C_k)·noise_std(σ, C_k) (:func:`~dptune.runners.heads.released_noise_stds`)."""

    def __init__(self, configs: Sequence[TrialConfig], schedule: GroupSchedule, data: DeviceWorkload) -> None:
        self.num_train = data.num_train
        self.people = data.people
        self.device = data.device
        #: r_k: the standard deviation of each configuration's noise as released.
        self.noise_stds = released_noise_stds(
            schedule.noise_multiplier,
            [c.clip_bound for c in configs],
            configs[0].clipping,
            schedule.expected_batch_size,
        )
        self._reused: torch.Tensor | None = None  # the one draw a reused_noise fault adds at every step
        weights, biases = [], []
        self.samplers: list[PoissonSteps] = []
        self.noise_coins: list[DeviceCoins] = []
        self.score_generators: list[np.random.Generator] = []
        for config in configs:
            coins = trial_coins(config.seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(init_seed(coins.init))
                head = new_head(data.features.shape[1] - 1, data.workload.num_classes)  # x̃ = (x, 1)
            weights.append(head.get_parameter("weight").detach())
            biases.append(head.get_parameter("bias").detach())
            self.samplers.append(PoissonSteps(data.num_units, schedule.sample_rate, cpu_generator(coins.sampling)))
            self.noise_coins.append(DeviceCoins(coins.noise, data.device))
            self.score_generators.append(score_generator(coins.score))
        #: (K, classes, dim + 1) on the device: every configuration's initial head (:func:`stack_heads`).
        self.initial_heads = stack_heads(weights, biases).to(data.device)

    def draw(self, steps: int) -> Draws:
        """The coins of the next ``steps`` steps, each configuration's from its own generators."""
        k = len(self.samplers)
        draws = [sampler.draw(steps) for sampler in self.samplers]
        # each configuration's draws fill its own contiguous block (as torch.randn would), no copy after
        noise = torch.empty(k, steps, *self.initial_heads.shape[1:], device=self.device)
        for block, coins, std in zip(noise, self.noise_coins, self.noise_stds, strict=True):
            coins.refresh()  # CUDA: a fresh secret Philox key and offset for this chunk; CPU: nothing
            block.normal_(0.0, std, generator=coins.generator)
        if faults.noise_reused():  # a test's broken mechanism (dptune.dp.faults): step 0's noise at every step
            self._reused = noise[:, 0].clone() if self._reused is None else self._reused
            noise = self._reused.unsqueeze(1).expand_as(noise)
        noise = noise.transpose(0, 1)
        if self.people is not None:
            people = self.people
            samples = [
                people.sample(step, person, sampler.generator)
                for (step, person), sampler in zip(draws, self.samplers, strict=True)
            ]
            index, counts, persons, bands = person_draws(samples, steps, self.num_train, self.device)
            return Draws(index.to(self.device), counts, noise, persons, bands)
        step_of = [step for step, _ in draws]
        counts, ranks = batch_counts(step_of, steps)
        index = padded(counts, step_of, ranks, [example for _, example in draws], self.num_train)
        return Draws(index=index.to(self.device), counts=counts, noise=noise)

    def noisy_score(self, index: int, val: Evaluation, score_noise_multiplier: float) -> float:
        """Configuration ``index``'s DP selection score of ``val`` (:func:`~dptune.runners.common.noisy_score`)."""
        return noisy_score(val, score_noise_multiplier, self.score_generators[index])


class LockStep:
    """The K stacked heads of a group and their optimizer, stepped together on each configuration's
    own batch, clip bound C_k, update scale and learning rate η_k (the noise comes drawn at its released
    scale, :class:`Draws`). A configuration that stops (:meth:`stop`, or a non-finite step loss when
    ``stop_on_loss``) keeps its head from then on.

    On the CPU the step knows without a device sync whether every configuration is still active
    (``all_active``) and then skips the masks; on a GPU every step applies them, with no sync."""

    def __init__(
        self,
        configs: Sequence[TrialConfig],
        heads: torch.Tensor,
        schedule: GroupSchedule,
        stop_on_loss: bool,
        observer: StepObserver | None = None,
    ) -> None:
        first = configs[0]
        self.observer = observer
        device = heads.device
        k = len(configs)
        self.heads = heads  # (K, classes, dim + 1), updated in place
        self.rule: ClippingRule = first.clipping
        self.stop_on_loss = stop_on_loss
        clip_bounds = [c.clip_bound for c in configs]
        self.clip_bounds = torch.tensor(clip_bounds, device=device)
        self.scales = torch.tensor(
            [update_scale(c, self.rule, schedule.expected_batch_size) for c in clip_bounds], device=device
        )
        self.optimizer = StackedOptimizer(
            first.optimizer, [self.heads], torch.tensor([c.learning_rate for c in configs], device=device)
        )
        self.active = torch.ones(k, dtype=torch.bool, device=device)  # not stopped
        self.all_active = device.type == "cpu"  # known true (CPU only: a GPU never syncs to find out)
        self.stopped_at = torch.zeros(k, dtype=torch.int64, device=device)  # steps taken by a stopped configuration
        self.divergent_loss = torch.zeros(k, device=device)  # the non-finite step loss that stopped a configuration
        self.steps_done = 0  # steps the group ran
        self._gathered: torch.Tensor | None = None  # the step's gathered training rows, reused (see _gradients)

    def train(self, data: DeviceWorkload, draws: Draws, losses: torch.Tensor) -> None:
        """Every step of ``draws``; adds each active configuration's step losses to ``losses`` (K,)."""
        widths = np.maximum(draws.counts.max(axis=1), 1)
        bands = [0] * len(widths) if draws.bands is None else draws.bands.tolist()
        rows = BatchRows.of(data, draws.index, draws.persons)
        for t, width in enumerate(widths.tolist()):
            gradients = self._gradients(data, rows.step(t, width, bands[t]), draws.noise[t])
            if self.observer is not None:
                self.observer(gradients.heads, self.clip_bounds, self.scales, self.rule)
            self.steps_done += 1
            if self.stop_on_loss:  # the trial's rule: a non-finite loss ends it before its optimizer steps
                self._stop_non_finite(gradients.losses)
            if self.all_active:
                losses += gradients.losses
                self.optimizer.step([gradients.heads], None)
            else:
                losses += torch.where(self.active, gradients.losses, 0.0)
                self.optimizer.step([gradients.heads], self.active)

    def _stop_non_finite(self, step_losses: torch.Tensor) -> None:
        """Stop every active configuration whose loss at the step just taken is not finite (the step
        counts for it); on the CPU only when one is (one sync), on a GPU as masks."""
        finite = torch.isfinite(step_losses)
        if self.all_active:
            if bool(finite.all()):
                return
            self.all_active = False
        stopping = self.active & ~finite
        self.divergent_loss = torch.where(stopping, step_losses, self.divergent_loss)
        self.stopped_at = torch.where(stopping, self.steps_done, self.stopped_at)
        self.active &= finite

    def _gradients(self, data: DeviceWorkload, rows: BatchRows, noise: torch.Tensor) -> HeadGradients:
        """One step's :func:`head_noisy_gradients` (person-level: :func:`head_person_noisy_gradients`)
        of every configuration on its batch ``rows`` (K, n), gathered and computed for at most
        :func:`gather_block_configurations` configurations at a time on the CPU (all at once on a
        GPU), into one buffer reused by every step (a fresh tensor of a large batch's rows costs the
        operating system's page faults at every step)."""
        k, width = rows.index.shape
        # measured on the CPU only; a GPU keeps the whole group in one gather and one product each
        block = gather_block_configurations(width, data.features.shape[1]) if data.device.type == "cpu" else k
        if self._gathered is None or self._gathered.numel() < block * width * data.features.shape[1]:
            self._gathered = data.features.new_empty(block * width, data.features.shape[1])
        parts = []
        for first in range(0, k, block):
            end = min(first + block, k)
            some = rows.configurations(first, end) if block < k else rows
            flat = some.index.reshape(-1)  # index_select: a faster gather than advanced indexing on the CPU
            features = torch.index_select(data.features, 0, flat, out=self._gathered[: len(flat)])
            heads, features = self.heads[first:end], features.view(end - first, width, -1)
            bounds, scales = self.clip_bounds[first:end], self.scales[first:end]
            if some.persons is None:
                part = head_noisy_gradients(
                    heads,
                    features,
                    some.labels,
                    some.row_weights,
                    some.feature_norms,
                    bounds,
                    self.rule,
                    noise[first:end],
                    scales,
                )
            else:
                rows_read = (some.labels, some.row_weights, some.feature_norms)
                part = head_person_noisy_gradients(
                    heads, features, rows_read, some.persons, bounds, self.rule, noise[first:end], scales
                )
            parts.append(part)
        if len(parts) == 1:
            return parts[0]
        return HeadGradients(
            heads=torch.cat([p.heads for p in parts]),
            losses=torch.cat([p.losses for p in parts]),
            norms=torch.cat([p.norms for p in parts]),
        )

    def steps_taken(self) -> list[int]:
        """Steps each configuration took (a stopped one: up to the step where it stopped)."""
        return torch.where(self.active, self.steps_done, self.stopped_at).tolist()

    def finite(self, index: int) -> bool:
        """Whether configuration ``index``'s head is finite: a function of the DP outputs only."""
        return bool(torch.isfinite(self.heads[index]).all())

    def stop(self, index: int) -> None:
        """Configuration ``index`` takes no further step (one already stopped keeps its step count)."""
        if bool(self.active[index]):
            self.stopped_at[index] = self.steps_done
            self.active[index] = False
        self.all_active = False


@dataclass
class _EpochTraining:
    """What one epoch's training left to record: each configuration's steps taken, summed loss and
    examples seen (those live at the epoch's start), the training time (s) and each live
    configuration's share of it (s)."""

    steps_taken: list[int]
    losses: np.ndarray
    examples: dict[int, int]
    train_time: float
    share: float


class FusedGroup:
    """K configurations with one batch size B, trained in lock-step (see :mod:`dptune.runners.fused`)."""

    def __init__(
        self,
        data: DeviceWorkload,
        configs: Sequence[TrialConfig],
        noise_multiplier: float,
        observer: StepObserver | None = None,
    ) -> None:
        self.data = data
        self.configs = list(configs)
        first = self.configs[0]
        self.schedule = GroupSchedule.of(first, data.num_units, noise_multiplier)
        self.private_score = first.score_noise_multiplier is not None
        self.coins = GroupCoins(self.configs, self.schedule, data)
        self.lock_step = LockStep(
            self.configs, self.coins.initial_heads, self.schedule, first.stops_on_exact_loss, observer
        )
        self.parameters = self.lock_step.heads[0].numel()
        self.results = [self._new_result(config) for config in self.configs]

    def _new_result(self, config: TrialConfig) -> TrialResult:
        workload, schedule = self.data.workload, self.schedule
        return TrialResult(
            config=config,
            status="ok",
            noise_multiplier=schedule.noise_multiplier,
            sample_rate=schedule.sample_rate,
            steps=schedule.steps,
            num_train=workload.units("train"),  # the privacy units: N of q = B/N, and the scores' counts
            num_val=workload.units("val"),
            num_test=workload.units("test"),
            num_classes=workload.num_classes,
            trainable_parameters=self.parameters,
            device=str(self.data.device),
            engine=FUSED_ENGINE,
            class_names=dict(enumerate(workload.class_names)),
        )

    def run(self, on_epoch: Callable[[float], None] | None = None) -> list[TrialResult]:
        """Train the group's T steps epoch by epoch, as a trial does; one result per configuration.
        ``on_epoch(share)`` after each epoch but the last, with the share of the epochs trained (e/E)."""
        k = len(self.configs)
        epochs = self.configs[0].epochs
        probe_epochs = diagnostic_epochs(epochs) if self.configs[0].diagnostics else []
        start = time.perf_counter()
        train_time = 0.0
        examples_seen = np.zeros(k)
        live = list(range(k))  # not diverged: still recorded
        if 0 in probe_epochs:
            self._diagnose(live, 0)
        for epoch, epoch_length in enumerate(self.schedule.epoch_steps, start=1):
            epoch_start = time.perf_counter()
            trained = self._train_epoch(live, epoch_length)
            train_time += trained.train_time
            for i in live:
                examples_seen[i] += trained.examples[i]
            live = self._check_training(live, trained, epoch)
            if not live:
                break
            live = self._record_epoch(live, trained, epoch, epoch_start)
            if epoch in probe_epochs:
                self._diagnose(live, epoch)
            if on_epoch is not None and epoch < epochs:
                on_epoch(epoch / epochs)
        self._finish(time.perf_counter() - start, train_time, examples_seen)
        return self.results

    def _train_epoch(self, live: list[int], epoch_length: int) -> _EpochTraining:
        """One epoch's ``epoch_length`` steps, drawn and trained in chunks of :func:`chunk_steps`."""
        k = len(self.configs)
        start = time.perf_counter()
        examples = np.zeros((epoch_length, k), dtype=np.int64)
        losses = torch.zeros(k, dtype=torch.float64, device=self.data.device)
        first_step = self.lock_step.steps_done
        chunk = chunk_steps(self.parameters)
        for offset in range(0, epoch_length, chunk):
            draws = self.coins.draw(min(chunk, epoch_length - offset))
            examples[offset : offset + len(draws.counts)] += draws.counts
            self.lock_step.train(self.data, draws, losses)
        taken = self.lock_step.steps_taken()
        train_time = time.perf_counter() - start
        return _EpochTraining(
            steps_taken=taken,
            losses=losses.cpu().numpy(),
            train_time=train_time,
            share=train_time / len(live),
            examples={i: int(examples[: taken[i] - first_step, i].sum()) for i in live},
        )

    def _check_training(self, live: list[int], trained: _EpochTraining, epoch: int) -> list[int]:
        """Apply the trial's divergence rules after training an epoch; the configurations still live."""
        divergent_losses = self.lock_step.divergent_loss.tolist()
        for i in live:
            if trained.steps_taken[i] < self.lock_step.steps_done:
                loss = divergent_losses[i]
                self._diverge(i, f"non-finite training loss ({loss}) at step {trained.steps_taken[i]} (epoch {epoch})")
            elif self.private_score and not self.lock_step.finite(i):
                self._diverge(i, f"non-finite parameters after epoch {epoch}")
        return [i for i in live if self.results[i].status != "diverged"]

    def _record_epoch(self, live: list[int], trained: _EpochTraining, epoch: int, epoch_start: float) -> list[int]:
        """Evaluate the live heads (validation; test after the last epoch) and record each one's
        :class:`EpochMetrics`; the configurations still live (a non-finite validation loss diverges)."""
        workload, heads = self.data.workload, self.lock_step.heads
        last = epoch == self.configs[0].epochs
        people = workload.people
        val = stacked_evaluations(
            heads, *feature_tensors(workload.val), workload.num_classes, None if people is None else people.val
        )
        test = (
            stacked_evaluations(
                heads, *feature_tensors(workload.test), workload.num_classes, None if people is None else people.test
            )
            if last
            else None
        )
        epoch_time = time.perf_counter() - epoch_start
        still = []
        for i in live:
            if not math.isfinite(val[i].loss) and self.configs[i].stops_on_exact_loss:
                self._diverge(i, f"non-finite validation loss ({val[i].loss}) after epoch {epoch}")
                continue
            still.append(i)
            result = self.results[i]
            metrics = EpochMetrics(
                epoch=epoch,
                steps=trained.steps_taken[i],
                train_loss=float(trained.losses[i]) / max(trained.examples[i], 1),
                val_loss=val[i].loss,
                val_accuracy=val[i].accuracy,
                wall_time_s=epoch_time / len(live),
                examples_per_s=trained.examples[i] / trained.share,
                test_accuracy=None if test is None else test[i].accuracy,
            )
            result.epochs.append(metrics)
            if test is not None:
                result.val_accuracy = val[i].accuracy
                result.test_accuracy = test[i].accuracy
                result.train_loss = metrics.train_loss
                result.class_accuracy = test[i].class_accuracy()
                result.class_val_accuracy = val[i].class_accuracy()
                sigma = self.configs[i].score_noise_multiplier
                if sigma is not None:
                    result.noisy_val_accuracy = self.coins.noisy_score(i, val[i], sigma)
        return still

    def _diagnose(self, live: list[int], epoch: int) -> None:
        """Append the probe's diagnostics at ``epoch`` to the results of configurations ``live``."""
        assert self.data.probe is not None
        features, labels = self.data.probe
        for k in live:
            start = time.perf_counter()
            record: Diagnostics = diagnose(
                head_probe_gradients(self.lock_step.heads[k], features, labels),
                epoch=epoch,
                clip_bound=self.configs[k].clip_bound,
                noise_multiplier=self.schedule.noise_multiplier,
                expected_batch_size=self.schedule.expected_batch_size,
            )
            record.wall_time_s = time.perf_counter() - start
            self.results[k].diagnostics.append(record)

    def _finish(self, wall: float, train_time: float, examples_seen: np.ndarray) -> None:
        """Each result's share of the group's time, its steps taken and its ε spent."""
        k = len(self.configs)
        diagnostics_time = [sum(d.wall_time_s for d in r.diagnostics) for r in self.results]
        shared_time = (wall - sum(diagnostics_time)) / k
        for i, (result, steps) in enumerate(zip(self.results, self.lock_step.steps_taken(), strict=True)):
            result.wall_time_s = shared_time + diagnostics_time[i]
            result.diagnostics_wall_time_s = diagnostics_time[i]
            result.examples_per_s = examples_seen[i] / (train_time / k) if train_time > 0 else 0.0
            result.steps_taken = steps
            # a diverged configuration stopped on the data (see _diverge): charged its planned steps
            result.epsilon_spent = self.schedule.epsilon_spent(
                self.schedule.steps if result.status == "diverged" else steps
            )
            if result.status == "ok":
                head = self.lock_step.heads[i].detach().cpu()  # (classes, dim + 1): [W | b]
                result.trained = TrainedModel(
                    parameters={"weight": head[:, :-1].numpy().copy(), "bias": head[:, -1].numpy().copy()},
                    provenance=model_provenance(self.data.workload),
                    logits="augmented",
                )

    def _diverge(self, index: int, reason: str) -> None:
        """Mark configuration ``index`` diverged: its head stops updating, its result says why and
        that it is charged its planned steps (:func:`~dptune.runners.common.diverged_charge`)."""
        self.results[index].status = "diverged"
        self.results[index].reason = reason + diverged_charge(self.schedule.steps, self.private_score)
        self.lock_step.stop(index)

    def failed(self, error: BaseException) -> list[TrialResult]:
        """The results of this group after ``error`` interrupted it: ``error`` with the steps each took,
        except a configuration that had diverged before, which keeps its record and its charge of
        the planned steps."""
        results = []
        active = self.lock_step.active.tolist()
        planned = self.schedule.steps
        for index, (config, steps) in enumerate(zip(self.configs, self.lock_step.steps_taken(), strict=True)):
            if not active[index] and self.results[index].status != "diverged":  # its loss stopped it mid-epoch
                loss = self.lock_step.divergent_loss[index].item()
                self._diverge(index, f"non-finite training loss ({loss}) at step {steps}")
            if self.results[index].status == "diverged":  # stopped on the data: keeps its planned-steps charge
                results.append(
                    dataclasses.replace(
                        self.results[index], steps_taken=steps, epsilon_spent=self.schedule.epsilon_spent(planned)
                    )
                )
                continue
            results.append(
                dataclasses.replace(
                    self._new_result(config),
                    status="error",
                    steps_taken=steps,
                    epsilon_spent=self.schedule.epsilon_spent(steps),
                    reason=f"{type(error).__name__}: {error} (after {steps} of {planned} steps)"[:2000],
                )
            )
        return results
