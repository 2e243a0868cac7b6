"""Reward-model training of the tiny model on the bundled 'vowels' preferences, 8 devices.

  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm
  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm \
      --config.init.reward=workdirs/sft/checkpoints

The SFT config's model, placement, data and checkpoint settings, with the reward model's own
schedule. `init.reward` starts the trunk from an SFT run (the value head starts at zero).
Rerunning with the same workdir resumes. PPO's reward role loads WORKDIR/checkpoints (item
'reward').
"""

import os
import runpy

import ml_collections

from rlhfjax.config import ExperimentConfig, complete


def get_config() -> ml_collections.ConfigDict:
  sft = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft_tiny.py")
  config = runpy.run_path(sft)["get_config"]()
  config.algorithm.name = "rm"
  config.supervised.micro_batches = 1
  config.total_steps = 30
  config.eval.every_steps = 10
  config.data.preferences = ""  # empty: the bundled preferences of data.task
  # The SFT schedule at the reward model's own learning rate.
  config.reward_optimizer = ml_collections.ConfigDict(config.actor_optimizer.to_dict())
  config.reward_optimizer.learning_rate = 1e-3
  config.checkpoint.every_steps = 10
  config.init.reward = ""  # an SFT run's checkpoints, or a Hugging Face causal LM
  return complete(config, ExperimentConfig)
