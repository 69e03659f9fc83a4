"""The options of ``python -m dptune.search`` once :mod:`dptune.search.cli` has validated them.

Plain data shared by the command line, which builds them, and the driver, which runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SearchOptions:
    """Command-line options after validation."""

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
