"""dptune from Python (``dptune.tune``): :func:`tune` runs a search and returns its :class:`SearchResult`; the
command line (``python -m dptune.search``, :mod:`dptune.search.cli`) is a thin layer over
:func:`search_options` and :func:`run`.

A space is a path, a mapping (as its YAML would be; ``extends`` and relative paths from the working
folder) or a :class:`~dptune.space.SearchSpace`; data is a path or a table in memory
(:mod:`dptune.search.frames`), checked as a file is. Keyword overrides name a space key with ``__`` for
each dot: ``privacy__epsilons=[8]`` sets ``privacy.epsilons``.

This module imports neither torch, Ray nor pandas: a bad space, name or flag is answered at once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dptune.errors import DptuneError
from dptune.paths import check_name
from dptune.search import preflight
from dptune.search.frames import table_path
from dptune.search.options import SearchOptions
from dptune.space import LoadedSpace, SearchSpace, SpaceError

if TYPE_CHECKING:
    import pandas as pd

#: The name, in messages, of a space given in Python (its folder, the working folder, is where its
#: relative paths resolve from).
PYTHON_SPACE = "<space given in Python>"


def search_options(
    space: str | Path | Mapping[str, Any] | SearchSpace | LoadedSpace,
    data: Any = None,
    *,
    test_data: Any = None,
    storage: str | Path = "results",
    name: str | None = None,
    address: str | None = None,
    resume: bool = False,
    dry_run: bool = False,
    report: bool = True,
    report_dir: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    max_train_examples: int | None = None,
    max_eval_examples: int | None = None,
    quarantine_corrupt: bool = False,
    charge_unreadable_ledger: bool = False,
) -> SearchOptions:
    """A search's options, every argument checked (:class:`DptuneError` naming it and what is allowed)
    before anything heavy loads; the space is validated by :func:`run`. ``data``/``test_data`` set
    ``task.dataset.path``/``test_path``; ``overrides`` are dotted space keys."""
    changes = {key: _plain(value, key) for key, value in (overrides or {}).items()}
    for key, value, where in (("task.dataset.path", data, "data"), ("task.dataset.test_path", test_data, "test_data")):
        if value is not None:
            changes[key] = table_path(value, where, cluster=address or os.environ.get("RAY_ADDRESS"))
    for where, cap in (("max_train_examples", max_train_examples), ("max_eval_examples", max_eval_examples)):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            flag = f"--{where.replace('_', '-')}"
            raise SpaceError(f"{flag} must be ≥ 1 (an int; {where}= in Python) (got {cap!r})")
    if name is not None:
        check_name(name, "--name")
    if address is not None:
        preflight.check_address_syntax(address)
    space_path, space_text = _space_source(space)
    return SearchOptions(
        space_path=space_path,
        storage=str(storage),
        name=name,
        address=address,
        resume=resume,
        dry_run=dry_run,
        report=report,
        overrides=changes,
        max_train_examples=max_train_examples,
        max_eval_examples=max_eval_examples,
        quarantine_corrupt=quarantine_corrupt,
        charge_unreadable_ledger=charge_unreadable_ledger,
        report_dir=report_dir,
        space_text=space_text,
    )


def _space_source(space: str | Path | Mapping[str, Any] | SearchSpace | LoadedSpace) -> tuple[Path, str | None]:
    """Where a space comes from: its file (no text), or a name and the YAML text of one given in Python
    (a loaded space by its validated values: its recorded text leaves out ``tracking``)."""
    import yaml

    if isinstance(space, (str, Path)):
        return Path(space).expanduser(), None
    if isinstance(space, LoadedSpace):
        space = space.space
    if isinstance(space, SearchSpace):
        return Path.cwd() / PYTHON_SPACE, yaml.safe_dump(space.model_dump(mode="json"), sort_keys=False)
    if isinstance(space, Mapping):
        return Path.cwd() / PYTHON_SPACE, yaml.safe_dump(_plain(space, "space"), sort_keys=False, allow_unicode=True)
    raise SpaceError(
        f"space: expected a YAML file's path, a mapping or a dptune SearchSpace, got {type(space).__name__}"
    )


def _plain(value: Any, key: str) -> Any:
    """The value of space key ``key`` given in Python as plain YAML data: mappings as dicts, tuples and
    numpy arrays as lists, numpy numbers as Python's, paths as strings; :class:`SpaceError` for anything
    else that is no YAML value."""
    if isinstance(value, Mapping):
        return {str(name): _plain(item, f"{key}.{name}") for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, key) for item in value]
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # a numpy array or number
        return _plain(value.tolist(), key)
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise SpaceError(f"{key}: a {type(value).__name__} is no space value (numbers, strings, lists and mappings are)")


def _check_table_target(options: SearchOptions) -> None:
    """A search given ``data=`` or ``test_data=`` whose space names a registry dataset is refused, saying how to
    name a table's columns (the override of ``task.dataset.path`` would say ``--set``, which was not given)."""
    data_keys = ("task.dataset.path", "task.dataset.test_path")
    if not any(key in options.overrides for key in data_keys):
        return
    try:
        options.load_space()
    except SpaceError as refused:
        others = {key: value for key, value in options.overrides.items() if key not in data_keys}
        try:
            dataset = replace(options, overrides=others).load_space().space.task.dataset
        except SpaceError:
            raise refused from None
        if not isinstance(dataset, str):
            raise
        raise SpaceError(
            f"data=: the space's task.dataset is the registry dataset {dataset!r}; for your own rows name their "
            "columns in the space: task: {dataset: {input_column: COLUMN, label_column: COLUMN}}"
        ) from None


