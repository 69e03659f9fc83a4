"""``load_workload``: spec → checked → raw dataset → seeded splits → model-ready datasets."""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dptune.contract import NO_BACKBONE, WorkloadSpec
from dptune.data import splits
from dptune.data.encoding_plan import PlannedEncoding, planned_encoding
from dptune.data.features import cached_features
from dptune.data.files import dataset_file_info
from dptune.data.people import RawPeople, read_people, split_people
from dptune.data.sources import DATASETS, DatasetInfo, ImageFiles, RawDataset, list_datasets
from dptune.data.spec import LabelledImages, People, Split, Workload, WorkloadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class SplitRows:
    """Raw row ids of each split (sorted); ``kept[i]`` is the raw class id of workload label
    ``i``; ``label_map`` maps raw class id → workload label (-1: class dropped)."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    kept: tuple[int, ...]
    label_map: np.ndarray


def check_spec(spec: WorkloadSpec) -> DatasetInfo:
    """Every check that needs no data but a data owner's own file (read once per process and
    checked, :mod:`dptune.data.files`): raise :class:`WorkloadError` naming the problem and the
    valid values. Returns the dataset's registry entry."""
    from dptune.models import ModelError, check_model_request

    try:  # the backbone first: a wrong one is told before a data owner's file is read
        backbone = None
        if spec.backbone != NO_BACKBONE:
            backbone = check_model_request(spec.backbone, spec.peft, feature_input=spec.peft == "head")
    except ModelError as error:
        raise WorkloadError(str(error)) from error
    info = dataset_info(spec)
    raw_people(spec)
    if backbone is None or info.modality == "features":
        _check_features_spec(spec, info)
        return _check_knobs(spec, info)
    if backbone.modality != info.modality:
        raise WorkloadError(
            f"backbone {spec.backbone!r} takes {backbone.modality}, dataset {spec.dataset!r} is "
            f"{info.modality}; pick a {info.modality} backbone"
        )
    if spec.peft == "head" and not backbone.has_pretrained_weights:
        raise WorkloadError(
            f"backbone {spec.backbone!r} is trained from scratch, so peft 'head' would fit a linear "
            f"probe on random features; use peft 'full' (or 'film')"
        )
    return _check_knobs(spec, info)


def dataset_info(spec: WorkloadSpec) -> DatasetInfo:
    """The registry entry of ``spec.dataset``, or of its own file (``spec.dataset_file``, read and
    checked: :mod:`dptune.data.files`); :class:`WorkloadError` for an unknown name."""
    if spec.dataset_file is not None:
        return dataset_file_info(spec.dataset_file)
    if spec.dataset not in DATASETS:
        raise WorkloadError(f"unknown dataset {spec.dataset!r}; choose one of {list_datasets()}")
    return DATASETS[spec.dataset]


def raw_people(spec: WorkloadSpec) -> RawPeople | None:
    """Each row's person when ``spec``'s privacy unit is a person (read and checked,
    :func:`dptune.data.people.read_people`), else None. Only a data owner's table has a person column."""
    if spec.person_unit is None:
        return None
    source = spec.dataset_file
    if source is None:
        raise WorkloadError(
            f"privacy.unit {{column: {spec.person_unit.column}}} needs a dataset file with that column; the "
            f"registry dataset {spec.dataset!r} has rows only (use privacy.unit: row, or give task.dataset as a file)"
        )
    if source.format == "imagefolder" or source.input_column is None:
        raise WorkloadError(
            "privacy.unit {column: ...} needs a table with a person column; an image folder has no columns "
            "(give a csv, tsv, jsonl, parquet or hf_disk table of image paths with the id column)"
        )
    from dptune.data.files import read_dataset_file

    return read_people(source, spec.person_unit.column, read_dataset_file(source).labels)


