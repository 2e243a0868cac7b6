"""REINFORCE++ on the tiny model and the bundled 'vowels' task, 8 devices: no critic, returns of
the KL-shaped token rewards whitened over the batch.

  python scripts/train.py --config=configs/reinforce_pp_tiny.py --workdir=workdirs/rpp

The optional argument after ':' picks a placement variant of configs/ppo_tiny.py.
"""

import os
import runpy


def get_config(variant: str = "colocated"):
  here = os.path.dirname(os.path.abspath(__file__))
  config = runpy.run_path(os.path.join(here, "ppo_tiny.py"))["get_config"](variant)
  config.algorithm.name = "reinforce_pp"
  config.ppo.kl_coef = 0.01
  config.ppo.whiten_advantages = False  # the estimator whitens the returns itself
  return config
