"""The trust boundary of an end-to-end private search: the folder its guarantee needs hidden.

An end-to-end private search (``privacy.private_selection``) keeps its per-run tables (trials,
epochs, classes, diagnostics), its privacy ledger and Ray Tune's state in
``<root>/inside_trust_boundary/`` (``runs_root``), beside a README saying why: they reveal the
secret number of runs and hold exact validation accuracies, so publishing them voids the
guarantee. ``<root>`` itself then holds only what may leave: the ``search`` rows (no count of
runs, no composition over them, no timestamp) and the ``release``. Everything such a search creates
is owner-only (:func:`owner_only`), so no other local user reads the boundary or its sizes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

#: The folder under a private search's results that holds what its guarantee needs hidden.
TRUST_BOUNDARY = "inside_trust_boundary"

#: The README written into ``TRUST_BOUNDARY``.
TRUST_BOUNDARY_README = """These are the per-run records of an end-to-end private search (dptune's
privacy.private_selection).

They stay inside the data owner's trust boundary. They are NOT covered by the search's (epsilon, delta):
they reveal the secret number of runs K (which the private-selection bound needs hidden), every run's
configuration, exact validation accuracies of private rows, and Ray Tune's state. Publishing any file
under this folder voids the guarantee. What may be released is the release table (and the search table)
in the folder above, and the report built from it.
"""


def runs_root(results_root: str, private: bool) -> str:
    """Where a search's per-run tables and Ray Tune's state go: ``results_root``, or for an
    end-to-end private search its ``TRUST_BOUNDARY`` folder."""
    return f"{results_root.rstrip('/')}/{TRUST_BOUNDARY}" if private else results_root


#: The umask of everything an end-to-end private search creates: files 0600, folders 0700.
OWNER_ONLY_UMASK = 0o077


@contextlib.contextmanager
def owner_only() -> Iterator[None]:
    """Create files and folders owner-only (``OWNER_ONLY_UMASK``) in the ``with`` block, and in every
    process started from it (a umask is inherited); the previous umask is restored on the way out."""
    previous = os.umask(OWNER_ONLY_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


def release_label(release: Mapping[str, Any]) -> str:
    """The name of an end-to-end private search's release, from its own guarantee: the total
    (ε, δ) that covers the tuning and the model, and its epoch budget (``eps=8|delta=1e-05|epochs=10``).
    Never the per-run budget of the cell the runs were planned in (``cell_id``): a reader of the name
    must see the ε the model has."""
    epsilon, delta = float(release["epsilon_total"]), float(release["delta_total"])
    return f"eps={epsilon:g}|delta={delta:g}|epochs={int(release['epochs'])}"


def withheld_reason(release: Mapping[str, Any]) -> str:
    """Why a release's test accuracy is not released: its row's ``test_withheld`` (results of schema 6
    and before have none: the general reason)."""
    reason = release.get("test_withheld")
    return str(reason) if isinstance(reason, str) and reason else "the test split is private data"
