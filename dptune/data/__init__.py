"""Workloads: datasets, their seeded splits and difficulty knobs, and cached backbone features.

Public API::

    spec = WorkloadSpec(dataset="20newsgroups", backbone="minilm", peft="head", seed=0)
    workload = load_workload(spec)          # -> Workload(train, val, test, num_classes, ...)
    list_datasets()                         # names in DATASETS, the one registry to add one to

Splits are fixed by the seed. Datasets that ship a test split keep it as the test set; the
validation split is carved from the training split row by row: a row is a validation row iff a
keyed hash (key: the seed) of its label and content falls below ``validation_fraction``.
Datasets without one get a test split carved the same way with a fixed split seed, so every
trial is tested on the same examples. A row's train/validation (and carved test) membership so
depends on that row alone: adding or removing one row moves no other, identical rows land on the
same side, and split sizes are binomial (≈ fraction·n), not stratified. Difficulty knobs
(``fraction``, ``examples_per_class``) act on the training split only, ``classes`` on all three;
they and the ``max_*_examples`` caps are seeded stratified samples of the pool (they depend on the
whole population), so with them the DP guarantee is for the training and validation sets they
produce, with their sizes treated as public. For ``peft == "head"`` the inputs are the frozen backbone's
features, encoded once and cached under ``dptune.paths.cache_dir("features")``.
"""

from dptune.contract import WorkloadSpec
from dptune.data.sources import DATASETS, DatasetInfo, RawDataset, list_datasets
from dptune.data.spec import Modality, Workload, WorkloadError
from dptune.data.workload import load_workload

__all__ = [
    "DATASETS",
    "DatasetInfo",
    "Modality",
    "RawDataset",
    "Workload",
    "WorkloadError",
    "WorkloadSpec",
    "list_datasets",
    "load_workload",
]
