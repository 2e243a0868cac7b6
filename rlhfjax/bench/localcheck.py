"""The planner against this machine: `scripts/bench_ppo.py`'s config, the fit of the efficiency
factors to one measured placement, and the comparison of predicted with measured stage times.

The check (`check`, `python scripts/bench_ppo.py --check=N`) is built to hold on a loaded,
shared machine: the calibration programs (`calibrate.DeviceCost`, `calibrate.Matmul`) are timed
right before every measured iteration, in the same process, and the placements run one
iteration at a time in alternating order, so every figure the prediction uses and every figure
it is compared with is a median over the same moments.
"""

from __future__ import annotations

import dataclasses
import math
import os
import runpy
import statistics
from collections.abc import Callable, Mapping, Sequence

from rlhfjax.bench.calibrate import IDEAL
from rlhfjax.config import ExperimentConfig, from_config_dict
from rlhfjax.costmodel.efficiency import Efficiency
from rlhfjax.costmodel.hardware import Hardware
from rlhfjax.planner import auto

_PPO_TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "ppo_tiny.py")
PLACEMENTS = ("colocated", "interleaved", "interleaved_split", "disaggregated")
"""`scripts/bench_ppo.py`'s placements less `disaggregated_async`, whose generation overlaps the
other stages by design (its stage spans are not comparable one by one)."""
COMPARED = ("generate", "score", "update", "sync")
"""Stages compared (advantages is a single tiny call that only sets `stage_s`)."""


def bench_config(
  variant: str,
  *,
  iterations: int = 5,
  devices: int = 8,
  size: str = "tiny",
  hidden: int = 128,
  layers: int = 4,
  mlp: int = 352,
  batch: int = 32,
  new_tokens: int = 32,
) -> ExperimentConfig:
  """`configs/ppo_tiny.py:<variant>` with the benchmark's model and batch (0: the size's own),
  a reward model beside the rule reward."""
  cd = runpy.run_path(os.path.normpath(_PPO_TINY))["get_config"](variant)
  cd.total_steps = iterations
  cd.placement.num_devices = devices
  if devices < cd.placement.rollout_tensor:  # one accelerator: the co-located placement only
    cd.placement.rollout_tensor = math.gcd(devices, cd.placement.rollout_tensor)
  cd.model.size = size
  overrides = {"hidden_size": hidden, "num_layers": layers, "intermediate_size": mlp}
  cd.model.overrides = {k: v for k, v in overrides.items() if v}
  cd.rollout.batch_size = batch
  cd.rollout.max_new_tokens = new_tokens
  cd.reward.model_coef = 0.5
  return from_config_dict(cd)


FITTED = {
  True: (
    ("advantages", "stage_s"),
    ("score", "layer_s"),
    ("update", "update_s"),
    ("generate", "decode_step_s"),
    ("sync", "transfer_s"),
  ),
  False: (
    ("advantages", "stage_s"),
    ("score", "forward_mfu"),
    ("update", "train_mfu"),
    ("generate", "decode_step_s"),
    ("sync", "transfer_bw"),
  ),
}
"""The factor each measured stage fixes, in order (later stages depend on earlier factors),
on a host-shared machine (key True: matmuls at the measured rate, every fixed cost per device)
and on accelerators (False: the fractions of peak)."""


def _solve(predicted: Callable[[float], float], target: float, factor: str) -> float:
  """The value of `factor` whose predicted stage time is `target` (clipped to its range): an
  overhead in seconds adds linearly; a fraction of peak (0, 1] is found by bisection."""
  if factor.endswith("_s"):
    at0, step = predicted(0.0), 1e-3
    slope = (predicted(step) - at0) / step
    return max((target - at0) / slope, 0.0) if slope > 0 else 0.0
  lo, hi = 1e-4, 1.0  # the stage gets faster as the fraction grows
  if predicted(hi) >= target:
    return hi
  if predicted(lo) <= target:
    return lo
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if predicted(mid) > target else (lo, mid)
  return (lo + hi) / 2


def fit(
  config: ExperimentConfig, hw: Hardware, num_devices: int, measured: Mapping[str, float]
) -> Efficiency:
  """Efficiency factors that make the planner's prediction of `config`'s placement equal its
  measured seconds per stage (`FITTED`: one factor per stage, solved through the planner
  itself, so the fit and the prediction are one model)."""
  eff = IDEAL
  for stage, factor in FITTED[hw.host_shared]:

    def predicted(value: float, stage=stage, factor=factor, eff=eff) -> float:
      trial = dataclasses.replace(eff, **{factor: value})
      return auto.predict(config, num_devices, hw, trial).stages[stage]

    eff = dataclasses.replace(eff, **{factor: _solve(predicted, measured[stage], factor)})
  return eff


