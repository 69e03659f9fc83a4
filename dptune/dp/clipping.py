"""Per-example clipping rules shared by every DP engine (Opacus path and the FiLM engine).

A DP step with expected batch size ``B`` (= q·N under Poisson sampling), per-example gradients
``g_i`` and clip bound ``C`` computes

    update = scale · (Σ_i f_i · g_i + N(0, s² I))

where the per-example factor ``f_i``, the noise standard deviation ``s`` and the ``scale`` depend
on the rule:

==============  =========================  ============  ===============
rule            f_i                        s             scale
==============  =========================  ============  ===============
``standard``    min(1, C / ‖g_i‖)          σ·C           1 / B
``normalized``  min(1, C / ‖g_i‖)          σ·C           1 / (C·B)
``auto_s``      1 / (‖g_i‖ + γ)            σ             1 / B
==============  =========================  ============  ===============

``normalized`` is the paper's Algorithm 1 (clip-and-rescale, De et al. 2022): dividing the noised
sum by C as well makes the update scale independent of C, so learning rate and clip bound
decouple. ``auto_s`` is automatic clipping AUTO-S (Bu et al. 2023) with stability constant γ: the
clipped vector has norm < 1, so sensitivity is 1 and the noise std is σ. In every rule each
summand has norm ≤ the sensitivity (C, C or 1), which is what the accountant assumes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dptune.contract import CLIPPING_RULES, ClippingRule
from dptune.dp import faults

if TYPE_CHECKING:  # torch-free at import, like the rule names in dptune.contract
    import torch

#: Stability constant γ of AUTO-S (Bu et al. 2023 use 0.01).
AUTO_S_STABILITY = 0.01
#: Guards C/‖g‖ against division by zero; matches Opacus' flat clipping.
_NORM_EPSILON = 1e-6


def check_rule(rule: str) -> ClippingRule:
    """Return ``rule`` if it names a clipping rule, else raise ``ValueError`` naming the choices."""
    if rule not in CLIPPING_RULES:
        raise ValueError(f"clipping rule {rule!r} is unknown; choose one of {', '.join(CLIPPING_RULES)}")
    return rule  # type: ignore[return-value]


def clip_factors(
    per_example_norms: torch.Tensor,
    clip_bound: float | torch.Tensor,
    rule: ClippingRule,
    stability: float = AUTO_S_STABILITY,
) -> torch.Tensor:
    """Per-example factors f_i that multiply g_i before summation (see module table).

    ``per_example_norms`` are ‖g_i‖ over all trainable parameters (flat clipping), shape (n,);
    ``clip_bound`` is C, or a tensor of C values that broadcasts against them (the fused runner's
    ``(k, 1)`` bounds of k configurations against ``(k, n)`` norms).
    """
    if faults.clipping_bypassed():
        return per_example_norms.new_ones(()).expand_as(per_example_norms).clone()
    if rule == "auto_s":
        return 1.0 / (per_example_norms + stability)
    return (clip_bound / (per_example_norms + _NORM_EPSILON)).clamp(max=1.0)


def noise_std(noise_multiplier: float, clip_bound: float, rule: ClippingRule) -> float:
    """Standard deviation s of the Gaussian noise added to the clipped sum (module table)."""
    std = noise_multiplier if rule == "auto_s" else noise_multiplier * clip_bound
    return std * faults.noise_factor()


def update_scale(clip_bound: float, rule: ClippingRule, expected_batch_size: float) -> float:
    """Factor applied to the noised sum to form the update direction (module table)."""
    if rule == "normalized":
        return 1.0 / (clip_bound * expected_batch_size)
    return 1.0 / expected_batch_size
