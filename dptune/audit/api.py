"""``dptune.audit(...)``: an empirical privacy audit of one cell's configurations, from a space or a
published model, written to its own folder (:mod:`dptune.audit.records`)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from dptune.audit.canaries import Canaries
from dptune.audit.records import AUDIT_FILES, summary_text, write_audit
from dptune.audit.run import RUNNERS, AuditError, Runner, run_audit
from dptune.contract import TrialConfig
from dptune.paths import probe_writable
from dptune.plan.schedule import coupled_learning_rate
from dptune.records.weights import CARD_JSON
from dptune.space import LoadedSpace, SearchSpace, load_space

if TYPE_CHECKING:  # the search's planning loads on the first audit, not on import
    from dptune.search.planning.cells import CellPlan

#: Canaries of an audit by default (Steinke et al. 2023 use 1,000 and up).
DEFAULT_CANARIES = 1000
#: The fewest canaries an audit takes: every one of 100 guesses right shows ε ≥ 2.3 at δ = 1e-5.
MIN_CANARIES = 100
#: A (C, B, η₀) configuration.
Configuration = tuple[float, int, float]


@dataclass(frozen=True)
class AuditReport:
    """A finished audit: its ``folder`` and ``rows`` (``audit.parquet``: one per configuration and
    threat model). ``str()`` is its summary."""

    folder: str
    rows: pd.DataFrame

    @property
    def epsilon_lower_bound(self) -> float:
        """The largest empirical ε lower bound of the audit's rows."""
        return float(self.rows["epsilon_lower_bound"].max())

    def __str__(self) -> str:
        return summary_text(self.rows)


