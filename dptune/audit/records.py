"""What an audit writes to its folder, each file whole or not at all (``dptune.paths.write_file_atomic``):

- ``audit.parquet``: one row per audited configuration and threat model (:data:`AUDIT_COLUMNS`): the
  configuration, the claimed (ε, δ) and mechanism (σ, q, T), m, the best guessing (score, r, v), the
  empirical ε lower bound at its confidence, the claim's p-value, the theorem's ceiling for m and δ,
  and whether the claim is refuted;
- ``canaries.parquet``: every canary of every configuration, its inclusion coin and its scores: the
  audit's secret, written here and nowhere else;
- ``audit.json``: the rows of ``audit.parquet``, the notes, whether the coins were fresh or a test's
  seed's and the digest of the data trained on, for :mod:`dptune.report` and a card's citation;
- ``summary.txt``: the one screen :func:`summary_text` prints;
- ``scores.png``: each threat model's canary scores, in-canaries against out-canaries.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dptune.audit.run import AuditedRun
from dptune.paths import write_file_atomic

AUDIT_FILE, CANARIES_FILE, SUMMARY_JSON, SUMMARY_TEXT, FIGURE = (
    "audit.parquet",
    "canaries.parquet",
    "audit.json",
    "summary.txt",
    "scores.png",
)
#: Every file an audit writes: an earlier audit's folder (these files only) may be given again, and is replaced.
AUDIT_FILES = frozenset({AUDIT_FILE, CANARIES_FILE, SUMMARY_JSON, SUMMARY_TEXT, FIGURE})
#: The columns of ``audit.parquet``.
AUDIT_COLUMNS = (
    "clip_bound",
    "batch_size",
    "base_learning_rate",
    "learning_rate",
    "epochs",
    "epsilon",
    "delta",
    "noise_multiplier",
    "sample_rate",
    "steps",
    "status",
    "val_accuracy",
    "threat_model",
    "canaries",
    "score",
    "sides",
    "guesses",
    "correct",
    "confidence",
    "epsilon_lower_bound",
    "claim_p_value",
    "ceiling",
    "claim_refuted",
)
#: What an audit shows and does not (docs/PRIVACY.md, "Auditing"), in every summary.
NOTES = (
    "Empirical lower bounds: where the mechanism is (ε, δ)-DP, all of this audit's bounds stay below ε "
    "together but with probability 1 − confidence. A bound above the claim proves a bug; one below it proves "
    "only that this audit found none.",
    "White-box: gradient canaries of norm C on coordinates no training row touches, every step's released "
    "gradient read (they test the noise, not the clipping). Black-box: out-of-distribution input canaries, "
    "clipped by the engine, scored by the final model's loss.",
    "The audit's training spends its own (ε, δ) on the data: its model is never published.",
)


def audit_rows(runs: Sequence[AuditedRun]) -> pd.DataFrame:
    """One row per run and threat model (:data:`AUDIT_COLUMNS`)."""
    rows = []
    for run in runs:
        config, result = run.config, run.result
        for threat, bound in run.bounds.items():
            rows.append(
                {
                    "clip_bound": config.clip_bound,
                    "batch_size": config.batch_size,
                    "base_learning_rate": config.base_learning_rate,
                    "learning_rate": config.learning_rate,
                    "epochs": config.epochs,
                    "epsilon": config.epsilon,
                    "delta": config.delta,
                    "noise_multiplier": result.noise_multiplier,
                    "sample_rate": result.sample_rate,
                    "steps": result.steps_taken,
                    "status": result.status,
                    "val_accuracy": result.val_accuracy,
                    "threat_model": threat,
                    "canaries": bound.canaries,
                    "score": bound.best.score,
                    "sides": bound.best.sides,
                    "guesses": bound.best.guesses,
                    "correct": bound.best.correct,
                    "confidence": bound.confidence,
                    "epsilon_lower_bound": bound.epsilon_lower_bound,
                    "claim_p_value": bound.claim_p_value,
                    "ceiling": bound.ceiling,
                    "claim_refuted": bound.claim_refuted,
                }
            )
    return pd.DataFrame(rows, columns=list(AUDIT_COLUMNS))


def canary_rows(runs: Sequence[AuditedRun], included: np.ndarray) -> pd.DataFrame:
    """Every canary of every run: ``configuration`` (its position), ``canary``, ``included`` and one
    column per threat model and score (``white-box:sum`` …)."""
    frames = []
    for position, run in enumerate(runs):
        frame = {"configuration": position, "canary": np.arange(len(included)), "included": included}
        for threat, named in run.scores.items():
            frame.update({f"{threat}:{name}": values for name, values in named.items()})
        frames.append(pd.DataFrame(frame))
    return pd.concat(frames, ignore_index=True)


def _parquet(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), buffer)
    return buffer.getvalue()


def _finite(value: Any) -> Any:
    """JSON's value of a table cell (NaN: null; numpy scalars: Python's)."""
    if isinstance(value, np.generic):
        value = value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else value


def summary_text(rows: pd.DataFrame) -> str:
    """The one screen of an audit: a line per run and threat model, then the notes."""
    lines = []
    for row in rows.itertuples():
        verdict = "REFUTED: the mechanism is broken" if row.claim_refuted else "below the claim"
        if row.ceiling <= row.epsilon:
            verdict += f" (this audit cannot refute ε = {row.epsilon:g} even with every guess right)"
        lines.append(
            f"{row.threat_model}: empirical ε lower bound {row.epsilon_lower_bound:.3f} "
            f"({row.confidence:.0%} confidence) vs claimed (ε, δ) = ({row.epsilon:g}, {row.delta:g}): {verdict}. "
            f"C = {row.clip_bound:.4g}, B = {row.batch_size}, η₀ = {row.base_learning_rate:.3g}, E = {row.epochs}, "
            f"σ = {row.noise_multiplier:.4g}; m = {row.canaries} canaries, {row.correct} of {row.guesses} "
            f"guesses ({row.sides}) right by {row.score}; with every guess right it would show ε ≥ {row.ceiling:.2f}; "
            f"p-value of the claim {row.claim_p_value:.2g}"
        )
    return "\n".join([*lines, "", *NOTES]) + "\n"


def score_figure(runs: Sequence[AuditedRun], included: np.ndarray) -> bytes:
    """PNG: the first run's canary scores per threat model (its best score), in against out."""
    from matplotlib.figure import Figure

    run = runs[0]
    threats = list(run.bounds)
    figure = Figure(figsize=(5.0 * len(threats), 3.4), layout="constrained")
    for axes, threat in zip(np.atleast_1d(figure.subplots(1, len(threats))), threats, strict=True):
        bound = run.bounds[threat]
        values = run.scores[threat][bound.best.score]
        finite = np.isfinite(values)
        if finite.any():
            bins = np.histogram_bin_edges(values[finite], bins=40)
            axes.hist(values[included & finite], bins=bins, alpha=0.6, label=f"in ({included.sum()})")
            axes.hist(values[~included & finite], bins=bins, alpha=0.6, label=f"out ({(~included).sum()})")
            axes.legend()
        else:
            axes.text(0.5, 0.5, "no finite score: the run diverged", ha="center", transform=axes.transAxes)
        axes.set_title(f"{threat}: ε ≥ {bound.epsilon_lower_bound:.2f} (claimed {bound.claimed_epsilon:g})")
        unit = "−loss of the final model" if threat == "black-box" else f"{bound.best.score} of the released updates"
        axes.set_xlabel(f"score: {unit}")
        axes.set_ylabel("canaries")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def write_audit(
    folder: str, runs: Sequence[AuditedRun], included: np.ndarray, *, seeded: bool, data_sha256: str | None
) -> pd.DataFrame:
    """Write the audit's files (module docstring) to ``folder``, ``audit.json`` last (a folder with it is
    whole); ``seeded``: the coins came from a test's seed (not secret), ``data_sha256``: the digest of the
    data the audit trained on. Returns ``audit.parquet``'s rows."""
    rows = audit_rows(runs)
    os.makedirs(folder, mode=0o700, exist_ok=True)  # local (``check_out``): the owner's alone, it holds the coins
    os.chmod(folder, 0o700)
    (Path(folder) / SUMMARY_JSON).unlink(missing_ok=True)  # an earlier audit's, replaced: whole again only at the end
    write_file_atomic(folder, CANARIES_FILE, _parquet(canary_rows(runs, included)))
    write_file_atomic(folder, AUDIT_FILE, _parquet(rows))
    write_file_atomic(folder, FIGURE, score_figure(runs, included))
    write_file_atomic(folder, SUMMARY_TEXT, summary_text(rows).encode())
    records = [{k: _finite(v) for k, v in row.items()} for row in rows.to_dict("records")]
    summary = {
        "rows": records,
        "notes": list(NOTES),
        "figure": FIGURE,
        "coins": "seeded (a test's: not secret)" if seeded else "fresh",
        "data_sha256": data_sha256,
    }
    write_file_atomic(folder, SUMMARY_JSON, json.dumps(summary, indent=1, ensure_ascii=False).encode())
    return rows
