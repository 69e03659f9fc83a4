"""The trust boundary of an end-to-end private search: the folder its guarantee needs hidden.

An end-to-end private search (``privacy.private_selection``) keeps its per-run tables (trials,
epochs, classes, diagnostics), its privacy ledger and Ray Tune's state in
``<root>/inside_trust_boundary/`` (``runs_root``), beside a README saying why: they reveal the
secret number of runs and hold exact validation accuracies, so publishing them voids the
guarantee. ``<root>`` itself then holds only what may leave: the ``search`` rows (no count of
runs, no composition over them, no timestamp) and the ``release``.
"""

from __future__ import annotations

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