def run(options: SearchOptions) -> str:
    """Validate the space and its dataset and backbone names (told at once, :class:`SpaceError`), then run
    the search ``options`` describe (the driver, :func:`dptune.search.driver.run_search`); return its
    results folder. A warning about the job's stop signals is printed first (not on a dry run)."""
    _check_table_target(options)
    preflight.check_task_names(options.load_space())
    if not options.dry_run:
        for note in preflight.job_stop_warnings(os.environ):
            print(f"warning: {note}", file=sys.stderr, flush=True)
    from dptune.search.driver import run_search

    return run_search(options)


def tune(
    space: str | Path | Mapping[str, Any] | SearchSpace | LoadedSpace = "search_spaces/default.yaml",
    data: Any = None,
    *,
    test_data: Any = None,
    storage: str | Path = "results",
    name: str | None = None,
    resume: bool = False,
    address: str | None = None,
    report: bool = True,
    max_train_examples: int | None = None,
    max_eval_examples: int | None = None,
    report_dir: str | None = None,
    quarantine_corrupt: bool = False,
    charge_unreadable_ledger: bool = False,
    **overrides: Any,
) -> SearchResult:
    """Run a search and return its :class:`SearchResult`, as ``python -m dptune.search`` would.

    ``space``: a YAML file's path, a mapping or a :class:`~dptune.space.SearchSpace`. ``data``: the
    training rows as a file's path (csv, tsv, jsonl, parquet, an image or ``save_to_disk`` folder, a URI)
    or a pandas/polars DataFrame, pyarrow Table or Hugging Face ``Dataset``, read with the space's
    ``task.dataset`` column keys and the same checks as a file; ``test_data`` likewise. ``storage`` and
    ``name``: the results go to ``<storage>/<name>`` (name: the space's). ``resume``: continue the
    search there (a finished one is shown, nothing retrained). ``address``: a Ray cluster to join (else
    ``RAY_ADDRESS``, else an embedded local Ray; a table in memory is refused there: pass a path every node
    reads). ``report_dir``, ``quarantine_corrupt``, ``charge_unreadable_ledger``: as the command's flags
    (``--report-dir`` and the recovery flags its refusals name). ``overrides``: space keys with ``__`` for each
    dot (numpy values are taken as Python's).

    Raises :class:`~dptune.errors.DptuneError` naming the problem (bad input before any compute; a
    search that could not finish, with what to run to resume it).
    """
    options = search_options(
        space,
        data,
        test_data=test_data,
        storage=storage,
        name=name,
        address=address,
        resume=resume,
        report=report,
        overrides={key.replace("__", "."): value for key, value in overrides.items()},
        max_train_examples=max_train_examples,
        max_eval_examples=max_eval_examples,
        report_dir=report_dir,
        quarantine_corrupt=quarantine_corrupt,
        charge_unreadable_ledger=charge_unreadable_ledger,
    )
    return SearchResult.of(options)


@dataclass(frozen=True)
class SearchPrivacy:
    """What a whole search costs in privacy, as its records state it (written once, from one guarantee
    object, by the search): (``epsilon``, ``delta``) and ``covers``, the statement of what they cover.
    ``private``: an end-to-end private search, whose one (ε, δ) covers its tuning and its release."""

    epsilon: float
    delta: float
    covers: str
    private: bool

    def __str__(self) -> str:
        return f"(ε, δ) = ({self.epsilon:.4g}, {self.delta:.3g}): {self.covers}"


