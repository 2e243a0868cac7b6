"""RLOO on the tiny model and the bundled 'vowels' task, 8 devices: no critic, each sample's
baseline is the mean reward of the other 3 samples of its prompt; KL in the reward.

  python scripts/train.py --config=configs/rloo_tiny.py --workdir=workdirs/rloo

The optional argument after ':' picks a placement variant of configs/ppo_tiny.py.
"""

import os
import runpy


def get_config(variant: str = "colocated"):
  here = os.path.dirname(os.path.abspath(__file__))
  config = runpy.run_path(os.path.join(here, "ppo_tiny.py"))["get_config"](variant)
  config.algorithm.name = "rloo"
  config.ppo.group_size = 4
  config.ppo.kl_coef = 0.01
  config.ppo.whiten_advantages = False
  return config
