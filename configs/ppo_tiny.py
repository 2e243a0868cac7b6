"""PPO on the tiny model and the bundled 'vowels' task, 8 devices: the demo and test config.

  python scripts/train_ppo.py --config=configs/ppo_tiny.py --workdir=workdirs/ppo
  python scripts/train_ppo.py --config=configs/ppo_tiny.py:disaggregated --workdir=...
  python scripts/show_placement.py --config=configs/ppo_tiny.py \
      --config.placement.strategy=interleaved --config.placement.split_actor_critic=True

The optional argument after ':' picks a placement variant: colocated (default), interleaved,
interleaved_split, disaggregated, disaggregated_async, explicit.
"""

import ml_collections

_VARIANTS = (
  "colocated",
  "interleaved",
  "interleaved_split",
  "disaggregated",
  "disaggregated_async",
  "explicit",
)


def get_config(variant: str = "colocated") -> ml_collections.ConfigDict:
  if variant not in _VARIANTS:
    raise ValueError(f"unknown variant {variant!r} of ppo_tiny; known: {', '.join(_VARIANTS)}")
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.total_steps = 60
  config.log_every = 1

  config.model = ml_collections.ConfigDict()
  config.model.size = "tiny"
  # A Hugging Face checkpoint directory instead (its architecture, weights and tokenizer):
  # --config.model.size= --config.model.hf=/path/to/Qwen2.5-0.5B-Instruct
  config.model.hf = ""

  config.placement = ml_collections.ConfigDict()
  config.placement.strategy = variant.split("_")[0]
  config.placement.num_devices = 8
  config.placement.memory_per_device_gb = 16.0
  config.placement.tensor = 1
  config.placement.rollout_tensor = 2
  config.placement.rollout_fraction = 0.5
  config.placement.split_actor_critic = variant == "interleaved_split"
  config.placement.split_reference_reward = False
  # strategy=auto: the planner's hardware ('local' needs efficiency = a calibrate.py output).
  config.placement.hardware = "local"
  config.placement.efficiency = ""
  # Used with the 'explicit' variant: actor, reference and rollout share the first half,
  # critic and reward the second; the two halves update concurrently.
  config.placement.explicit = ml_collections.ConfigDict()
  first, second = (0, 1, 2, 3), (4, 5, 6, 7)
  for role, devices in (
    ("actor", first),
    ("reference", first),
    ("critic", second),
    ("reward", second),
  ):
    config.placement.explicit[role] = ml_collections.ConfigDict(
      {"devices": devices, "axes": {"fsdp": 4}, "layout": "training"}
    )
  config.placement.explicit.rollout = ml_collections.ConfigDict(
    {"devices": first, "axes": {"data": 2, "tensor": 2}, "layout": "generation"}
  )
  config.placement.explicit.colocate = (("actor", "reference", "rollout"), ("critic", "reward"))

  config.rollout = ml_collections.ConfigDict()
  config.rollout.batch_size = 16
  config.rollout.max_prompt_len = 48
  config.rollout.max_new_tokens = 16
  config.rollout.temperature = 1.0
  config.rollout.top_k = 0
  config.rollout.top_p = 1.0
  config.rollout.slots = 0
  config.rollout.tail_threshold = 0.0
  # Fused scoring (RLHFuse): score finished samples in micro-batches while the rest generate.
  config.rollout.fused_scoring = False
  config.rollout.score_micro_batch = 0

  config.data = ml_collections.ConfigDict()
  config.data.task = "vowels"
  config.data.prompts = ""  # empty: the bundled prompts of data.task
  config.data.train_split = "train[:90%]"
  config.data.eval_split = "train[90%:]"
  config.data.tokenizer = "byte"  # or the path of a Hugging Face tokenizer.json
  config.data.chat_template = False
  config.data.data_dir = ""  # empty: WORKDIR/data
  config.data.on_bad_record = "error"  # or "skip" (counted)
  config.data.on_long_prompt = "truncate"  # or "skip", "error"

  config.reward = ml_collections.ConfigDict()
  config.reward.fn = "rlhfjax.tasks:vowel_reward"
  config.reward.fn_coef = 1.0
  config.reward.model_coef = 0.0

  config.algorithm = ml_collections.ConfigDict({"name": "ppo", "flow": ""})

  config.ppo = ml_collections.ConfigDict()
  config.ppo.ppo_epochs = 2
  config.ppo.mini_batches = 2
  config.ppo.micro_batches = 1
  config.ppo.clip_eps = 0.2
  config.ppo.value_clip_eps = 0.2
  config.ppo.entropy_coef = 0.0
  config.ppo.advantage = "gae"
  config.ppo.group_size = 1
  config.ppo.gamma = 1.0
  config.ppo.lam = 0.95
  config.ppo.whiten_advantages = True
  config.ppo.kl_estimator = "k1"
  config.ppo.kl_coef = 0.01
  config.ppo.kl_loss_coef = 0.0
  config.ppo.loss_agg = "token_mean"
  config.ppo.clip_eps_high = 0.0
  config.ppo.normalize_group_std = True
  config.ppo.overlong_buffer = 0
  config.ppo.dynamic_sampling_rounds = 0
  config.ppo.kl_controller = "fixed"
  config.ppo.kl_target = 6.0
  config.ppo.kl_horizon = 10_000
  config.ppo.async_rollout = variant == "disaggregated_async"
  config.ppo.max_skipped_updates = 3

  config.checkpoint = ml_collections.ConfigDict(
    {"every_steps": 20, "keep": 2, "async_save": True, "resume": True}
  )
  # Where the models start: an SFT run for the actor (and reference, and the critic's trunk),
  # a reward-model run for the reward role, or Hugging Face checkpoints; empty: random.
  config.init = ml_collections.ConfigDict({"actor": "", "critic": "", "reward": ""})
  config.eval = ml_collections.ConfigDict({"num_prompts": 64, "temperature": 0.0})
  # One process unless enabled; see scripts/train_ppo.py for a two-process run on one machine.
  config.distributed = ml_collections.ConfigDict(
    {
      "enabled": False,
      "coordinator_address": "",
      "num_processes": 0,
      "process_id": -1,
      "local_device_count": 0,
      "start_timeout_s": 300,
      "peer_timeout_s": 60,
    }
  )

  config.actor_optimizer = ml_collections.ConfigDict(
    {"learning_rate": 1e-3, "warmup_steps": 0, "decay": "constant", "max_grad_norm": 1.0}
  )
  config.critic_optimizer = ml_collections.ConfigDict(
    {"learning_rate": 2e-3, "warmup_steps": 0, "decay": "constant", "max_grad_norm": 1.0}
  )
  # Weights & Biases beside metrics.jsonl and TensorBoard (pip install -e ".[wandb]"); the run
  # name defaults to the workdir's name, the mode to W&B's own (WANDB_MODE).
  config.logging = ml_collections.ConfigDict(
    dict(wandb=False, wandb_project="rlhfjax", wandb_entity="", wandb_run_name="", wandb_mode="")
  )
  return config
