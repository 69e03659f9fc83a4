"""What a workload is: the spec that names it and the splits it resolves to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from dptune.contract import WorkloadSpec
from dptune.errors import DptuneError

Modality = Literal["text", "image", "features"]


class WorkloadError(DptuneError, ValueError):
    """A workload cannot be built from the spec: bad value, unknown name, missing data or weights.

    The message names the offending value and the valid choices (or how to provide what is
    missing: path, environment variable, cache folder).
    """


class LabelledImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Rows ``rows`` of lazily read images with their (relabelled) labels: item = ``(image, label)``."""

    def __init__(self, images: Dataset[tuple[torch.Tensor]], rows: np.ndarray, labels: torch.Tensor) -> None:
        self.images, self.rows, self.labels = images, rows, labels

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (*self.images[int(self.rows[index])], self.labels[index])


#: One split of a :class:`Workload`: in memory (features, tokens, in-memory images) or images read
#: from files when an item is asked for.
Split: TypeAlias = TensorDataset | LabelledImages


@dataclass(frozen=True)
class People:
    """Who each row of a workload's splits belongs to, when the privacy unit is a person
    (:class:`~dptune.contract.PersonUnit`): ``train``, ``val`` and ``test`` hold, in item order, the
    int64 index of each row's person, dense ``0..count-1`` within the split and ascending in the order
    the people first appear. A person's rows are all in one split. ``column`` names the id column."""

    column: str
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def count(self, split: Literal["train", "val", "test"]) -> int:
        """The number of people in ``split``."""
        people = getattr(self, split)
        return int(people.max()) + 1 if len(people) else 0


@dataclass
class Workload:
    """The resolved splits of a :class:`WorkloadSpec`.

    ``train``/``val``/``test`` yield tuples ``(*inputs, label)`` with an int64 scalar label in
    ``0..num_classes-1`` (a :class:`torch.utils.data.TensorDataset` for every in-memory dataset,
    so Opacus' Poisson ``DPDataLoader`` collates them and builds empty batches). Inputs by
    ``modality``:

    - ``"features"`` (``peft == "head"``): one float32 vector of size ``feature_dim``, the frozen
      backbone's pooled output, cached on disk;
    - ``"text"``: ``(input_ids, attention_mask)``, int64, padded to ``max_tokens``;
    - ``"image"``: one uint8 tensor ``(channels, height, width)`` at the dataset's stored
      resolution; the model's own preprocessing resizes it to ``image_size`` px (pass it to
      ``build_model``) and normalises it.

    ``class_names[i]`` names workload label ``i`` (after any ``classes`` relabelling).
    ``people``: each row's person when the privacy unit is a person (:class:`People`), else ``None``.
    ``provenance`` (str → str) identifies what the inputs were made from, for a saved model's card:
    ``data_sha256`` (the dataset's content digest), ``backbone``, and on cached features the
    encoder's ``weights_sha256``, ``precision`` and ``max_tokens`` (:func:`dptune.data.features.cached_features`).
    """

    spec: WorkloadSpec
    num_classes: int
    class_names: list[str]
    train: Split
    val: Split
    test: Split
    modality: Modality
    feature_dim: int | None = None
    max_tokens: int | None = None
    image_size: int | None = None
    provenance: dict[str, str] = field(default_factory=dict)
    people: People | None = None

    @property
    def num_units(self) -> int:
        """N of q = B/N: the training split's privacy units, its people or else its rows."""
        return self.units("train")

    def units(self, split: Literal["train", "val", "test"]) -> int:
        """The privacy units of ``split``: its people, or else its rows (the ``num_train``, ``num_val`` and
        ``num_test`` of a run's record)."""
        return len(getattr(self, split)) if self.people is None else self.people.count(split)

    def labels(self, split: Literal["train", "val", "test"]) -> torch.Tensor:
        """The int64 labels of ``split`` in item order, without reading any input."""
        dataset = {"train": self.train, "val": self.val, "test": self.test}[split]
        return dataset.tensors[-1] if isinstance(dataset, TensorDataset) else dataset.labels