def _check_features_spec(spec: WorkloadSpec, info: DatasetInfo) -> None:
    """Embeddings train a linear head as they are: backbone ``none`` with peft ``head``, and only them."""
    if info.modality != "features":
        raise WorkloadError(
            f"backbone {NO_BACKBONE!r} trains on a dataset's own embeddings; {spec.dataset!r} holds "
            f"{info.modality}: name a {info.modality} backbone (dptune.models.list_backbones())"
        )
    if spec.backbone != NO_BACKBONE:
        raise WorkloadError(
            f"dataset {spec.dataset!r} holds embeddings (the rows' own features): use backbone {NO_BACKBONE!r}, "
            f"not {spec.backbone!r}"
        )
    if spec.peft != "head":
        raise WorkloadError(
            f"backbone {NO_BACKBONE!r} trains a linear head on the embeddings: peft 'head', not {spec.peft!r}"
        )


def _check_knobs(spec: WorkloadSpec, info: DatasetInfo) -> DatasetInfo:
    """The checks of the difficulty knobs, split and caps (no data read)."""
    if not isinstance(spec.seed, int) or spec.seed < 0:
        raise WorkloadError(f"seed must be a non-negative integer, got {spec.seed!r}")
    if not 0.0 < spec.fraction <= 1.0:
        raise WorkloadError(f"fraction must be in (0, 1], got {spec.fraction}")
    if spec.examples_per_class is not None:
        if spec.person_unit is not None:
            raise WorkloadError(
                "examples_per_class counts rows, and would keep part of a person's rows; with privacy.unit a "
                "person, use fraction (whole people, each kept with that probability)"
            )
        if spec.examples_per_class < 1:
            raise WorkloadError(f"examples_per_class must be >= 1 (or None for all), got {spec.examples_per_class}")
        if spec.fraction < 1.0:
            raise WorkloadError("give either fraction < 1 or examples_per_class, not both")
    if spec.classes is not None:
        valid = range(info.num_classes)
        unknown = [c for c in spec.classes if not isinstance(c, (int, np.integer)) or c not in valid]
        if unknown:
            raise WorkloadError(
                f"unknown class ids {unknown} for {spec.dataset!r}; valid ids are 0..{info.num_classes - 1}"
            )
        if len(set(spec.classes)) != len(spec.classes) or len(spec.classes) < 2:
            raise WorkloadError(f"classes must be at least 2 distinct ids, got {spec.classes}")
    if not 0.0 < spec.validation_fraction < 1.0:
        raise WorkloadError(f"validation_fraction must be in (0, 1), got {spec.validation_fraction}")
    if spec.max_tokens is not None:
        if info.modality != "text":
            raise WorkloadError(
                f"max_tokens applies to text datasets; {spec.dataset!r} is {info.modality}: set task.max_tokens: null "
                "(a space that extends default.yaml inherits its 128)"
            )
        if spec.max_tokens < 8:
            raise WorkloadError(f"max_tokens must be >= 8, got {spec.max_tokens}")
    for name in ("max_train_examples", "max_eval_examples"):
        value = getattr(spec, name)
        if value is not None and value < 1:
            raise WorkloadError(f"{name} must be >= 1 (or None for no cap), got {value}")
    return info


def row_digests(raw: RawDataset) -> np.ndarray:
    """Content digest of every row of ``raw`` (``splits.content_digests``), what a row's split
    membership is decided from: the label with, for text, the document's UTF-8 bytes; for
    in-memory images, the image's uint8 pixel bytes; for image files (read lazily), the file's
    name (reading every image of SUN397 to split it would cost far more than the split). Rows with
    the same label and the same text, pixels or file name get the same digest."""
    contents: Iterable[bytes | memoryview]
    if isinstance(raw.inputs, list):
        contents = (document.encode("utf-8") for document in raw.inputs)
    elif isinstance(raw.inputs, np.ndarray):  # embeddings: their float32 bytes
        contents = (row.data for row in np.ascontiguousarray(raw.inputs, dtype=np.float32))
    elif isinstance(raw.inputs, torch.Tensor):
        pixels = np.ascontiguousarray(raw.inputs.numpy()).reshape(len(raw.inputs), -1)
        contents = (row.data for row in pixels)
    else:
        contents = (path.name.encode("utf-8") for path in raw.inputs.files)
    return splits.content_digests(contents, raw.labels)


