"""The fused person-level DP step against the row-level step on the same rows, before and after the
banded Gram of ``person_norms``.

Synthetic heavy-tailed people (``--people`` people, m ~ 1 + ⌊exp(N(1.2, 1.1))⌋ rows each, at most 50:
mean ≈ 6.4, 14 % with one row), ``--dim`` features (rows of one person near a common centre),
``--classes`` classes, K = ``--configurations`` heads, each configuration's batch B = ``--batch``
people drawn without replacement, expanded by :class:`~dptune.runners.batches.PersonIndex` with
``max_rows`` ∈ {1, 4, 16, None}. Timed at the gradient-function level, on the step's gathered rows
(the gather itself is the same for every arm and left out):

- ``person (before)``: :func:`~dptune.runners.person_heads.head_person_noisy_gradients` with the
  pair-list ``person_norms`` this file keeps as :func:`baseline_person_norms` (a copy of the code it
  replaced: same-person pairs of rows gathered with ``index_select``, people of > 39 rows formed
  one G_u at a time), its pair lists built here as ``person_draws`` built them;
- ``person (after)``: ``head_person_noisy_gradients`` as it is (tiles of consecutive rows, the band
  priced per step by ``band_width``);
- ``row``: :func:`~dptune.runners.heads.head_noisy_gradients` on the same padded rows (the row-level
  step with the same expected rows).

Arms interleaved within every repeat; medians of ``--repeats``. Also the largest relative error of
each person arm's ‖G_u‖ against G_u formed in float64. Writes JSON (with the CPU model and its
avx2/avx512/amx flags) and prints a markdown table.

    OMP_NUM_THREADS=1 nice .venv/bin/python bench/bench_person_step.py [--out bench/results/person_step.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from machine import machine

from dptune.contract import ClippingRule
from dptune.dp.clipping import clip_factors
from dptune.runners.batches import PersonBatches, PersonIndex, person_draws
from dptune.runners.heads import HeadGradients, augment, head_deltas, head_noisy_gradients
from dptune.runners.person_heads import head_person_noisy_gradients

MAX_ROWS: tuple[int | None, ...] = (1, 4, 16, None)
#: The replaced code's pair limit at 20 classes and 384 features (``pair_limit(20, 384)``).
BASELINE_PAIR_LIMIT = 39
RULE: ClippingRule = "standard"


# --------------------------------------------------------------------------- baseline (the replaced code)


def baseline_pairs(persons: PersonBatches) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """BASELINE: the replaced ``person_draws``' pair lists of one step: (left, right, segments) (K, pairs)
    of every same-person pair i < j of a person of ≤ 39 rows (padded with 0, 0 and the padding slot) and
    ``blocks`` (b, 5) (step, k, first, end, segment) of the larger people."""
    k = persons.segments.shape[0]
    lefts, rights, segs, blocks = [], [], [], []
    for c in range(k):
        segments, weights = persons.segments[c].numpy(), persons.weights[c].numpy()
        real = np.flatnonzero(weights > 0)
        starts = real[np.r_[True, np.diff(segments[real]) != 0]]
        ends = np.r_[starts[1:], real[-1] + 1] if len(real) else starts
        left, right, seg = [], [], []
        for first, end in zip(starts.tolist(), ends.tolist(), strict=True):
            if end - first > BASELINE_PAIR_LIMIT:
                blocks.append((0, c, first, end, int(segments[first])))
                continue
            i, j = np.triu_indices(end - first, 1)
            left.append(first + i)
            right.append(first + j)
            seg.append(np.full(len(i), segments[first]))
        lefts.append(np.concatenate(left) if left else np.zeros(0, np.int64))
        rights.append(np.concatenate(right) if right else np.zeros(0, np.int64))
        segs.append(np.concatenate(seg) if seg else np.zeros(0, np.int64))
    width = max(len(x) for x in lefts)
    out = [
        np.zeros((k, width), np.int64),
        np.zeros((k, width), np.int64),
        np.full((k, width), persons.num_segments - 1),
    ]
    for c in range(k):
        for array, values in zip(out, (lefts[c], rights[c], segs[c]), strict=True):
            array[c, : len(values)] = values
    left_t, right_t, seg_t = (torch.from_numpy(a) for a in out)
    return left_t, right_t, seg_t, np.array(blocks, dtype=np.int64).reshape(-1, 5)


def baseline_person_norms(
    deltas: torch.Tensor,
    features: torch.Tensor,
    feature_norms: torch.Tensor,
    persons: PersonBatches,
    pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray],
) -> torch.Tensor:
    """BASELINE: a copy of the replaced ``person_norms`` (pairs gathered with ``index_select``)."""
    weights = persons.weights
    pair_left, pair_right, pair_segments, blocks = pairs
    diagonal = (torch.linalg.vector_norm(deltas, dim=2) * feature_norms * weights).double().square_()
    squares = diagonal.new_zeros(weights.shape[0], persons.num_segments).scatter_add_(1, persons.segments, diagonal)
    if pair_left.shape[1]:
        left, right = pair_left, pair_right
        delta_products = torch.linalg.vecdot(_rows(deltas, left), _rows(deltas, right))
        feature_products = torch.linalg.vecdot(_rows(features, left), _rows(features, right))
        pair_weights = weights.gather(1, left) * weights.gather(1, right)
        terms = (2.0 * pair_weights * delta_products * feature_products).double()
        squares.scatter_add_(1, pair_segments, terms)
    if len(blocks):
        squares[blocks[:, 1], blocks[:, 4]] = torch.stack(
            [
                torch.linalg.matrix_norm(deltas[k, first:end].T @ features[k, first:end]).double() / (end - first)
                for _, k, first, end, _ in blocks.tolist()
            ]
        ).square_()
    return squares.clamp_(min=0.0).sqrt_().float()


def _rows(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """BASELINE: ``values[k, positions[k, p]]`` as one ``index_select`` of the flattened rows."""
    k, n, width = values.shape
    flat = (positions + torch.arange(k).unsqueeze(1) * n).reshape(-1)
    return torch.index_select(values.reshape(k * n, width), 0, flat).view(*positions.shape, width)


def baseline_step(
    step: dict[str, Any], pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]
) -> HeadGradients:
    """BASELINE: ``head_person_noisy_gradients`` with :func:`baseline_person_norms`."""
    labels, row_weights, feature_norms = step["rows"]
    persons, features = step["persons"], step["features"]
    deltas, row_losses = head_deltas(step["heads"], features, labels)
    losses = torch.linalg.vecdot(row_losses, row_weights)
    norms = baseline_person_norms(deltas, features, feature_norms, persons, pairs)
    factors = clip_factors(norms, step["bounds"].unsqueeze(1), RULE).mul_(step["scales"].unsqueeze(1))
    row_factors = factors.gather(1, persons.segments).mul_(persons.weights)
    released = torch.baddbmm(step["noise"], deltas.mul_(row_factors.unsqueeze(2)).transpose(1, 2), features)
    return HeadGradients(heads=released, losses=losses, norms=norms.gather(1, persons.segments).mul_(row_weights))


# --------------------------------------------------------------------------- the step


def population(args: argparse.Namespace) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Each training row's person (heavy-tailed sizes), augmented features (a zero padding row last)
    and labels."""
    rng = np.random.default_rng(args.seed)
    sizes = np.minimum(50, 1 + np.floor(np.exp(rng.normal(1.2, 1.1, args.people)))).astype(np.int64)
    owners = np.repeat(np.arange(args.people), sizes)
    centres = rng.normal(size=(args.people, args.dim)).astype(np.float32)
    x = centres[owners] + 0.3 * rng.normal(size=(len(owners), args.dim)).astype(np.float32)
    features = augment(torch.from_numpy(x))
    features = torch.cat([features, features.new_zeros(1, args.dim + 1)])
    labels = torch.from_numpy(rng.integers(args.classes, size=len(owners) + 1))
    return owners, features, labels


