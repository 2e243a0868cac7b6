"""Online DPO on the tiny model and the bundled 'vowels' task, 8 devices: two samples per prompt
ranked by the rule reward, DPO steps on the pairs (2 epochs of 2 mini-batches: four optimizer
steps per iteration, as PPO and GRPO take), the rollout synced as in PPO.

  python scripts/train.py --config=configs/online_dpo_tiny.py --workdir=workdirs/odpo

`online_dpo` sets the sampling and the update schedule, `dpo` the loss; no `ppo` field is read
(but `ppo.max_skipped_updates`, the runner's). The optional argument after ':' picks a
placement variant of configs/ppo_tiny.py.
"""

import os
import runpy

import ml_collections

from rlhfjax.config import PPOSection, complete


def get_config(variant: str = "colocated"):
  here = os.path.dirname(os.path.abspath(__file__))
  config = runpy.run_path(os.path.join(here, "ppo_tiny.py"))["get_config"](variant)
  config.algorithm.name = "online_dpo"
  # ppo_tiny's PPO settings: online DPO would refuse them rather than ignore them.
  config.ppo = complete(ml_collections.ConfigDict(), PPOSection)
  config.online_dpo.samples_per_prompt = 2
  # Four optimizer steps per iteration over the iteration's pairs. With one (as before) the
  # reward rose only 0.014 -> 0.04 in 40 iterations; see tests/test_dpo.py's learning test.
  config.online_dpo.epochs = 2
  config.online_dpo.mini_batches = 2
  config.dpo = {
    "beta": 0.1,
    "loss": "sigmoid",
    "label_smoothing": 0.0,
    "packing": False,
    "max_tokens_per_micro_batch": 0,
  }
  return config