def split_rows(
    labels: np.ndarray, num_classes: int, num_official_train: int | None, spec: WorkloadSpec, digests: np.ndarray
) -> SplitRows:
    """The splits of a dataset's rows under ``spec`` (see ``dptune.data``).

    ``labels`` are the raw class ids (``0..num_classes-1``) of every row, official training rows
    first; ``digests`` their content digests (:func:`row_digests`). Order: the official test
    split, or, without one, the rows whose keyed hash (key: ``TEST_SPLIT_SEED``) falls below
    ``TEST_FRACTION``; class subset on all splits; validation: the training rows whose keyed hash
    (key: ``spec.seed``) falls below ``validation_fraction``; then ``fraction`` or
    ``examples_per_class`` on the training rows; then the ``max_*_examples`` caps.

    The per-row rule (``splits.held_out``): a row's train/validation (and carved test) membership
    depends on that row's label and content alone, so adding or removing one row of the pool
    moves no other row, and identical rows (same label and content) land on the same side. Sizes
    are binomial (≈ fraction·n), not stratified. The later knobs ``fraction``,
    ``examples_per_class`` and the caps are seeded stratified samples of the pool, which depend
    on the whole population: with them, the DP guarantee is for the training and validation sets
    they produce, with their sizes treated as public. Where the privacy unit is a person, ``digests``
    are the people's (every row of a person carries it) and the later knobs keep whole people by the
    same per-person rule (:func:`_person_knobs`), so none of this caveat applies to them. Raises
    :class:`WorkloadError` when a split comes out empty or a class has fewer than ``examples_per_class``
    training rows.
    """
    everything = np.arange(len(labels))
    if len(digests) != len(labels):
        raise ValueError(f"{len(digests)} row digests for {len(labels)} rows")
    if num_official_train is None:
        carved = splits.held_out(digests, splits.TEST_FRACTION, splits.TEST_SPLIT_SEED, splits.TEST)
        test, train = everything[carved], everything[~carved]
    else:
        train, test = everything[:num_official_train], everything[num_official_train:]
    label_map = np.full(num_classes, -1, dtype=np.int64)
    kept = tuple(int(c) for c in spec.classes) if spec.classes is not None else tuple(range(num_classes))
    label_map[list(kept)] = np.arange(len(kept))
    train, test = train[label_map[labels[train]] >= 0], test[label_map[labels[test]] >= 0]

    held = splits.held_out(digests[train], spec.validation_fraction, spec.seed, splits.VALIDATION)
    pool, val, train = len(train), train[held], train[~held]
    for name, split in (("training", train), ("validation", val), ("test", test)):
        if len(split) == 0:
            raise WorkloadError(
                f"the {name} split is empty: the training pool has {pool} rows and the test split "
                f"{len(test)} at validation_fraction={spec.validation_fraction} (seed {spec.seed}); "
                f"use more rows or classes, or another validation_fraction"
            )
    if spec.person_unit is not None:  # whole people, each kept by its own keyed hash
        return _person_knobs(SplitRows(train, val, test, kept, label_map), spec, digests)
    if spec.fraction < 1.0:
        train = splits.stratified_sample(
            train,
            labels,
            max(1, round(spec.fraction * len(train))),
            splits.stream(spec.seed, splits._FRACTION),
        )
    if spec.examples_per_class is not None:
        counts = np.bincount(labels[train], minlength=num_classes)
        short = [int(c) for c in kept if counts[c] < spec.examples_per_class]
        if short:
            raise WorkloadError(
                f"examples_per_class={spec.examples_per_class} exceeds the training examples of "
                f"class(es) {short} (smallest has {min(counts[c] for c in short)} after the validation split)"
            )
        train = splits.per_class(
            train,
            labels,
            spec.examples_per_class,
            splits.stream(spec.seed, splits._EXAMPLES_PER_CLASS),
        )
    train = splits.cap(train, labels, spec.max_train_examples, splits.stream(spec.seed, splits._CAP))
    val = splits.cap(val, labels, spec.max_eval_examples, splits.stream(spec.seed, splits._CAP + 1))
    test = splits.cap(test, labels, spec.max_eval_examples, splits.stream(spec.seed, splits._CAP + 2))
    return SplitRows(train=train, val=val, test=test, kept=kept, label_map=label_map)


