"""GRPO on the tiny model and the bundled 'vowels' task, 8 devices: no critic, group-normalised
advantages of 4 samples per prompt, the KL to the reference as a loss term (k3).

  python scripts/train.py --config=configs/grpo_tiny.py --workdir=workdirs/grpo
  python scripts/train.py --config=configs/grpo_tiny.py:disaggregated --workdir=...

Dr. GRPO: --config.ppo.loss_agg=seq_mean_token_sum_norm --config.ppo.normalize_group_std=False.
KL in the reward instead: --config.ppo.kl_loss_coef=0 --config.ppo.kl_coef=0.01.
The optional argument after ':' picks a placement variant of configs/ppo_tiny.py.
"""

import os
import runpy


def get_config(variant: str = "colocated"):
  here = os.path.dirname(os.path.abspath(__file__))
  config = runpy.run_path(os.path.join(here, "ppo_tiny.py"))["get_config"](variant)
  config.algorithm.name = "grpo"
  config.ppo.group_size = 4
  config.ppo.kl_estimator = "k3"
  config.ppo.kl_coef = 0.0
  config.ppo.kl_loss_coef = 0.01
  config.ppo.loss_agg = "seq_mean_token_mean"
  config.ppo.whiten_advantages = False
  return config
