"""GRPO's scoring and update on a long-tailed length mix, padded against packed: one JSON object
per iteration and mode, then a summary (`rlhfjax.bench.packing_bench`).

  python scripts/bench_packing.py
  python scripts/bench_packing.py --max_new_tokens=1024 --mean_fraction=0.25 --seed=0

Target (issue 24): packed score + update at least 2x faster than padded at mean/max = 0.25,
with the same metrics.
"""

import dataclasses

from absl import app, flags

from rlhfjax import launch
from rlhfjax.bench import packing_bench

_DEFAULTS = packing_bench.Settings()
_FLAGS = {
  f.name: (flags.DEFINE_float if f.type in (float, "float") else flags.DEFINE_integer)(
    f.name, getattr(_DEFAULTS, f.name), f"Settings.{f.name}"
  )
  for f in dataclasses.fields(packing_bench.Settings)
}


def main(argv):
  del argv
  launch.quiet_logging()
  launch.emulate_host_devices(_FLAGS["devices"].value)
  packing_bench.run(packing_bench.Settings(**{k: v.value for k, v in _FLAGS.items()}))


if __name__ == "__main__":
  app.run(main)
