"""DAPO on the tiny model and the bundled 'vowels' task, 8 devices: group-relative advantages
(4 samples per prompt), decoupled clip (0.2 / 0.28), dynamic sampling (groups whose rewards
are all equal are dropped and more are generated, up to 2 extra rounds), soft overlong
punishment over the last 4 tokens, token-mean loss, no KL.

  python scripts/train.py --config=configs/dapo_tiny.py --workdir=workdirs/dapo

The optional argument after ':' picks a placement variant of configs/ppo_tiny.py.
"""

import os
import runpy


def get_config(variant: str = "colocated"):
  here = os.path.dirname(os.path.abspath(__file__))
  config = runpy.run_path(os.path.join(here, "ppo_tiny.py"))["get_config"](variant)
  config.algorithm.name = "dapo"
  config.ppo.group_size = 4
  config.ppo.clip_eps = 0.2
  config.ppo.clip_eps_high = 0.28
  config.ppo.kl_coef = 0.0
  config.ppo.loss_agg = "token_mean"
  config.ppo.whiten_advantages = False
  config.ppo.dynamic_sampling_rounds = 2
  config.ppo.overlong_buffer = 4
  return config
