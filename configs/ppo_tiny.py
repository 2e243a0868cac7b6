"""PPO on the tiny model, 8 devices: the CPU test and demo configuration.

  python scripts/show_placement.py --config=configs/ppo_tiny.py \
      --config.placement.strategy=interleaved --config.placement.split_actor_critic=True
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  config.model = ml_collections.ConfigDict()
  config.model.size = "tiny"

  config.placement = ml_collections.ConfigDict()
  config.placement.strategy = "colocated"
  config.placement.num_devices = 8
  config.placement.memory_per_device_gb = 16.0
  config.placement.tensor = 1
  config.placement.rollout_tensor = 1
  config.placement.rollout_fraction = 0.5
  config.placement.split_actor_critic = False
  config.placement.split_reference_reward = False
  # Used with --config.placement.strategy=explicit: actor, reference and rollout share the
  # first half, critic and reward the second; the two halves update concurrently.
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
  config.rollout.max_prompt_len = 64
  config.rollout.max_new_tokens = 64
  return config
