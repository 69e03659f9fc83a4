"""Poisson sampling, as the accountant assumes it, and physical batches bounded for memory.

Every step's batch includes each of the N training examples independently with probability
q = B/N (Opacus' ``DPDataLoader`` with its ``UniformWithReplacementSampler``): batch sizes vary
around B, and a batch can be empty. A logical batch is then cut into physical batches of at most
``max_physical_batch_size`` examples, moved to the device one at a time (the role of Opacus'
``BatchMemoryManager``, here at the :class:`~dptune.dp.engine.DPEngine` seam: the engine sees one
Poisson batch as a stream of physical batches). Host memory holds one logical batch.

Where the privacy unit is a person (user-level DP: McMahan et al. 2018; Levy et al. 2021),
:class:`PersonPoissonLoader` samples people instead: each of the N_people training people joins a
step independently with probability q = B/N_people, bringing all their rows or ``max_rows`` of them
drawn afresh; :func:`person_physical_batches` cuts such a batch only between people.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from dptune.dp.engine import PhysicalBatch

if TYPE_CHECKING:
    from opacus.data_loader import DPDataLoader


def poisson_loader(
    dataset: Dataset[tuple[torch.Tensor, ...]], sample_rate: float, steps: int, generator: torch.Generator
) -> DPDataLoader:
    """Opacus' Poisson loader over ``dataset``: one pass yields exactly ``steps`` batches.

    ``sample_rate`` is q = B/N; ``generator`` (CPU) fixes the draws. A trial makes one pass of
    all T steps the accountant was given and cuts it into epochs. Batches are collated tuples
    ``(*inputs, labels)``; an empty draw yields zero-length tensors of the right shapes.
    """
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    from opacus.data_loader import DPDataLoader  # Opacus is imported only by the trials that use it

    loader = DPDataLoader(dataset, sample_rate=sample_rate, generator=generator)
    loader.batch_sampler.steps = steps  # Opacus' default is one "epoch" of int(1/q) batches
    return loader


def physical_batches(
    batch: tuple[torch.Tensor, ...], max_physical_batch_size: int, device: torch.device
) -> Iterator[PhysicalBatch]:
    """Cut a logical batch into consecutive chunks of ≤ ``max_physical_batch_size`` on ``device``.

    An empty logical batch yields no physical batch (the engine then releases noise alone).
    """
    if len(batch[-1]) == 0:
        return
    for chunk in zip(*(t.split(max_physical_batch_size) for t in batch), strict=True):
        yield tuple(t.to(device, non_blocking=True) for t in chunk)


def _gather(dataset: Dataset[tuple[torch.Tensor, ...]], rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The items ``rows`` of ``dataset`` collated as ``(*inputs, labels)`` (zero-length when empty)."""
    if isinstance(dataset, TensorDataset):
        return tuple(t[rows] for t in dataset.tensors)
    if len(rows) == 0:
        return tuple(t[:0] for t in default_collate([dataset[0]]))
    return tuple(default_collate([dataset[i] for i in rows.tolist()]))


