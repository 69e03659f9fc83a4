"""What a fused group (:mod:`dptune.runners.fused_group`) trains on: the training split on the
device (:class:`DeviceWorkload`), each configuration's Poisson batches (:class:`PoissonSteps`), the
coins of a chunk of steps (:class:`Draws`) and the rows a step reads (:class:`BatchRows`).

Where the privacy unit is a person (user-level DP-SGD: McMahan et al. 2018, "Learning Differentially
Private Recurrent Language Models"; Levy et al. 2021, "Learning with User-Level Privacy"), the Poisson
batches sample *people* and :class:`PersonIndex` expands each sampled person into the rows it trains
on; :class:`PersonBatches` says which person each row of a padded batch belongs to and how far
apart rows of one person lie (what the per-person clipping of :func:`~dptune.runners.heads.head_person_noisy_gradients`
reads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dptune.contract import TrialConfig
from dptune.data import Workload
from dptune.data.spec import Split
from dptune.dp.sampling import PeopleRows
from dptune.runners.common import probe_indices
from dptune.runners.heads import augment

#: Noise drawn per configuration per call: as many steps as fit this many bytes (float32).
NOISE_CHUNK_BYTES = 1 << 20
#: Most steps whose noise and Poisson batches are drawn in one call.
MAX_CHUNK_STEPS = 64
#: Fewest rows of a tile of the banded Gram (:func:`tile_rows`): a smaller tile's products cost
#: more in dispatch than they save.
MIN_TILE_ROWS = 4
#: Cost of one product of the banded Grams relative to one of a block's G_u (:func:`band_width`):
#: calibrated by bench/bench_person_step.py (CPU, one thread, 384 features, 20 classes).
TILE_PRODUCT_COST = 1.0


def tile_rows(band: int) -> int:
    """Rows of a tile of the banded Gram of a step whose band is ``band`` (≥ 1): at least the band,
    so a pair of rows at most ``band`` apart lies in one tile or two consecutive ones."""
    return max(band, MIN_TILE_ROWS)


def band_width(sizes: np.ndarray, rows: int, head_shape: tuple[int, int] | None) -> int:
    """The band D (≥ 0) of a step whose sampled people use ``sizes`` rows each (m_u, all
    configurations) in ``rows`` padded rows (K × width): a person of m_u ≤ D + 1 rows has ‖G_u‖ from
    the Grams of tiles of :func:`tile_rows` (D) rows, 2·rows·T·(classes + dim + 1) products (none at
    D = 0), a larger one from its G_u, m_u·classes·(dim + 1) products; D minimises the sum over the
    sizes present (0, or some m_u − 1). ``head_shape`` (classes, dim + 1); None: the largest person's
    m_u − 1 (no G_u formed)."""
    largest = int(sizes.max()) if len(sizes) else 1
    if head_shape is None or largest <= 1:
        return largest - 1
    classes, values = head_shape
    candidates = np.union1d([0], np.unique(sizes) - 1)
    tiles = np.maximum(candidates, MIN_TILE_ROWS)
    tile_cost = np.where(candidates > 0, 2.0 * rows * tiles * (classes + values) * TILE_PRODUCT_COST, 0.0)
    ordered = np.sort(sizes)
    above = np.concatenate([np.cumsum(ordered[::-1])[::-1], [0]])  # above[i] = Σ ordered[i:]
    block_cost = above[np.searchsorted(ordered, candidates + 1, side="right")] * float(classes * values)
    return int(candidates[np.argmin(tile_cost + block_cost)])


def chunk_steps(parameters: int) -> int:
    """Steps whose noise (``parameters`` float32 values each) and Poisson batches are drawn at once."""
    return max(1, min(MAX_CHUNK_STEPS, NOISE_CHUNK_BYTES // (4 * parameters)))


class PoissonSteps:
    """The Poisson batches of one configuration: at every step each of the N examples is included
    independently with probability q, drawn from the configuration's own (CPU) generator.

    Exactness. Number the (step, example) pairs of the coming steps in order, position
    p = step·N + example. Inclusion of each pair is an independent Bernoulli(q) trial, so the
    included positions are a Bernoulli process, whose gaps (failures before each success) are
    i.i.d. Geometric(q): P(F ≥ k) = (1 − q)^k. A gap is drawn by inversion from a float64 uniform
    U ∈ [0, 1): F = ⌊log(1 − U) / log(1 − q)⌋ has P(F ≥ k) = P(1 − U ≤ (1 − q)^k) = (1 − q)^k, exact
    up to the 2⁻⁵³ resolution of U (Opacus' loader compares float32 uniforms with q, a 2⁻²⁴
    resolution). Gaps are drawn in batches; when a batch ends before the last position, the process
    restarts at the next position with fresh gaps, which by the independence of the Bernoulli trials
    (the geometric law's memorylessness) is the same process. Draws past the last position are
    discarded, so the batches of disjoint steps are independent. Expected cost: q·N + O(1) uniforms
    per step instead of N.
    """

    def __init__(self, num_examples: int, sample_rate: float, generator: torch.Generator) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.num_examples = num_examples
        self.sample_rate = sample_rate
        self.generator = generator
        self._log_miss = math.log1p(-sample_rate) if sample_rate < 1 else -math.inf

    def draw(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``steps`` steps' batches: (step, example) int64 tensors of every inclusion, in
        order of step then example (steps counted from 0 at this call)."""
        end = steps * self.num_examples
        if self.sample_rate == 1:  # full batch: every pair, no coin is drawn
            positions = torch.arange(end)
            return positions // self.num_examples, positions % self.num_examples
        found: list[torch.Tensor] = []
        start = 0  # the first position not yet decided
        while start < end:
            expected = (end - start) * self.sample_rate
            count = int(expected + 6 * math.sqrt(expected) + 16)
            uniforms = torch.rand(count, generator=self.generator, dtype=torch.float64)
            gaps = torch.floor(torch.log1p(-uniforms) / self._log_miss).clamp_(max=end).long()
            positions = start + torch.cumsum(gaps + 1, 0) - 1
            inside = positions[positions < end]
            found.append(inside)
            start = end if len(inside) < count else int(positions[-1]) + 1
        positions = torch.cat(found)
        return positions // self.num_examples, positions % self.num_examples


@dataclass(frozen=True)
class PersonSample:
    """The rows a chunk of person-level steps trains on, in order of step, then person, then row.

    Per used row (int64 unless said): ``steps`` its step, ``rows`` its training row, ``ranks`` its
    position in its step's batch, ``segments`` its person's position among the step's sampled people
    and ``weights`` (float32) 1/m_u, m_u the rows person u uses. Per sampled person, ``people`` (p, 4):
    its step, its first rank, its m_u and its segment (its rows are consecutive in its batch).
    ``head_shape`` (classes, dim + 1) prices the step's band (:func:`band_width`; None: no blocks).
    """

    steps: torch.Tensor
    rows: torch.Tensor
    ranks: torch.Tensor
    segments: torch.Tensor
    weights: torch.Tensor
    people: torch.Tensor
    head_shape: tuple[int, int] | None


class PersonIndex(PeopleRows):
    """The training rows of each person (:class:`~dptune.dp.sampling.PeopleRows`, the expansion the
    one-trial runner's loader uses too) for a fused group: :meth:`sample` expands the (step, person)
    pairs a configuration sampled into its :class:`PersonSample`. ``head_shape`` (classes, dim + 1) of
    the heads trained prices each step's band (:func:`band_width`); None: every person in the band."""

    def __init__(self, people: np.ndarray, max_rows: int | None, head_shape: tuple[int, int] | None = None) -> None:
        super().__init__(people, max_rows)
        self.head_shape = head_shape

    def sample(self, step: torch.Tensor, person: torch.Tensor, generator: torch.Generator) -> PersonSample:
        """The rows of the sampled (``step``, ``person``) pairs (:meth:`PoissonSteps.draw`: in order of
        step, then person), drawn with the configuration's sampling ``generator``."""
        rows, owner, used = self.expand(person, generator)
        return _person_sample(step, owner, rows, used, self.head_shape)


def _person_sample(
    step: torch.Tensor, owner: torch.Tensor, rows: torch.Tensor, used: torch.Tensor, head_shape: tuple[int, int] | None
) -> PersonSample:
    """:class:`PersonSample` of used ``rows`` grouped by ``owner`` (the position of their person in
    ``step``, which is sorted), each owner with ``used`` rows."""
    row_steps = step[owner]
    people_per_step = torch.bincount(step)
    segment_of = torch.arange(len(step)) - (torch.cumsum(people_per_step, 0) - people_per_step)[step]
    rows_per_step = torch.bincount(row_steps)
    firsts = torch.cumsum(rows_per_step, 0) - rows_per_step  # each step's first row in the list
    person_first = (torch.cumsum(used, 0) - used) - firsts[step]  # each person's first rank in its batch
    return PersonSample(
        steps=row_steps,
        rows=rows,
        ranks=torch.arange(len(rows)) - firsts[row_steps],
        segments=segment_of[owner],  # the person's position among its step's people
        weights=(1.0 / used.float())[owner],
        people=torch.stack([step, person_first, used, segment_of], dim=1),
        head_shape=head_shape,
    )


def feature_tensors(split: Split) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features, labels)`` of a split of cached features, the only kind a fused group trains on."""
    if not isinstance(split, TensorDataset):
        raise TypeError(f"the fused runner trains heads on cached features, not on {type(split).__name__}")
    features, labels = split.tensors
    return features, labels


@dataclass(frozen=True)
class DeviceWorkload:
    """What every group of one ``run_fused`` call shares: the workload's training split on the device,
    and where the privacy unit is a person, each person's training rows (:class:`PersonIndex`)."""

    workload: Workload
    device: torch.device
    features: torch.Tensor  # (N + 1, dim + 1) augmented training features x̃ on the device; row N is zeros (padding)
    feature_norms: torch.Tensor  # (N + 1,) ‖x̃_i‖ = √(‖x_i‖² + 1); 0 at row N
    labels: torch.Tensor  # (N + 1,) int64; row N is 0 (padding)
    probe: tuple[torch.Tensor, torch.Tensor] | None  # augmented probe features and labels on the device
    people: PersonIndex | None = None  # each person's rows (person-level DP), None where the unit is a row

    @classmethod
    def build(cls, config: TrialConfig, workload: Workload, device: torch.device) -> DeviceWorkload:
        features, labels = feature_tensors(workload.train)
        features = augment(features.to(device))
        features = torch.cat([features, features.new_zeros(1, features.shape[1])])
        labels = torch.cat([labels, labels.new_zeros(1)]).to(device)
        probe = None
        if config.diagnostics:
            rows = probe_indices(config, len(workload.train), features.shape[1] * workload.num_classes).to(device)
            probe = (features[rows], labels[rows])
        return cls(
            workload=workload,
            device=device,
            features=features,
            feature_norms=torch.linalg.vector_norm(features, dim=1),
            labels=labels,
            probe=probe,
            people=person_index(workload, config),
        )

    @property
    def num_train(self) -> int:
        """N, the training rows (the padding row excluded): what the padded row index counts."""
        return len(self.workload.train)

    @property
    def num_units(self) -> int:
        """The privacy units of the training split (q = B/N counts them): its people, or its rows."""
        return self.num_train if self.people is None else self.people.num_people


