"""Checks a search runs before it loads data or starts Ray, and the notes it keeps for the record.

Everything that can be known without the workload is checked here, in ``--dry-run`` too: the
name and the results location (a write probe), the Ray address (syntax at once, then a TCP
connection with a short timeout), the resources a trial asks for against this machine, the
results folder (every part readable, Tune's state loadable, the same search space on
``--resume``). A failed check raises ``PreflightError``: the command exits before any compute,
so nothing can fail after Ray has started or hang waiting for resources that never come.

A started search keeps a manifest (``manifest.json``: search id, name, spec hash, resolved spec),
written atomically before Ray starts, so that ``--resume`` can compare spaces (as validated, not as
written) even when the search was stopped before it wrote its ``search`` table.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dptune.contract import BACKBONE_NAMES, DATASET_NAMES, NO_BACKBONE, is_own_backbone
from dptune.errors import DptuneError, shown
from dptune.paths import filesystem, write_file_atomic
from dptune.plan import check_max_steps
from dptune.privacy import check_delta
from dptune.space import LoadedSpace, ResourcesSpec, SearchSpace, SpaceError, parse_space, spec_differences

#: The manifest a started search writes into its results folder.
MANIFEST = "manifest.json"
#: Seconds to wait for a TCP connection to the Ray address (GCS port) before giving up.
ADDRESS_TIMEOUT_S = 5.0
#: Where Tune keeps its experiment state under the results folder (``dptune.search`` writes it).
TUNE_EXPERIMENT = "_tune/search"
#: The file (beside Tune's experiment folder) naming where the folder was when Tune last saved its state:
#: Tune's saved state holds absolute paths, so a copied or moved folder does not restore it.
TUNE_LOCATION = "_tune/location.txt"

_ADDRESS = re.compile(r"(?:ray://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})")


class PreflightError(DptuneError, ValueError):
    """A search refused before any compute: the message names the flag or key and what is allowed."""


# --------------------------------------------------------------------------- the Ray address


_ALLOWED_ADDRESS = "HOST:PORT of the cluster's head, e.g. 127.0.0.1:6379, or ray://HOST:10001"


def check_address_syntax(address: str, where: str = "--address") -> tuple[str, int] | None:
    """``(host, port)`` of a Ray address, None for Ray's keywords ``auto`` and ``local``.

    ``PreflightError`` at once when it is neither ``HOST:PORT`` nor ``ray://HOST:PORT``.
    """
    if address in ("auto", "local"):
        return None
    match = _ADDRESS.fullmatch(address.strip())
    if match is None or not 0 < int(match["port"]) < 65536:
        raise PreflightError(f"{where} {shown(address)}: not a Ray address (expected {_ALLOWED_ADDRESS})")
    return match["host"].strip("[]"), int(match["port"])


def check_address(address: str, where: str = "--address", timeout_s: float = ADDRESS_TIMEOUT_S) -> None:
    """Refuse a Ray address that is malformed (at once) or where nothing answers within ``timeout_s``.

    ``auto`` and ``local`` (Ray's own keywords) pass unchecked; otherwise a TCP connection to
    the address must open.
    """
    endpoint = check_address_syntax(address, where)
    if endpoint is None:
        return
    problem = _connect(*endpoint, timeout_s)
    if problem is not None:
        raise PreflightError(
            f"{where} {shown(address)}: no Ray cluster answers there ({problem}; expected "
            f"{_ALLOWED_ADDRESS} of a running cluster, or no address for an embedded local Ray)"
        )


def token_configured() -> bool:
    """Whether this process would present a Ray auth token: ``RAY_AUTH_MODE=token`` and a token in
    ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return False
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or Path(path or Path.home() / ".ray" / "auth_token").is_file()


def cluster_join_error(address: str, where: str, error: BaseException) -> PreflightError:
    """What to say when ``ray.init`` cannot join the cluster at ``address``: the error's first line and,
    since a token-protected head (Ray 2.60's default) refuses a driver without its token, what to set."""
    lines = str(error).strip().splitlines()
    first = lines[0][:200] if lines else type(error).__name__
    if not token_configured():
        hint = (
            "the cluster most likely requires token authentication (on by default in Ray 2.60): set "
            "RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN (or in the file RAY_AUTH_TOKEN_PATH "
            "names, or ~/.ray/auth_token)"
        )
    else:
        hint = (
            "RAY_AUTH_MODE=token is set: check that the token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
            "~/.ray/auth_token) is this cluster's, and that the address is its head's GCS port"
        )
    return PreflightError(
        f"{where} {shown(address)}: could not join the Ray cluster ({first}); {hint}; nothing was loaded or trained"
    )


def _connect(host: str, port: int, timeout_s: float) -> str | None:
    """Open and close a TCP connection: the problem in words, or None; bounded by ``timeout_s``, name lookup
    included."""
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc.strerror or type(exc).__name__)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout_s + 0.5)
    return outcome[0] if outcome else f"no answer within {timeout_s:g} s"


