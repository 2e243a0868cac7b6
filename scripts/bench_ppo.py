"""PPO iteration time per placement on one fixed config: one JSON object per placement.

  python scripts/bench_ppo.py --iterations=6 --hidden=256 --layers=4 --batch=32 --new_tokens=32
  python scripts/bench_ppo.py --check=8

Each line: placement, setup and compile time, steady-state iteration time (median after the
first iteration), per-stage times, tokens/s/device, and the stage that dominates. On 2 CPU
cores meshes do not overlap in wall time; on accelerators disjoint meshes do.
"""

import json
import tempfile
import time

from absl import flags

from rlhfjax import launch
from rlhfjax.bench import run_flags

_PLACEMENTS = flags.DEFINE_list(
  "placements",
  ["colocated", "interleaved", "interleaved_split", "disaggregated", "disaggregated_async"],
  "Variants of configs/ppo_tiny.py to run.",
)
_RUN = run_flags.define_run_flags(iterations=5, iterations_help="PPO iterations per placement")
flags.adopt_module_key_flags(run_flags)
_SIZE = flags.DEFINE_string("size", "tiny", "Registered model size to start from.")
_PREDICT = flags.DEFINE_string(
  "predict", None, "Calibration JSON of scripts/calibrate.py: add the planner's prediction."
)
_CHECK = flags.DEFINE_integer(
  "check",
  0,
  "Instead: calibrate, then run the placements this many rounds one iteration at a time in "
  "alternating order, with the calibration programs timed before each iteration; fit the "
  "efficiency factors to the first placement and print predicted against measured per stage "
  "with the spread, and whether each stage of the other placements is within 30% "
  "(rlhfjax.bench.localcheck.check).",
)


def _config(variant: str):
  from rlhfjax.bench.localcheck import bench_config

  return bench_config(variant, size=_SIZE.value, **_RUN.config_kwargs())


def main(argv):
  del argv
  launch.quiet_logging()
  launch.emulate_host_devices(_RUN.devices.value)
  import numpy as np

  from rlhfjax.runner import Runner

  if _CHECK.value:
    from rlhfjax.bench import localcheck

    # The one-step-off-policy variant overlaps generation with the other stages by design;
    # its stage spans are not comparable one by one.
    variants = [p for p in _PLACEMENTS.value if p != "disaggregated_async"]
    shape = _RUN.config_kwargs()
    del shape["iterations"]  # one per round
    result = localcheck.check(
      variants,
      fit_variant=variants[0],
      rounds=_CHECK.value,
      sync_repeats=_RUN.sync_repeats.value,
      progress=lambda line: print(line, flush=True),
      size=_SIZE.value,
      **shape,
    )
    print(json.dumps(result.to_json()))
    found = localcheck.agreements(result)
    for kind, rows in found.items():
      for what, ok in rows:
        print(f"{kind}: {'ok' if ok else 'NOT MET'}: {what}")
    if not all(ok for rows in found.values() for _, ok in rows):
      raise SystemExit(1)
    return
  for variant in _PLACEMENTS.value:
    start = time.perf_counter()
    trainer = Runner(_config(variant), tempfile.mkdtemp(), show_progress=False)
    setup = time.perf_counter() - start
    rows = trainer.run().metrics
    steady = rows[1:]
    stages = {
      k: float(np.median([r[k] for r in steady]))
      for k in steady[0]
      if k.startswith("time/") and k != "time/iteration"
    }
    iteration = float(np.median([r["time/iteration"] for r in steady]))
    predicted = {}
    if _PREDICT.value:
      from rlhfjax.bench import localcheck
      from rlhfjax.costmodel import efficiency, hardware

      measured = {k[len("time/") :]: v for k, v in stages.items()}
      predicted["predicted"] = localcheck.compare(
        trainer.cfg,
        hardware.load_hardware("local", _PREDICT.value),
        efficiency.load_efficiency(_PREDICT.value),
        _RUN.devices.value,
        {**measured, "iteration": iteration},
      )
    print(
      json.dumps(
        {
          "placement": variant,
          "setup_s": round(setup, 3),
          "compile_s": round(rows[0]["time/iteration"] - iteration, 3),
          "iteration_s": round(iteration, 4),
          **{k: round(v, 4) for k, v in stages.items()},
          "tokens_per_s_per_device": round(
            float(np.median([r["throughput/tokens_per_s_per_device"] for r in steady])), 2
          ),
          "dominant_stage": max(stages, key=stages.get),
          "reward_first_last": [
            round(rows[0]["reward/mean"], 4),
            round(rows[-1]["reward/mean"], 4),
          ],
          **predicted,
        }
      ),
      flush=True,
    )


if __name__ == "__main__":
  launch.run(main)
