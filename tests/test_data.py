"""Workloads: spec checks, per-row seeded splits and stratified knobs, embedded datasets, feature cache."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading

import numpy as np
import pytest
import torch
from PIL import Image

import dptune.data.features as features
import dptune.data.precision_choice as precision_choice
from dptune.data import DATASETS, WorkloadError, WorkloadSpec, downstream, list_datasets, load_workload
from dptune.data.downstream import DownstreamAgreement
from dptune.data.sources import ImageFiles, RawDataset, load_20newsgroups, load_mnist5k
from dptune.data.splits import TEST_FRACTION, allocate, content_digests
from dptune.data.workload import row_digests, split_rows

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def temporary_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def fp32_features(monkeypatch):
    """Features in fp32 here, whatever the CPU: these tests compare them with fp32 references
    (bf16 encoding has its own test below)."""
    monkeypatch.setenv(features.PRECISION_ENV, "fp32")


@pytest.fixture
def encoder_calls(monkeypatch):
    """Counts the real encoder's calls (and the rows it encoded) without changing what it does."""
    calls: list[int] = []
    real = features.encode_rows

    def spy(extractor, raw, rows, *args, **kwargs):
        calls.append(len(rows))
        return real(extractor, raw, rows, *args, **kwargs)

    monkeypatch.setattr(features, "encode_rows", spy)
    return calls


def labels_of(dataset) -> np.ndarray:
    return dataset.tensors[-1].numpy()


# ----------------------------------------------------------------------- spec checks


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"dataset": "imagenet"}, ["unknown dataset 'imagenet'", "20newsgroups", "mnist5k"]),
        ({"backbone": "bert-large"}, ["unknown backbone 'bert-large'", "minilm"]),
        ({"peft": "prompt"}, ["unknown peft 'prompt'", "lora"]),
        ({"backbone": "efficientnet_lite0"}, ["takes image", "is text"]),
        ({"fraction": 0.0}, ["fraction must be in (0, 1]", "0.0"]),
        ({"fraction": 1.5}, ["fraction must be in (0, 1]"]),
        ({"examples_per_class": 0}, ["examples_per_class must be >= 1"]),
        ({"examples_per_class": 5, "fraction": 0.5}, ["not both"]),
        ({"classes": (0, 20, 99)}, ["unknown class ids [20, 99]", "0..19"]),
        ({"classes": (3, 3)}, ["at least 2 distinct"]),
        ({"validation_fraction": 1.0}, ["validation_fraction must be in (0, 1)"]),
        ({"max_tokens": 4}, ["max_tokens must be >= 8"]),
        ({"max_train_examples": 0}, ["max_train_examples must be >= 1"]),
        ({"seed": -1}, ["seed must be a non-negative integer"]),
    ],
)
def test_bad_specs_fail_before_any_data_is_read(monkeypatch, changes, fragments):
    def no_read(*_):
        raise AssertionError("data was read for an invalid spec")

    for name, info in list(DATASETS.items()):
        monkeypatch.setitem(DATASETS, name, dataclasses.replace(info, load=no_read))
    spec = dataclasses.replace(WorkloadSpec("20newsgroups", "minilm", "head"), **changes)
    with pytest.raises(WorkloadError) as error:
        load_workload(spec)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_scratch_backbone_refuses_a_linear_probe_and_lora_needs_attention():
    with pytest.raises(WorkloadError, match="trained from scratch.*'full'"):
        load_workload(WorkloadSpec("mnist5k", "wrn16_4", "head"))
    with pytest.raises(WorkloadError, match="no attention"):
        load_workload(WorkloadSpec("mnist5k", "efficientnet_lite0", "lora"))


def test_registry():
    assert list_datasets() == sorted(DATASETS) == ["20newsgroups", "cassava", "cifar100", "mnist5k", "sun397"]


# -------------------------------------------------------------------------- splits


def test_allocate_is_proportional_and_exact():
    sizes = np.array([7, 13, 1, 29, 50])
    for total in (0, 1, 9, 33, 100):
        counts = allocate(sizes, total)
        quotas = total * sizes / sizes.sum()
        assert counts.sum() == total
        assert np.all(counts >= np.floor(quotas)) and np.all(counts <= np.ceil(quotas))


def synthetic_labels() -> np.ndarray:
    rng = np.random.default_rng(123)
    return rng.permutation(np.repeat(np.arange(5), [40, 60, 80, 100, 120]))  # 400 rows


def documents(ids) -> list[bytes]:
    """Distinct row contents: document ``i`` is ``b"document i"``."""
    return [f"document {i}".encode() for i in ids]


def synthetic_digests(labels: np.ndarray) -> np.ndarray:
    return content_digests(documents(range(len(labels))), labels)


