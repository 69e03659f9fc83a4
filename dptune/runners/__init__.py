"""The runners: what turns :class:`~dptune.contract.TrialConfig` s into
:class:`~dptune.contract.TrialResult` s, one DP fine-tune each. Ray-free; the search calls them
from its Ray actors (``dptune.search.runs.execution``) and tests call them directly.

- :mod:`~dptune.runners.trial`: ``run_trial(config, report)``, one trial of any backbone × PEFT,
  and ``check_trial_can_run`` (torch-free to import); its implementation is
  :mod:`~dptune.runners.trainer` (the model, the engine, the Poisson loop, evaluation, diagnostics);
- :mod:`~dptune.runners.fused`: ``run_fused(configs)``, the configurations of one cell that
  differ only in C, B, η and seed trained side by side as stacked linear heads on cached features;
  one group of them is :mod:`~dptune.runners.fused_group`, what it trains on (the training split
  on the device, the Poisson batches) :mod:`~dptune.runners.batches`, the stacked heads' tensor
  math :mod:`~dptune.runners.heads`;
- :mod:`~dptune.runners.common`: what both share (checks, workload loading, the diagnostics
  probe, evaluation records, the noisy selection score). The coins are :mod:`dptune.dp.coins`.

Import the runner from its module (``from dptune.runners.trial import run_trial``): this package
imports nothing, so that importing the one-trial entry point stays free of torch.
"""
