"""People for person-level tests: a real multi-row dataset (:func:`newsgroup_people`, 20 Newsgroups posts
cut into rows of a few words, each post one person, so people have from one to :data:`MAX_ROWS` rows,
heavy-tailed as long posts are rare) and small clustered ones in memory (:func:`clustered_people`,
:func:`people_workload`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch.utils.data import TensorDataset

from dptune.contract import WorkloadSpec
from dptune.data.sources import load_20newsgroups
from dptune.data.spec import People, Workload

#: One split of :func:`people_workload`: (inputs, labels, each row's person).
PeopleSplit = tuple[torch.Tensor, torch.Tensor, np.ndarray]

#: Newsgroups kept (string labels).
GROUPS = ("rec.autos", "sci.space", "talk.politics.guns")
#: Most rows of one person (a post longer than this many rows keeps its first ones).
MAX_ROWS = 50


def newsgroup_people(posts_per_group: int, words_per_row: int = 40, offset: int = 0) -> pd.DataFrame:
    """Rows ``text``, ``label`` (the newsgroup) and ``user`` (``post-<i>``) of the first ``posts_per_group``
    training posts of each group in :data:`GROUPS` after ``offset``, each post cut into rows of
    ``words_per_row`` words (at most :data:`MAX_ROWS` of them)."""
    raw = load_20newsgroups()
    rows = []
    for group in GROUPS:
        label = raw.class_names.index(group)
        posts = [i for i in range(raw.num_official_train or 0) if raw.labels[i] == label][offset:]
        for post in posts[:posts_per_group]:
            words = raw.inputs[post].split()
            for start in range(0, min(len(words), MAX_ROWS * words_per_row), words_per_row):
                rows.append(
                    {"text": " ".join(words[start : start + words_per_row]), "label": group, "user": f"post-{post}"}
                )
    return pd.DataFrame(rows)


def dense_people(owner: np.ndarray) -> np.ndarray:
    """``owner`` renumbered ``0..P-1`` in the order people first appear (:class:`People`'s layout)."""
    _, first, inverse = np.unique(owner, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inverse]


def clustered_people(sizes: list[int], shape: tuple[int, ...], classes: int, seed: int) -> PeopleSplit:
    """(inputs, labels, people) of people with ``sizes`` rows, shuffled: a person's rows are their own
    centre plus small noise and share one label (so a person's per-example gradients point alike)."""
    generator = torch.Generator().manual_seed(seed)
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    centres = 2.0 * torch.randn(len(sizes), *shape, generator=generator)
    labels = torch.randint(classes, (len(sizes),), generator=generator)
    order = torch.randperm(len(owner), generator=generator)
    inputs = centres[owner] + 0.1 * torch.randn(len(owner), *shape, generator=generator)
    return inputs[order], labels[owner][order], dense_people(owner[order].numpy())


def people_workload(spec: WorkloadSpec, splits: tuple[PeopleSplit, PeopleSplit, PeopleSplit], classes: int) -> Workload:
    """A features workload of the train, validation and test ``splits`` (:func:`clustered_people`)."""
    (train, train_people), (val, val_people), (test, test_people) = (
        (TensorDataset(inputs, labels), people) for inputs, labels, people in splits
    )
    return Workload(
        spec=spec,
        num_classes=classes,
        class_names=[f"c{k}" for k in range(classes)],
        train=train,
        val=val,
        test=test,
        modality="features",
        feature_dim=int(splits[0][0].shape[-1]),
        people=People(column="user", train=train_people, val=val_people, test=test_people),
    )
