"""Reward-model training of the tiny model on the bundled 'vowels' preferences, 8 devices.

  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm
  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm \
      --config.init.checkpoint=workdirs/sft/checkpoints

The SFT config's model, placement, data and checkpoint settings, with the reward model's own
schedule. `init.checkpoint` starts the trunk from an SFT run (the value head starts at zero).
Rerunning with the same workdir resumes. PPO's reward role loads WORKDIR/checkpoints (item
'reward').
"""

import os
import runpy

import ml_collections

from rlhfjax.config import RewardModelConfig, complete


def get_config() -> ml_collections.ConfigDict:
  sft = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft_tiny.py")
  config = runpy.run_path(sft)["get_config"]()
  config.micro_batches = 1
  config.total_steps = 30
  config.eval_every = 10
  del config.data["demonstrations"]
  config.data.preferences = ""  # empty: the bundled preferences of data.task
  config.optimizer.learning_rate = 1e-3
  config.checkpoint.every_steps = 10
  # Every field of RewardModelConfig settable from the command line (defaults unless set above).
  return complete(config, RewardModelConfig)
