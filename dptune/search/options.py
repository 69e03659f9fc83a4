"""The options of a search once they are validated: what ``python -m dptune.search`` (:mod:`dptune.search.cli`)
and :func:`dptune.tune` (:mod:`dptune.search.api`) build, and what the driver runs.

Plain data shared by the command line and the Python API, which build them, and the driver, which runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptune.space import LoadedSpace, load_space, parse_space


@dataclass(frozen=True)
class SearchOptions:
    """A search's validated options. ``space_path`` is the space file; or, with ``space_text`` (a space
    given in Python), a name for messages whose folder relative paths resolve from."""

    space_path: Path
    storage: str
    name: str | None
    address: str | None
    resume: bool
    dry_run: bool
    report: bool
    overrides: dict[str, Any]
    max_train_examples: int | None
    max_eval_examples: int | None
    quarantine_corrupt: bool = False
    charge_unreadable_ledger: bool = (
        False  # charge unreadable start files conservatively (dptune.search.damaged_ledger)
    )
    report_dir: str | None = None  # None: <storage>/<name>/report
    space_text: str | None = None  # the space's YAML, when it was given in Python rather than as a file

    def load_space(self) -> LoadedSpace:
        """The space, validated with the overrides (``SpaceError`` naming the file, the key and what is allowed)."""
        if self.space_text is not None:
            return parse_space(self.space_text, self.space_path, self.overrides)
        return load_space(self.space_path, self.overrides)