def person_index(workload: Workload, config: TrialConfig) -> PersonIndex | None:
    """The :class:`PersonIndex` of ``workload``'s training people under ``config``'s
    :class:`~dptune.contract.PersonUnit` (its ``max_rows``), pricing bands by its heads' shape
    (classes, dim + 1); None where the unit is a row."""
    if workload.people is None:
        return None
    unit = config.workload.person_unit
    head_shape = (workload.num_classes, (workload.feature_dim or 0) + 1)
    return PersonIndex(workload.people.train, None if unit is None else unit.max_rows, head_shape)


@dataclass(frozen=True)
class PersonBatches:
    """Who each row of padded person-level batches (:class:`Draws`) belongs to, in one shape
    (steps, K, width) (or (K, width) for one step) on the device: ``segments`` (int64) the position
    of the row's person among its step's people (``num_segments`` − 1 at padding, a slot no row
    reads), ``weights`` (float32) 1/m_u (0 at padding). A person's rows are consecutive. ``band`` D:
    the rows of a person with m_u ≤ D + 1 are paired through the banded Grams of
    :func:`~dptune.runners.person_heads.person_norms` (for many steps, the largest step's D);
    ``blocks`` (b, 5) int64 on the CPU, one row (step, configuration, first, end, segment) per person
    of more rows (``first:end``), whose G_u is formed outright, sorted by step (:func:`band_width`)."""

    segments: torch.Tensor
    weights: torch.Tensor
    num_segments: int
    band: int
    blocks: np.ndarray

    def step(self, t: int, width: int, band: int) -> PersonBatches:
        """Step ``t``, cut to ``width`` rows, with its ``band`` (the step's :attr:`Draws.bands`)."""
        return PersonBatches(
            segments=self.segments[t, :, :width],
            weights=self.weights[t, :, :width],
            num_segments=self.num_segments,
            band=band,
            blocks=self.blocks[self.blocks[:, 0] == t],
        )

    def configurations(self, first: int, end: int) -> PersonBatches:
        """One step's batches of configurations ``first`` to ``end`` (excluded)."""
        return PersonBatches(
            segments=self.segments[first:end],
            weights=self.weights[first:end],
            num_segments=self.num_segments,
            band=self.band,
            blocks=self.blocks[(self.blocks[:, 1] >= first) & (self.blocks[:, 1] < end)] - [0, first, 0, 0, 0],
        )