def _person_knobs(rows: SplitRows, spec: WorkloadSpec, digests: np.ndarray) -> SplitRows:
    """``fraction`` and the ``max_*_examples`` caps where the privacy unit is a person: each keeps whole
    people, every person by the keyed hash of their digest (``splits.held_out``) with probability
    ``fraction``, or ``cap / rows`` of the split, so adding or removing one person moves no other person
    (row counts are then binomial around the share, not exact). ``examples_per_class`` counts rows and is
    refused with a person unit (``check_spec``)."""

    def keep(split: np.ndarray, share: float, purpose: str) -> np.ndarray:
        return split if share >= 1.0 else split[splits.held_out(digests[split], share, spec.seed, purpose)]

    def capped(split: np.ndarray, limit: int | None, purpose: str) -> np.ndarray:
        return split if limit is None else keep(split, limit / max(len(split), 1), purpose)

    train = keep(rows.train, spec.fraction, "fraction")
    return replace(
        rows,
        train=capped(train, spec.max_train_examples, "cap-train"),
        val=capped(rows.val, spec.max_eval_examples, "cap-val"),
        test=capped(rows.test, spec.max_eval_examples, "cap-test"),
    )


def tuning_rows_bytes(train: np.ndarray, val: np.ndarray, sizes: tuple[int, int]) -> bytes:
    """The file of a tuning subsample X₁ (``WorkloadSpec.tuning_rows``): the kept positions ``train``
    and ``val`` (sorted, in the training and validation splits of sizes ``sizes``), as ``.npz`` bytes."""
    buffer = io.BytesIO()
    np.savez(buffer, train=np.asarray(train, np.int64), val=np.asarray(val, np.int64), sizes=np.asarray(sizes))
    return buffer.getvalue()


def tuning_subset(rows: SplitRows, location: str) -> SplitRows:
    """``rows`` with only the training and validation rows of the tuning subsample stored at
    ``location`` (written by :func:`tuning_rows_bytes`); the test rows unchanged. Raises
    :class:`WorkloadError` when the file is missing or unreadable, or was drawn for other splits."""
    from dptune.paths import read_file

    folder, _, name = location.rpartition("/")
    try:
        data = read_file(folder, name)
        if data is None:
            raise FileNotFoundError("no such file")
        with np.load(io.BytesIO(data)) as kept:
            train, val, sizes = kept["train"], kept["val"], tuple(int(n) for n in kept["sizes"])
    except (OSError, KeyError, ValueError) as error:
        raise WorkloadError(f"tuning_rows {location!r}: cannot read the tuning subsample ({error})") from None
    if sizes != (len(rows.train), len(rows.val)):
        raise WorkloadError(
            f"tuning_rows {location!r} was drawn for {sizes[0]} training and {sizes[1]} validation rows; "
            f"this workload has {len(rows.train)} and {len(rows.val)}"
        )
    return replace(rows, train=rows.train[train], val=rows.val[val])


