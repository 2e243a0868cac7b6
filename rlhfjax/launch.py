"""What every entry point does before JAX starts: flags with one-line errors, host devices.

Nothing here imports JAX: `emulate_host_devices` must run before the CPU backend starts.
"""

from __future__ import annotations

import os
import re
import sys
from typing import NoReturn

from absl import flags, logging

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def fail(error: object) -> NoReturn:
  """Prints `error: <one line>` on stderr and exits with status 2."""
  print("error: " + " ".join(str(error).split()), file=sys.stderr)
  sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing whose errors (bad `--config.x=...` overrides too) are one line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    fail(error)
  except (AttributeError, KeyError, TypeError, ValueError) as error:
    # config_flags wraps the KeyError of an unknown `--config.x.y` field in an AttributeError.
    while error.args and isinstance(error.args[0], Exception):
      error = error.args[0]
    fail(f"bad --config override: {error.args[0] if error.args else error}")


def quiet_logging() -> None:
  """Keeps stderr for errors unless --verbosity was given: JAX logs at INFO level which
  backends it could not start."""
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def emulate_host_devices(num_devices: int) -> None:
  """Asks XLA for `num_devices` host devices unless it already has as many.

  XLA reads the flag when JAX starts its CPU backend, so this must run before JAX is imported;
  only the host (CPU) platform uses it, so it changes nothing on GPU or TPU.
  """
  xla_flags = os.environ.get("XLA_FLAGS", "")
  match = re.search(rf"{_COUNT_FLAG}=(\d+)", xla_flags)
  if match and int(match.group(1)) >= num_devices:
    return
  xla_flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", xla_flags)
  os.environ["XLA_FLAGS"] = f"{xla_flags} {_COUNT_FLAG}={num_devices}".strip()


def requested_devices(config_dict, max_cpu_devices: int) -> int | None:
  """`placement.num_devices` of a config file, capped, or None when it does not say."""
  try:
    num_devices = config_dict.placement.num_devices
  except OSError as error:  # the config file could not be loaded
    fail(error)
  except AttributeError:  # no placement section: from_config_dict says what is wrong
    return None
  if isinstance(num_devices, int) and num_devices > 0:
    return min(num_devices, max_cpu_devices)
  return None


def start(argv: list[str], config_dict, max_cpu_devices: int) -> None:
  """The common start of an entry point: no stray arguments, quiet logs, and as many host
  devices as the config's placement asks for (on CPU). Call it before importing JAX.

  With `distributed.enabled`, joins the job's processes instead (`rlhfjax.distributed`), each
  emulating its share of the devices."""
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])}")
  quiet_logging()
  num_devices = requested_devices(config_dict, max_cpu_devices)
  if _distributed_enabled(config_dict):
    # Imports JAX, which is fine: only its backends must start after this.
    from rlhfjax import distributed

    try:
      distributed.initialize(distributed.section_from_config_dict(config_dict), num_devices)
    except ValueError as error:
      fail(error)
  elif num_devices:
    emulate_host_devices(num_devices)


def _distributed_enabled(config_dict) -> bool:
  try:
    return config_dict.distributed.enabled is True
  except (AttributeError, KeyError):  # no such section: single process
    return False