def person_step(
    args: argparse.Namespace, max_rows: int | None, data: tuple[np.ndarray, torch.Tensor, torch.Tensor]
) -> dict[str, Any]:
    """One step's inputs: K configurations' batches of B people (``max_rows`` rows at most each)."""
    owners, all_features, all_labels = data
    rng = np.random.default_rng(args.seed + 1)
    index = PersonIndex(owners, max_rows, (args.classes, args.dim + 1))
    generator = torch.Generator().manual_seed(args.seed)
    zeros = torch.zeros(args.batch, dtype=torch.int64)
    samples = [
        index.sample(zeros, torch.from_numpy(np.sort(rng.choice(args.people, args.batch, replace=False))), generator)
        for _ in range(args.configurations)
    ]
    rows, counts, persons, bands = person_draws(samples, 1, len(owners), torch.device("cpu"))
    width = int(counts.max())
    rows = rows[0, :, :width]
    features = all_features[rows]
    k = args.configurations
    return {
        "heads": torch.randn(k, args.classes, args.dim + 1, generator=generator) * 0.05,
        "features": features,
        "rows": (all_labels[rows], (rows < len(owners)).float(), torch.linalg.vector_norm(features, dim=2)),
        "persons": persons.step(0, width, int(bands[0])),
        "bounds": torch.full((k,), 1.0),
        "scales": torch.ones(k),
        "noise": torch.zeros(k, args.classes, args.dim + 1),
        "mean_rows": float(counts.mean()),
    }


def after_step(step: dict[str, Any]) -> HeadGradients:
    """``head_person_noisy_gradients`` as it is."""
    persons = step["persons"]
    return head_person_noisy_gradients(
        step["heads"], step["features"], step["rows"], persons, step["bounds"], RULE, step["noise"], step["scales"]
    )