def compare(
  config: ExperimentConfig,
  hw: Hardware,
  eff: Efficiency,
  num_devices: int,
  measured: dict[str, float],
) -> dict:
  """Predicted against measured seconds per stage and for the iteration, with ratios."""
  plan = auto.predict(config, num_devices, hw, eff)
  row = {}
  for stage in COMPARED:
    p, m = plan.stages[stage], measured[stage]
    row[stage] = {"predicted": round(p, 4), "measured": round(m, 4), "ratio": _ratio(p, m)}
  m = measured["iteration"]
  row["iteration"] = {
    "predicted": round(plan.iteration_s, 4),
    "measured": round(m, 4),
    "ratio": _ratio(plan.iteration_s, m),
  }
  return row


def _ratio(predicted: float, measured: float) -> float | None:
  """predicted / measured; 1 when both are 0 (a stage that does not run, such as the sync of a
  rollout that reads the actor's own weights), None when only the measurement is 0."""
  if measured == 0:
    return 1.0 if predicted == 0 else None
  return round(predicted / measured, 3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Check:
  """Predicted against measured stage seconds per placement, measured in one process.

  Measured seconds are medians over the rounds (the sync's over its repeats too, see
  `check`); `spread` is the relative range (max - min) / median of a stage's samples: the
  run-to-run noise a comparison can resolve.
  """

  predicted: Mapping[str, Mapping[str, float]]
  measured: Mapping[str, Mapping[str, float]]
  spread: Mapping[str, Mapping[str, float]]
  samples: Mapping[str, Mapping[str, list[float]]]
  fitted_on: str
  """The placement the efficiency factors were fitted to (its ratios are 1 by construction)."""
  efficiency: Efficiency
  hardware: Hardware
  scaling_samples: Mapping[str, list[tuple[float, ...]]]
  """`Hardware.device_cost` and `step_cost` (`calibrate.DeviceCost`) measured before every
  iteration; the hardware holds their medians."""

  def ratio(self, variant: str, stage: str) -> float:
    return self.predicted[variant][stage] / self.measured[variant][stage]

  def to_json(self) -> dict:
    eff = {f: getattr(self.efficiency, f) for _, f in FITTED[self.hardware.host_shared]}
    return {
      "fitted_on": self.fitted_on,
      "hardware": {
        "float_flops": float(f"{self.hardware.float_flops:.4g}"),
        **{
          name: [round(x, 3) for x in getattr(self.hardware, name)] for name in self.scaling_samples
        },
        **{
          f"{name}_spread": [
            round((max(xs) - min(xs)) / statistics.median(xs), 3) for xs in zip(*rows, strict=True)
          ]
          for name, rows in self.scaling_samples.items()
        },
      },
      "efficiency": {k: float(f"{v:.4g}") for k, v in eff.items()},
      "placements": {
        v: {
          s: {
            "predicted": round(self.predicted[v][s], 4),
            "measured": round(self.measured[v][s], 4),
            "ratio": round(self.ratio(v, s), 3),
            "spread": round(self.spread[v][s], 3),
          }
          for s in (*COMPARED, "iteration")
        }
        for v in self.measured
      },
      "samples": {
        v: {s: [round(x, 4) for x in xs] for s, xs in st.items()} for v, st in self.samples.items()
      },
      "scaling_samples": {
        name: [[round(x, 3) for x in row] for row in rows]
        for name, rows in self.scaling_samples.items()
      },
    }


STAGES = (*COMPARED, "advantages", "iteration")
"""The stages sampled (advantages sets `stage_s` in the fit)."""


def resync_samples(clusters: Sequence, repeats: int) -> list[list[float]]:
  """Seconds of `repeats` more syncs of each cluster (`Cluster.resync`: the rollout takes the
  actor's current weights again, outside the timeline), in passes over the clusters in
  alternating order, so that every cluster's samples span the same moments.

  The sync is one copy of a few milliseconds per iteration: on a shared host one sample per
  iteration cannot resolve it, and its time drifts from moment to moment by more than the
  placements' syncs differ."""
  samples = [[] for _ in clusters]
  order = list(range(len(clusters)))
  for k in range(repeats):
    for i in order if k % 2 == 0 else reversed(order):
      samples[i].append(clusters[i].resync())
  return samples


def engine_cost(config: ExperimentConfig, devices):
  """`calibrate.EngineCost` of `config`'s rollout on `devices` when they share one host (the
  scaling of its decode steps is then measured with its own engine), else None."""
  from rlhfjax.bench import calibrate

  if devices[0].platform != "cpu":
    return None
  return calibrate.EngineCost(
    devices, config.model.for_role("actor"), config.rollout, config.placement.rollout_tensor
  )


def check(
  variants: Sequence[str] = PLACEMENTS,
  *,
  rounds: int = 8,
  sync_repeats: int = 16,
  fit_variant: str = "colocated",
  devices: int = 8,
  workdir: str | None = None,
  progress=None,
  **config_kwargs,
) -> Check:
  """Calibrates this machine, then runs `bench_config`'s placements one iteration at a time,
  alternating their order every round, with the calibration programs timed right before each
  iteration; fits the efficiency factors to `fit_variant`'s medians and predicts every
  placement from the medians of the calibration taken over the same moments. The sync's
  median and spread are over `sync_repeats` more samples per round too (`resync_samples`,
  every placement's taken in turn after the round's iterations)."""
  import tempfile
  import time

  import jax

  if fit_variant not in variants:
    raise ValueError(f"fit_variant {fit_variant!r} is not one of the variants {list(variants)}")
  start = time.perf_counter()
  say = lambda what: progress and progress(f"{time.perf_counter() - start:7.1f}s {what}")

  from rlhfjax.bench import calibrate
  from rlhfjax.runner import Runner

  used = jax.devices()[:devices]
  configs = {
    v: bench_config(v, iterations=rounds + 1, devices=devices, **config_kwargs) for v in variants
  }
  step = engine_cost(configs[fit_variant], used)
  base = calibrate.measure_hardware(
    used, matmul_size=256, copy_bytes=16 << 20, pair_bytes=1 << 20, step=step
  )
  moments = calibrate.AtMoments(base, used, step=step)
  say(
    f"calibrated: device_cost {[round(x, 2) for x in base.device_cost]}, "
    f"step_cost {[round(x, 2) for x in base.step_cost]}"
  )
  root = workdir or tempfile.mkdtemp()
  runners = {v: Runner(c, os.path.join(root, v), show_progress=False) for v, c in configs.items()}
  for v, runner in runners.items():
    runner.iterate(0)  # compiles
    say(f"{v} built and compiled")
  samples = {v: {s: [] for s in STAGES} for v in variants}
  for k in range(1, rounds + 1):
    for v in variants if k % 2 else tuple(reversed(variants)):
      moments.sample()
      row = runners[v].iterate(k)
      for s in STAGES:
        samples[v][s].append(row[f"time/{s}"])
      say(f"round {k} {v}: {row['time/iteration']:.3f}s")
    clusters = [runners[v].cluster for v in variants]
    for v, xs in zip(variants, resync_samples(clusters, sync_repeats), strict=True):
      samples[v]["sync"] += xs
  for runner in runners.values():
    runner.flow.close()
  measured = {v: {s: statistics.median(x) for s, x in st.items()} for v, st in samples.items()}
  spread = {
    v: {s: (max(x) - min(x)) / max(statistics.median(x), 1e-9) for s, x in st.items()}
    for v, st in samples.items()
  }
  hw = moments.hardware()
  eff = fit(configs[fit_variant], hw, devices, measured[fit_variant])
  predicted = {}
  for v, config in configs.items():
    plan = auto.predict(config, devices, hw, eff)
    predicted[v] = {**{s: plan.stages[s] for s in COMPARED}, "iteration": plan.iteration_s}
  return Check(
    predicted=predicted,
    measured=measured,
    spread=spread,
    samples=samples,
    fitted_on=fit_variant,
    efficiency=eff,
    hardware=hw,
    scaling_samples=moments.samples,
  )


def agreements(result: Check, tolerance: float = 0.3) -> dict[str, list]:
  """The assertions the local check makes, as lists of (what, ok) with the figures:

  - `stages`: every stage of every placement but the fitted one: predicted within
    `tolerance` of measured;
  - `order`: every pair of placements whose measured iteration gap exceeds both spreads: the
    predicted order agrees with the measured one.
  """
  stages, order = [], []
  for v in result.measured:
    if v == result.fitted_on:
      continue
    for s in COMPARED:
      r = result.ratio(v, s)
      what = f"{v} {s}: predicted/measured {r:.2f} (spread {result.spread[v][s]:.0%})"
      stages.append((what, abs(r - 1) <= tolerance))
  names = list(result.measured)
  for i, a in enumerate(names):
    for b in names[i + 1 :]:
      ma, mb = result.measured[a]["iteration"], result.measured[b]["iteration"]
      gap = abs(ma - mb) / min(ma, mb)
      noise = max(result.spread[a]["iteration"], result.spread[b]["iteration"])
      if gap > noise:
        pa, pb = result.predicted[a]["iteration"], result.predicted[b]["iteration"]
        order.append(
          (
            f"{a} {ma:.3g}s vs {b} {mb:.3g}s (gap {gap:.0%} > spread {noise:.0%}); "
            f"predicted {pa:.3g}s vs {pb:.3g}s",
            (pa < pb) == (ma < mb),
          )
        )
  return {"stages": stages, "order": order}
