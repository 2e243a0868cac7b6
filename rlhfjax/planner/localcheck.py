"""The planner against this machine: `scripts/bench_ppo.py`'s config, the ideal stage times the
calibration fits to, and the comparison of predicted with measured stage times."""

from __future__ import annotations

import dataclasses
import math
import os
import runpy
from collections.abc import Mapping, Sequence

from rlhfjax.config import ExperimentConfig, from_config_dict
from rlhfjax.placement.spec import Role
from rlhfjax.planner import auto, costs
from rlhfjax.planner.calibrate import IDEAL, fit_efficiency
from rlhfjax.planner.efficiency import Efficiency
from rlhfjax.planner.evaluate import present_roles
from rlhfjax.planner.hardware import Hardware

_PPO_TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "ppo_tiny.py")
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


def ideal_times(config: ExperimentConfig, hw: Hardware, num_devices: int) -> dict[str, float]:
  """Stage seconds of `config` with every efficiency factor ideal, generation split."""
  plan = auto.predict(config, num_devices, hw, IDEAL)
  work = auto.workload_of(config)
  rollout = plan.spec[Role.ROLLOUT]
  group = costs.Group(devices=len(rollout.devices), tensor=rollout.axis_size("tensor"))
  prefill, decode = costs.generate_time(
    hw,
    IDEAL,
    work.actor,
    group,
    sequences=work.sequences,
    prompt_len=work.prompt_len,
    response_mean=work.response_len_mean,
    response_max=work.response_len_max,
    slots=math.ceil(work.sequences / group.replicas),
    static_batching=work.static_batching,
  )
  return {**plan.stages, "generate_prefill": prefill, "generate_decode": decode}


def fit(
  config: ExperimentConfig, hw: Hardware, num_devices: int, measured: dict[str, float]
) -> Efficiency:
  """Efficiency factors of this machine from one measured run of `config`."""
  work = auto.workload_of(config)
  trained = 1 + (work.critic is not None)
  counts = {
    "score_stages": len(present_roles(work)) - 1,
    "update_calls": trained * work.ppo_epochs * work.optimizer_steps,
    "decode_steps": work.response_len_max,
  }
  return fit_efficiency(ideal_times(config, hw, num_devices), measured, counts=counts)


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

  Measured seconds are medians over the rounds of each stage's time divided by the load factor
  of its moment (the probe matmul's time then, over its time at calibration); `spread` is the
  relative range (max - min) / median of those load-corrected samples: the run-to-run noise a
  comparison can resolve.
  """

  predicted: Mapping[str, Mapping[str, float]]
  measured: Mapping[str, Mapping[str, float]]
  spread: Mapping[str, Mapping[str, float]]
  samples: Mapping[str, Mapping[str, list[float]]]
  load: list[float]
  """The load factor of every measured iteration (1: as loaded as at calibration)."""
  fitted_on: str

  def ratio(self, variant: str, stage: str) -> float:
    return self.predicted[variant][stage] / self.measured[variant][stage]

  def to_json(self) -> dict:
    return {
      "fitted_on": self.fitted_on,
      "load": [round(x, 3) for x in self.load],
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
    }


def check(
  variants: Sequence[str] = ("colocated", "interleaved_split", "disaggregated"),
  *,
  rounds: int = 4,
  fit_variant: str = "colocated",
  devices: int = 8,
  workdir: str | None = None,
  progress=None,
  **config_kwargs,
) -> Check:
  """Calibrates this machine, then runs `bench_config`'s placements one iteration at a time,
  alternating their order every round with the probe timed around each iteration; fits the
  efficiency factors to `fit_variant`'s load-corrected medians and predicts every placement.
  """
  import statistics
  import tempfile
  import time

  import jax

  start = time.perf_counter()
  say = lambda what: progress and progress(f"{time.perf_counter() - start:7.1f}s {what}")

  from rlhfjax.planner import calibrate
  from rlhfjax.runner import Runner

  used = jax.devices()[:devices]
  probe = calibrate.Probe(used)
  hw = calibrate.measure_hardware(used, matmul_size=256, copy_bytes=16 << 20, pair_bytes=1 << 20)
  base = probe.seconds(repeats=5)
  say(f"calibrated: probe {base:.4f}s")
  configs = {
    v: bench_config(v, iterations=rounds + 1, devices=devices, **config_kwargs) for v in variants
  }
  root = workdir or tempfile.mkdtemp()
  runners = {v: Runner(c, os.path.join(root, v), show_progress=False) for v, c in configs.items()}
  for v, runner in runners.items():
    runner.iterate(0)  # compiles
    say(f"{v} built and compiled")
  samples = {v: {s: [] for s in (*COMPARED, "advantages", "iteration")} for v in variants}
  load = []
  for k in range(1, rounds + 1):
    for v in variants if k % 2 else tuple(reversed(variants)):
      before = probe.seconds()
      row = runners[v].iterate(k)
      factor = (before + probe.seconds()) / 2 / base
      load.append(factor)
      for s in samples[v]:
        samples[v][s].append(row[f"time/{s}"] / factor)
      say(f"round {k} {v}: {row['time/iteration']:.3f}s, load x{factor:.2f}")
  measured = {v: {s: statistics.median(x) for s, x in st.items()} for v, st in samples.items()}
  spread = {
    v: {s: (max(x) - min(x)) / max(statistics.median(x), 1e-9) for s, x in st.items()}
    for v, st in samples.items()
  }
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
    load=load,
    fitted_on=fit_variant,
  )


def agreements(result: Check, tolerance: float = 0.3) -> dict[str, list]:
  """The assertions the local check makes, as lists of (what, ok) with the figures:

  - `stages`: every (placement, stage) whose measured spread is within `tolerance`: predicted
    within `tolerance` of measured;
  - `order`: every pair of placements whose measured iteration gap exceeds both spreads: the
    predicted order agrees with the measured one.
  """
  stages, order = [], []
  for v in result.measured:
    for s in COMPARED:
      if result.spread[v][s] <= tolerance:
        r = result.ratio(v, s)
        stages.append((f"{v} {s}: predicted/measured {r:.2f}", abs(r - 1) <= tolerance))
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
            f"{a} {ma:.3g}s vs {b} {mb:.3g}s (gap {gap:.0%} > spread {noise:.0%})",
            (pa < pb) == (ma < mb),
          )
        )
  return {"stages": stages, "order": order}
