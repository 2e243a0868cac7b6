"""GSPO (Qwen's group sequence policy optimization) on the tiny model and the bundled 'vowels'
task: GRPO's flow and group-relative advantages, the importance ratio and its clip per sequence
(`rlhfjax/algorithms/gspo.py`), the paper's clip range (3e-4 below, 4e-4 above), and no KL term
(the paper's setting).

  python scripts/train.py --config=configs/gspo_tiny.py --workdir=workdirs/gspo

The optional argument after ':' picks a placement variant of configs/ppo_tiny.py.
"""

import os
import runpy


def get_config(variant: str = "colocated"):
  here = os.path.dirname(os.path.abspath(__file__))
  config = runpy.run_path(os.path.join(here, "grpo_tiny.py"))["get_config"](variant)
  config.ppo.policy_loss = "gspo"
  config.ppo.clip_eps = 3e-4
  config.ppo.clip_eps_high = 4e-4
  config.ppo.kl_loss_coef = 0.0
  config.ppo.loss_agg = "seq_mean_token_mean"  # GSPO's mean over each sequence, then the batch
  return config
