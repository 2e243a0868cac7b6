"""Prints where each RLHF role runs, on which mesh, and its estimated memory per device.

  python scripts/show_placement.py --config=configs/ppo_tiny.py \
      --config.placement.strategy=interleaved --config.placement.split_actor_critic=True

On a CPU-only machine the script emulates `placement.num_devices` host devices (at most
--max_cpu_devices), so an 8-device placement can be planned on a laptop. Bad input prints one
`error: ...` line on stderr and exits with status 2.
"""

import os
import re
import sys
from typing import NoReturn

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_MAX_CPU_DEVICES = flags.DEFINE_integer(
  "max_cpu_devices", 64, "Most host devices to emulate on CPU to plan a placement."
)
flags.mark_flags_as_required(["config"])

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _fail(error: object) -> NoReturn:
  print("error: " + " ".join(str(error).split()), file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    _fail(error)
  except (AttributeError, KeyError, TypeError, ValueError) as error:
    # config_flags wraps the KeyError of an unknown `--config.x.y` field in an AttributeError.
    while error.args and isinstance(error.args[0], Exception):
      error = error.args[0]
    _fail(f"bad --config override: {error.args[0] if error.args else error}")


def _emulate_host_devices(num_devices: int) -> None:
  """Asks XLA for `num_devices` host devices unless it already has as many.

  XLA reads the flag when JAX starts its CPU backend, so this runs before JAX is imported;
  only the host (CPU) platform uses it, so it changes nothing on GPU or TPU.
  """
  xla_flags = os.environ.get("XLA_FLAGS", "")
  match = re.search(rf"{_COUNT_FLAG}=(\d+)", xla_flags)
  if match and int(match.group(1)) >= num_devices:
    return
  xla_flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", xla_flags)
  os.environ["XLA_FLAGS"] = f"{xla_flags} {_COUNT_FLAG}={num_devices}".strip()


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}")
  if not flags.FLAGS["verbosity"].present:
    # Keep stderr for errors: JAX logs at INFO level which backends it could not start.
    logging.set_verbosity(logging.WARNING)
  try:
    num_devices = _CONFIG.value.placement.num_devices
  except OSError as error:  # the config file could not be loaded
    _fail(error)
  except AttributeError:  # no placement section: from_config_dict says what is wrong
    num_devices = None
  if isinstance(num_devices, int) and num_devices > 0:
    _emulate_host_devices(min(num_devices, _MAX_CPU_DEVICES.value))

  # Imported only now: JAX (which rlhfjax imports) must start after XLA_FLAGS is set.
  import jax

  from rlhfjax import config as config_lib
  from rlhfjax import placement

  try:
    config = config_lib.from_config_dict(_CONFIG.value)
    spec = placement.plan_placement(config, available_devices=jax.device_count())
  except (config_lib.ConfigError, placement.PlacementError) as error:
    _fail(error)
  estimates = placement.estimate_placement_memory(spec, config.model, config.rollout)
  budget = config.placement.memory_per_device_gb
  print(placement.format_placement_table(spec, estimates, memory_per_device_gb=budget))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
