"""What loading a workload would encode, found without encoding anything: the rows, the backbone, where
and in which precision, whether the feature cache already holds them, and how long encoding them would
take where this machine has measured it (what ``python -m dptune.search --dry-run`` says).

The estimate is the encoding speed in rows per second that :func:`dptune.data.features.choose_precision`
measured on this machine (its CPU, threads, device and torch) for this backbone on ``PROBE_ROWS`` rows of
the data it first encoded, and recorded with its choice. Without that measurement (nothing encoded here
yet, or a precision forced by ``DPTUNE_ENCODE_PRECISION``) a backbone of :data:`REFERENCE_ROWS_PER_S` gets
the range its speeds on reference machines span; any other is not estimated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dptune.data.features import (
    PRECISION_ENV,
    PROBE_ROWS,
    FeatureCache,
    candidate_precisions,
    encoding_device,
    recorded_precision,
    weights_digest,
)
from dptune.data.precision_choice import PrecisionChoice
from dptune.data.sources import RawDataset

#: Rows per second a backbone encoded on 2-core reference machines, slowest and fastest (bench/RESULTS.md):
#: MiniLM on 20 Newsgroups at 128 tokens, about 16 on an AVX2-only AMD EPYC (a cold ``make run`` of
#: 19 min 45 s, mostly encoding 18,821 texts) to 125 on an Intel Xeon with AMX (150 s for them).
REFERENCE_ROWS_PER_S: dict[str, tuple[float, float]] = {"minilm": (16.0, 125.0)}


@dataclass(frozen=True)
class PlannedEncoding:
    """What :func:`dptune.data.features.cached_features` would do for ``rows`` rows of ``dataset`` encoded by
    ``backbone`` (``modality`` text with ``max_tokens``, or images at ``image_size`` px) on ``device``.

    ``cached``: the precision of the cache entry that holds them (None: none does, they would be encoded);
    ``cache_checked``: False where the backbone's weights are identified only by loading its model, so the
    cache was not looked up. ``choice``: the precision recorded for this machine and backbone, or forced
    (None: measured among ``candidates`` on first use).
    """

    dataset: str
    backbone: str
    modality: str
    rows: int
    device: str
    max_tokens: int | None
    image_size: int | None
    cached: str | None
    cache_checked: bool
    choice: PrecisionChoice | None
    candidates: tuple[str, ...]

    @property
    def rows_per_s(self) -> float | None:
        """The recorded choice's measured speed (rows per second of wall time); None: not measured."""
        return None if self.choice is None else self.choice.rows_per_s.get(self.choice.precision)

    @property
    def seconds(self) -> float | None:
        """Estimated wall time (s) to encode the rows at :attr:`rows_per_s`, model loading not included;
        None where nothing is to encode or no speed was measured."""
        speed = self.rows_per_s
        return None if self.cached is not None or not speed else self.rows / speed

    def describe(self) -> str:
        """What a dry run says of the encoding, in one line."""
        shape = f"max_tokens {self.max_tokens}" if self.modality == "text" else f"{self.image_size} px"
        what = f"{self.rows:,} rows of {self.dataset} by {self.backbone} ({shape})"
        if self.cached is not None:
            return f"features: cached ({self.cached}), nothing to encode: {what}"
        cache = "not cached" if self.cache_checked else "cache not checked (the weights' digest needs the model)"
        if self.choice is None:
            precision = f"precision chosen on first use by timing {', '.join(self.candidates)} on {PROBE_ROWS} rows"
        else:
            precision = f"in {self.choice.precision} ({_chosen(self.choice)})"
        seconds, speed = self.seconds, self.rows_per_s
        reference = REFERENCE_ROWS_PER_S.get(self.backbone)
        if (seconds is None or speed is None) and reference is not None:
            slowest, fastest = reference
            estimate = (
                f"roughly {_duration(self.rows / fastest)} to {_duration(self.rows / slowest)}: no encoding speed is "
                f"recorded on this machine, and {self.backbone} encoded {slowest:.0f}–{fastest:.0f} rows/s on 2-core "
                "reference machines (AVX2-only to AMX; bench/RESULTS.md)"
            )
        elif seconds is None or speed is None:
            estimate = "time not estimated: no encoding speed is recorded on this machine for this backbone"
        else:
            estimate = (
                f"about {_duration(seconds)} at {speed:,.0f} rows/s, the speed this machine measured on "
                f"{PROBE_ROWS} probe rows when it chose the precision (loading the model not included)"
            )
        return f"features: {cache}; the search would encode {what} on the {self.device}, {precision}; {estimate}"


def planned_encoding(
    raw: RawDataset, rows: np.ndarray | None, backbone: str, *, max_tokens: int | None, image_size: int | None
) -> PlannedEncoding:
    """What encoding ``raw`` rows ``rows`` (None: every row) with ``backbone`` would take, as
    :func:`~dptune.data.features.cached_features` would look them up: no model is built, nothing encoded
    or written (the cache is read where it holds them)."""
    from dptune.models.backbones import get_backbone

    device = encoding_device()
    candidates = candidate_precisions(device, raw.modality)
    choice = recorded_precision(device, backbone, candidates)
    weights = weights_digest(backbone)
    cached = None
    if weights is not None:
        cache = FeatureCache.of(raw, rows, backbone, weights, max_tokens=max_tokens, image_size=image_size)
        precisions = [choice.precision] if choice is not None else candidates
        found = cache.find(precisions, get_backbone(backbone).feature_dim, load=False)
        cached = None if found is None else found[1]
    return PlannedEncoding(
        dataset=raw.name,
        backbone=backbone,
        modality=raw.modality,
        rows=len(raw.labels) if rows is None else len(np.unique(rows)),
        device=device.type,
        max_tokens=max_tokens,
        image_size=image_size,
        cached=cached,
        cache_checked=weights is not None,
        choice=choice,
        candidates=candidates,
    )


def encoding_summary(encoding: PlannedEncoding | None, peft: str) -> str:
    """What a dry run says of the features a search of ``peft`` would encode before its runs: ``encoding``
    as :func:`dptune.data.workload.planned_workload` found it, None where there are none to encode."""
    if encoding is not None:
        return f"dry run: {encoding.describe()}"
    if peft == "head":
        return "dry run: features: the dataset's own embeddings, nothing to encode"
    return f"dry run: no features to encode: peft {peft!r} trains the backbone on the rows' own inputs"


def _chosen(choice: PrecisionChoice) -> str:
    """Where ``choice`` comes from, in a few words."""
    return f"forced by {PRECISION_ENV}" if not choice.rows_per_s else "this machine's recorded choice"


def _duration(seconds: float) -> str:
    """``seconds`` rounded for a person: seconds below two minutes, else minutes, else hours."""
    if seconds < 120:
        return f"{max(seconds, 1):.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