@dataclass(frozen=True)
class SearchResult:
    """A search's results at ``root`` (``<storage>/<name>``), read from its records on each access.

    For an end-to-end private search (``private``), :attr:`trials`, :attr:`epochs` and :attr:`classes`
    are the owner's records inside the trust boundary: not covered by (ε, δ), not for release; what may
    be released is :meth:`best` (the release), :attr:`models`, :attr:`epsilon` and the report.
    """

    root: str
    options: SearchOptions
    private: bool  # an end-to-end private search (``privacy.private_selection``)

    @classmethod
    def of(cls, options: SearchOptions) -> SearchResult:
        """Run the search ``options`` describe (:func:`run`) and return its results."""
        root = run(options)
        return cls(root, options, options.load_space().space.privacy.private_selection is not None)

    @property
    def runs_root(self) -> str:
        """Where the per-run tables are: :attr:`root`, or a private search's trust-boundary folder."""
        from dptune.records import runs_root

        return runs_root(self.root, self.private)

    def _table(self, name: str) -> pd.DataFrame:
        from dptune.records import read_table

        return read_table(self.runs_root, name)

    @property
    def trials(self) -> pd.DataFrame:
        """One row per run: its cell, configuration, (ε, δ), σ, q, T, accuracies and status."""
        return self._table("trials")

    @property
    def epochs(self) -> pd.DataFrame:
        """One row per run and epoch: losses and accuracies."""
        return self._table("epochs")

    @property
    def classes(self) -> pd.DataFrame:
        """One row per run and class: the class's test accuracy and difficulty."""
        return self._table("classes")

    def best(self, cell: str | None = None) -> pd.DataFrame:
        """Per cell (``cell``: that cell's ``cell_id`` only) the best configuration, its accuracies with
        their intervals and the configurations within noise of it; for a private search its release: the
        released configuration, its noisy score and total (ε, δ)."""
        from dptune.records import read_table
        from dptune.search.finish.outcome import summary_table

        table = read_table(self.root, "release") if self.private else summary_table(self.root)
        return table if cell is None or table.empty else table[table["cell_id"] == cell].reset_index(drop=True)

    @property
    def models(self) -> list[str]:
        """The published model folders (:func:`dptune.load_model` reads one), in the search's cell order."""
        import json

        from dptune.paths import filesystem
        from dptune.records import read_table
        from dptune.records.weights import CARD_JSON, MODELS_FOLDER

        folder = f"{self.root.rstrip('/')}/{MODELS_FOLDER}"
        fs, path = filesystem(folder)
        import pyarrow.fs as pafs

        cards = [
            info.path.rsplit("/", 1)[0]
            for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=True))
            if info.base_name == CARD_JSON
        ]
        order = {
            (str(row.cell_id), str(row.clipping)): i
            for i, row in enumerate(read_table(self.root, "search", columns=["cell_id", "clipping"]).itertuples())
        }

        def rank(card_folder: str) -> tuple[int, str]:
            with fs.open_input_stream(f"{card_folder}/{CARD_JSON}") as handle:
                model = json.loads(handle.read())["model"]
            return order.get((str(model["cell_id"]), str(model["clipping"])), len(order)), card_folder

        prefix = "" if "://" not in folder else folder[: folder.index("://") + 3]
        return [prefix + found for found in sorted(cards, key=rank)]

    @property
    def epsilon(self) -> SearchPrivacy:
        """The whole search's privacy cost and what it covers (a private search: its one total (ε, δ))."""
        from dptune.records import read_table

        if self.private:
            release = read_table(self.root, "release")
            if release.empty:
                raise DptuneError(f"{self.root}: the search has no release (it did not finish)")
            row = release.iloc[0]
            return SearchPrivacy(float(row["epsilon_total"]), float(row["delta_total"]), str(row["guarantee"]), True)
        search = read_table(self.root, "search")
        if search.empty:
            raise DptuneError(f"{self.root}: the search has not finished (no search rows)")
        row = search.iloc[0]
        return SearchPrivacy(float(row["epsilon_search"]), float(row["delta"]), str(row["guarantee"]), False)

    def report(self, path: str | Path | None = None) -> Report:
        """Build the HTML report (default: ``<root>/report``) and return it (:class:`Report`: its
        ``index.html`` and figures; shown inline in a notebook)."""
        from dptune.search.finished import build_report_at, report_location

        location = report_location(self.root, None if path is None else str(path))
        return Report(build_report_at(self.root, location))

    def resume(self) -> SearchResult:
        """Continue this search (its runs not yet recorded, each exactly once) and return its results."""
        return SearchResult.of(replace(self.options, resume=True, dry_run=False))

    def __repr__(self) -> str:
        shape = "end-to-end private search" if self.private else "search"
        return f"SearchResult({shape} at {self.root!r}, {len(self.models)} model(s))"


@dataclass(frozen=True)
class Report:
    """A built report: its ``index`` (``index.html``'s location); in a notebook, its figures inline."""

    index: str

    @property
    def figures(self) -> list[Path]:
        """The report's PNG figures (a local report's; none for one on an object store)."""
        folder = Path(self.index).parent
        return sorted(folder.glob("*.png")) if "://" not in self.index else []

    def _repr_html_(self) -> str:
        import base64
        import html

        images = "".join(
            f'<figure><img src="data:image/png;base64,{base64.b64encode(figure.read_bytes()).decode()}" '
            f'style="max-width:100%"><figcaption>{html.escape(figure.stem)}</figcaption></figure>'
            for figure in self.figures
        )
        return f"<p>dptune report: <code>{html.escape(self.index)}</code></p>{images}"

    def __str__(self) -> str:
        return self.index