def binomially_close(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * np.sqrt(n * p * (1 - p))


def test_official_test_split_is_kept_and_validation_is_a_per_row_share():
    labels = synthetic_labels()
    spec = WorkloadSpec("x", "minilm", "head", validation_fraction=0.2)
    rows = split_rows(labels, 5, 300, spec, synthetic_digests(labels))
    np.testing.assert_array_equal(rows.test, np.arange(300, 400))
    assert set(rows.train).isdisjoint(rows.val) and set(rows.train) | set(rows.val) == set(range(300))
    assert binomially_close(len(rows.val), 300, 0.2)


def test_same_seed_same_splits_other_seed_other_validation_same_test():
    labels = synthetic_labels()
    digests = synthetic_digests(labels)
    spec = WorkloadSpec("x", "minilm", "head", seed=3, fraction=0.5)
    first, again = split_rows(labels, 5, None, spec, digests), split_rows(labels, 5, None, spec, digests)
    other = split_rows(labels, 5, None, dataclasses.replace(spec, seed=4), digests)
    for name in ("train", "val", "test"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert not np.array_equal(first.val, other.val) and not np.array_equal(first.train, other.train)
    np.testing.assert_array_equal(first.test, other.test)  # fixed-seed test split without an official one
    assert binomially_close(len(first.test), 400, TEST_FRACTION)
    assert len({*first.train, *first.val, *first.test}) == len(first.train) + len(first.val) + len(first.test)


def membership(rows, ids: list[int]) -> dict[int, str]:
    """Document id → the split its row is in."""
    return {ids[row]: name for name in ("train", "val", "test") for row in getattr(rows, name)}


@pytest.mark.parametrize("official", [True, False])
def test_adding_or_removing_one_row_moves_no_other_row(official):
    rng = np.random.default_rng(7)
    ids = list(range(2000))
    labels = rng.integers(0, 5, len(ids))
    spec = WorkloadSpec("x", "minilm", "head", seed=11, validation_fraction=0.3)

    def split(ids: list[int], labels: np.ndarray) -> dict[int, str]:
        # documents 1500..1999 are the official test rows (they come last), the others training rows
        official_train = sum(not 1500 <= i < 2000 for i in ids) if official else None
        digests = content_digests(documents(ids), labels)
        return membership(split_rows(labels, 5, official_train, spec, digests), ids)

    before = split(ids, labels)
    assert set(before.values()) == {"train", "val", "test"} and len(before) == len(ids)
    # one more row in the middle of the pool (every later row id shifts by one)
    added_ids = [*ids[:700], 5000, *ids[700:]]
    added = split(added_ids, np.insert(labels, 700, 3))
    assert set(added) == {*before, 5000}
    assert {i: added[i] for i in before} == before
    # one row fewer
    removed_ids = ids[:300] + ids[301:]
    removed = split(removed_ids, np.delete(labels, 300))
    assert removed == {i: side for i, side in before.items() if i != 300}


def test_validation_and_carved_test_shares_are_binomial_on_10000_rows():
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 10, 10_000)
    digests = synthetic_digests(labels)
    spec = WorkloadSpec("x", "minilm", "head", seed=0, validation_fraction=0.1)
    official = split_rows(labels, 10, 10_000 - 1, spec, digests)
    assert binomially_close(len(official.val), 9_999, 0.1)
    carved = split_rows(labels, 10, None, spec, digests)
    assert binomially_close(len(carved.test), 10_000, TEST_FRACTION)
    assert binomially_close(len(carved.val), 10_000 - len(carved.test), 0.1)
    # other seeds: other validation rows (about 10% overlap, as independent draws), same test rows
    for seed in (1, 2):
        other = split_rows(labels, 10, None, dataclasses.replace(spec, seed=seed), digests)
        np.testing.assert_array_equal(other.test, carved.test)
        shared = len(np.intersect1d(other.val, carved.val))
        assert binomially_close(shared, len(carved.val), 0.1)


def test_identical_rows_land_on_the_same_side():
    labels = np.array([2, 2, 1] * 200)
    contents = [b"the same document", b"the same document", b"the same document"] * 200
    contents[::3] = documents(range(200))  # every third row distinct
    digests = content_digests(contents, labels)
    for seed in range(5):
        rows = split_rows(labels, 3, 300, WorkloadSpec("x", "minilm", "head", seed=seed), digests)
        side = membership(rows, list(range(len(labels))))
        same_label = [side[row] for row in range(1, 300, 3)]  # label 2, identical content: one side
        assert len(set(same_label)) == 1
        assert len({side[row] for row in range(2, 300, 3)}) == 1  # label 1, identical content
        assert {side[row] for row in range(300, 600)} == {"test"}


def test_row_digests_hash_text_pixels_and_file_names_with_the_label(tmp_path):
    text = RawDataset("t", "text", ["a", "b"], ["same", "same", "same", "other"], np.array([0, 0, 1, 0]), None, "t")
    digests = row_digests(text)
    assert digests.shape == (4, 16) and digests.dtype == np.uint8
    assert (digests[0] == digests[1]).all() and len({row.tobytes() for row in digests}) == 3
    images = torch.zeros(3, 1, 4, 4, dtype=torch.uint8)
    images[2, 0, 3, 3] = 1  # one pixel differs
    pixels = row_digests(RawDataset("i", "image", ["a"], images, np.zeros(3, np.int64), None, "i"))
    assert (pixels[0] == pixels[1]).all() and not (pixels[0] == pixels[2]).all()
    files = ImageFiles([tmp_path / "a" / "x.png", tmp_path / "b" / "x.png", tmp_path / "a" / "y.png"], 32)
    named = row_digests(RawDataset("f", "image", ["a", "b"], files, np.array([0, 0, 0]), None, "f"))
    assert (named[0] == named[1]).all() and not (named[0] == named[2]).all()


def test_an_empty_split_fails_with_a_clear_message():
    labels = np.array([0, 1, 0, 1])
    spec = WorkloadSpec("x", "minilm", "head", validation_fraction=0.5)
    with pytest.raises(WorkloadError, match=r"the (training|validation) split is empty: the training pool has 1 rows"):
        split_rows(labels, 2, 1, spec, synthetic_digests(labels))  # one training row: one of the two is empty
    with pytest.raises(WorkloadError, match="the test split is empty"):
        split_rows(labels, 2, 4, spec, synthetic_digests(labels))


def test_fraction_examples_per_class_and_class_subset():
    labels = synthetic_labels()
    digests = synthetic_digests(labels)
    base = WorkloadSpec("x", "minilm", "head", seed=1)
    full = split_rows(labels, 5, 300, base, digests)
    half = split_rows(labels, 5, 300, dataclasses.replace(base, fraction=0.5), digests)
    np.testing.assert_array_equal(half.val, full.val)  # knobs act on training rows only
    assert set(half.train) <= set(full.train) and len(half.train) == round(0.5 * len(full.train))
    assert np.all(np.abs(np.bincount(labels[half.train]) - 0.5 * np.bincount(labels[full.train])) < 1)

    shots = split_rows(labels, 5, 300, dataclasses.replace(base, examples_per_class=3), digests)
    np.testing.assert_array_equal(np.bincount(labels[shots.train]), [3] * 5)
    with pytest.raises(WorkloadError, match="examples_per_class=200 exceeds.*class"):
        split_rows(labels, 5, 300, dataclasses.replace(base, examples_per_class=200), digests)

    subset = split_rows(labels, 5, 300, dataclasses.replace(base, classes=(4, 1)), digests)
    for part in (subset.train, subset.val, subset.test):
        assert set(labels[part]) == {1, 4}
    assert subset.kept == (4, 1) and subset.label_map[4] == 0 and subset.label_map[1] == 1
    assert subset.label_map[[0, 2, 3]].tolist() == [-1, -1, -1]


# ---------------------------------------------------------------- embedded datasets


def test_20newsgroups_has_the_published_sizes():
    raw = load_20newsgroups()
    assert raw.num_official_train == 11_293 and len(raw.inputs) - raw.num_official_train == 7_528
    assert len(raw.class_names) == 20 and raw.class_names == sorted(raw.class_names)
    assert raw.class_names[0] == "alt.atheism" and raw.inputs[0].startswith("alt atheism faq")
    assert np.all(np.bincount(raw.labels[:11_293]) > 300)


def reference_minilm_features(texts: list[str], max_tokens: int) -> np.ndarray:
    """sentence-transformers' recipe written out: fixed-length padding, masked mean pooling."""
    from transformers import AutoModel, AutoTokenizer

    from dptune.models.backbones import minilm_folder

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    model = AutoModel.from_pretrained(minilm_folder()).eval()
    batch = tokenizer(texts, truncation=True, max_length=max_tokens, padding="max_length", return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return ((hidden * mask).sum(1) / mask.sum(1)).numpy()


def test_20newsgroups_minilm_head_features_and_cache_reuse(encoder_calls, temporary_cache):
    spec = WorkloadSpec(
        "20newsgroups",
        "minilm",
        "head",
        seed=2,
        max_tokens=32,
        classes=(3, 7, 11),
        max_train_examples=12,
        max_eval_examples=6,
    )
    workload = load_workload(spec)
    assert workload.modality == "features" and workload.feature_dim == 384 and workload.num_classes == 3
    raw = load_20newsgroups()
    assert workload.class_names == [raw.class_names[3], raw.class_names[7], raw.class_names[11]]
    assert [len(workload.train), len(workload.val), len(workload.test)] == [12, 6, 6]
    assert encoder_calls == [24]  # only the kept rows were encoded

    rows = split_rows(raw.labels, 20, raw.num_official_train, spec, row_digests(raw))
    x, y = workload.train.tensors
    assert x.dtype == torch.float32 and x.shape == (12, 384)
    np.testing.assert_array_equal(y.numpy(), rows.label_map[raw.labels[rows.train]])
    expected = reference_minilm_features([raw.inputs[r] for r in rows.train[:4]], 32)
    np.testing.assert_allclose(x[:4].numpy(), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(labels_of(workload.test), rows.label_map[raw.labels[rows.test]])

    again = load_workload(spec)
    assert encoder_calls == [24]  # second load: read from the cache, encoder not run
    torch.testing.assert_close(again.train.tensors[0], x, rtol=0, atol=0)
    assert len(list((temporary_cache / "features").glob("20newsgroups-minilm-*.npy"))) == 1


def test_feature_workload_feeds_opacus_poisson_loader_including_empty_batches():
    from opacus.data_loader import DPDataLoader
    from torch.utils.data import DataLoader

    spec = WorkloadSpec("20newsgroups", "minilm", "head", max_tokens=16, max_train_examples=8, max_eval_examples=2)
    workload = load_workload(spec)
    torch.testing.assert_close(workload.labels("train"), workload.train.tensors[1])
    loader = DPDataLoader.from_data_loader(
        DataLoader(workload.train, batch_size=1), generator=torch.Generator().manual_seed(0)
    )
    assert loader.batch_sampler.sample_rate == pytest.approx(1 / 8)
    batches = list(loader)
    assert {(tuple(x.shape[1:]), x.dtype, y.dtype) for x, y in batches} == {((384,), torch.float32, torch.int64)}
    assert any(len(y) == 0 for _, y in batches)  # (7/8)^8 ≈ 34% chance per step: seeded


def tiny_corpus() -> RawDataset:
    raw = load_20newsgroups()
    rows = np.r_[0:6, 11_293:11_299]
    return dataclasses.replace(
        raw,
        name="tiny20",
        inputs=[" ".join(raw.inputs[r].split()[:12]) for r in rows],
        labels=raw.labels[rows],
        num_official_train=6,
        fingerprint="tiny20-v1",
    )


def test_full_cache_serves_subsets_and_concurrent_encoders_share_one_write(encoder_calls, temporary_cache):
    raw = tiny_corpus()
    results: dict[int, np.ndarray] = {}

    def worker(index: int) -> None:
        results[index] = features.cached_features(raw, None, "minilm", max_tokens=16, image_size=None)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert encoder_calls == [12]  # the second waited on the lock, then read the first's file
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(results[0], reference_minilm_features(raw.inputs, 16), rtol=1e-4, atol=1e-5)

    subset = features.cached_features(raw, np.array([7, 2, 9]), "minilm", max_tokens=16, image_size=None)
    assert encoder_calls == [12]
    np.testing.assert_array_equal(subset, results[0][[7, 2, 9]])
    leftovers = [p.name for p in (temporary_cache / "features").iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_20newsgroups_tokens_for_fine_tuning():
    from dptune.models import load_tokenizer

    spec = WorkloadSpec("20newsgroups", "minilm", "lora", max_tokens=24, max_train_examples=10, max_eval_examples=4)
    workload = load_workload(spec)
    assert workload.modality == "text" and workload.max_tokens == 24 and workload.num_classes == 20
    input_ids, attention_mask, labels = workload.train.tensors
    assert input_ids.shape == attention_mask.shape == (10, 24) and input_ids.dtype == torch.int64
    raw = load_20newsgroups()
    rows = split_rows(raw.labels, 20, raw.num_official_train, spec, row_digests(raw))
    tokenizer = load_tokenizer("minilm")
    first = tokenizer(raw.inputs[rows.train[0]], truncation=True, max_length=24)["input_ids"]
    assert input_ids[0, : len(first)].tolist() == first and attention_mask[0].sum() == len(first)
    np.testing.assert_array_equal(labels.numpy(), raw.labels[rows.train])


def test_mnist5k_splits_and_efficientnet_features(encoder_calls):
    from dptune.models import build_feature_extractor

    raw = load_mnist5k()
    assert raw.inputs.shape == (5000, 1, 28, 28) and raw.inputs.dtype == torch.uint8
    np.testing.assert_array_equal(np.bincount(raw.labels), [500] * 10)
    full = split_rows(raw.labels, 10, None, WorkloadSpec("mnist5k", "efficientnet_lite0", "head"), row_digests(raw))
    assert len(full.train) + len(full.val) + len(full.test) == 5000
    assert binomially_close(len(full.test), 5000, TEST_FRACTION) and binomially_close(len(full.val), 4000, 0.1)

    spec = WorkloadSpec("mnist5k", "efficientnet_lite0", "head", max_train_examples=20, max_eval_examples=10)
    workload = load_workload(spec)
    assert workload.feature_dim == 1280 and workload.train.tensors[0].shape == (20, 1280)
    rows = split_rows(raw.labels, 10, None, spec, row_digests(raw))
    extractor = build_feature_extractor("efficientnet_lite0").eval()
    with torch.no_grad():
        expected = extractor(raw.inputs[torch.from_numpy(rows.val[:3])])
    torch.testing.assert_close(workload.val.tensors[0][:3], expected, rtol=1e-4, atol=1e-5)

    images = load_workload(dataclasses.replace(spec, peft="film"))
    assert images.modality == "image" and images.image_size == 64
    image, label = images.train[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.uint8 and label.dtype == torch.int64


# ---------------------------------------------------------------- on-disk datasets


def test_missing_disk_datasets_say_where_to_put_them(monkeypatch, tmp_path):
    monkeypatch.delenv("DPTUNE_DATA_DIR", raising=False)
    with pytest.raises(WorkloadError, match="set DPTUNE_DATA_DIR"):
        load_workload(WorkloadSpec("cifar100", "wrn16_4", "full"))
    monkeypatch.setenv("DPTUNE_DATA_DIR", str(tmp_path))
    with pytest.raises(WorkloadError, match=r"'cifar100' not found under .*CIFAR100\(root, download=True\)"):
        load_workload(WorkloadSpec("cifar100", "wrn16_4", "full", fraction=0.1))
    with pytest.raises(WorkloadError, match=r"'sun397' not found under .*SUN397\(root, download=True\)"):
        load_workload(WorkloadSpec("sun397", "wrn16_4", "full"))
    with pytest.raises(WorkloadError, match=r"'cassava' not found under .*one sub-folder per class"):
        load_workload(WorkloadSpec("cassava", "wrn16_4", "full"))


def test_cassava_image_folder_lazy_images_and_features(monkeypatch, tmp_path, encoder_calls):
    rng = np.random.default_rng(0)
    classes = ["cbb", "cbsd", "cgm", "cmd", "healthy"]
    for label, name in enumerate(classes):
        (tmp_path / "cassava" / name).mkdir(parents=True)
        for i in range(6):
            size = (int(rng.integers(40, 90)), int(rng.integers(40, 90)))
            pixels = np.full((size[1], size[0], 3), 40 * label, dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "cassava" / name / f"{i}.png")
    monkeypatch.setenv("DPTUNE_DATA_DIR", str(tmp_path))

    workload = load_workload(WorkloadSpec("cassava", "wrn16_4", "full"))
    assert workload.class_names == classes and workload.image_size == 32
    assert [len(workload.train), len(workload.val), len(workload.test)] == [21, 2, 7]  # per-row hash of 30 files
    for index in range(len(workload.train)):
        image, label = workload.train[index]
        assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
        assert torch.all(image == 40 * int(label))  # each class has its own grey level
    torch.testing.assert_close(workload.labels("train"), torch.stack([workload.train[i][1] for i in range(21)]))

    head = load_workload(
        WorkloadSpec("cassava", "efficientnet_lite0", "head", max_train_examples=5, max_eval_examples=5)
    )
    assert head.train.tensors[0].shape == (5, 1280) and encoder_calls == [5 + 2 + 5]


# ---------------------------------------------------------------- encoding precision


class _Clock:
    """A stub timer: each ``encode(precision)`` advances it by that precision's fixed cost."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.now, self.seconds, self.calls = 0.0, seconds, []

    def __call__(self) -> float:
        return self.now

    def encode(self, precision: str, cosine_gap: dict[str, float] | None = None) -> np.ndarray:
        self.calls.append(precision)
        self.now += self.seconds[precision]
        rows = np.eye(4, 8, dtype=np.float32) + 1.0
        gap = (cosine_gap or {}).get(precision, 0.0)  # a small rotation: cosine to fp32 of about 1 - gap
        rows[:, -1] += np.sqrt(2 * gap) * np.linalg.norm(rows, axis=1)
        return rows


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        ({"fp32": 1.0, "bf16": 2.5}, "fp32"),
        ({"fp32": 2.5, "bf16": 1.0}, "bf16"),
        ({"fp32": 1.0, "bf16": 2.5, "openvino-fp32": 1.5, "openvino-bf16": 2.0}, "fp32"),
        ({"fp32": 2.5, "bf16": 1.0, "openvino-fp32": 2.0, "openvino-bf16": 0.8}, "openvino-bf16"),
        ({"fp32": 2.5, "bf16": 1.9, "openvino-fp32": 1.2, "openvino-bf16": 1.3}, "openvino-fp32"),
    ],
)
def test_the_precision_is_the_fastest_one_measured(seconds, expected):
    clock = _Clock(seconds)
    candidates = tuple(seconds)
    choice = precision_choice.measure_precision(clock.encode, rows=48, candidates=candidates, clock=clock)
    assert choice.precision == expected
    assert choice.rows_per_s == pytest.approx({p: 48 / t for p, t in seconds.items()})
    assert [clock.calls.count(p) for p in candidates] == [1 + precision_choice.PROBE_ROUNDS] * len(candidates)
    assert choice.min_cosine == pytest.approx(dict.fromkeys(candidates, 1.0)) and "measured" in choice.reason


def test_a_faster_precision_whose_features_disagree_is_not_chosen():
    clock = _Clock({"fp32": 2.5, "bf16": 1.0, "openvino-fp32": 2.0, "openvino-bf16": 0.8})
    gaps = {"openvino-bf16": 1e-3}
    choice = precision_choice.measure_precision(
        lambda p: clock.encode(p, gaps), rows=48, candidates=features.PRECISIONS, clock=clock
    )
    assert choice.precision == "bf16" and choice.min_cosine["openvino-bf16"] < precision_choice.MIN_COSINE
    assert re.search(r"; openvino-bf16 60 \(cosine 0\.999\d\d < 0\.9999: not eligible\)", choice.reason)
    gaps["bf16"] = 2e-4
    choice = precision_choice.measure_precision(
        lambda p: clock.encode(p, gaps), rows=48, candidates=("fp32", "bf16"), clock=clock
    )
    assert choice.precision == "fp32" and "not eligible" in choice.reason


def test_downstream_evidence_decides_where_a_precision_has_it():
    inside = DownstreamAgreement({1.0: (-0.2, 0.3), 8.0: (-0.1, 0.1)}, {1.0: 0.5, 8.0: 0.4}, 8, 0.999, ("a CPU",))
    outside = DownstreamAgreement({1.0: (-0.2, 0.3), 8.0: (0.2, 0.6)}, {1.0: 0.5, 8.0: 0.4}, 8, 0.999, ("a CPU",))
    assert inside.inside_noise and not outside.inside_noise and inside.sane_cosine == pytest.approx(0.998)
    clock = _Clock({"fp32": 2.5, "bf16": 1.0, "openvino-fp32": 2.0, "openvino-bf16": 0.8})
    gaps = {"bf16": 2e-4, "openvino-bf16": 1e-3}  # both below MIN_COSINE, as an int8 runtime's would be

    def measure(agreement):
        return precision_choice.measure_precision(
            lambda p: clock.encode(p, gaps), rows=48, candidates=features.PRECISIONS, clock=clock, agreement=agreement
        )

    # evidence inside the runs' noise lets the fastest be chosen although its cosine is under MIN_COSINE
    choice = measure({"openvino-bf16": inside})
    assert choice.precision == "openvino-bf16" and choice.min_cosine["openvino-bf16"] < precision_choice.MIN_COSINE
    assert "(DP probes inside the runs' noise at ε = 1, 8, 8 seeds; cosine to fp32 ≥ 0.99" in choice.reason
    # evidence outside the noise rules it out although it is the fastest; bf16 has none: its cosine decides
    choice = measure({"openvino-bf16": outside})
    assert choice.precision == "openvino-fp32"
    assert "openvino-bf16 60 (DP probes outside the runs' noise (" in choice.reason
    assert "ε = 8: [+0.20, +0.60] vs ±0.40 test points, 8 seeds): not eligible)" in choice.reason
    assert re.search(r"bf16 48 \(cosine 0\.999\d\d < 0\.9999: not eligible\)", choice.reason)
    # features far from fp32's are not the runtime that was measured, whatever the evidence
    gaps["openvino-bf16"] = 0.05
    choice = measure({"openvino-bf16": inside, "bf16": inside})
    assert choice.precision == "bf16" and "openvino-bf16 60 (cosine 0.9" in choice.reason
    assert "< 0.99800: not the runtime measured, not eligible)" in choice.reason
    # the reference is always eligible: nothing else agrees here
    choice = measure({"openvino-bf16": outside, "bf16": outside, "openvino-fp32": outside})
    assert choice.precision == "fp32"


def test_the_chooser_goes_by_the_backbones_recorded_evidence(monkeypatch, temporary_cache):
    monkeypatch.delenv(features.PRECISION_ENV)
    outside = DownstreamAgreement({1.0: (0.6, 0.9)}, {1.0: 0.5}, 8, 0.9999, ("a CPU",))
    monkeypatch.setattr(downstream, "AGREEMENT", {("minilm", "bf16"): outside})
    clock = _Clock({"fp32": 2.5, "bf16": 1.0})
    cpu = torch.device("cpu")
    assert features.choose_precision(cpu, "minilm", clock.encode, 48, ("fp32", "bf16")).precision == "fp32"
    assert features.choose_precision(cpu, "other", clock.encode, 48, ("fp32", "bf16")).precision == "bf16"
    monkeypatch.setattr(downstream, "AGREEMENT", {})  # other evidence (an update of dptune): measured anew
    assert features.choose_precision(cpu, "minilm", clock.encode, 48, ("fp32", "bf16")).precision == "bf16"


def test_the_measured_choice_is_recorded_per_machine_and_forced_by_the_environment(monkeypatch, temporary_cache):
    monkeypatch.delenv(features.PRECISION_ENV)
    cpu = torch.device("cpu")
    both = features.PRECISIONS
    assert features.recorded_precision(cpu, "minilm", both) is None
    clock = _Clock({"fp32": 2.5, "bf16": 1.0})
    stub = precision_choice.PrecisionChoice("bf16", "stub", {"bf16": 2.0}, {"bf16": 1.0})
    monkeypatch.setattr(features, "measure_precision", lambda encode, rows, candidates, **_: stub)
    assert features.choose_precision(cpu, "minilm", clock.encode, 48, both).precision == "bf16"
    assert features.recorded_precision(cpu, "minilm", both).precision == "bf16"  # the next process measures nothing
    (record,) = (temporary_cache / "precision").glob("minilm-*.json")
    assert json.loads(record.read_text())["machine"]["cpu_flags_sha256"]
    assert features.recorded_precision(cpu, "minilm", ("fp32", "bf16")) is None  # other candidates: measured anew
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)  # another machine (threads) measures anew
    assert features.recorded_precision(cpu, "minilm", both) is None
    monkeypatch.setenv(features.PRECISION_ENV, "openvino-fp32")
    assert features.recorded_precision(cpu, "minilm", both).precision == "openvino-fp32"
    with pytest.raises(
        ValueError, match=r"'openvino-fp32' is not available here .* choose one of \['fp32', 'bf16', 'auto'\]"
    ):
        features.recorded_precision(cpu, "minilm", ("fp32", "bf16"))  # not a candidate here (say, images)
    monkeypatch.setenv(features.PRECISION_ENV, "fp16")
    with pytest.raises(
        ValueError,
        match=r"DPTUNE_ENCODE_PRECISION='fp16': expected one of "
        r"\['fp32', 'bf16', 'openvino-fp32', 'openvino-bf16', 'auto'\]",
    ):
        features.recorded_precision(cpu, "minilm", both)


def test_an_unmeasured_machine_measures_on_the_real_encoder_and_says_why(monkeypatch, temporary_cache, capsys):
    monkeypatch.delenv(features.PRECISION_ENV)
    raw = tiny_corpus()
    found = features.cached_features(raw, None, "minilm", max_tokens=16, image_size=None)
    (record,) = (temporary_cache / "precision").glob("minilm-*.json")
    choice = json.loads(record.read_text())["choice"]
    available = features.candidate_precisions(torch.device("cpu"), "text")  # openvino installed: 3 or 4
    assert set(choice["rows_per_s"]) == set(choice["min_cosine"]) == set(available) and len(available) >= 3
    evidence = downstream.downstream_agreement("minilm")
    fastest_agreeing = max(
        (p for p in available if precision_choice.ineligibility(p, choice["min_cosine"][p], evidence.get(p)) is None),
        key=choice["rows_per_s"].get,
    )
    assert choice["precision"] == fastest_agreeing and choice["min_cosine"]["openvino-fp32"] > 0.99999
    (key_file,) = (temporary_cache / "features").glob("tiny20-minilm-*.json")
    assert json.loads(key_file.read_text())["precision"] == choice["precision"]
    assert f"encoding text ({choice['precision']}; measured: " in capsys.readouterr().err
    assert found.shape == (len(raw.labels), 384)


def test_a_cache_hit_builds_no_encoder_and_other_weight_files_make_a_new_entry(
    monkeypatch, encoder_calls, temporary_cache, tmp_path
):
    import shutil

    import dptune.models as models
    from dptune.models.backbones import minilm_folder

    raw = tiny_corpus()
    first = features.cached_features(raw, None, "minilm", max_tokens=16, image_size=None)
    (key_file,) = (temporary_cache / "features").glob("tiny20-minilm-*.json")
    assert json.loads(key_file.read_text())["weights_sha256"] == features.folder_fingerprint(minilm_folder())

    real_build, built = models.build_feature_extractor, []
    monkeypatch.setattr(models, "build_feature_extractor", lambda *a, **k: built.append(a) or real_build(*a, **k))
    again = features.cached_features(raw, None, "minilm", max_tokens=16, image_size=None)
    assert built == [] and encoder_calls == [12]  # the key came from the weight files: no model was built
    np.testing.assert_array_equal(again, first)

    other = tmp_path / "minilm"
    shutil.copytree(minilm_folder(), other)
    (other / "README.md").write_text("changed")  # another folder: another identity, another entry
    monkeypatch.setitem(
        models.BACKBONES, "minilm", dataclasses.replace(models.BACKBONES["minilm"], weight_source=lambda: other)
    )
    features.cached_features(raw, None, "minilm", max_tokens=16, image_size=None)
    assert encoder_calls == [12, 12] and len(list((temporary_cache / "features").glob("tiny20-minilm-*.json"))) == 2


class _CoreWithoutBF16:
    """OpenVINO's ``Core`` reporting what it reports on a CPU without bf16 (an AVX2-only AMD EPYC): its
    ``OPTIMIZATION_CAPABILITIES`` without ``BF16``; everything else is the real one's."""

    def __init__(self, core) -> None:
        self.core = core

    def get_property(self, device, name):
        value = self.core.get_property(device, name)
        return [c for c in value if c != "BF16"] if name == "OPTIMIZATION_CAPABILITIES" else value

    def __getattr__(self, name):
        return getattr(self.core, name)


@pytest.mark.parametrize("bf16_reported", [True, False], ids=["bf16-reported", "no-bf16-faked"])
def test_every_precision_agrees_with_fp32_and_is_cached_apart(
    monkeypatch, encoder_calls, temporary_cache, capsys, bf16_reported
):
    """Where OpenVINO reports that the CPU computes bf16 (AVX-512 BF16, AMX), ``openvino-bf16`` is offered,
    changes the features and agrees with fp32; where it reports none, it would compute in fp32, so it is
    not offered, the probe's message says why, it is refused when forced, and a model card's
    ``openvino-bf16`` is encoded in ``openvino-fp32``, said so. The second case runs on every CPU (the
    report faked without BF16); the first is skipped, with its reason, on a CPU without bf16."""
    from dptune.data import openvino_runtime

    if bf16_reported and not openvino_runtime.native_bf16():
        capabilities = openvino_runtime._core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        pytest.skip(f"OpenVINO reports no BF16 on this CPU ({capabilities}): the faked case checks this one")
    if not bf16_reported:
        core = _CoreWithoutBF16(openvino_runtime._core())
        monkeypatch.setattr(openvino_runtime, "_core", lambda: core)
    raw = tiny_corpus()
    found = {}
    available = features.candidate_precisions(torch.device("cpu"), "text")
    expected = features.PRECISIONS if bf16_reported else ("fp32", "bf16", "openvino-fp32")
    assert available == expected and features.openvino_left_out().keys() == set(features.PRECISIONS) - set(expected)
    for precision in available:
        monkeypatch.setenv(features.PRECISION_ENV, precision)
        found[precision] = features.cached_features(raw, None, "minilm", max_tokens=16, image_size=None)
    assert encoder_calls == [12] * len(available)  # one cache entry per precision: bf16 never serves fp32
    keys = [json.loads(p.read_text()) for p in (temporary_cache / "features").glob("tiny20-minilm-*.json")]
    assert sorted(key["precision"] for key in keys) == sorted(available)
    reference = reference_minilm_features(raw.inputs, 16)
    for precision in ("fp32", "openvino-fp32"):
        np.testing.assert_allclose(found[precision], reference, rtol=1e-4, atol=1e-5)
    for precision in {"bf16", "openvino-bf16"} & set(available):
        low = found[precision]
        cosine = (low * reference).sum(1) / (np.linalg.norm(low, axis=1) * np.linalg.norm(reference, axis=1))
        assert low.dtype == np.float32 and cosine.min() > 0.9995
        assert np.abs(low - reference).max() > 1e-4, f"{precision} did not take effect"
    if bf16_reported:
        return
    monkeypatch.setenv(features.PRECISION_ENV, "openvino-bf16")  # forced all the same: refused, naming why
    with pytest.raises(ValueError, match="its bf16 only on a CPU that computes in bf16"):
        features.cached_features(raw, None, "minilm", max_tokens=16, image_size=None)
    from dptune.models import build_feature_extractor, load_tokenizer

    capsys.readouterr()
    card = features.encode_texts(  # as predict encodes for a model card's openvino-bf16
        build_feature_extractor("minilm"), load_tokenizer("minilm"), raw.inputs, 16, 384, "openvino-bf16", ", card"
    )
    np.testing.assert_allclose(card, found["openvino-fp32"], rtol=1e-5, atol=1e-6)
    no_bf16 = "OpenVINO reports no BF16 on this CPU (it would compute in fp32)"
    assert f"encoding text (openvino-fp32 in place of openvino-bf16: {no_bf16}, card)" in capsys.readouterr().err
    monkeypatch.delenv(features.PRECISION_ENV)  # a measured choice (timings stubbed): its message says why
    monkeypatch.setenv("DPTUNE_CACHE_DIR", str(temporary_cache.parent / "unmeasured"))
    stub = precision_choice.PrecisionChoice(
        "fp32", "measured: stub", {p: 1.0 for p in available}, dict.fromkeys(available, 1.0)
    )
    monkeypatch.setattr(features, "measure_precision", lambda encode, rows, candidates, **_: stub)
    features.cached_features(raw, None, "minilm", max_tokens=16, image_size=None)
    assert f"encoding text (fp32; measured: stub; openvino-bf16 not measured: {no_bf16})" in capsys.readouterr().err
    (record,) = (temporary_cache.parent / "unmeasured" / "precision").glob("minilm-*.json")
    assert json.loads(record.read_text())["candidates"] == list(available)


def test_a_precision_openvino_does_not_compute_as_asked_is_refused():
    """OpenVINO's CPU plugin computes a bf16 request in fp32 without a word where the CPU lacks bf16; its
    compiled model's inference precision says so, and the runner refuses such a model (faked here)."""
    from dptune.data.openvino_runtime import check_inference_precision, native_bf16

    assert isinstance(native_bf16(), bool)  # the real report; dptune's Core first (it keeps telemetry out)
    import openvino as ov

    class Compiled:  # a compiled model whose inference precision came out as ``resolved``
        def __init__(self, resolved: ov.Type) -> None:
            self.resolved = resolved

        def get_property(self, name: str) -> ov.Type:
            assert name == "INFERENCE_PRECISION_HINT"
            return self.resolved

    check_inference_precision(Compiled(ov.Type.f32), "fp32")
    check_inference_precision(Compiled(ov.Type.bf16), "bf16")
    with pytest.raises(RuntimeError, match=r"computes in f32 on this CPU where openvino-bf16 was asked: .*FP32"):
        check_inference_precision(Compiled(ov.Type.f32), "bf16")


def test_openvino_encodes_without_telemetry_and_leaves_the_signal_stack_valid(tmp_path):
    """A fake ``openvino_telemetry`` on the path records its import: a bare ``import openvino`` imports
    it (the control), dptune's OpenVINO encoder does not. The same process then encodes at both
    OpenVINO precisions with two encoders, frees them and handles a signal: OpenVINO plugins freed
    out of order would leave the signal stack unmapped and this process killed by SIGSEGV."""
    import subprocess
    import sys

    site, marker = tmp_path / "site", tmp_path / "telemetry-imported"
    site.mkdir()
    (site / "openvino_telemetry.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError\n")
    env = {**os.environ, "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    subprocess.run([sys.executable, "-c", "import openvino"], env=env, check=True)
    assert marker.exists()
    marker.unlink()
    encode = (
        "import gc, os, signal, numpy as np, torch; from dptune.data import features; from dptune.models import "
        "build_feature_extractor, load_tokenizer; torch.set_num_threads(1)\n"
        "for precision in ('openvino-fp32', 'openvino-bf16'):\n"
        "    f = features.encode_texts(build_feature_extractor('minilm'), load_tokenizer('minilm'), "
        "['a private text', 'another one'], 16, 384, precision, why=None)\n"
        "    assert f.shape == (2, 384) and np.isfinite(f).all()\n"
        "gc.collect(); received = []\n"
        "signal.signal(signal.SIGUSR1, lambda number, frame: received.append(number))\n"
        "os.kill(os.getpid(), signal.SIGUSR1); assert received == [signal.SIGUSR1]"
    )
    done = subprocess.run([sys.executable, "-c", encode], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists() and not (tmp_path / "intel").exists()


def test_tokens_of_long_documents_come_from_a_prefix_and_equal_the_whole_documents():
    from dptune.models import load_tokenizer

    tokenizer = load_tokenizer("minilm")
    raw = load_20newsgroups()
    by_length = np.argsort([len(text) for text in raw.inputs])
    rows = np.concatenate([by_length[-300:], by_length[:: len(by_length) // 300]])  # the longest, and a spread
    texts = [raw.inputs[row] for row in rows] + [
        "spaced " + " " * 2000 + "out words " * 50,  # a short prefix in tokens: tokenized whole
        "x" * 3000,  # no space to cut at
        "Ünïcödé ÀccÉnts, punctuation!? and 中文 characters " * 40,
    ]
    for max_tokens in (16, 128):
        expected = tokenizer(texts, truncation=True, max_length=max_tokens, return_attention_mask=False)["input_ids"]
        assert features.token_ids(tokenizer, texts, max_tokens) == list(expected)
    assert sum(len(text) > features.PREFIX_CHARS_PER_TOKEN * 128 for text in texts) > 300  # prefixes were used
