"""SFT of the tiny model on the bundled 'vowels' demonstrations, 8 devices (fsdp=4 x tensor=2).

  python scripts/train_sft.py --config=configs/sft_tiny.py --workdir=workdirs/sft
  python scripts/train_sft.py --config=configs/sft_tiny.py --workdir=workdirs/sft \
      --config.total_steps=200 --config.placement.tensor=1 --config.supervised.batch_size=16
  python scripts/train_sft.py --config=configs/sft_tiny.py --workdir=workdirs/sft \
      --config.placement.strategy=auto --config.placement.hardware=h100

Rerunning with the same workdir resumes from its latest checkpoint. PPO starts its actor and
reference from WORKDIR/checkpoints (item 'actor', `init.actor`).
"""

import ml_collections

from rlhfjax.config import ExperimentConfig, complete


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.algorithm = ml_collections.ConfigDict({"name": "sft"})
  config.seed = 0
  config.supervised = ml_collections.ConfigDict(
    {"batch_size": 32, "micro_batches": 2, "max_len": 64}
  )
  config.total_steps = 60
  config.eval = ml_collections.ConfigDict({"every_steps": 20})  # and before and after
  config.log_every = 5

  config.model = ml_collections.ConfigDict()
  config.model.size = "tiny"
  # A Hugging Face checkpoint directory instead (its architecture, weights and tokenizer):
  # --config.model.size= --config.model.hf=/path/to/Qwen2.5-0.5B-Instruct
  config.model.hf = ""

  config.placement = ml_collections.ConfigDict()
  config.placement.strategy = "colocated"  # 'auto': the planner picks data x fsdp x tensor
  config.placement.num_devices = 8
  config.placement.data = 1
  config.placement.tensor = 2
  config.placement.memory_per_device_gb = 16.0
  config.placement.hardware = "local"  # auto: a preset, or 'local' with a calibration file
  config.placement.efficiency = ""
  # Unused (one trained model is placed by data x fsdp x tensor), but settable like every field.
  config.placement.explicit = ml_collections.ConfigDict(
    {role: {} for role in ("actor", "critic", "reference", "reward", "rollout")}
  )

  config.data = ml_collections.ConfigDict()
  config.data.task = "vowels"
  config.data.demonstrations = ""
  config.data.train_split = "train[:90%]"
  config.data.eval_split = "train[90%:]"
  config.data.tokenizer = "byte"
  config.data.data_dir = ""  # empty: WORKDIR/data
  config.data.chat_template = False
  config.data.on_bad_record = "error"  # or "skip" (counted)
  config.data.on_long_prompt = "truncate"  # or "skip", "error"

  config.actor_optimizer = ml_collections.ConfigDict(
    {"learning_rate": 3e-3, "warmup_steps": 5, "decay": "cosine", "max_grad_norm": 1.0}
  )

  # The task's rule, as every config names a reward; SFT and the reward model do not use it.
  config.reward = ml_collections.ConfigDict({"fn": "rlhfjax.tasks:vowel_reward"})

  config.checkpoint = ml_collections.ConfigDict(
    {"every_steps": 20, "keep": 2, "async_save": True, "resume": True}
  )
  # A Hugging Face causal LM or an rlhfjax run's checkpoints to start from (empty: random).
  config.init = ml_collections.ConfigDict({"actor": ""})
  # Every field of ExperimentConfig settable from the command line, at its default unless set
  # above.
  return complete(config, ExperimentConfig)
