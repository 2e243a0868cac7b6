"""Measures this machine for the planner: `--hardware=local --efficiency=FILE` reads the output.

  python scripts/calibrate.py --out=local.json

Times a sharded matmul (float32 and bfloat16), a sharded copy, a transfer between every pair
of devices and (virtual CPU devices) the same small train step on 1, 2, 4, 8 devices, then runs
`scripts/bench_ppo.py`'s config in ONE placement (`--variant`, co-located by default) for a few
iterations, with the matmul and the train steps timed again before each, and fits the
efficiency factors to its median stage times (`rlhfjax.bench.localcheck.fit`). Every other
placement's prediction is then a test of the model. Prints the JSON it writes.
"""

import json
import tempfile

from absl import app, flags

from rlhfjax import launch

_OUT = flags.DEFINE_string("out", None, "Where to write the calibration JSON.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Devices (host devices emulated on CPU).")
_ITERATIONS = flags.DEFINE_integer("iterations", 4, "PPO iterations of the fitted run (>= 2).")
_VARIANT = flags.DEFINE_string("variant", "colocated", "Placement of the fitted run.")
_HIDDEN = flags.DEFINE_integer("hidden", 128, "Fitted run: hidden_size (bench_ppo's default).")
_LAYERS = flags.DEFINE_integer("layers", 4, "Fitted run: num_layers.")
_MLP = flags.DEFINE_integer("mlp", 352, "Fitted run: intermediate_size.")
_BATCH = flags.DEFINE_integer("batch", 32, "Fitted run: sequences per rollout batch.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 32, "Fitted run: response tokens per sequence.")
_SYNC_REPEATS = flags.DEFINE_integer(
  "sync_repeats", 16, "Fitted run: syncs timed again after each iteration (Cluster.resync)."
)
flags.mark_flags_as_required(["out"])


def main(argv):
  if len(argv) > 1:
    launch.fail(f"unexpected arguments: {' '.join(argv[1:])}")
  if _ITERATIONS.value < 2:
    launch.fail("--iterations must be >= 2 (the first one compiles)")
  launch.quiet_logging()
  launch.emulate_host_devices(_DEVICES.value)
  import dataclasses

  import jax
  import numpy as np

  from rlhfjax.bench import calibrate, localcheck
  from rlhfjax.runner import Runner

  devices = jax.devices()[: _DEVICES.value]
  hw = calibrate.measure_hardware(devices)
  config = localcheck.bench_config(
    _VARIANT.value,
    iterations=_ITERATIONS.value,
    devices=_DEVICES.value,
    hidden=_HIDDEN.value,
    layers=_LAYERS.value,
    mlp=_MLP.value,
    batch=_BATCH.value,
    new_tokens=_NEW_TOKENS.value,
  )
  runner = Runner(config, tempfile.mkdtemp(), show_progress=False)
  runner.iterate(0)  # compiles
  moments = calibrate.AtMoments(hw, devices)
  samples = {s: [] for s in localcheck.STAGES}
  for k in range(1, _ITERATIONS.value):  # the calibration timed at the moments of the run
    moments.sample()
    row = runner.iterate(k)
    for s in samples:
      samples[s].append(row[f"time/{s}"])
    samples["sync"] += localcheck.resync_samples([runner.cluster], _SYNC_REPEATS.value)[0]
  runner.flow.close()
  hw = moments.hardware()
  measured = {s: float(np.median(xs)) for s, xs in samples.items()}
  eff = localcheck.fit(config, hw, _DEVICES.value, measured)
  out = {
    "hardware": hw.to_json(),
    "efficiency": dataclasses.asdict(eff),
    "fit_run": {
      "config": f"bench_ppo {_VARIANT.value}",
      "model": {"hidden": _HIDDEN.value, "layers": _LAYERS.value, "mlp": _MLP.value},
      "batch": _BATCH.value,
      "new_tokens": _NEW_TOKENS.value,
      "measured": measured,
    },
  }
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=1)
  summary = {k: v for k, v in out["hardware"].items() if k != "pair_bw"}
  print(json.dumps({"hardware": summary, "efficiency": out["efficiency"], "measured": measured}))


if __name__ == "__main__":
  app.run(main, flags_parser=launch.parse_flags)
