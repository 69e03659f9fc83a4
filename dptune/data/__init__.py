"""Workloads: datasets, their seeded splits and difficulty knobs, and cached backbone features.

Public API::

    spec = WorkloadSpec(dataset="20newsgroups", backbone="minilm", peft="head", seed=0)
    workload = load_workload(spec)          # -> Workload(train, val, test, num_classes, ...)
    list_datasets()                         # names in DATASETS, the one registry to add one to

Splits are fixed by the seed. Datasets that ship a test split keep it as the test set; the
validation split is carved (stratified) from the training split. Datasets without one get a
stratified test split drawn with a fixed split seed, so every trial is tested on the same
examples. Difficulty knobs (``fraction``, ``examples_per_class``) act on the training split
only; ``classes`` acts on all three. For ``peft == "head"`` the inputs are the frozen backbone's
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