@dataclass(frozen=True)
class Draws:
    """A group's coins for S steps. ``index[t, k, r]`` (S, K, width; on the device) is the r-th
    training row in configuration k's Poisson batch at step t, in increasing order, padded with N
    (the zero row); ``counts[t, k]`` (numpy) its batch size in rows; ``noise[t, k]`` (S, K, classes,
    dim + 1; on the device; a view of a (K, S, …) block per configuration) its Gaussian noise at its
    released scale, N(0, r_k²) with r_k = ``GroupCoins.noise_stds[k]``. Person-level: the rows come
    grouped by person (in order of person, then in the person's own order), ``persons`` says whose
    they are and ``bands[t]`` (numpy, (S,)) step t's band D (:attr:`PersonBatches.band`, the same
    for every k: a row's same-person partners lie at most D rows after it); both None where the unit
    is a row."""

    index: torch.Tensor
    counts: np.ndarray
    noise: torch.Tensor
    persons: PersonBatches | None = None
    bands: np.ndarray | None = None


def batch_counts(steps_of: list[torch.Tensor], steps: int) -> tuple[np.ndarray, list[torch.Tensor]]:
    """Per configuration, the step (sorted) of each of its entries → ``counts[t, k]`` (S, K) the
    entries of each step and each entry's rank within its step."""
    counts = np.stack([np.bincount(step.numpy(), minlength=steps) for step in steps_of], axis=1)
    ranks = []
    for column, step in enumerate(steps_of):
        starts = np.concatenate([[0], np.cumsum(counts[:, column])[:-1]])
        ranks.append(torch.arange(len(step)) - torch.from_numpy(starts)[step])
    return counts, ranks


