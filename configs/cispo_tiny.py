"""CISPO (MiniMax-M1's clipped importance-sampling policy optimization) on the tiny model and
the bundled 'vowels' task: GRPO's flow and group-relative advantages, each token's REINFORCE
loss weighed by its importance ratio clipped from above, without gradient through the weight
(`rlhfjax/algorithms/cispo.py`), token-level aggregation, no KL term.

  python scripts/train.py --config=configs/cispo_tiny.py --workdir=workdirs/cispo

The optional argument after ':' picks a placement variant of configs/ppo_tiny.py.
"""

import os
import runpy


def get_config(variant: str = "colocated"):
  here = os.path.dirname(os.path.abspath(__file__))
  config = runpy.run_path(os.path.join(here, "grpo_tiny.py"))["get_config"](variant)
  config.ppo.policy_loss = "cispo"
  config.ppo.clip_eps = 1.0  # a lower bound of 0: MiniMax-M1 clips only from above
  config.ppo.clip_eps_high = 0.28
  config.ppo.kl_loss_coef = 0.0
  config.ppo.loss_agg = "token_mean"
  return config
