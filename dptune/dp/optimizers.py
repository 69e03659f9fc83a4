"""The base optimizers of DP-SGD and DP-Adam, and per-example gradient norms (torch only).

A DP step is split at the engine seam (:mod:`dptune.dp.engine`): the engine releases the private
gradient ``p.grad`` (clipped, noised, scaled by the rule of :mod:`dptune.dp.clipping`), then the
trial's base optimizer (:data:`OPTIMIZERS`: Adam → DP-Adam, SGD → DP-SGD) steps on it. Opacus'
``DPOptimizer`` with the rules is :class:`dptune.dp.opacus_engine.RuleDPOptimizer`; it lives with
the Opacus engine so that a trial that never uses Opacus never imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dptune.contract import OPTIMIZER_NAMES, check_registry

#: Base optimizers by name (the implementations of ``dptune.contract.OPTIMIZER_NAMES``): DP-Adam and
#: DP-SGD are these stepping on a released DP gradient.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = check_registry(
    "optimizer", OPTIMIZER_NAMES, {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}
)


def check_optimizer(name: str) -> str:
    """Return ``name`` if it names a base optimizer, else raise naming the choices."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")
    return name


def build_optimizer(name: str, params: Sequence[torch.nn.Parameter], learning_rate: float) -> torch.optim.Optimizer:
    """The base (non-private) optimizer ``name`` over ``params`` with step size η = ``learning_rate``."""
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    return OPTIMIZERS[check_optimizer(name)](params, lr=learning_rate)


def per_example_norms(grad_samples: Sequence[torch.Tensor]) -> torch.Tensor:
    """‖g_i‖₂ over all parameters (flat), in float32, from per-parameter per-example gradients.

    ``grad_samples[k]`` has shape (n, *shape of parameter k); the result has shape (n,).
    """
    per_param = [torch.linalg.vector_norm(g.reshape(len(g), -1), dim=1, dtype=torch.float32) for g in grad_samples]
    device = per_param[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in per_param], dim=1), dim=1)