def load_workload(spec: WorkloadSpec, *, data_dir: Path | None = None) -> Workload:
    """Build the train/validation/test datasets of ``spec`` (see ``dptune.data`` and
    :class:`Workload`). ``data_dir`` overrides ``$DPTUNE_DATA_DIR`` for on-disk datasets.

    The spec is checked before anything is read; for ``peft == "head"`` the frozen pretrained
    backbone's features come from the cache (encoded on first use: every row of the dataset,
    or only the kept rows when ``max_train_examples``/``max_eval_examples`` cap the splits).
    """
    return _workload(spec, data_dir, encode=True)[0]


def planned_workload(spec: WorkloadSpec, *, data_dir: Path | None = None) -> tuple[Workload, PlannedEncoding | None]:
    """:func:`load_workload`'s workload with nothing encoded or tokenized (what a dry run plans from), and
    what loading it would encode (None: no features to encode, the runs train on the rows' own inputs).

    Its splits, labels, people and class names are the ones :func:`load_workload` makes (the same code: the
    same rows, the same privacy units); the features of ``peft == "head"`` and a text model's token ids are
    tensors on PyTorch's ``meta`` device, their shape without data (a head's ``provenance``, the identity of
    its encoding, is empty).
    """
    return _workload(spec, data_dir, encode=False)


def _workload(spec: WorkloadSpec, data_dir: Path | None, *, encode: bool) -> tuple[Workload, PlannedEncoding | None]:
    """The workload of ``spec``; ``encode`` False: its encoded or tokenized inputs left unmade
    (:func:`_unmade`), with what encoding them would take."""
    from dptune.models import get_backbone, load_tokenizer

    info = check_spec(spec)
    if info.modality == "features":
        return _own_features(spec, info.load(data_dir, None)), None
    backbone = get_backbone(spec.backbone)
    raw = info.load(data_dir, backbone.image_size)
    rows, labels, people = _rows_and_labels(spec, raw)
    max_tokens = spec.max_tokens or backbone.max_tokens
    common = (spec, len(rows.kept), [raw.class_names[c] for c in rows.kept])
    identity = {"data_sha256": raw.fingerprint, "backbone": spec.backbone}
    train: Split
    val: Split
    test: Split
    if spec.peft == "head":
        capped = spec.max_train_examples is not None or spec.max_eval_examples is not None
        needed = np.concatenate([rows.train, rows.val, rows.test]) if capped else None
        provenance: dict[str, str] = {}
        planned = None
        if encode:
            features = cached_features(
                raw, needed, spec.backbone, max_tokens=max_tokens, image_size=backbone.image_size, provenance=provenance
            )
            position = np.arange(len(raw.labels)) if needed is None else _positions(needed, len(raw.labels))
            train, val, test = (
                TensorDataset(torch.from_numpy(features[position[getattr(rows, name)]]), labels[name])
                for name in labels
            )
        else:
            train, val, test = (_unmade(labels[name], (backbone.feature_dim,), torch.float32) for name in labels)
            planned = planned_encoding(
                raw, needed, spec.backbone, max_tokens=max_tokens, image_size=backbone.image_size
            )
        workload = Workload(
            *common,
            train,
            val,
            test,
            modality="features",
            feature_dim=backbone.feature_dim,
            provenance=provenance,
            people=people,
        )
        return workload, planned
    if raw.modality == "text":
        if encode:
            tokenizer = load_tokenizer(spec.backbone)
            train, val, test = (
                _tokenized(raw, getattr(rows, name), tokenizer, max_tokens, labels[name]) for name in labels
            )
        else:
            assert max_tokens is not None, "a text backbone has a max_tokens"
            train, val, test = (_unmade(labels[name], (max_tokens,), torch.int64, inputs=2) for name in labels)
        workload = Workload(
            *common,
            train,
            val,
            test,
            modality="text",
            max_tokens=max_tokens,
            provenance={**identity, "max_tokens": str(max_tokens)},
            people=people,
        )
        return workload, None
    train, val, test = (_images(raw, getattr(rows, name), labels[name]) for name in labels)
    workload = Workload(
        *common, train, val, test, modality="image", image_size=backbone.image_size, provenance=identity, people=people
    )
    return workload, None


