"""Prints where each RLHF role runs, on which mesh, and its estimated memory per device; then
what remat, log-prob chunks and offload do to each role's memory per device.

  python scripts/show_placement.py --config=configs/ppo_tiny.py \
      --config.placement.strategy=interleaved --config.placement.split_actor_critic=True

On a CPU-only machine the script emulates `placement.num_devices` host devices (at most
--max_cpu_devices), so an 8-device placement can be planned on a laptop. Bad input prints one
`error: ...` line on stderr and exits with status 2.
"""

from absl import flags
from ml_collections import config_flags

from rlhfjax import launch

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_MAX_CPU_DEVICES = flags.DEFINE_integer(
  "max_cpu_devices", 64, "Most host devices to emulate on CPU to plan a placement."
)
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
  launch.start(argv, _CONFIG.value, _MAX_CPU_DEVICES.value)

  # Imported only now: JAX (which rlhfjax imports) must start after XLA_FLAGS is set.
  import jax

  from rlhfjax import config as config_lib
  from rlhfjax import placement
  from rlhfjax.flows import registry
  from rlhfjax.planner import auto, place

  try:
    config = registry.configure(config_lib.from_config_dict(_CONFIG.value))
    spec = place.plan_placement(config, available_devices=jax.device_count())
    config, pool = place.sized(config, spec)
  except (config_lib.ConfigError, placement.PlacementError) as error:
    launch.fail(error)
  train_rows, score_rows = auto.memory_rows(config)
  pipelining = auto.pipelining(config)
  estimates = placement.estimate_placement_memory(
    spec,
    config.model,
    config.rollout,
    train_rows=train_rows,
    score_rows=score_rows,
    offload=config.offload,
    pipelining=pipelining,
  )
  budget = config.placement.memory_per_device_gb
  print(placement.format_placement_table(spec, estimates, memory_per_device_gb=budget))
  if pool is not None:
    print(pool.describe())
  print(placement.format_batches(config, train_rows, score_rows, packed=registry.packs(config)))
  from_base = registry.reference_from_base(config)
  if adapters := placement.format_adapters(config, spec, reference_from_base=from_base):
    print(adapters)
  print()
  print(placement.option_report(config, spec, train_rows, score_rows, pipelining))
  for line in place.tensor_warnings(config, spec):
    print(f"warning: {line}")


if __name__ == "__main__":
  launch.run(main)
