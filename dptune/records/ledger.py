"""The write-ahead privacy ledger: every run is charged before it takes its first step.

Under a search's per-run folder (``records.runs_root``: inside the trust boundary of an
end-to-end private search, since the ledger counts the runs) ``ledger/`` holds small JSON files,
each written whole or not at all and never rewritten (append-only as a set of files, which works
alike on local disks, network file systems and object stores, and from every Ray worker at once):

- ``start-<id>.json``: written (durably: fsynced, with its folder, before it returns) by the
  process that is about to train, *before the first step*, one per batch of runs: per run a fresh
  ``run`` id, the trial it records into (``trial_id``, configuration, replicate, cell, clipping),
  σ (``noise_multiplier``), q (``sample_rate``), the planned steps (``steps``), δ and the cell's ε.
  A run that cannot be charged does not start (a full disk stops it here).
- ``end-<id>.json``: written when runs end, *before* their rows: per run its ``run`` id (or, from
  the driver for a unit it saw end, only its ``trial_id``: see :func:`charged_runs`), status,
  steps taken and ε spent.

Each file carries a ``checksum``: SHA-256 of the rest of its document in canonical JSON
(:func:`_checksum`), written with it, so a file that still parses after a change (bit rot that turns
one digit into another, a partial copy, an edit) is known as damaged and never trusted: a damaged
start file is refused like an unreadable one (restore it, or charge it conservatively:
``CHARGE_UNREADABLE_FLAG``), a damaged end file is skipped like an unreadable one
(:func:`unreadable_ends`). Files of format 1 (older dptune) carry none and are read as they are.

Invariant: what a search is charged (:func:`charged_runs`) is every start entry, at the steps its
end entry took if there is one, else at its planned steps; a diverged run at its planned steps
(``privacy.search.charged_steps``). A rerun (a retry of a lost process, or ``--resume``) is a new
start entry: nothing a crash, kill, race or full disk does can make the composition smaller than
what was trained. Results written before the ledger existed are charged from their rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from dptune.errors import DptuneError
from dptune.paths import filesystem, write_file_atomic

#: The ledger's folder under a search's per-run folder.
LEDGER = "ledger"
#: Format of an entry file: 2 carries ``checksum`` (:func:`_checksum`); 1 (older dptune) has none.
LEDGER_VERSION = 2
#: The formats this dptune reads.
READABLE_VERSIONS = (1, 2)
#: Where :func:`replace_unreadable_start` moves an unreadable start file (``ledger/unreadable/``).
UNREADABLE = "unreadable"
#: How the trial ids of the runs charged in place of an unreadable start file begin: no row records
#: them (``dptune.search.finish.outcome.check_every_run_recorded`` expects none).
UNREADABLE_TRIAL_PREFIX = "unreadable-ledger-entry:"
#: The flag of ``python -m dptune.search`` that charges unreadable start files conservatively.
CHARGE_UNREADABLE_FLAG = "--charge-unreadable-ledger"

#: Columns of :func:`charged_runs`: those ``privacy.search.composition_cost`` reads, and how each
#: run is known.
CHARGED_COLUMNS = (
    "run",
    "search_id",
    "trial_id",
    "cell_id",
    "clipping",
    "noise_multiplier",
    "sample_rate",
    "steps",
    "steps_taken",
    "epsilon_spent",
    "status",
    "ended",
)


class LedgerError(DptuneError, ValueError):
    """A ledger entry that cannot be read, or is damaged: what it charges is unknown."""


class _Damaged(ValueError):
    """An entry file that parses but is not as it was written (its checksum does not hold)."""


@dataclass(frozen=True)
class RunStart:
    """A run about to take its first step, as its start entry records it.

    ``steps`` is T planned at σ = ``noise_multiplier`` and q = ``sample_rate``; ``epsilon`` the ε
    its σ was calibrated to for those T steps (an upper bound on the ε of any prefix of the run).
    """

    trial_id: str
    configuration_id: str
    replicate: int
    search_id: str
    cell_id: str
    clipping: str
    params: Mapping[str, float]
    noise_multiplier: float
    sample_rate: float
    steps: int
    delta: float
    epsilon: float


@dataclass(frozen=True)
class RunEnd:
    """How a run ended: ``run`` (its start entry's id; None when the writer knows only ``trial_id``),
    its status, the steps it took and their ε."""

    run: str | None
    trial_id: str
    status: str
    steps_taken: int
    epsilon_spent: float


def _folder(runs_root: str) -> str:
    return f"{runs_root.rstrip('/')}/{LEDGER}"


def _write(
    runs_root: str, kind: str, entries: list[dict[str, Any]], durable: bool, name: str | None = None, **about: str
) -> None:
    document = {
        "version": LEDGER_VERSION,
        "kind": kind,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "written_at": pd.Timestamp.now(tz="UTC").isoformat(),
        **about,
        "entries": entries,
    }
    document["checksum"] = _checksum(document)
    name = name or f"{kind}-{uuid.uuid4().hex}.json"
    write_file_atomic(_folder(runs_root), name, json.dumps(document).encode(), durable=durable)


def _checksum(document: Mapping[str, Any]) -> str:
    """SHA-256 (64 hex digits) of ``document`` without its ``checksum``, as canonical JSON (keys sorted,
    no spaces, ASCII). What ``json.loads`` reads back of a written document serialises to the same text
    (a float as its shortest round-tripping repr, an int exactly), so a file verifies as long as no
    byte of its content changed."""
    content = {key: value for key, value in document.items() if key != "checksum"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _verified_entries(document: Any) -> list[dict[str, Any]]:
    """The entries of a parsed entry file; ``ValueError`` unless it is one, of a format this dptune reads,
    and ``_Damaged`` unless its checksum holds (one is required from format 2 on, and checked wherever
    present)."""
    if not isinstance(document, dict):
        raise ValueError(f"expected a JSON object, got {type(document).__name__}")
    version = document.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise ValueError(f"format version {version!r} is not one this dptune reads ({READABLE_VERSIONS})")
    if "checksum" in document or version >= 2:
        if "checksum" not in document:
            raise _Damaged(f"no checksum, which every entry file of format {version} carries")
        if document["checksum"] != _checksum(document):
            raise _Damaged(
                "checksum mismatch: its content changed after it was written (bit rot, a partial copy or an "
                "edit), so none of its values can be trusted"
            )
    entries = document["entries"]
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError("'entries' is not a list of objects")
    return entries


def _refusal(path: str, problem: Exception) -> LedgerError:
    """What to say about the unreadable or damaged start file at ``path``, and what to do."""
    what = (
        f"damaged privacy ledger entry ({problem})"
        if isinstance(problem, _Damaged)
        else f"unreadable privacy ledger entry ({type(problem).__name__}: {str(problem)[:160]})"
    )
    return LedgerError(
        f"{path}: {what}; what it charges is unknown, so no ε can be printed and nothing more is trained on "
        f"this results folder. Restore the file from a backup, or pass {CHARGE_UNREADABLE_FLAG} to charge it "
        "conservatively (every run one start file of this search can hold, at every mechanism its plan can "
        "start; the printed ε then says so)"
    )


def _start_entries(starts: list[RunStart]) -> tuple[list[str], list[dict[str, Any]]]:
    """Fresh run ids for ``starts`` and their entries as a start file holds them."""
    runs = [uuid.uuid4().hex for _ in starts]
    fields = RunStart.__dataclass_fields__
    entries = [
        {"run": run, **{field: getattr(start, field) for field in fields}, "params": dict(start.params)}
        for run, start in zip(runs, starts, strict=True)
    ]
    return runs, entries


def record_starts(runs_root: str, starts: Iterable[RunStart]) -> list[str]:
    """Charge ``starts`` before any of them takes a step: one durable start file; returns their run ids.

    Raises (``OSError``: a full or read-only disk) when the file cannot be written: then no run may start.
    """
    starts = list(starts)
    if not starts:
        return []
    runs, entries = _start_entries(starts)
    _write(runs_root, "start", entries, durable=True)
    return runs


def replace_unreadable_start(runs_root: str, path: str, starts: Iterable[RunStart]) -> None:
    """Charge ``starts`` in place of the unreadable start file at ``path`` (inside the ledger's filesystem,
    as :func:`unreadable_starts` gives it): its conservative stand-in, which
    ``dptune.search.damaged_ledger`` builds), then move ``path`` to ``ledger/unreadable/``.

    The stand-in is written durably under a name drawn from ``path``'s (``start-<id>-conservative.json``)
    before the file moves, so a crash in between leaves both, and a second pass rewrites the same
    stand-in: the ledger never charges less than either.
    """
    name = path.rstrip("/").rsplit("/", 1)[-1]
    _, entries = _start_entries(list(starts))
    stem = name.removeprefix("start-").removesuffix(".json")
    _write(runs_root, "start", entries, durable=True, name=f"start-{stem}-conservative.json", replaces=name)
    fs, folder = filesystem(_folder(runs_root))
    fs.create_dir(f"{folder}/{UNREADABLE}", recursive=True)
    fs.move(path, f"{folder}/{UNREADABLE}/{name}")


def record_ends(runs_root: str, ends: Iterable[RunEnd]) -> None:
    """Append how ``ends`` ended (one file). Not fsynced: an end entry lost to a crash leaves its run
    charged its planned steps, which never undercounts."""
    entries = [vars(end) for end in ends]
    if entries:
        _write(runs_root, "end", entries, durable=False)


def _entries(
    runs_root: str, unreadable: list[str] | None = None, unreadable_end_files: list[str] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(start entries, end entries) of the ledger, from its intact files only. An unreadable or damaged
    (:func:`_verified_entries`) start file raises ``LedgerError`` (or, given ``unreadable``, is appended to
    it: :func:`unreadable_starts`); such an end file is skipped, its runs staying charged their planned
    steps (appended to ``unreadable_end_files`` if given: :func:`unreadable_ends`)."""
    import pyarrow.fs as pafs

    fs, path = filesystem(runs_root)
    infos = fs.get_file_info(pafs.FileSelector(f"{path.rstrip('/')}/{LEDGER}", allow_not_found=True))
    starts: list[dict[str, Any]] = []
    ends: list[dict[str, Any]] = []
    for info in sorted(infos, key=lambda i: i.path):
        name = info.base_name
        if info.type != pafs.FileType.File or not name.endswith(".json") or name.startswith("."):
            continue
        try:
            with fs.open_input_file(info.path) as file:
                entries = _verified_entries(json.loads(file.readall()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if name.startswith("start-"):
                if unreadable is None:
                    raise _refusal(info.path, exc) from None
                unreadable.append(info.path)
            elif name.startswith("end-") and unreadable_end_files is not None:
                unreadable_end_files.append(info.path)
            continue
        (starts if name.startswith("start-") else ends if name.startswith("end-") else []).extend(entries)
    return starts, ends


def check_ledger(runs_root: str, unreadable: list[str] | None = None) -> Counter[str]:
    """Read every entry of the ledger at ``runs_root`` once: ``LedgerError`` naming an unreadable start
    file (unless ``unreadable`` collects them), before a search trains anything more on top of a
    ledger whose total it could not print. Returns the number of start entries per search id."""
    starts, _ = _entries(runs_root, unreadable)
    return Counter(str(start.get("search_id")) for start in starts)


def unreadable_starts(runs_root: str) -> list[str]:
    """The paths (inside the ledger's filesystem) of the start files of the ledger at ``runs_root`` that
    cannot be read or are damaged (their checksum does not hold)."""
    found: list[str] = []
    _entries(runs_root, found)
    return found


def unreadable_ends(runs_root: str) -> list[str]:
    """The paths (inside the ledger's filesystem) of the end files of the ledger at ``runs_root`` that
    cannot be read or are damaged: skipped, so the runs they close stay charged their planned steps
    (never fewer than they took; the printed ε is an upper bound, looser than it would be with them).
    Never raises for an unreadable or damaged start file (:func:`check_ledger` and :func:`unreadable_starts`
    tell those)."""
    found: list[str] = []
    _entries(runs_root, [], found)
    return found


def started_runs(runs_root: str, search_id: str) -> list[RunStart]:
    """Every run of ``search_id`` the ledger at ``runs_root`` holds a start entry of (one per start: a
    run started twice is listed twice), as it was charged: what a resume must see recorded."""
    starts, _ = _entries(runs_root)
    fields = RunStart.__dataclass_fields__
    return [
        RunStart(**{name: start[name] for name in fields})
        for start in starts
        if start.get("search_id") == search_id and not str(start.get("trial_id")).startswith(UNREADABLE_TRIAL_PREFIX)
    ]


def charged_runs(runs_root: str, search_id: str, trials: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every run of ``search_id`` the ledger at ``runs_root`` charges, one row each (``CHARGED_COLUMNS``).

    A start entry with an end entry (matched by run id; an end entry that names only a trial closes
    one open start of that trial, and every start of one trial is the same mechanism) is charged
    the steps the end took (``ended`` True); without one, its planned steps (``steps_taken =
    steps``, status ``unrecorded``: the process was lost, or the disk filled, before it could say).
    Trials of ``trials`` (the ``trials`` table) with no ledger entry at all (results written before
    the ledger) are charged from their rows.
    """
    starts, ends = _entries(runs_root)
    by_run = {end["run"]: end for end in ends if end.get("run")}
    by_trial: dict[str, list[dict[str, Any]]] = {}
    for entry in ends:
        if not entry.get("run"):
            by_trial.setdefault(entry["trial_id"], []).append(entry)
    rows = []
    for start in starts:
        if start.get("search_id") != search_id:
            continue
        end = by_run.get(start["run"])
        if end is None and by_trial.get(start["trial_id"]):
            end = by_trial[start["trial_id"]].pop(0)
        row = {
            name: start.get(name)
            for name in (
                "run",
                "search_id",
                "trial_id",
                "cell_id",
                "clipping",
                "noise_multiplier",
                "sample_rate",
                "steps",
            )
        }
        if end is None:
            row.update(
                steps_taken=int(start["steps"]), epsilon_spent=float(start["epsilon"]), status="unrecorded", ended=False
            )
        else:
            row.update(
                steps_taken=int(end["steps_taken"]),
                epsilon_spent=float(end["epsilon_spent"]),
                status=str(end["status"]),
                ended=True,
            )
        rows.append(row)
    charged = pd.DataFrame(rows, columns=list(CHARGED_COLUMNS))
    if trials is not None and not trials.empty:
        mine = trials[trials["search_id"] == search_id]
        before = mine[~mine["trial_id"].isin(set(charged["trial_id"]))].assign(run=None, ended=True)
        if not before.empty:
            charged = (
                pd.concat([charged, before[list(CHARGED_COLUMNS)]], ignore_index=True)
                if len(charged)
                else before[list(CHARGED_COLUMNS)].reset_index(drop=True)
            )
    return charged
