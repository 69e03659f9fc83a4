"""What a workload is: the spec that names it and the splits it resolves to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from dptune.errors import DptuneError

Modality = Literal["text", "image", "features"]


class WorkloadError(DptuneError, ValueError):
    """A workload cannot be built from the spec: bad value, unknown name, missing data or weights.

    The message names the offending value and the valid choices (or how to provide what is
    missing: path, environment variable, cache folder).
    """


@dataclass(frozen=True)
class WorkloadSpec:
    """Names one workload: dataset × backbone × PEFT, plus the difficulty knobs and the seed.

    Invariants checked by :func:`dptune.data.load_workload` before any heavy work:
    ``0 < fraction <= 1``; ``examples_per_class >= 1``; ``fraction`` and ``examples_per_class``
    are not both set; ``classes`` are distinct label ids of the dataset (kept in the given order
    and relabelled ``0..k-1``); ``0 < validation_fraction < 1``; ``max_tokens >= 8`` (text);
    ``max_train_examples``/``max_eval_examples >= 1``.

    - ``fraction``: stratified share of the training split to keep (the paper's CIFAR-100 10%
      subset is ``fraction=0.1``); the validation split is carved before it and does not shrink.
    - ``examples_per_class``: keep exactly this many training examples per class (few-shot).
    - ``classes``: keep only these classes, in train, validation and test.
    - ``max_tokens``: text truncation/padding length in tokens; ``None`` = the backbone's default.
    - ``validation_fraction``: stratified share of the (class-filtered) training split held out
      for hyperparameter selection. Selection uses validation, never test.
    - ``max_train_examples`` / ``max_eval_examples``: stratified caps for tests and smoke runs;
      when set, only the kept examples are encoded (cached under their own key).
    """

    dataset: str
    backbone: str
    peft: str
    seed: int = 0
    fraction: float = 1.0
    examples_per_class: int | None = None
    classes: tuple[int, ...] | None = None
    max_tokens: int | None = None
    validation_fraction: float = 0.1
    max_train_examples: int | None = None
    max_eval_examples: int | None = None


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

    def labels(self, split: Literal["train", "val", "test"]) -> torch.Tensor:
        """The int64 labels of ``split`` in item order, without reading any input."""
        dataset = {"train": self.train, "val": self.val, "test": self.test}[split]
        return dataset.tensors[-1] if isinstance(dataset, TensorDataset) else dataset.labels
