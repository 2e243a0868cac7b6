"""Pipeline schedules of PPO's actor and critic: one JSON object per schedule with its bubble
fraction (from the schedule's table) and its measured step time (`rlhfjax.bench.pipeline_bench`).

  python scripts/bench_pipeline.py
  python scripts/bench_pipeline.py --stages=4 --micro_batches=8 --layers=8

Schedules: 'unpipelined' (the baseline, no stage axis), 'gpipe' and '1f1b' (the actor alone),
'1f1b_recompute' (the same, each backward running its stage's forward again), 'two_1f1b'
(actor then critic, 1F1B each), 'fused' (both in one schedule, the critic's stages in the
reverse device order). On CPU, --devices host devices are emulated: they share the
host's cores, so stages do not run in parallel and the step times say little about pipelining
(the bubble fractions are the schedules' own); see the module's docstring.
"""

import json

from absl import app, flags

from rlhfjax import launch

_SIZE = flags.DEFINE_string("size", "tiny", "Model size (a registered size).")
_LAYERS = flags.DEFINE_integer("layers", 4, "num_layers (0: the size's own); --stages divides it.")
_STAGES = flags.DEFINE_integer("stages", 2, "Pipeline stages (the 'stage' mesh axis).")
_MICRO = flags.DEFINE_integer("micro_batches", 4, "Micro-batches per optimizer step.")
_ROWS = flags.DEFINE_integer("rows", 8, "Rows per micro-batch.")
_SEQ = flags.DEFINE_integer("seq", 32, "Tokens per row (half prompt, half response).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per step after its compile (median).")
_DEVICES = flags.DEFINE_integer("devices", 8, "Devices: stages x fsdp (emulated on CPU).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the parameters and the batch.")
_SCHEDULES = flags.DEFINE_list(
  "schedules",
  ["unpipelined", "gpipe", "1f1b", "1f1b_recompute", "two_1f1b", "fused"],
  "Schedules to run.",
)


def main(argv):
  del argv
  launch.quiet_logging()
  launch.emulate_host_devices(_DEVICES.value)
  from rlhfjax.bench import pipeline_bench  # JAX starts after the device count is set

  settings = pipeline_bench.Settings(
    size=_SIZE.value,
    layers=_LAYERS.value,
    stages=_STAGES.value,
    micro_batches=_MICRO.value,
    rows=_ROWS.value,
    seq=_SEQ.value,
    repeats=_REPEATS.value,
    devices=_DEVICES.value,
    seed=_SEED.value,
    schedules=tuple(_SCHEDULES.value),
  )
  for row in pipeline_bench.run(settings):
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  app.run(main)