def row_step(step: dict[str, Any]) -> HeadGradients:
    """The row-level step on the same padded rows."""
    labels, row_weights, feature_norms = step["rows"]
    return head_noisy_gradients(
        step["heads"],
        step["features"],
        labels,
        row_weights,
        feature_norms,
        step["bounds"],
        RULE,
        step["noise"],
        step["scales"],
    )


def exact_norms(step: dict[str, Any]) -> torch.Tensor:
    """‖G_u‖ (K, people) with every G_u formed in float64 (the reference)."""
    persons = step["persons"]
    deltas, _ = head_deltas(step["heads"], step["features"], step["rows"][0])
    weighted = deltas.double() * persons.weights.double().unsqueeze(2)
    k, _, classes = deltas.shape
    out = torch.zeros(k, persons.num_segments - 1, dtype=torch.float64)
    for c in range(k):
        gradients = torch.zeros(persons.num_segments, classes, step["features"].shape[2], dtype=torch.float64)
        outer = weighted[c].unsqueeze(2) * step["features"][c].double().unsqueeze(1)
        gradients.index_add_(0, persons.segments[c], outer)
        out[c] = torch.linalg.matrix_norm(gradients[:-1])
    return out


def relative_error(norms: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest |‖G_u‖ − exact| / exact over the people of a step."""
    present = exact > 0
    return float(((norms[:, :-1].double() - exact).abs()[present] / exact[present]).max())


def errors(
    step: dict[str, Any], pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]
) -> dict[str, float]:
    """Each person arm's largest relative error of ‖G_u‖ against :func:`exact_norms`."""
    from dptune.runners.person_heads import person_norms

    deltas, _ = head_deltas(step["heads"], step["features"], step["rows"][0])
    args = (deltas, step["features"], step["rows"][2], step["persons"])
    exact = exact_norms(step)
    return {
        "before_max_rel_error": relative_error(baseline_person_norms(*args, pairs), exact),
        "after_max_rel_error": relative_error(person_norms(*args), exact),
    }


def timed(arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per call of each arm, the arms interleaved within every repeat (one warm-up call each)."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for arm in arms.values():
        arm()
    for _ in range(repeats):
        for name, arm in arms.items():
            start = time.perf_counter()
            arm()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: round(float(np.median(t)), 3) for name, t in times.items()}


def measure(
    args: argparse.Namespace, max_rows: int | None, data: tuple[np.ndarray, torch.Tensor, torch.Tensor]
) -> dict[str, Any]:
    """One ``max_rows``: the step's shape, the three arms' medians, their ratios and the errors."""
    step = person_step(args, max_rows, data)
    pairs = baseline_pairs(step["persons"])
    ms = timed(
        {
            "before": lambda: baseline_step(step, pairs),
            "after": lambda: after_step(step),
            "row": lambda: row_step(step),
        },
        args.repeats,
    )
    persons = step["persons"]
    return {
        "max_rows": max_rows,
        "rows_per_configuration": step["mean_rows"],
        "width": int(persons.segments.shape[1]),
        "band": persons.band,
        "blocks": len(persons.blocks),
        "baseline_pairs": int(pairs[0].shape[1]),
        "baseline_blocks": len(pairs[3]),
        "ms_before": ms["before"],
        "ms_after": ms["after"],
        "ms_row": ms["row"],
        "speedup": round(ms["before"] / ms["after"], 2),
        "after_over_row": round(ms["after"] / ms["row"], 2),
        **errors(step, pairs),
    }


def render(report: dict[str, Any]) -> str:
    """The markdown table of a report."""
    lines = [
        f"Person-level step, K = {report['configurations']}, B = {report['batch']} people, dim {report['dim']}, "
        f"{report['classes']} classes, {report['machine']['cpu']}, {report['machine']['threads']} thread(s); "
        f"medians of {report['repeats']} interleaved repeats (ms per step).",
        "",
        "| max_rows | rows/config | band D | blocks | before (pairs) | after (tiles) | row-level "
        "| before/after | after/row | rel. error after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        shape = f"| {r['max_rows']} | {r['rows_per_configuration']:.0f} | {r['band']} | {r['blocks']} "
        times = f"| {r['ms_before']:.1f} | {r['ms_after']:.1f} | {r['ms_row']:.1f} "
        ratios = f"| {r['speedup']:.1f}× | {r['after_over_row']:.2f} | {r['after_max_rel_error']:.1e} |"
        lines.append(shape + times + ratios)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configurations", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--people", type=int, default=4000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--classes", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = population(args)
    report = {
        "configurations": args.configurations,
        "batch": args.batch,
        "people": args.people,
        "dim": args.dim,
        "classes": args.classes,
        "repeats": args.repeats,
        "machine": machine(),
        "results": [measure(args, max_rows, data) for max_rows in MAX_ROWS],
    }
    print(render(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