# --------------------------------------------------------------------------- resources


def local_gpus() -> int:
    """GPUs an embedded Ray would see: ``CUDA_VISIBLE_DEVICES`` if set, else the NVIDIA device files."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in Path("/dev").glob("nvidia[0-9]*") if p.name[len("nvidia") :].isdigit()])


def check_local_resources(resources: ResourcesSpec, cpus: int | None = None, gpus: int | None = None) -> None:
    """Refuse per-trial resources this machine cannot give (an embedded Ray would wait forever).

    ``cpus``/``gpus`` default to what ``dptune.search.scheduling.ray_session.init_ray`` gives the embedded Ray:
    ``os.cpu_count()`` CPUs and ``local_gpus()`` GPUs.
    """
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    gpus = local_gpus() if gpus is None else gpus
    _check_fits(resources, [{"CPU": cpus, "GPU": gpus}], "this machine")


def check_cluster_resources(resources: ResourcesSpec, nodes: list[dict[str, Any]]) -> None:
    """Refuse per-trial resources no live node of a Ray cluster has; ``nodes`` as ``ray.nodes()``
    lists them (the driver asks, after it joined the cluster).

    A trial runs on one node, so one node must have the CPUs and GPUs a trial asks for.
    """
    alive = [node.get("Resources", {}) for node in nodes if node.get("Alive")]
    _check_fits(resources, alive, "any node of the Ray cluster")


def _check_fits(resources: ResourcesSpec, nodes: list[dict[str, float]], what: str) -> None:
    asked = {"CPU": resources.cpus, "GPU": resources.gpu}
    if any(all(node.get(kind, 0) >= amount for kind, amount in asked.items()) for node in nodes):
        return
    largest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
    raise PreflightError(
        f"resources: a trial asks for {resources.cpus:g} CPU(s) and {resources.gpu:g} GPU(s), more than {what} has "
        f"({largest.get('CPU', 0):g} CPU(s), {largest.get('GPU', 0):g} GPU(s)); the search would wait forever "
        "(lower resources.cpus/resources.gpu, or join a cluster with --address)"
    )


# --------------------------------------------------------------------------- the results folder


def check_results_folder(results_root: str, quarantine: bool, move: bool = True) -> list[str]:
    """Refuse unreadable parts, or with ``quarantine`` move them aside (only say so unless ``move``).

    Opens the footer of each file that exists (``records.unreadable_parts``): a run's own parts until it
    is compacted, then the few compacted files of each table, whatever the number of runs. A compacted
    file moved aside takes every run it holds with it: they are unrecorded, and ``--resume`` runs them
    again. Returns one note per part moved (or to be moved).
    """
    import pyarrow.fs as pafs

    from dptune.paths import filesystem
    from dptune.records import TABLES, quarantine_part, unreadable_parts  # pyarrow, pandas: not for the command line

    fs, root = filesystem(results_root)
    for table in TABLES:
        if fs.get_file_info(f"{root.rstrip('/')}/{table}").type == pafs.FileType.File:
            raise PreflightError(
                f"{results_root}/{table} is a file where dptune keeps table '{table}' (a folder of part files); "
                "move it away, then run the command again"
            )
    notes = []
    for table, part, problem in unreadable_parts(results_root):
        if not quarantine:
            raise PreflightError(
                f"{part}: {problem} (an unreadable part of table '{table}'; move it "
                "aside, or pass --quarantine-corrupt to move every such part to "
                f"{results_root}/quarantine/)"
            )
        target = quarantine_part(results_root, table, part) if move else f"{results_root}/quarantine/{table}/"
        notes.append(f"unreadable part {part} ({problem}) {'moved' if move else 'would be moved'} to {target}")
    return notes


def check_tune_state(results_root: str, set_aside: bool = False) -> list[str]:
    """Refuse a Tune experiment state that ``--resume`` could not load (checked before Ray starts).

    ``set_aside`` (a search whose proposals the public seed repeats: grid, or random without
    private selection): an experiment-state JSON that is cut short (Tune rewrites it in place, so
    a disk that filled while it wrote leaves it so) is not refused: the experiment folder moves to
    ``<TUNE_EXPERIMENT>.unreadable-<time>`` and the search starts Tune afresh; its samplers propose
    the same configurations again and every recorded run is skipped. An unloadable ``tuner.pkl``
    (written once, before any run) is always refused. Returns one note per move.
    """
    fs, root = filesystem(results_root)
    experiment = f"{root}/{TUNE_EXPERIMENT}"
    import pyarrow.fs as pafs

    tuner = f"{experiment}/tuner.pkl"
    if fs.get_file_info(tuner).type != pafs.FileType.File:
        return []
    fix = f"(remove {experiment} to restart the search; its finished trials are kept and not run again)"
    try:
        with fs.open_input_file(tuner) as file:
            pickle.loads(file.readall())  # what Tune's restore does with it
    except Exception as exc:  # any failure to load it is the problem reported
        raise PreflightError(
            f"{tuner}: Tune's state cannot be loaded ({type(exc).__name__}: {shown(str(exc))}) {fix}"
        ) from None
    states = sorted(
        info.path
        for info in fs.get_file_info(pafs.FileSelector(experiment))
        if info.base_name.startswith("experiment_state-") and info.base_name.endswith(".json")
    )
    if states:
        try:
            with fs.open_input_file(states[-1]) as file:
                json.loads(file.readall())
        except (ValueError, OSError) as exc:
            problem = f"{states[-1]}: Tune's state is not valid JSON ({shown(str(exc))})"
            if not set_aside:
                raise PreflightError(f"{problem} {fix}") from None
            aside = f"{experiment}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}"
            fs.move(experiment, aside)
            return [
                f"{problem}; moved the experiment to {aside} and starting Tune afresh (the same proposals "
                "again: recorded runs are not run again)"
            ]
    return []


def read_manifest(results_root: str) -> dict[str, Any] | None:
    """The manifest of the search at ``results_root``, or None when there is none."""
    import pyarrow.fs as pafs

    fs, root = filesystem(results_root)
    path = f"{root}/{MANIFEST}"
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    try:
        with fs.open_input_file(path) as file:
            manifest = json.loads(file.readall())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("spec_yaml"), str):
            raise ValueError("expected an object with spec_hash and spec_yaml")
    except (ValueError, OSError) as exc:
        raise PreflightError(
            f"{path}: unreadable manifest ({shown(str(exc))}; it is rewritten by a search started without --resume)"
        ) from None
    return manifest


def write_manifest(results_root: str, loaded: LoadedSpace, name: str, search_id: str) -> None:
    """Write the manifest atomically (``paths.write_file_atomic``): the folder's ``search_id``
    (:func:`folder_search_id`), the ``name`` it ran under last, and the space."""
    manifest = {"search_id": search_id, "name": name, "spec_hash": loaded.spec_hash, "spec_yaml": loaded.text}
    write_file_atomic(results_root, MANIFEST, json.dumps(manifest, indent=1).encode())


def folder_search_id(
    runs: str, loaded: LoadedSpace, name: str, resume: bool, dry_run: bool = False, unreadable: list[str] | None = None
) -> str:
    """The id the runs of the search at ``runs`` are recorded and charged under: the folder's, whatever
    the folder is called now.

    The search that starts a folder names it ``<name>-<spec hash>`` and keeps that id in the folder's
    manifest; a resume takes it from there (from a ``search`` row when there is no manifest) when the
    recorded space is this one (:func:`same_space`: formatting never counts, and a folder whose id an
    older dptune drew from the space's text keeps it), so a copied, renamed or moved folder resumed
    under another ``--name`` continues the same search, and its printed ε composes every start entry
    of its ledger. Refused (``PreflightError``), before anything trains, each with its own message: a
    resume with another space (the keys that differ); a start without ``--resume`` on a folder whose
    ledger charges runs; a ledger holding intact start entries of another search (entry files copied
    in from another folder), which this search's ε would not compose. An unreadable or damaged start
    file (its checksum does not hold) raises ``LedgerError`` unless ``unreadable`` collects its path
    (then the driver charges it conservatively before anything trains: :mod:`dptune.search.damaged_ledger`).
    """
    from dptune.records.ledger import check_ledger

    charged = check_ledger(runs, unreadable)  # an unreadable start entry is told now, not after more training
    search_id = f"{name}-{loaded.spec_hash}"
    if resume and (recorded := _recorded_spaces(runs)):
        mine = next((space for space in recorded if same_space(space, loaded)), None)
        if mine is None:  # told as a changed space, never as the ledger's entries being another search's
            raise _changed_space(runs, recorded[0], loaded)
        search_id = str(mine.get("search_id") or f"{mine.get('name')}-{mine.get('spec_hash')}")
    if charged and not resume and not dry_run:
        raise PreflightError(
            f"{runs}/ledger: the privacy ledger of this results folder already charges {sum(charged.values())} "
            "run(s) (a search started here and stopped before it recorded a result); pass --resume to "
            "continue that search (its ε counts them), or choose another --name/--storage"
        )
    if foreign := sorted(set(charged) - {search_id}):
        raise PreflightError(
            f"{runs}/ledger: the privacy ledger holds start entries of search(es) {', '.join(foreign)[:200]}, not "
            f"of this folder's search {search_id}, so this search's ε would not count them; move those "
            "entry files back to the results folder they came from, or run this search under another "
            "--name/--storage"
        )
    return search_id


def check_same_space(results_root: str, loaded: LoadedSpace) -> None:
    """On ``--resume``: refuse a space other than the one the search started with (:func:`same_space`).

    The recorded space is the manifest's, else (searches from before manifests) the ``search``
    table's. The error lists the keys that differ. Nothing recorded: nothing to compare.
    """
    recorded = _recorded_spaces(results_root)
    if recorded and not any(same_space(space, loaded) for space in recorded):
        raise _changed_space(results_root, recorded[0], loaded)


def _recorded_spaces(results_root: str) -> list[dict[str, Any]]:
    """The spaces the search at ``results_root`` recorded, each with ``search_id``, ``spec_hash`` and
    ``spec_yaml``: the manifest, else (searches from before manifests) the ``search`` table's rows; none
    when nothing is recorded."""
    manifest = read_manifest(results_root)
    if manifest is not None:
        return [manifest]
    from dptune.records import read_table

    search = read_table(results_root, "search", columns=["search_id", "spec_hash", "spec_yaml"])
    return list(search.drop_duplicates().to_dict("records"))


def same_space(recorded: Mapping[str, Any], loaded: LoadedSpace) -> bool:
    """Whether a recorded space (a manifest, or a ``search`` row) is ``loaded``'s: the same spec hash, or
    its ``spec_yaml`` validates, now, to the same space (a folder written by a dptune that hashed the
    space's text, or whose canonical form has changed since). Formatting never makes two spaces differ."""
    if recorded.get("spec_hash") == loaded.spec_hash:
        return True
    try:
        return parse_space(str(recorded.get("spec_yaml")), "the recorded space").spec_hash == loaded.spec_hash
    except SpaceError:  # it no longer validates: not the space that does
        return False


def _changed_space(results_root: str, recorded: Mapping[str, Any], loaded: LoadedSpace) -> PreflightError:
    """The refusal of a ``--resume`` with a space other than ``recorded``: the keys that differ."""
    changes = spec_differences(str(recorded.get("spec_yaml")), loaded.text)
    what = "; ".join(changes[:8]) + (f"; and {len(changes) - 8} more" if len(changes) > 8 else "")
    return PreflightError(
        f"--resume: the search space differs from the one {results_root} was started with (spec "
        f"{recorded.get('spec_hash')} → {loaded.spec_hash}): {what or 'no key as written, but their validated values'} "
        "(resume with the same space and --set flags, or start a new search with another --name)"
    )


def record_tune_location(results_root: str, location: str) -> None:
    """Note, before Tune starts, that its state under ``results_root`` is saved at ``location`` (Tune's storage
    path: an absolute path or a URI)."""
    folder, name = TUNE_LOCATION.rsplit("/", 1)
    write_file_atomic(f"{results_root.rstrip('/')}/{folder}", name, location.encode())


def set_aside_moved_tune_state(results_root: str, location: str, move: bool = True) -> list[str]:
    """On ``--resume`` of a folder copied or moved since Tune last saved its state (:data:`TUNE_LOCATION` names
    another place than ``location``): Tune's state leads back to the original folder (its new trials would
    write there), so it moves to ``<TUNE_EXPERIMENT>.moved-<time>`` and the search starts Tune afresh; what
    to run comes from the folder itself (``dptune.search.scheduling.reconcile``: every configuration recorded or charged
    is kept, every charged one without its rows runs again). ``move`` False (``--dry-run``) only says so.
    Returns one note."""
    import pyarrow.fs as pafs

    fs, root = filesystem(results_root)
    marker, experiment = f"{root}/{TUNE_LOCATION}", f"{root}/{TUNE_EXPERIMENT}"
    absent = fs.get_file_info(experiment).type == pafs.FileType.NotFound
    if absent or fs.get_file_info(marker).type != pafs.FileType.File:
        return []
    with fs.open_input_file(marker) as file:
        saved_at = file.readall().decode(errors="replace")
    if saved_at == location:
        return []
    aside = f"{experiment}.moved-{time.strftime('%Y%m%d-%H%M%S')}"
    if move:
        fs.move(experiment, aside)
    return [
        f"this results folder was copied or moved from {shown(saved_at)}: Tune's saved state there is set aside "
        f"({aside}) and Tune starts afresh; every configuration recorded or charged in the folder is kept, and "
        "every charged run without its row runs again"
    ]


# --------------------------------------------------------------------------- warnings


def flag_warnings(space: SearchSpace, trials_per_cell_flag: bool) -> list[str]:
    """Settings that are accepted but do nothing, each as one sentence."""
    notes = []
    if space.sampler.name == "grid" and space.sampler.trials_per_cell is not None:
        source = (
            "--trials-per-cell (or --set sampler.trials_per_cell)"
            if trials_per_cell_flag
            else "sampler.trials_per_cell"
        )
        notes.append(f"{source} does not apply to sampler 'grid', which runs each grid point once; ignored")
    if space.coupling.rule == "none" and "reference_batch_size" in space.coupling.model_fields_set:
        notes.append("coupling.reference_batch_size does not apply with coupling rule 'none'; ignored")
    return notes


#: Seconds ``ray job stop`` should give a search between its SIGTERM and the SIGKILL that follows: Ray's
#: job supervisor reads ``RAY_JOB_STOP_WAIT_TIME_S`` from its own environment (its node's, or the job's
#: runtime_env ``env_vars``; Ray's default 3 s). The graceful stop (Tune's state saved, the recorded runs
#: counted, the results folder's lease released) took 15 s on an object store.
JOB_STOP_WAIT_S = 120


def job_stop_warnings(environ: Mapping[str, str]) -> list[str]:
    """Under ``ray job submit`` (``environ`` has Ray's ``RAY_JOB_CONFIG_JSON_ENV_VAR``; a job's driver inherits
    its supervisor's environment): a warning when ``RAY_JOB_STOP_WAIT_TIME_S`` is below ``JOB_STOP_WAIT_S``."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in environ:
        return []
    value = environ.get("RAY_JOB_STOP_WAIT_TIME_S")
    fix = (
        f"set RAY_JOB_STOP_WAIT_TIME_S={JOB_STOP_WAIT_S} in the environment of the cluster's nodes or in the job's "
        "--runtime-env-json env_vars (cluster/README.md)"
    )
    if value is not None and not value.strip().isdigit():
        return [f"RAY_JOB_STOP_WAIT_TIME_S={shown(value)} is not a whole number of seconds, as Ray reads it; {fix}"]
    wait = 3 if value is None else int(value)
    if wait >= JOB_STOP_WAIT_S:
        return []
    source = "Ray's default" if value is None else "RAY_JOB_STOP_WAIT_TIME_S"
    return [
        f"`ray job stop` kills this search {wait} s after its SIGTERM ({source}), before it can stop cleanly; {fix}"
    ]


def check_task_names(loaded: LoadedSpace) -> None:
    """Refuse a ``task.dataset`` or ``task.backbone`` that no registry (``dptune.contract.DATASET_NAMES``,
    ``BACKBONE_NAMES``) holds and that is not a file or model of one's own (nor ``none``), from the names
    alone: before torch, Ray or any data loads."""
    task, where = loaded.space.task, f"{loaded.path}: task"
    if isinstance(task.dataset, str) and task.dataset not in DATASET_NAMES:
        raise PreflightError(
            f"{where}.dataset: unknown dataset {shown(task.dataset)} (allowed: {', '.join(DATASET_NAMES)}, or a "
            "file of your own: {path: FILE, input_column: COLUMN, label_column: COLUMN})"
        )
    if task.backbone not in (*BACKBONE_NAMES, NO_BACKBONE) and not is_own_backbone(task.backbone):
        raise PreflightError(
            f"{where}.backbone: unknown backbone {shown(task.backbone)} (allowed: {', '.join(BACKBONE_NAMES)}; "
            f"{NO_BACKBONE} for rows that are embeddings; or a model of your own: {{hf: FOLDER}} or "
            "{timm: ARCHITECTURE, weights: FILE})"
        )


def check_steps(space: SearchSpace, num_train: int) -> None:
    """Refuse batch sizes whose step count T is beyond ``MAX_STEPS`` (before σ is calibrated)."""
    candidates = space.batch_size.candidates(num_train)
    if candidates:
        check_max_steps(num_train, min(candidates), max(space.epochs), "batch_size, epochs")


def data_warnings(space: SearchSpace, num_train: int) -> list[str]:
    """Warnings that need the training set's size N (its people under a person unit): δ > 1/N, batch
    sizes above N."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_delta(space.privacy.delta, num_train)
    notes = [f"privacy.delta: {warning.message}" for warning in caught]
    oversized = space.batch_size.oversized(num_train)
    if oversized:
        units = "the training set (N" if space.privacy.person_unit is None else "the training people (N_people"
        notes.append(f"batch_size: B = {oversized} exceed {units} = {num_train}) and are dropped")
    return notes