class PeopleRows:
    """The training rows of each person (user-level DP: McMahan et al. 2018; Levy et al. 2021), on the
    CPU: person u's k_u = ``sizes[u]`` rows are ``rows[starts[u]:starts[u] + k_u]`` (ascending), from
    ``people``, the training split's person index of each row (dense ``0..N_people-1``,
    :class:`dptune.data.spec.People`). :meth:`expand` turns the people a step sampled into the rows it
    trains on; both runners use it (:class:`PersonPoissonLoader`, ``dptune.runners.batches``)."""

    def __init__(self, people: np.ndarray, max_rows: int | None) -> None:
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be ≥ 1 or None, got {max_rows}")
        owners = torch.as_tensor(np.asarray(people), dtype=torch.int64)
        self.rows = torch.argsort(owners, stable=True)
        self.sizes = torch.bincount(owners, minlength=int(owners.max()) + 1 if len(owners) else 0)
        self.starts = torch.cumsum(self.sizes, 0) - self.sizes
        self.max_rows = max_rows

    @property
    def num_people(self) -> int:
        """N_people, the privacy units of the training split."""
        return len(self.sizes)

    def used_sizes(self) -> torch.Tensor:
        """m_u = min(k_u, ``max_rows``): the rows each person trains on when sampled (int64)."""
        return self.sizes if self.max_rows is None else self.sizes.clamp(max=self.max_rows)

    def expand(
        self, person: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, owner, used) of the sampled ``person`` (int64 ids, in the order given): every row of
        each, or with ``max_rows`` = m min(k_u, m) of them drawn uniformly without replacement (the first
        m of a uniformly random order of the person's rows, by sorting i.i.d. float64 uniforms from
        ``generator``, fresh at every call, drawn only when some person has more than m rows).
        ``owner[i]`` is the position in ``person`` of row i's person; rows are grouped by owner in
        ``person``'s order; ``used`` (one per person) counts each owner's rows."""
        sizes = self.sizes[person]
        owner = torch.repeat_interleave(torch.arange(len(person)), sizes)
        first = torch.cumsum(sizes, 0) - sizes  # each owner's first position in the expanded list
        rows = self.rows[torch.repeat_interleave(self.starts[person] - first, sizes) + torch.arange(len(owner))]
        if self.max_rows is None or not bool((sizes > self.max_rows).any()):
            return rows, owner, sizes
        used = sizes.clamp(max=self.max_rows)
        order = torch.argsort(torch.rand(len(rows), generator=generator, dtype=torch.float64))
        order = order[torch.argsort(owner[order], stable=True)]  # each owner's rows in a random order
        keep = torch.arange(len(order)) - first[owner] < used[owner]  # owners stay in place: first holds
        return rows[order][keep], owner[keep], used


class PersonPoissonLoader:
    """Person-level Poisson batches (user-level DP-SGD: McMahan et al. 2018; Levy et al. 2021).

    At each of ``steps`` steps each of the N_people people of ``people`` (the training split's person
    index of each row, dense ``0..N_people-1``, :class:`dptune.data.spec.People`) joins independently
    with probability q = ``sample_rate`` (a float64 uniform < q: the accountant's Poisson sampling of
    units, exact up to the uniforms' 2⁻⁵³ resolution). A joined person brings the rows
    :meth:`PeopleRows.expand` gives (all, or ``max_rows`` drawn afresh). Every coin comes from
    ``generator`` (CPU), in step order.

    Each step yields ``(*inputs, labels, people)``: the rows grouped by person (people in ascending
    order), ``people`` their batch-local person ids ``0..P-1`` (int64, non-decreasing), the carrier of
    :mod:`dptune.dp.engine`. Iterating reads ``steps`` and draws only when the first batch is asked
    for, so a restore may set ``generator``'s state and ``steps`` (those left) after ``iter()``.
    """

    def __init__(
        self,
        dataset: Dataset[tuple[torch.Tensor, ...]],
        people: np.ndarray,
        sample_rate: float,
        steps: int,
        generator: torch.Generator,
        max_rows: int | None = None,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.dataset = dataset
        self.sample_rate = sample_rate
        self.steps = steps
        self.generator = generator
        self.people = PeopleRows(people, max_rows)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for _ in range(self.steps):
            rows, people = self.sample()
            yield (*_gather(self.dataset, rows), people)

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's draw: (rows, their batch-local person ids), rows grouped by person."""
        coins = torch.rand(self.people.num_people, generator=self.generator, dtype=torch.float64)
        rows, owner, _ = self.people.expand(torch.nonzero(coins < self.sample_rate).flatten(), self.generator)
        return rows, owner


def _person_chunks(rows_per_person: list[int], max_physical_batch_size: int) -> list[int]:
    """Row counts of consecutive chunks of whole people, each ≤ ``max_physical_batch_size`` rows
    except a single person with more rows, who is a chunk alone (greedy, in order)."""
    sizes = [0]
    for rows in rows_per_person:
        if sizes[-1] and sizes[-1] + rows > max_physical_batch_size:
            sizes.append(0)
        sizes[-1] += rows
    return sizes


def person_physical_batches(
    batch: tuple[torch.Tensor, ...], max_physical_batch_size: int, device: torch.device
) -> Iterator[PhysicalBatch]:
    """Cut a person-level logical batch ``(*inputs, labels, people)`` (``people`` non-decreasing ids)
    into physical batches on ``device`` that never split a person (:mod:`dptune.dp.engine`): whole
    people, ≤ ``max_physical_batch_size`` rows unless one person alone has more. Each physical batch's
    ``people`` are renumbered ``0..P-1``. An empty logical batch yields no physical batch.
    """
    if len(batch[-1]) == 0:
        return
    _, people, counts = torch.unique_consecutive(batch[-1], return_inverse=True, return_counts=True)
    sizes = _person_chunks(counts.tolist(), max_physical_batch_size)
    for *chunk, chunk_people in zip(*(t.split(sizes) for t in (*batch[:-1], people)), strict=True):
        yield tuple(t.to(device, non_blocking=True) for t in (*chunk, chunk_people - chunk_people[0]))