def _middle(low: float | None, high: float | None, values: Sequence[float] | None) -> float:
    """The geometric middle of a range, or the middle of its values."""
    if values:
        return float(sorted(values)[len(values) // 2])
    assert low is not None and high is not None
    return math.sqrt(low * high)


def default_configuration(space: SearchSpace, batch_sizes: Sequence[int]) -> Configuration:
    """The middle of the space's ranges: geometric middles of C and η₀, the middle feasible B."""
    clip, rate = space.clip_bound, space.base_learning_rate
    return (
        _middle(clip.low, clip.high, clip.values),
        int(sorted(batch_sizes)[len(batch_sizes) // 2]),
        _middle(rate.low, rate.high, rate.values),
    )


def model_configuration(model: str | Path, space: SearchSpace) -> tuple[Configuration, float, int, str]:
    """(C, B, η₀), ε, E and the clipping rule of a published model's card (``model_card.json``), refused
    unless the model was trained on ``space``'s dataset with its optimizer."""
    card_path = Path(model) / CARD_JSON
    try:
        card = json.loads(card_path.read_text())
        config, privacy, dataset = card["configuration"], card["privacy"], card["data"]["dataset"]
        found = (
            (float(config["clip_bound"]), int(config["batch_size"]), float(config["base_learning_rate"])),
            float(privacy["epsilon"]),
            int(config["epochs"]),
            str(config["clipping"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise AuditError(f"--model {model}: no readable dptune model card ({card_path}): {error}") from error
    ours = {"dataset": space.task.dataset_name, "optimizer": space.training.optimizer}
    theirs = {"dataset": dataset, "optimizer": config.get("optimizer")}
    for key, value in ours.items():
        if theirs[key] != value:
            raise AuditError(
                f"--model {model} was trained with {key} {theirs[key]!r}, the space with {value!r}: "
                "audit it with the space it was searched with (--space)"
            )
    return found


def _positive(value: object) -> bool:
    """A finite number > 0 (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_request(configurations: Sequence[Configuration], canaries: int, confidence: float, seed: int | None) -> None:
    """Refuse bad values before any compute, naming what is allowed."""
    if not (isinstance(canaries, int) and canaries >= MIN_CANARIES):
        raise AuditError(
            f"canaries must be an integer ≥ {MIN_CANARIES} (with fewer, no outcome could show ε above about 2; "
            f"1,000 or more for a useful bound), got {canaries!r}"
        )
    if not (_positive(confidence) and 0.5 <= confidence < 1):
        raise AuditError(f"confidence must be in [0.5, 1), e.g. 0.95; got {confidence!r}")
    if seed is not None and not (isinstance(seed, int) and seed >= 0):
        raise AuditError(f"seed must be None (fresh coins) or an integer ≥ 0 (tests only), got {seed!r}")
    for configuration in configurations:
        clip_bound, batch_size, rate = configuration
        if not (_positive(clip_bound) and _positive(rate) and isinstance(batch_size, int) and batch_size >= 1):
            raise AuditError(
                f"configuration {configuration!r}: need a finite C > 0, an integer B ≥ 1 and a finite η₀ > 0"
            )


def check_out(folder: str) -> None:
    """Refuse an ``out`` an audit cannot own: a remote location (its secret coins would sit where access
    is not the owner's alone), an existing file, or a folder holding anything but an earlier audit's files
    (an audit's folder is its own; an earlier audit there is replaced)."""
    if "://" in folder:
        raise AuditError(
            f"--out {folder}: an audit's folder holds its secret inclusion coins; give a local folder (mode 0700)"
        )
    path = Path(folder)
    if path.exists() and (not path.is_dir() or any(p.name not in AUDIT_FILES for p in path.iterdir())):
        raise AuditError(
            f"--out {folder}: exists and is not an empty folder or an earlier audit's; an audit writes a folder "
            "of its own (its secret coins among its files): give a new or empty one"
        )
    probe_writable(folder, "--out")


def _config(base: TrialConfig, space: SearchSpace, configuration: Configuration) -> TrialConfig:
    """The trial config of (C, B, η₀) in ``base``'s cell, η coupled to B as the space couples it."""
    clip_bound, batch_size, rate = configuration
    coupling = space.coupling
    learning_rate = (
        coupled_learning_rate(rate, batch_size, coupling.reference_batch_size) if coupling.rule == "sqrt" else rate
    )
    return replace(
        base,
        clip_bound=float(clip_bound),
        batch_size=int(batch_size),
        base_learning_rate=float(rate),
        learning_rate=learning_rate,
    )


def _cell_plan(plans: Sequence[CellPlan], epsilon: float | None, epochs: int | None, clipping: str | None) -> CellPlan:
    """The first of a space's cell plans at ε, E and clipping rule (each None: any); ``AuditError`` naming
    the cells where none is."""
    for plan in plans:
        if (
            epsilon in (None, plan.cell.epsilon)
            and epochs in (None, plan.cell.epochs)
            and clipping in (None, plan.clipping)
        ):
            return plan
    cells = ", ".join(f"(ε {p.cell.epsilon:g}, E {p.cell.epochs}, {p.clipping})" for p in plans)
    raise AuditError(
        f"the space has no cell with ε {epsilon}, E {epochs} and clipping {clipping}; its cells are {cells}"
    )


def _progress(total: int, shown: bool) -> Callable[[float], None] | None:
    """A tqdm bar (stderr) of the runs trained, told by :func:`~dptune.runners.fused.run_fused`."""
    if not shown:
        return None
    bar = tqdm(total=total, desc="auditing", unit="run", file=sys.stderr, leave=False)

    def update(runs: float) -> None:
        bar.n = round(runs, 2)
        bar.refresh()

    return update


def audit(
    space: str | Path | LoadedSpace = "search_spaces/default.yaml",
    *,
    out: str | Path,
    overrides: Mapping[str, Any] | None = None,
    configurations: Sequence[Configuration] | None = None,
    model: str | Path | None = None,
    epsilon: float | None = None,
    epochs: int | None = None,
    canaries: int = DEFAULT_CANARIES,
    confidence: float = 0.95,
    runner: Runner = "fused",
    max_train_examples: int | None = None,
    max_eval_examples: int | None = None,
    seed: int | None = None,
    progress: bool = True,
) -> AuditReport:
    """Audit configurations of one cell of ``space`` empirically (docs/PRIVACY.md, "Auditing").

    The cell is (``epsilon``, ``epochs``), by default the space's first; ``configurations`` are (C, B, η₀)
    (default: the middle of the space's ranges, :func:`default_configuration`), or ``model`` a published
    model folder whose card gives (C, B, η₀), ε and E. They train once on the task's data with
    ``canaries`` canaries, each in with probability ½, through ``runner``: ``fused`` (all together, as a
    search of heads does) or ``trial`` (one at a time, with the space's ``training.engine``, FiLM or
    Opacus); ``max_train_examples`` and ``max_eval_examples`` cap the data as a search's flags of the same
    names do (quick runs and tests); each run's empirical ε
    lower bound at ``confidence`` under both threat models is written to ``out`` (its own folder: the
    canaries' inclusion coins are written there and nowhere else). ``seed`` fixes every coin (tests
    only: an audit's coins are fresh OS entropy otherwise). Raises :class:`AuditError` (or the space's
    ``SpaceError``) before any compute for bad input.
    """
    from dptune.data import load_workload
    from dptune.search.modes import mode_of
    from dptune.search.planning.cells import base_trial_config, task_workload

    clipping = None
    check_request(configurations or [], canaries, confidence, seed)
    for name, cap in (("max_train_examples", max_train_examples), ("max_eval_examples", max_eval_examples)):
        if cap is not None and not (isinstance(cap, int) and cap >= 1):
            raise AuditError(f"{name} must be an integer ≥ 1 (or None: every row), got {cap!r}")
    if runner not in RUNNERS:
        raise AuditError(f"runner {runner!r} is unknown; choose one of {', '.join(RUNNERS)}")
    spec = (space if isinstance(space, LoadedSpace) else load_space(space, dict(overrides or {}))).space
    if model is not None:
        configuration, epsilon, epochs, clipping = model_configuration(model, spec)
        configurations = [configuration]
    if spec.task.peft != "head":
        raise AuditError(
            f"the audit trains a linear head on cached features (peft 'head'), the threat models' canaries need it; "
            f"this space's task has peft {spec.task.peft!r}"
        )
    named = spec.cells()
    if named and not any(epsilon in (None, c.epsilon) and epochs in (None, c.epochs) for c in named):
        listed = ", ".join(f"(ε {c.epsilon:g}, E {c.epochs})" for c in named)
        raise AuditError(f"the space has no cell with ε {epsilon} and E {epochs}; its cells are {listed}")
    folder = str(out)
    check_out(folder)
    workload = load_workload(task_workload(spec, max_train_examples, max_eval_examples))
    plans = mode_of(spec).plan(spec, len(workload.train), progress=False)
    plan = _cell_plan(plans, epsilon, epochs, clipping)
    configurations = list(configurations or [default_configuration(spec, plan.feasible_batch_sizes)])
    too_large = [c for c in configurations if c[1] > len(workload.train)]
    if too_large:
        raise AuditError(f"batch size {too_large[0][1]} exceeds the {len(workload.train)} training rows")
    base = base_trial_config(spec, plan, max_train_examples, max_eval_examples)
    coins = np.random.SeedSequence(seed)
    seeds = coins.spawn(len(configurations) + 1)
    configs = [
        replace(_config(base, spec, c), seed=None if seed is None else int(s.generate_state(2, np.uint64)[0]))
        for c, s in zip(configurations, seeds, strict=False)
    ]
    drawn = Canaries.draw(workload, canaries, seeds[-1])
    runs = run_audit(configs, workload, drawn, confidence, runner, _progress(len(configs), progress))
    rows = write_audit(
        folder, runs, drawn.included, seeded=seed is not None, data_sha256=workload.provenance.get("data_sha256")
    )
    return AuditReport(folder=folder, rows=rows)
