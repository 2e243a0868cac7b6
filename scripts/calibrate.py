"""Measures this machine for the planner: `--hardware=local --efficiency=FILE` reads the output.

  python scripts/calibrate.py --out=local.json

Times a sharded matmul (float32 and bfloat16), a sharded copy, a transfer between every pair
of devices and (virtual CPU devices) the same small train step and the run's own rollout engine
on 1, 2, 4, 8 devices, then runs `scripts/bench_ppo.py`'s config in ONE placement (`--variant`,
co-located by default) for a few iterations, with the matmul, the train steps and the engine
timed again before each, and fits the efficiency factors to its median stage times
(`rlhfjax.bench.localcheck.fit`). Every other placement's prediction is then a test of the
model. Prints the JSON it writes.
"""

import json
import tempfile

from absl import app, flags

from rlhfjax import launch
from rlhfjax.bench import run_flags

_OUT = flags.DEFINE_string("out", None, "Where to write the calibration JSON.")
_RUN = run_flags.define_run_flags(iterations=4, iterations_help="PPO iterations of the fitted run")
flags.adopt_module_key_flags(run_flags)
_VARIANT = flags.DEFINE_string("variant", "colocated", "Placement of the fitted run.")
flags.mark_flags_as_required(["out"])


def main(argv):
  if len(argv) > 1:
    launch.fail(f"unexpected arguments: {' '.join(argv[1:])}")
  if _RUN.iterations.value < 2:
    launch.fail("--iterations must be >= 2 (the first one compiles)")
  launch.quiet_logging()
  launch.emulate_host_devices(_RUN.devices.value)
  import dataclasses

  import jax
  import numpy as np

  from rlhfjax.bench import calibrate, localcheck
  from rlhfjax.runner import Runner

  devices = jax.devices()[: _RUN.devices.value]
  config = localcheck.bench_config(_VARIANT.value, **_RUN.config_kwargs())
  step = localcheck.engine_cost(config, devices)  # its decode steps' scaling on a shared host
  hw = calibrate.measure_hardware(devices, step=step)
  runner = Runner(config, tempfile.mkdtemp(), show_progress=False)
  runner.iterate(0)  # compiles
  moments = calibrate.AtMoments(hw, devices, step=step)
  samples = {s: [] for s in localcheck.STAGES}
  for k in range(1, _RUN.iterations.value):  # the calibration timed at the moments of the run
    moments.sample()
    row = runner.iterate(k)
    for s in samples:
      samples[s].append(row[f"time/{s}"])
    samples["sync"] += localcheck.resync_samples([runner.cluster], _RUN.sync_repeats.value)[0]
  runner.flow.close()
  hw = moments.hardware()
  measured = {s: float(np.median(xs)) for s, xs in samples.items()}
  eff = localcheck.fit(config, hw, _RUN.devices.value, measured)
  out = {
    "hardware": hw.to_json(),
    "efficiency": dataclasses.asdict(eff),
    "fit_run": {
      "config": f"bench_ppo {_VARIANT.value}",
      "model": {"hidden": _RUN.hidden.value, "layers": _RUN.layers.value, "mlp": _RUN.mlp.value},
      "batch": _RUN.batch.value,
      "new_tokens": _RUN.new_tokens.value,
      "measured": measured,
    },
  }
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=1)
  summary = {k: v for k, v in out["hardware"].items() if k != "pair_bw"}
  print(json.dumps({"hardware": summary, "efficiency": out["efficiency"], "measured": measured}))


if __name__ == "__main__":
  app.run(main, flags_parser=launch.parse_flags)
