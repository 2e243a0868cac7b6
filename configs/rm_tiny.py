"""Reward-model training of the tiny model on the bundled 'vowels' preferences, 8 devices.

  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm
  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm \
      --config.init.checkpoint=workdirs/sft/checkpoints

`init.checkpoint` starts the trunk from an SFT run (the value head starts at zero). Rerunning
with the same workdir resumes. PPO's reward role loads WORKDIR/checkpoints (item 'reward').
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.batch_size = 32
  config.micro_batches = 1
  config.max_len = 64
  config.total_steps = 30
  config.eval_every = 10
  config.log_every = 5

  config.model = ml_collections.ConfigDict()
  config.model.size = "tiny"

  config.placement = ml_collections.ConfigDict()
  config.placement.num_devices = 8
  config.placement.tensor = 2
  config.placement.memory_per_device_gb = 16.0

  config.data = ml_collections.ConfigDict()
  config.data.task = "vowels"
  config.data.preferences = ""
  config.data.train_split = "train[:90%]"
  config.data.eval_split = "train[90%:]"
  config.data.tokenizer = "byte"
  config.data.data_dir = ""  # empty: WORKDIR/data

  config.optimizer = ml_collections.ConfigDict(
    {"learning_rate": 1e-3, "warmup_steps": 5, "decay": "cosine", "max_grad_norm": 1.0}
  )

  config.checkpoint = ml_collections.ConfigDict(
    {"every_steps": 10, "keep": 2, "async_save": True, "resume": True}
  )
  config.init = ml_collections.ConfigDict({"hf_checkpoint": "", "checkpoint": ""})
  return config