def padded(
    counts: np.ndarray, steps_of: list[torch.Tensor], ranks: list[torch.Tensor], values: list[torch.Tensor], fill: float
) -> torch.Tensor:
    """(S, K, max(1, largest count)) tensor of configuration k's ``values`` at (step, rank), ``fill``
    elsewhere (:func:`batch_counts`); the dtype of the values."""
    out = torch.full((*counts.shape, max(1, int(counts.max()))), fill, dtype=values[0].dtype)
    for column, (step, rank, value) in enumerate(zip(steps_of, ranks, values, strict=True)):
        out[step, column, rank] = value
    return out


def person_draws(
    samples: list[PersonSample], steps: int, num_train: int, device: torch.device
) -> tuple[torch.Tensor, np.ndarray, PersonBatches, np.ndarray]:
    """Padded batches of each configuration's :class:`PersonSample` (one per configuration): the row
    ``index`` (S, K, width; padded with ``num_train``), its row ``counts`` (S, K), the
    :class:`PersonBatches` and each step's band (S,) (:func:`band_width`)."""
    row_steps = [s.steps for s in samples]
    counts, ranks = batch_counts(row_steps, steps)
    people = max((int(s.segments.max()) + 1 for s in samples if len(s.segments)), default=0)
    index = padded(counts, row_steps, ranks, [s.rows for s in samples], num_train)
    segments = padded(counts, row_steps, ranks, [s.segments for s in samples], people)
    weights = padded(counts, row_steps, ranks, [s.weights for s in samples], 0.0)
    sampled = [s.people.numpy() for s in samples]
    bands = np.zeros(steps, dtype=np.int64)
    for t in range(steps):
        sizes = np.concatenate([p[p[:, 0] == t, 2] for p in sampled]) if sampled else np.zeros(0, np.int64)
        bands[t] = band_width(sizes, len(samples) * max(1, int(counts[t].max())), samples[0].head_shape)
    persons = PersonBatches(
        segments=segments.to(device),
        weights=weights.to(device),
        num_segments=people + 1,
        band=int(bands.max(initial=0)),
        blocks=_blocks(sampled, bands),
    )
    return index, counts, persons, bands


