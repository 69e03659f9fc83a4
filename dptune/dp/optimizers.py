"""DP-SGD and DP-Adam: Opacus' ``DPOptimizer`` with dptune's clipping rules, and the base optimizers.

``RuleDPOptimizer`` overrides the three stages of Opacus' pre-step with the rule's factors from
:mod:`dptune.dp.clipping` — per-example factor f_i (``clip_and_accumulate``), noise std s
(``add_noise``) and update scale (``scale_grad``) — so that after a step's backward passes

    p.grad = update_scale(C, rule, B) · (Σ_i f_i g_i + N(0, s² I)).

With rule ``standard`` this is exactly Opacus' DP-SGD step (flat clipping, std σC, divide by B);
``normalized`` is the paper's Algorithm 1 (divide by C·B as well); ``auto_s`` is AUTO-S. Everything
else (parameter bookkeeping, the processed-gradient checks, ``zero_grad``, ``step`` and Opacus'
``BatchMemoryManager`` skip logic) is Opacus', so ``RuleDPOptimizer(Adam(...))`` is DP-Adam in
Opacus' own training loop. A trial splits the same step at the engine seam
(:mod:`dptune.dp.engine`): the engine releases ``p.grad`` (the Opacus engine through these three
stages), then the trial's base optimizer (:data:`OPTIMIZERS`: Adam → DP-Adam, SGD → DP-SGD) steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from opacus.optimizers.optimizer import DPOptimizer

from dptune._thirdparty import check_processed_flag, generate_noise, mark_as_processed
from dptune.contract import OPTIMIZER_NAMES, check_registry
from dptune.dp.clipping import AUTO_S_STABILITY, ClippingRule, check_rule, clip_factors, noise_std, update_scale

#: Base optimizers by name (the implementations of ``dptune.contract.OPTIMIZER_NAMES``): DP-Adam and
#: DP-SGD are these stepping on a released DP gradient.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = check_registry(
    "optimizer", OPTIMIZER_NAMES, {"adam": torch.optim.Adam, "sgd": torch.optim.SGD})


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


class RuleDPOptimizer(DPOptimizer):
    """Opacus ``DPOptimizer`` whose clip, noise and scale follow a :mod:`dptune.dp.clipping` rule.

    ``max_grad_norm`` is the clip bound C; ``expected_batch_size`` is B = q·N (examples);
    ``noise_multiplier`` is σ. Per-example gradients come from Opacus' grad-sample hooks with
    ``loss_reduction="sum"`` (g_i is one example's gradient).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float,
        clip_bound: float,
        expected_batch_size: float,
        rule: ClippingRule,
        stability: float = AUTO_S_STABILITY,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=clip_bound,
            expected_batch_size=expected_batch_size,  # type: ignore[arg-type]  # B = q·N need not be an int
            loss_reduction="mean",
            generator=generator,
        )
        self.rule: ClippingRule = check_rule(rule)
        self.stability = stability

    def clip_and_accumulate(self) -> None:
        """p.summed_grad += Σ_i f_i · g_i with the rule's per-example factors f_i (flat norms)."""
        grad_samples = self.grad_samples
        factors = clip_factors(per_example_norms(grad_samples), self.max_grad_norm, self.rule, self.stability)
        for p, grad_sample in zip(self.params, grad_samples, strict=True):
            check_processed_flag(p.grad_sample)
            grad = torch.einsum("i,i...", factors.to(grad_sample.device, p.dtype), grad_sample.to(p.dtype))
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            mark_as_processed(p.grad_sample)

    def add_noise(self) -> None:
        """p.grad = p.summed_grad + N(0, s² I), s = ``noise_std(σ, C, rule)``.

        A parameter with no accumulated sum (an empty Poisson batch: no backward pass ran) gets
        noise alone, as the mechanism requires.
        """
        std = noise_std(self.noise_multiplier, self.max_grad_norm, self.rule)
        for p in self.params:
            summed = torch.zeros_like(p) if p.summed_grad is None else p.summed_grad
            check_processed_flag(summed)
            noise = generate_noise(std=std, reference=summed, generator=self.generator, secure_mode=self.secure_mode)
            p.grad = (summed + noise).view_as(p)
            mark_as_processed(summed)

    def scale_grad(self) -> None:
        """p.grad *= ``update_scale(C, rule, B)`` (1/B; 1/(C·B) for ``normalized``)."""
        scale = update_scale(self.max_grad_norm, self.rule, self.expected_batch_size)
        for p in self.params:
            p.grad *= scale
