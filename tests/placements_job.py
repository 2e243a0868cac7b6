"""Test-only entry point: `scripts/train.py`'s run of several variants of one config file in
turn, in one process or one job of processes (`tests/test_multihost.py`).

  python tests/placements_job.py --config=configs/ppo_tiny.py --config.total_steps=3 \
      --variants=colocated,interleaved --workdir=ROOT [--config.distributed.enabled=True ...]

Each variant `V` is the file's `get_config(V)` with the command line's `--config.x=...`
overrides, run by `rlhfjax.runner.cli.train` into `ROOT/V`, as `scripts/train.py` runs it. A
job's processes start and join once for all of them, and programs spanning processes that the
variants have in common are compiled once (JAX keeps the executables it shared in memory).
"""

import importlib.util
import os

from absl import flags
from ml_collections import config_flags

from rlhfjax import launch

_CONFIG, _WORKDIR, _MAX_CPU_DEVICES = launch.define_flags(
  "Experiment config file (its get_config takes the variant).", "Root of the variants' workdirs."
)
_VARIANTS = flags.DEFINE_list("variants", None, "The variants to run, in this order.")
flags.mark_flag_as_required("variants")


def _variant(name: str):
  """The config file's `get_config(name)` with the command line's overrides."""
  path = config_flags.get_config_filename(flags.FLAGS["config"]).split(":")[0]
  spec = importlib.util.spec_from_file_location("_placements_job_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(name)
  config.update_from_flattened_dict(config_flags.get_override_values(flags.FLAGS["config"]))
  return config


def main(argv: list[str]) -> None:
  launch.start(argv, _CONFIG.value, _MAX_CPU_DEVICES.value)

  from rlhfjax.runner import cli  # imports JAX: after `start`

  for name in _VARIANTS.value:
    cli.train(_variant(name), os.path.join(_WORKDIR.value, name))


if __name__ == "__main__":
  launch.run(main)
