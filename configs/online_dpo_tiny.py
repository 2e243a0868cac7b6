"""Online DPO on the tiny model and the bundled 'vowels' task, 8 devices: two samples per prompt
ranked by the rule reward, a DPO step on each pair, the rollout synced as in PPO.

  python scripts/train.py --config=configs/online_dpo_tiny.py --workdir=workdirs/odpo

The optional argument after ':' picks a placement variant of configs/ppo_tiny.py.
"""

import os
import runpy


def get_config(variant: str = "colocated"):
  here = os.path.dirname(os.path.abspath(__file__))
  config = runpy.run_path(os.path.join(here, "ppo_tiny.py"))["get_config"](variant)
  config.algorithm.name = "online_dpo"
  config.ppo.group_size = 2
  config.dpo = {"beta": 0.1, "loss": "sigmoid", "label_smoothing": 0.0}
  return config