def _unmade(labels: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, inputs: int = 1) -> TensorDataset:
    """A split of ``labels`` whose ``inputs`` input tensors (each row of ``shape`` and ``dtype``) are on
    PyTorch's ``meta`` device: their shape without data, nothing encoded, tokenized or allocated."""
    made = [torch.empty((len(labels), *shape), dtype=dtype, device="meta") for _ in range(inputs)]
    return TensorDataset(*made, labels)


def _rows_and_labels(spec: WorkloadSpec, raw: RawDataset) -> tuple[SplitRows, dict[str, torch.Tensor], People | None]:
    """The split rows of ``raw`` under ``spec`` (its tuning subsample applied), each split's labels, and
    each split's people where the privacy unit is a person (every row of a person hashed by the person's
    digest, so the validation and carved test splits take whole people)."""
    people = raw_people(spec)
    digests = row_digests(raw) if people is None else people.row_digests()
    rows = split_rows(raw.labels, len(raw.class_names), raw.num_official_train, spec, digests)
    if spec.tuning_rows is not None:
        rows = tuning_subset(rows, spec.tuning_rows)
    labels = {
        name: torch.from_numpy(rows.label_map[raw.labels[getattr(rows, name)]]) for name in ("train", "val", "test")
    }
    return rows, labels, None if people is None else split_people(people, rows.train, rows.val, rows.test)


def _own_features(spec: WorkloadSpec, raw: RawDataset) -> Workload:
    """The workload of a dataset of embeddings (backbone ``none``): its rows' vectors are the features."""
    assert isinstance(raw.inputs, np.ndarray), "a features dataset's inputs are an (n, d) array"
    rows, labels, people = _rows_and_labels(spec, raw)
    train, val, test = (
        TensorDataset(torch.from_numpy(raw.inputs[getattr(rows, name)]), labels[name]) for name in labels
    )
    names = [raw.class_names[c] for c in rows.kept]
    return Workload(
        spec,
        len(rows.kept),
        names,
        train,
        val,
        test,
        modality="features",
        feature_dim=raw.inputs.shape[1],
        provenance={"data_sha256": raw.fingerprint, "backbone": NO_BACKBONE},
        people=people,
    )


def _positions(needed: np.ndarray, total: int) -> np.ndarray:
    """Map raw row id → position in ``needed`` (the row order of the returned features)."""
    position = np.full(total, -1, dtype=np.int64)
    position[needed] = np.arange(len(needed))
    return position


def _tokenized(
    raw: RawDataset,
    rows: np.ndarray,
    tokenizer: PreTrainedTokenizerBase,
    max_tokens: int | None,
    labels: torch.Tensor,
) -> TensorDataset:
    """``(input_ids, attention_mask, label)`` rows (:func:`tokenized_texts`)."""
    assert isinstance(raw.inputs, list), "a text dataset's inputs are its documents"
    return TensorDataset(*tokenized_texts([raw.inputs[row] for row in rows], tokenizer, max_tokens), labels)


def tokenized_texts(
    texts: list[str], tokenizer: PreTrainedTokenizerBase, max_tokens: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` int64 of ``texts``, truncated and padded to ``max_tokens`` (None:
    the tokenizer's own limit): what a text model trains and predicts on."""
    encoded = tokenizer(texts, truncation=True, max_length=max_tokens, padding="max_length", return_tensors="pt")
    return encoded["input_ids"].long(), encoded["attention_mask"].long()


def _images(raw: RawDataset, rows: np.ndarray, labels: torch.Tensor) -> Split:
    if isinstance(raw.inputs, torch.Tensor):
        return TensorDataset(raw.inputs[torch.from_numpy(rows)], labels)
    assert isinstance(raw.inputs, ImageFiles), "an image dataset's inputs are a tensor or ImageFiles"
    return LabelledImages(raw.inputs, rows, labels)
