r"""Sample-level fusion on a long-tailed workload: one JSON line per (placement, fused on/off),
then one summary line per placement with the speed-up of fused + compacted iterations.

  python scripts/bench_fusion.py --batch=40 --mean_len=48 --max_len=384 --tail_ratio=8
  python scripts/bench_fusion.py --size=tiny --hidden_size=96 --placements=co-located

Response lengths: log-normal with about --tail_fraction of the samples at least --tail_ratio
times the median, mean --mean_len, clipped at --max_len (see rlhfjax.bench.fusion_bench).
On CPU, --devices host devices are emulated (disaggregated: half for rollout, half for scoring).
"""

import json

from absl import app, flags

from rlhfjax import launch
from rlhfjax.config.model import SHAPE_FIELDS

_SIZE = flags.DEFINE_string("size", "small", "Model size (registered sizes and 'small').")
_BATCH = flags.DEFINE_integer("batch", 40, "Prompts per rollout batch (= decode slots).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt length.")
_MEAN_LEN = flags.DEFINE_float("mean_len", 48.0, "Mean response length (before clipping).")
_MAX_LEN = flags.DEFINE_integer("max_len", 384, "Longest response.")
_TAIL_FRACTION = flags.DEFINE_float("tail_fraction", 0.1, "Fraction of samples in the tail.")
_TAIL_RATIO = flags.DEFINE_float("tail_ratio", 8.0, "Tail length over the median length.")
_MICRO_BATCH = flags.DEFINE_integer("micro_batch", 8, "Samples per fused scoring call.")
_THRESHOLD = flags.DEFINE_float("tail_threshold", 0.25, "rollout.tail_threshold when fused.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed iterations per configuration (median).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds lengths, prompts and weights.")
_PLACEMENTS = flags.DEFINE_list("placements", ["disaggregated", "co-located"], "Placements.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Devices to use (emulated on CPU).")
_PREDICT = flags.DEFINE_string(
  "predict_with",
  None,
  "A calibration JSON (scripts/calibrate.py): also print the planner's prediction (hardware "
  "'local'); 'only' after it (--predict_with=FILE,only) skips the measurement.",
)
_OVERRIDES = {
  name: flags.DEFINE_integer(name, None, f"Override the size's {name}.") for name in SHAPE_FIELDS
}


def main(argv):
  del argv
  launch.quiet_logging()
  launch.emulate_host_devices(_DEVICES.value)
  from rlhfjax.bench import fusion_bench  # JAX starts after the device count is set

  bench = fusion_bench.FusionBench(
    size=_SIZE.value,
    model_overrides={k: f.value for k, f in _OVERRIDES.items() if f.value is not None},
    batch=_BATCH.value,
    prompt_len=_PROMPT_LEN.value,
    mean_len=_MEAN_LEN.value,
    max_len=_MAX_LEN.value,
    tail_fraction=_TAIL_FRACTION.value,
    tail_ratio=_TAIL_RATIO.value,
    micro_batch=_MICRO_BATCH.value,
    tail_threshold=_THRESHOLD.value,
    repeats=_REPEATS.value,
    seed=_SEED.value,
    placements=tuple(_PLACEMENTS.value),
    num_devices=_DEVICES.value,
  )
  if _PREDICT.value:
    from rlhfjax.bench import fusion
    from rlhfjax.bench.rollout_bench import model_config
    from rlhfjax.costmodel import efficiency, hardware

    path, _, only = _PREDICT.value.partition(",")
    model = model_config(bench.size, **bench.model_overrides)
    hw, eff = hardware.load_hardware("local", path), efficiency.load_efficiency(path)
    lengths = fusion_bench.tail_lengths(bench)
    for record in fusion.predict_benchmark(bench, lengths, hw, eff, model):
      print(json.dumps(record), flush=True)
    if only == "only":
      return
  for record in fusion_bench.run(bench):
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
  app.run(main)
