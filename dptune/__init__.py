"""dptune: hyperparameter search for differentially private deep transfer learning.

The public API is :data:`__all__`; every other name, and every sub-module, is dptune's own::

    import dptune
    result = dptune.tune("search_spaces/default.yaml", storage="results")   # a SearchResult
    model = dptune.load_model(result.models[0])                            # a Model
    model.predict(["the launch slipped again", "my hard disk is failing"])

- :func:`tune` runs a search (a space as a file, a mapping or a :class:`SearchSpace`; data as a path or
  a table in memory) and returns a :class:`SearchResult`: ``trials``, ``epochs``, ``classes`` as
  DataFrames, ``best()``, ``models``, ``epsilon`` (a :class:`SearchPrivacy`), ``report()``, ``resume()``;
- :func:`load_model` reads a published model folder into a :class:`Model`: ``predict``,
  ``predict_proba``, ``predict_frame``, ``card``;
- :func:`plan` is the batch-size planner's table (q, T, σ per (ε, B)) before any compute;
- :func:`audit` is an empirical privacy audit: one training with canaries, an ε lower bound;
- :func:`load_space` validates a space file; :class:`DptuneError` is every refusal's type.

Data flows one way: search space → plan (accounting, pruning) → trials → result records → analysis
and reports (docs/ARCHITECTURE.md). Names load on first use, so ``import dptune`` is light; their types
are in ``__init__.pyi``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("dptune")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"

#: Each public name and the module it loads from on first use (PEP 562).
_PUBLIC = {
    "tune": "dptune.search.api",
    "SearchResult": "dptune.search.api",
    "SearchPrivacy": "dptune.search.api",
    "Report": "dptune.search.api",
    "load_model": "dptune.model",
    "Model": "dptune.model",
    "plan": "dptune.plan",
    "audit": "dptune.audit",
    "PlanRow": "dptune.plan.table",
    "load_space": "dptune.space",
    "SearchSpace": "dptune.space",
    "DptuneError": "dptune.errors",
}

__all__ = [
    "DptuneError",
    "Model",
    "PlanRow",
    "Report",
    "SearchPrivacy",
    "SearchResult",
    "SearchSpace",
    "__version__",
    "audit",
    "load_model",
    "load_space",
    "plan",
    "tune",
]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'dptune' has no attribute {name!r}")
    module = importlib.import_module(_PUBLIC[name])
    callable_package = module.__name__ == f"dptune.{name}"  # dptune.plan and dptune.audit are called
    return module if callable_package else getattr(module, name)


def __dir__() -> list[str]:
    return sorted(__all__)
