"""A finished search of N runs (default 100,000) written as a real search leaves it, then what comes after
the compute measured on it: ``--resume`` of the finished search, the finishing step (composition, search
rows, models, summary, report), ``python -m dptune.report``, and the folder's files (issue 51, item 3).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_scale.py [--runs 2000 8000 32000 100000] [--bulk]
        [--root DIR | --root s3://BUCKET/PREFIX --moto] [--slots 2] [--timeout 600] [--profile] [--keep]
        [--reuse --root DIR] [--json OUT]

How the folder is built (no training, no Ray): a space derived from ``search_spaces/default.yaml`` (20 Newsgroups
on cached MiniLM features, DP linear head, fused runner, 4 (ε, E) cells, 7 batch sizes, diagnostics on) with
2 replicates (doubled while a cell would need more than 10,000 configurations: 4 at 100,000 runs) and
``sampler.trials_per_cell`` = N / (cells × replicates), written beside the results. Everything but the numbers
is dptune's own: the workload and the plan (``SearchMode.plan``: σ calibrated by the planner), the cell
contexts (``SearchMode.cell_context``), the folder's lease and manifest, each cell's sampler
(``CellSampler(cell_spec(...))``) asked one Tune unit at a time (``unit_size`` for ``--slots`` trial slots), the
unit's runs and ids (``unit_runs``), their start entries (``charge_runs``: one start file per unit), the fused
runner's groups (``plan_groups``) and, per group, ``write_results`` (one end file per group, then every run's
weights and rows), then, where dptune compacts, the unit's ``compact_records`` as ``run_configurations`` ends.
``--bulk`` (needs compaction): each unit's rows go straight into the compacted file per table its compaction
would write (compaction's own writer), the end files and weights as ``write_results`` writes them, then the
unit's ``compact_records``: the same folder without writing and deleting every single part (about 2.5× faster).
Synthetic: each run's :class:`TrialResult` (accuracies from a smooth function of (ε, E, C, B, η₀) plus noise,
losses, per-class accuracies, three diagnostics records of 256 probe gradient norms on a fixed probe's labels,
a random head as its weights); ``steps_taken`` = T and ``epsilon_spent`` = ``privacy.epsilon_spent`` of the
run's own mechanism. Not written: Ray Tune's experiment folder (``_tune/``, about 5 files per Tune trial; a
finished search's resume does not read it).

What is measured, each in its own process (wall and CPU seconds and peak RSS from ``/usr/bin/time``; the
1-minute load average before and after, since the machine may be shared):

- ``finish``: the driver's own phases of a ``--resume`` whose runs are all recorded (``driver.load``,
  ``check``, ``plan``, ``finish``) under the folder's lease, without the Tune run (it would find nothing to run);
  ``finish`` split by wrapping the functions it calls: the compaction, the ``trials`` read, the ledger
  (``charged_runs``), the composition (``composition_cost``), the ``search`` rows, the models (``publish``), the
  summary and the report (wall and CPU seconds, and the peak RSS after each). It writes the ``search`` rows: the
  folder is then a finished search.
- ``resume``: ``python -m dptune.search --space X --storage ROOT --name NAME --resume --no-report``, and
  ``resume+report``: the same with its report (the whole command a user runs).
- ``report``: ``python -m dptune.report RESULTS --out DIR``.
- ``files``: the file count and bytes of each top-level folder of the results.

``--profile`` runs the resume and the report once more under cProfile (top 25 by cumulative time in the logs
and the JSON). ``--reuse`` measures a folder built before under ``--root`` again (its finishing step undone).
The accounting cache (``DPTUNE_CACHE_DIR``) is a fresh folder per N (its ``features`` linked to the user's, so
no encoding): the composition is computed, not read back. A measured command is killed after ``--timeout``
seconds or when its processes hold more than ``MAX_RSS_GIB``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
#: The space the benchmark scales: the shipped default, with its trials per cell set from N.
BASE_SPACE = REPO / "search_spaces" / "default.yaml"
#: The search's name (a folder under ``--root``), per N.
NAME = "scale-{runs}"
#: Budgets of issue 51, item 3.
BUDGETS = {"resume_s": 30.0, "finish_s": 180.0, "peak_rss_gib": 4.0, "files": 5000}


# --------------------------------------------------------------------------- the space


#: The most ``sampler.trials_per_cell`` a space may ask for (``dptune.space``'s bound).
MAX_TRIALS_PER_CELL = 10_000


def write_space(folder: Path, runs: int, replicates: int = 2) -> tuple[Path, int]:
    """Write the benchmark's space for about ``runs`` runs into ``folder``: the default space with
    ``trials_per_cell`` = ⌈runs / (cells × replicates)⌉, ``replicates`` doubled while that is over the
    space's bound (100,000 runs: 4 replicates of 6,250 configurations per cell). Returns its path and the
    runs it plans."""
    space = yaml.safe_load(BASE_SPACE.read_text())
    cells = len(space["privacy"]["epsilons"]) * len(space["epochs"])
    while math.ceil(runs / (cells * replicates)) > MAX_TRIALS_PER_CELL:
        replicates *= 2
    per_cell = max(1, math.ceil(runs / (cells * replicates)))
    space.update(name=NAME.format(runs=runs), replicates=replicates)
    space["description"] = f"bench_scale: {per_cell * cells * replicates} synthetic runs of the default space"
    space["sampler"] = {**space["sampler"], "trials_per_cell": per_cell}
    path = folder / f"scale_{runs}.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path, per_cell * cells * replicates


# --------------------------------------------------------------------------- synthetic results


@dataclass
class Synthetic:
    """Plausible values for the runs of one workload: one generator, the probe's labels and the model's
    provenance (each run draws its own numbers)."""

    workload: Any
    seed: int = 0
    rng: np.random.Generator = field(init=False)
    probe_labels: np.ndarray = field(init=False)
    probe_classes: list[np.ndarray] = field(init=False)
    provenance: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        from dptune.runners.common import model_provenance

        self.rng = np.random.default_rng(self.seed)
        labels = self.workload.train.tensors[1].numpy()
        count = min(256, len(labels))
        self.probe_labels = labels[np.random.default_rng(0).choice(len(labels), count, replace=False)]
        self.probe_classes = [np.flatnonzero(self.probe_labels == c) for c in range(self.workload.num_classes)]
        self.provenance = model_provenance(self.workload)

    def class_records(self, norms: np.ndarray, clip_bound: float) -> list[Any]:
        """Per-class diagnostics of the probe's gradient ``norms`` at C = ``clip_bound`` (quantiles by the
        nearest rank, computed for every class at once)."""
        from dptune.contract import ClassDiagnostics
        from dptune.records.schemas import QUANTILES

        order = np.lexsort((norms, self.probe_labels))  # by class, then by norm
        ranked, counts = norms[order], np.bincount(self.probe_labels, minlength=len(self.probe_classes))
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        present = np.flatnonzero(counts)
        positions = starts[present, None] + np.floor(
            np.array([0.05, 0.25, 0.5, 0.75, 0.95])[None, :] * (counts[present, None] - 1)
        ).astype(int)
        quantiles = ranked[positions].tolist()
        clipped = np.add.reduceat(ranked > clip_bound, starts[present]) / counts[present]
        retained = np.add.reduceat(np.minimum(1.0, clip_bound / ranked), starts[present]) / counts[present]
        return [
            ClassDiagnostics(
                label=int(label),
                examples=int(counts[label]),
                grad_norm_quantiles=dict(zip(QUANTILES, quantiles[i], strict=True)),
                clipped_fraction=float(clipped[i]),
                retention_weight=float(retained[i]),
            )
            for i, label in enumerate(present)
        ]

    def result(self, config: Any, epsilon_spent: float) -> Any:
        """A finished ``ok`` :class:`TrialResult` of ``config`` (its mechanism's σ, q, T; every step taken)."""
        from dptune.contract import Diagnostics, EpochMetrics, TrainedModel, TrialResult
        from dptune.runners.common import diagnostic_epochs
        from dptune.runners.fused_group import FUSED_ENGINE

        rng, workload, mechanism = self.rng, self.workload, config.mechanism
        classes, dim = workload.num_classes, workload.feature_dim
        ceiling = 0.55 + 0.08 * math.log10(config.epsilon) + 0.02 * math.log2(config.epochs / 5)
        misfit = 0.05 * math.log10(config.learning_rate / 0.003) ** 2 + 0.02 * math.log10(config.clip_bound / 0.1) ** 2
        val = float(np.clip(ceiling - misfit + rng.normal(0, 0.01), 0.05, 0.95))
        test = float(np.clip(val - 0.01 + rng.normal(0, 0.008), 0.0, 1.0))
        loss = float(1.0 + 2.0 * (1 - val) + rng.normal(0, 0.05))
        steps = np.cumsum(mechanism.epoch_steps)
        epochs = [
            EpochMetrics(
                epoch=e,
                steps=int(steps[e - 1]),
                train_loss=loss + 0.5 / e,
                val_loss=loss + 0.4 / e + 0.05,
                val_accuracy=val - 0.15 / e + 0.15 / config.epochs,
                wall_time_s=0.015,
                examples_per_s=7.0e5,
                test_accuracy=test if e == config.epochs else None,
            )
            for e in range(1, config.epochs + 1)
        ]
        per_class = np.clip(val + rng.normal(0, 0.12, classes), 0, 1)
        diagnostics = []
        probe_epochs = diagnostic_epochs(config.epochs) if config.diagnostics else []
        for epoch in probe_epochs:
            norms = rng.lognormal(math.log(2.0) - 0.3 * epoch / config.epochs, 0.25, len(self.probe_labels))
            diagnostics.append(
                Diagnostics(
                    epoch=epoch,
                    clip_bound=config.clip_bound,
                    noise_multiplier=mechanism.noise_multiplier,
                    dimension=classes * (dim + 1),
                    grad_norms=norms,  # arrays, not lists: the same rows, without asdict copying each float
                    labels=self.probe_labels,
                    mse_bias=float(rng.uniform(0.01, 0.1)),
                    mse_variance=float(rng.uniform(0.001, 0.01)),
                    optimal_clip_bound=float(rng.uniform(0.05, 0.5)),
                    # per class on the last record only: the rows keep the last record's (records.rows)
                    classes=self.class_records(norms, config.clip_bound) if epoch == probe_epochs[-1] else [],
                    expected_batch_size=mechanism.expected_batch_size,
                    wall_time_s=0.004,
                )
            )
        head = (rng.standard_normal((classes, dim + 1)) * 0.05).astype(np.float32)
        return TrialResult(
            config=config,
            status="ok",
            noise_multiplier=mechanism.noise_multiplier,
            sample_rate=mechanism.sample_rate,
            steps=mechanism.steps,
            steps_taken=mechanism.steps,
            epsilon_spent=epsilon_spent,
            num_train=len(workload.train),
            num_val=len(workload.val),
            num_test=len(workload.test),
            num_classes=classes,
            trainable_parameters=classes * (dim + 1),
            val_accuracy=val,
            test_accuracy=test,
            train_loss=loss,
            wall_time_s=0.3,
            examples_per_s=7.0e5,
            diagnostics_wall_time_s=0.012,
            device="cpu",
            engine=FUSED_ENGINE,
            epochs=epochs,
            class_accuracy={c: float(a) for c, a in enumerate(np.clip(per_class - 0.01, 0, 1))},
            class_val_accuracy={c: float(a) for c, a in enumerate(per_class)},
            class_names=dict(enumerate(workload.class_names)),
            diagnostics=diagnostics,
            trained=TrainedModel(
                parameters={"weight": head[:, :-1].copy(), "bias": head[:, -1].copy()},
                provenance=self.provenance,
                logits="augmented",
            ),
        )


# --------------------------------------------------------------------------- the folder


def _compaction() -> Any:
    """dptune's compaction module where this dptune has one (``records.compaction``), else None."""
    try:
        from dptune.records import compaction
    except ImportError:
        return None
    return compaction


def build(space_path: Path, root: str, name: str, slots: int, bulk: bool = False) -> dict[str, Any]:
    """Write the finished runs of the search ``space_path`` plans under ``<root>/<name>`` as its units would:
    per unit one start file (``charge_runs``), per fused group one end file and each run's weights and rows
    (``write_results``), then, where dptune compacts, the unit's compaction (``compact_records`` of its trial
    ids, as ``run_configurations`` ends). No ``search`` rows. Returns what it wrote.

    ``bulk`` (needs compaction): each unit's rows go straight into one compacted file per table (the file its
    compaction would write from the single parts, written by the same function), the end files and weights as
    ``write_results`` writes them; then the unit's compaction as above (it bundles the weights and merges the
    tables' files by tiers). No single part is written and deleted: a folder the same as the real one, faster."""
    from dptune.data import load_workload
    from dptune.privacy import epsilon_spent
    from dptune.runners.fused import FUSED_MEMORY_BYTES, plan_groups
    from dptune.search import preflight
    from dptune.search.driver import _results_root
    from dptune.search.modes import mode_of
    from dptune.search.planning.cells import cell_spec, task_workload, unit_size
    from dptune.search.planning.sampler import CellSampler
    from dptune.search.runs.execution import FinishedRun, charge_runs, record_pruned, unit_runs, write_results
    from dptune.space import load_space

    compaction = _compaction()
    if bulk and compaction is None:
        raise SystemExit("bench_scale: --bulk needs dptune.records.compaction, which this dptune does not have")
    started = time.perf_counter()
    loaded = load_space(space_path)
    space, mode = loaded.space, mode_of(loaded.space)
    results_root = _results_root(root, name)
    runs_root = mode.runs_root(results_root)
    workload = load_workload(task_workload(space, None, None))
    num_train = len(workload.train)
    plans = mode.prepare(runs_root, mode.plan(space, num_train, progress=False))
    synthetic = Synthetic(workload)
    counts = {"runs": 0, "units": 0, "groups": 0, "pruned": 0}
    seconds = {"results": 0.0, "compaction": 0.0}
    with mode.guards(runs_root, "bench_scale --root") as token:
        search_id = preflight.folder_search_id(runs_root, loaded, name, resume=False)
        preflight.write_manifest(runs_root, loaded, name, search_id)
        for plan in plans:
            context = mode.cell_context(space, plan, None, None, runs_root, search_id, True, None, token)
            sampler = CellSampler(cell_spec(space, plan))
            size = unit_size(space, plan, slots, fused=True)

            def pruned(params: dict[str, Any], context: Any = context) -> None:
                record_pruned(context, params, num_train, space.min_steps)
                counts["pruned"] += 1

            left = plan.configurations
            while left > 0:
                configurations = sampler.ask(min(size, left), pruned)
                if not configurations:
                    break
                left -= len(configurations)
                runs = unit_runs(context, configurations)
                run_ids = charge_runs(context, runs)
                tick = time.perf_counter()
                unit: list[Any] = []
                for group in plan_groups([run.config for run in runs], workload, FUSED_MEMORY_BYTES):
                    mechanism = group.mechanism
                    spent = epsilon_spent(
                        mechanism.noise_multiplier, mechanism.sample_rate, mechanism.steps, mechanism.delta
                    )
                    finished = [
                        FinishedRun(runs[i], synthetic.result(runs[i].config, spent), run_ids[i]) for i in group.members
                    ]
                    if bulk:
                        _record_group(context, finished)
                        unit += finished
                    else:
                        write_results(context, finished, ledger=True)
                    counts["groups"] += 1
                if bulk:
                    _write_unit_compacted(context, unit, compaction)
                seconds["results"] += time.perf_counter() - tick
                tick = time.perf_counter()
                if compaction is not None:
                    compaction.compact_records(runs_root, [run.trial_id for run in runs])
                seconds["compaction"] += time.perf_counter() - tick
                counts["runs"] += len(runs)
                counts["units"] += 1
                print(f"\r  built {counts['runs']} runs ({time.perf_counter() - started:.0f} s)", end="", flush=True)
    print(flush=True)
    return {
        **counts,
        "search_id": search_id,
        "results_root": results_root,
        "compacted": compaction is not None,
        "bulk": bulk,
        "seconds": time.perf_counter() - started,
        "results_s": seconds["results"],
        "compaction_s": seconds["compaction"],
    }


def _record_group(context: Any, finished: list[Any]) -> None:
    """What ``write_results`` writes of a fused group but its rows: its end file, then each run's weights."""
    from dptune.records.ledger import record_ends
    from dptune.records.weights import write_weights
    from dptune.search.runs.execution import end_entries

    record_ends(context.results_root, end_entries(finished))
    for run in finished:
        if run.result.trained is not None:
            write_weights(context.results_root, run.spec.trial_id, run.result.trained)


def _write_unit_compacted(context: Any, finished: list[Any], compaction: Any) -> None:
    """The rows of a unit's runs (``execution.run_rows``, as ``write_results`` makes them) as one compacted file
    per table, written by compaction's own writer at the table's next sequence number; ``trials`` last."""
    import pyarrow as pa

    from dptune.records import ResultsStore
    from dptune.records.schemas import SCHEMAS
    from dptune.search.runs.execution import run_rows

    rows: dict[str, list[dict[str, Any]]] = {}
    for run in finished:
        for table, table_rows in run_rows(context, run).items():
            rows.setdefault(table, []).extend(table_rows)
    store = ResultsStore(context.results_root, cache=None)
    for table in sorted(rows, key=lambda name: name == "trials"):
        data = pa.Table.from_pylist(rows[table], schema=SCHEMAS[table])
        compaction._write_merged(store, table, [data], store.table_files(table).next_seq())


# --------------------------------------------------------------------------- the finishing step, timed


def finish_harness(space_path: Path, root: str, name: str, out: Path) -> None:
    """The driver's phases of ``--resume`` on a folder whose runs are all recorded, without the Tune run
    (``load``, ``check``, ``plan``, ``finish``), each timed, ``finish`` split by wrapping what it calls;
    the timings and the peak RSS after each phase go to ``out`` (JSON)."""
    from dptune.search import driver, finished
    from dptune.search.finish import outcome
    from dptune.search.modes import cells
    from dptune.search.options import SearchOptions

    phases: dict[str, float] = {}
    cpu: dict[str, float] = {}
    peaks: dict[str, float] = {}

    def timed(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - start
                cpu[label] = cpu.get(label, 0.0) + time.process_time() - start_cpu
                peaks[label] = _self_peak_gib()

        return wrapper

    if hasattr(driver, "compact_records"):
        driver.compact_records = timed("finish: compaction", driver.compact_records)
    driver.read_table = timed("finish: read trials", driver.read_table)
    driver.charged_runs = timed("finish: ledger (charged_runs)", driver.charged_runs)
    outcome.composition_cost = timed("finish: composition (composition_cost)", outcome.composition_cost)
    cells.CellSearch.search_rows = timed("finish: search rows (with composition)", cells.CellSearch.search_rows)
    cells.CellSearch.publish = timed("finish: models (publish)", cells.CellSearch.publish)
    finished.summary_text = timed("finish: summary", finished.summary_text)
    finished.build_report_at = timed("finish: report", finished.build_report_at)
    options = SearchOptions(
        space_path=space_path,
        storage=root,
        name=name,
        address=None,
        resume=True,
        dry_run=False,
        report=True,
        overrides={},
        max_train_examples=None,
        max_eval_examples=None,
    )
    session = timed("load", driver.load)(options)
    with session.mode.guards(session.runs, "bench_scale") as token:
        session.lease_token = token
        if not timed("check (results folder, ledger)", driver.check)(session):
            raise SystemExit("bench_scale: the search is finished already; the finishing step was not measured")
        timed("plan (workload, σ)", driver.plan)(session)
        timed("finish", driver.finish)(session)
    out.write_text(json.dumps({"phases": phases, "cpu_s": cpu, "peak_rss_gib_after": peaks}, indent=1))


def _self_peak_gib() -> float:
    """This process's peak RSS so far (GiB): ``VmHWM``, which ``exec`` resets (``ru_maxrss`` does not)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# --------------------------------------------------------------------------- measuring


@dataclass
class Measured:
    """One command's wall seconds, peak RSS (GiB, that process and the children it waited for), exit status."""

    label: str
    wall_s: float
    peak_rss_gib: float
    returncode: int
    log: str
    timed_out: bool = False
    cpu_s: float | None = None  # user + system CPU seconds of the command (its own load, not the machine's)
    load: tuple[float, float] = (0.0, 0.0)  # the 1-minute load average when it started and when it ended
    phases: dict[str, float] = field(default_factory=dict)


def group_rss_gib(group: int) -> float:
    """The summed RSS (GiB) of the live processes of process group ``group`` (from ``/proc``)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:  # pgrp
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # rss, pages
    return total / 2**30


#: Kill a measured command whose process group holds more than this (GiB): the machine is shared.
MAX_RSS_GIB = 10.0


def measure(label: str, command: list[str], env: dict[str, str], log: Path, timeout: float) -> Measured:
    """Run ``command`` (its own process group) under ``/usr/bin/time``: its wall time and peak RSS.

    The peak comes from ``/usr/bin/time`` (GNU time's ``%M``), not from this process's ``os.wait4``: a child
    forked from this large process starts with its pages, and ``ru_maxrss`` keeps that high-water mark
    across ``exec``. Without ``/usr/bin/time``, ``os.wait4``'s figure is kept (an upper bound)."""
    print(f"  {label}: {' '.join(command)}", flush=True)
    usage_file = log.with_suffix(".time")
    timer = ["/usr/bin/time", "-o", str(usage_file), "-f", "%M %U %S"] if Path("/usr/bin/time").exists() else []
    load_before = os.getloadavg()[0]
    with open(log, "w") as sink:
        start = time.perf_counter()
        process = subprocess.Popen(
            [*timer, *command], stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        timed_out = False
        polls = 0
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            polls += 1
            too_big = polls % 10 == 0 and group_rss_gib(process.pid) > MAX_RSS_GIB
            if (time.perf_counter() - start > timeout or too_big) and not timed_out:
                timed_out = True
                print(f"    killed: {'over ' + str(MAX_RSS_GIB) + ' GiB' if too_big else 'timed out'}", flush=True)
                os.killpg(process.pid, signal.SIGKILL)
            time.sleep(0.05)
        wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    peak_kib, cpu = usage.ru_maxrss, None
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = usage_file.read_text().split()[-3:]  # a killed command's file has a note first
        peak_kib, cpu = int(fields[0]), float(fields[1]) + float(fields[2])
    result = Measured(
        label, wall, peak_kib / 2**20, process.returncode, str(log), timed_out, cpu, (load_before, os.getloadavg()[0])
    )
    print(
        f"    {wall:.1f} s ({cpu or 0:.1f} s CPU, load {load_before:.1f}), peak {result.peak_rss_gib:.2f} GiB, "
        f"exit {result.returncode}" + (" (KILLED)" if timed_out else ""),
        flush=True,
    )
    return result


def folder_files(results_root: str) -> dict[str, dict[str, int]]:
    """Files and bytes per top-level entry of ``results_root`` (a folder's whole subtree; ``.`` the files
    directly in it), through pyarrow's file system (a path or a URI)."""
    import pyarrow.fs as pafs

    from dptune.paths import filesystem

    fs, path = filesystem(results_root)
    base = path.rstrip("/")
    found: dict[str, dict[str, int]] = {}
    for info in fs.get_file_info(pafs.FileSelector(base, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        relative = info.path[len(base) + 1 :]
        top = relative.split("/", 1)[0] if "/" in relative else "."
        entry = found.setdefault(top, {"files": 0, "bytes": 0})
        entry["files"] += 1
        entry["bytes"] += info.size or 0
    return dict(sorted(found.items()))


@contextlib.contextmanager
def moto_bucket(root: str) -> Iterator[None]:
    """An S3-compatible server (moto) on loopback with ``root``'s bucket, in this process's environment
    (the measured commands inherit it)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="dptune-bench",
        AWS_SECRET_ACCESS_KEY="dptune-bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket=root[5:].split("/", 1)[0])
    try:
        yield
    finally:
        server.stop()


def cold_cache(folder: Path) -> Path:
    """A fresh ``DPTUNE_CACHE_DIR`` whose ``features`` is the user's (no encoding; accounting computed anew)."""
    from dptune.paths import cache_dir

    features = cache_dir("features")
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (folder / "features").symlink_to(features, target_is_directory=True)
    return folder


def profile(label: str, command: list[str], env: dict[str, str], logs: Path, timeout: float) -> list[str]:
    """Run the ``python -m MODULE ...`` ``command`` again under cProfile (its times inflated by the profiler);
    the 25 functions of largest cumulative time, also written to ``<logs>/<label>.profile.txt``."""
    import pstats

    stats_file = logs / f"{label}.prof"
    measure(
        f"{label} (cProfile)",
        [command[0], "-m", "cProfile", "-o", str(stats_file), *command[1:]],
        env,
        logs / f"{label}.profile.log",
        timeout,
    )
    if not stats_file.exists():
        return []
    text = logs / f"{label}.profile.txt"
    with open(text, "w") as sink:
        pstats.Stats(str(stats_file), stream=sink).sort_stats("cumulative").print_stats(25)
    return text.read_text().splitlines()


def unfinish(results_root: str) -> None:
    """Take a finished search built here back to all runs recorded and nothing finished: remove what the
    finishing step writes (its ``search`` and ``release`` rows, models and report)."""
    from dptune.paths import filesystem

    fs, path = filesystem(results_root)
    for folder in ("search", "release", "models", "report"):
        with contextlib.suppress(FileNotFoundError, OSError):
            fs.delete_dir(f"{path.rstrip('/')}/{folder}")


def bench_one(
    runs: int,
    root: str,
    work: Path,
    slots: int,
    timeout: float,
    profiled: bool,
    bulk: bool = False,
    reuse: bool = False,
) -> dict[str, Any]:
    """Build the folder of ``runs`` runs and measure everything on it (``profiled``: then the resume and the
    report again under cProfile; ``reuse``: a folder this benchmark built under ``root`` before is measured
    again, its finishing step undone first, instead of building one)."""
    from dptune.search.driver import _results_root
    from dptune.search.preflight import read_manifest

    space_path, planned = write_space(work / "spaces", runs)
    name = NAME.format(runs=runs)
    env = {**os.environ, "DPTUNE_CACHE_DIR": str(cold_cache(work / f"cache-{runs}")), "PYTHONPATH": str(REPO)}
    os.environ["DPTUNE_CACHE_DIR"] = env["DPTUNE_CACHE_DIR"]
    if reuse and read_manifest(_results_root(root, name)) is not None:
        print(f"{planned} runs: measuring {root}/{name} again (built before)", flush=True)
        built = {"results_root": _results_root(root, name), "runs": planned, "units": None, "groups": None}
        built |= {"seconds": 0.0, "compacted": None, "bulk": None, "results_s": 0.0, "compaction_s": 0.0, "pruned": 0}
        unfinish(built["results_root"])
    else:
        print(f"{planned} runs: building {root}/{name}", flush=True)
        built = build(space_path, root, name, slots, bulk)
    results_root = built["results_root"]
    python = sys.executable
    logs = work / f"logs-{runs}"
    logs.mkdir(parents=True, exist_ok=True)
    measured: list[Measured] = []
    phases_json = logs / "finish_phases.json"
    finish = measure(
        "finish",
        [python, __file__, "--finish-harness", str(space_path), root, name, str(phases_json)],
        env,
        logs / "finish.log",
        timeout,
    )
    if phases_json.exists():
        finish.phases = json.loads(phases_json.read_text())
    measured.append(finish)
    search = [python, "-m", "dptune.search", "--space", str(space_path), "--storage", root, "--name", name, "--resume"]
    if finish.returncode == 0:
        measured.append(measure("resume", [*search, "--no-report"], env, logs / "resume.log", timeout))
        measured.append(measure("resume+report", search, env, logs / "resume_report.log", timeout))
    report_out = work / f"report-{runs}"
    measured.append(
        measure(
            "report",
            [python, "-m", "dptune.report", results_root, "--out", str(report_out)],
            env,
            logs / "report.log",
            timeout,
        )
    )
    profiles = {}
    if profiled:
        if finish.returncode == 0:
            profiles["resume"] = profile("resume", [*search, "--no-report"], env, logs, timeout)
        profiles["report"] = profile(
            "report", [python, "-m", "dptune.report", results_root, "--out", str(report_out)], env, logs, timeout
        )
    files = folder_files(results_root)
    return {
        "profiles": profiles,
        "runs": built["runs"],
        "planned_runs": planned,
        "units": built["units"],
        "fused_groups": built["groups"],
        "build_s": round(built["seconds"], 1),
        "build": {key: built[key] for key in ("compacted", "bulk", "results_s", "compaction_s", "pruned")},
        "results_root": results_root,
        "measured": [vars(m) for m in measured],
        "files": files,
        "total_files": sum(entry["files"] for entry in files.values()),
        "total_bytes": sum(entry["bytes"] for entry in files.values()),
    }


def table(results: list[dict[str, Any]]) -> str:
    """The measurements as a Markdown table, one row per N, then each N's finishing phases and files."""
    lines = [
        "| runs | build s | finish: wall / CPU s (peak GiB) | resume | resume+report | report | files | MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        by = {m["label"]: m for m in result["measured"]}

        def cell(label: str, by: dict[str, Any] = by) -> str:
            m = by.get(label)
            if m is None:
                return "—"
            flag = " TIMEOUT" if m["timed_out"] else (f" exit {m['returncode']}" if m["returncode"] else "")
            return f"{m['wall_s']:.1f} / {m['cpu_s'] or 0:.1f} ({m['peak_rss_gib']:.2f}){flag}"

        lines.append(
            f"| {result['runs']:,} | {result['build_s']:.0f} | {cell('finish')} | {cell('resume')} | "
            f"{cell('resume+report')} | {cell('report')} | {result['total_files']:,} | "
            f"{result['total_bytes'] / 1e6:,.0f} |"
        )
    for result in results:
        finish = next((m for m in result["measured"] if m["label"] == "finish"), None)
        if finish and finish["phases"]:
            cpu = finish["phases"].get("cpu_s", {})
            phases = ", ".join(
                f"{k} {v:.1f}" + (f"/{cpu[k]:.1f}" if k in cpu else "") for k, v in finish["phases"]["phases"].items()
            )
            lines.append(f"\n{result['runs']:,} runs, finish phases (wall/CPU s): {phases}")
        folders = ", ".join(f"{k} {v['files']:,} ({v['bytes'] / 1e6:,.1f} MB)" for k, v in result["files"].items())
        lines.append(f"{result['runs']:,} runs, files: {folders}")
    return "\n".join(lines)


def machine() -> str:
    """The CPU model and core count (``lscpu``'s model name where there is one)."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    return f"{model}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--runs", type=int, nargs="+", default=[100_000], help="N, one or more (default 100000)")
    parser.add_argument(
        "--root", help="where the results folders go: a folder or s3://BUCKET/PREFIX (default: a temp folder)"
    )
    parser.add_argument("--moto", action="store_true", help="serve --root s3://... from a moto server on loopback")
    parser.add_argument("--slots", type=int, default=2, help="Tune trial slots the units are sized for (default 2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds each measured command may take")
    parser.add_argument(
        "--bulk", action="store_true", help="write each unit's rows as one compacted file (needs compaction)"
    )
    parser.add_argument(
        "--reuse", action="store_true", help="measure a folder built under --root before again (no build)"
    )
    parser.add_argument("--profile", action="store_true", help="also run the resume and the report under cProfile")
    parser.add_argument("--keep", action="store_true", help="keep the results folders and logs")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    parser.add_argument("--finish-harness", nargs=4, metavar=("SPACE", "ROOT", "NAME", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.finish_harness:
        space, root, name, out = args.finish_harness
        finish_harness(Path(space), root, name, Path(out))
        return
    work = Path(tempfile.mkdtemp(prefix="dptune-bench-scale-"))
    root = args.root or str(work / "results")
    if args.moto and not root.startswith("s3://"):
        parser.error("--moto needs --root s3://BUCKET/PREFIX")
    results = []
    try:
        with moto_bucket(root) if args.moto else contextlib.nullcontext():
            for runs in args.runs:
                results.append(
                    bench_one(runs, root, work, args.slots, args.timeout, args.profile, args.bulk, args.reuse)
                )
                if not args.keep and not args.reuse and "://" not in root:
                    shutil.rmtree(results[-1]["results_root"], ignore_errors=True)
    finally:
        report = {"machine": machine(), "root": root, "budgets": BUDGETS, "results": results}
        if results:
            print(table(results))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept: {work}")


if __name__ == "__main__":
    main()
