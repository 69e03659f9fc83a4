"""Differentially private training pieces (Ray-free).

- :mod:`~dptune.dp.clipping`: the clipping rules ``standard | normalized | auto_s``;
- :mod:`~dptune.dp.engine`: the ``DPEngine`` seam (one Poisson batch → released ``p.grad``);
  :mod:`~dptune.dp.opacus_engine` (Opacus hooks) and :mod:`~dptune.dp.film` (closed-form FiLM/head
  per-example gradients) implement it, and :mod:`~dptune.dp.engine_registry` names them and selects
  one for a trial (the one place to add an engine);
- :mod:`~dptune.dp.optimizers`: the base optimizers of DP-SGD and DP-Adam (Opacus' ``DPOptimizer``
  with the rules is in :mod:`~dptune.dp.opacus_engine`);
- :mod:`~dptune.dp.sampling`: Poisson sampling and physical batches;
- :mod:`~dptune.dp.precision`: the forward pass's autocast, shared by the engines and evaluation;
- :mod:`~dptune.dp.diagnostics`: the paper's gradient-norm, w_y(C), MSE and C* diagnostics;
- :mod:`~dptune.dp.coins`: the coins of the mechanism (seed sequences, generators).

When BatchNorm is accepted under DP (frozen running statistics) and its per-example γ/β gradients
live with the models, in :mod:`dptune.models.batch_norm`. The runners that use these pieces are
:mod:`dptune.runners`.
"""