def _blocks(sampled: list[np.ndarray], bands: np.ndarray) -> np.ndarray:
    """:attr:`PersonBatches.blocks` of each configuration's sampled people (:attr:`PersonSample.people`,
    one array per configuration): those of more than their step's band + 1 rows."""
    parts = []
    for k, people in enumerate(sampled):
        b = people[people[:, 2] > bands[people[:, 0]] + 1]
        parts.append(np.column_stack([b[:, 0], np.full(len(b), k), b[:, 1], b[:, 1] + b[:, 2], b[:, 3]]))
    blocks = np.concatenate(parts) if parts else np.zeros((0, 5), dtype=np.int64)
    return blocks[np.argsort(blocks[:, 0], kind="stable")].astype(np.int64)


@dataclass(frozen=True)
class BatchRows:
    """Padded Poisson batches (see :class:`Draws`) and what a step reads of its rows besides their
    features: ``index``, ``labels`` (int64), ``row_weights`` (1.0 for a batch row, 0.0 for padding)
    and ``feature_norms`` (‖x̃_i‖, 0 at padding), all of one shape (steps, K, width) or, for one
    step, (K, width), on the device; ``persons`` whose they are (person-level; else None).
    :meth:`of` looks up the labels and norms of many steps at once."""

    index: torch.Tensor
    labels: torch.Tensor
    row_weights: torch.Tensor
    feature_norms: torch.Tensor
    persons: PersonBatches | None = None

    @classmethod
    def of(cls, data: DeviceWorkload, index: torch.Tensor, persons: PersonBatches | None = None) -> BatchRows:
        """The rows ``index`` (padded with N) of ``data``'s training split, of ``persons``."""
        return cls(
            index=index,
            labels=data.labels[index],
            row_weights=(index < data.num_train).float(),
            feature_norms=data.feature_norms[index],
            persons=persons,
        )

    def step(self, t: int, width: int, band: int = 0) -> BatchRows:
        """Step ``t``'s batches, cut to ``width`` rows (the largest batch of the step) and, person-level,
        with the step's ``band`` (:attr:`Draws.bands`)."""
        persons = None if self.persons is None else self.persons.step(t, width, band)
        return BatchRows(
            self.index[t, :, :width],
            self.labels[t, :, :width],
            self.row_weights[t, :, :width],
            self.feature_norms[t, :, :width],
            persons,
        )

    def configurations(self, first: int, end: int) -> BatchRows:
        """One step's batches of configurations ``first`` to ``end`` (excluded)."""
        persons = None if self.persons is None else self.persons.configurations(first, end)
        return BatchRows(
            self.index[first:end],
            self.labels[first:end],
            self.row_weights[first:end],
            self.feature_norms[first:end],
            persons,
        )
