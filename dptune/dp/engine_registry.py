"""The per-example gradient engines by name: the one place to add one (as timm registers models).

:data:`ENGINES` maps each engine name of :data:`dptune.contract.ENGINE_NAMES` (but ``auto``, a
choice among them) to an :class:`EngineEntry`, in the order ``auto`` tries them; the first whose
refusal is ``None`` for a model runs it. An entry names its module and attributes rather than
holding them, so an engine's module is imported on first use: the Opacus engine imports Opacus and
the FiLM engine timm (seconds each), which a trial on cached features never needs.

Adding an engine: implement :class:`~dptune.dp.engine.DPEngine` and an
:class:`~dptune.dp.engine.EngineFactory` in a module of its own (which imports the seam,
:mod:`dptune.dp.engine`, and never this registry), add its name to ``EngineName`` in
:mod:`dptune.contract` and its entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from torch import nn

from dptune.contract import ENGINE_NAMES
from dptune.dp.engine import EngineFactory, check_engine

#: ``refusal(model, peft) -> str | None``: why an engine cannot run ``model`` fine-tuned with ``peft``.
Refusal = Callable[[nn.Module, str], "str | None"]


@dataclass(frozen=True)
class EngineEntry:
    """Where an engine lives: ``module`` (imported on first use), its :class:`EngineFactory`
    attribute ``factory`` and its :data:`Refusal` attribute ``refusal`` (``None``: it runs any
    model that passed :func:`dptune.models.check_dp_compatible`)."""

    module: str
    factory: str
    refusal: str | None = None

    def load(self) -> EngineFactory:
        """The engine factory (imports :attr:`module`)."""
        return cast(EngineFactory, getattr(importlib.import_module(self.module), self.factory))

    def refuse(self, model: nn.Module, peft: str) -> str | None:
        """Why this engine cannot run ``model`` with ``peft`` (``None``: it can)."""
        if self.refusal is None:
            return None
        refusal: Refusal = getattr(importlib.import_module(self.module), self.refusal)
        return refusal(model, peft)


#: The engines, in the order ``auto`` tries them: the fast closed-form FiLM/head engine where it
#: applies, else Opacus' hooks.
ENGINES: dict[str, EngineEntry] = {
    "film": EngineEntry("dptune.dp.film", "FilmEngine", refusal="engine_refusal"),
    "opacus": EngineEntry("dptune.dp.opacus_engine", "OpacusEngine"),
}
if set(ENGINES) != set(ENGINE_NAMES) - {"auto"}:
    raise TypeError(f"the engines {tuple(ENGINES)} do not match the names {ENGINE_NAMES} of dptune.contract (but auto)")


def select_engine(requested: str, model: nn.Module, peft: str) -> EngineFactory:
    """The engine factory for a trial of ``model`` fine-tuned with ``peft``.

    ``"auto"``: the first engine of :data:`ENGINES` that can run the model (FiLM when ``peft`` is
    film/head and it supports every trainable module, else Opacus hooks). A name: that engine, or
    a ``ValueError`` saying why it cannot run the model and what to use instead.
    """
    choice = check_engine(requested)
    if choice != "auto":
        refusal = ENGINES[choice].refuse(model, peft)
        if refusal is not None:
            others = " or ".join(repr(name) for name in (*ENGINES, "auto") if name != choice)
            raise ValueError(f"engine {choice!r} cannot run this model: {refusal}; use engine {others}")
        return ENGINES[choice].load()
    for entry in ENGINES.values():
        if entry.refuse(model, peft) is None:
            return entry.load()
    refusals = "; ".join(f"{name}: {entry.refuse(model, peft)}" for name, entry in ENGINES.items())
    raise ValueError(f"no engine can run this model ({refusals})")
