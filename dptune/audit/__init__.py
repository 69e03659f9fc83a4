"""The empirical privacy audit: ``dptune.audit(...)`` and ``python -m dptune.audit``.

Every (ε, δ) dptune states is an upper bound from the mechanism it believes it runs. An audit checks
the whole of it, as a search runs it, against what an adversary can infer: one training of the
fused runner with m canaries, each in with probability ½ by a secret coin, an inclusion guess for the
most and least confident, and the one-run theorem of Steinke, Nasr & Jagielski (NeurIPS 2023) turning
the right guesses into an empirical ε lower bound (docs/PRIVACY.md, "Auditing"):

- :mod:`~dptune.audit.bound`: the theorem (torch-free);
- :mod:`~dptune.audit.canaries`: the canaries, input (black-box) and gradient (white-box);
- :mod:`~dptune.audit.run`: the audit's training through ``run_fused`` and each run's bounds;
- :mod:`~dptune.audit.records`: the folder it writes (Parquet, summary, figure);
- :mod:`~dptune.audit.cite`: a published model's card citing its audit, with the two trainings composed;
- :mod:`~dptune.audit.api`: :func:`audit`; :mod:`~dptune.audit.cli`: the command.

A broken mechanism for the audit's own tests is injected with :mod:`dptune.dp.faults`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from dptune.audit.api import DEFAULT_CANARIES, AuditReport, audit, default_configuration
from dptune.audit.bound import AuditBound, best_bound, ceiling, epsilon_lower_bound, p_value
from dptune.audit.cite import cite_audit
from dptune.audit.run import BLACK_BOX, WHITE_BOX, AuditError

__all__ = [
    "BLACK_BOX",
    "DEFAULT_CANARIES",
    "WHITE_BOX",
    "AuditBound",
    "AuditError",
    "AuditReport",
    "audit",
    "best_bound",
    "ceiling",
    "cite_audit",
    "default_configuration",
    "epsilon_lower_bound",
    "p_value",
]


class _Auditor(types.ModuleType):
    """This package, callable: ``dptune.audit(...)`` is :func:`~dptune.audit.api.audit`."""

    def __call__(self, *args: Any, **kwargs: Any) -> AuditReport:
        return audit(*args, **kwargs)


sys.modules[__name__].__class__ = _Auditor
