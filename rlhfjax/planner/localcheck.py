"""The planner against this machine: `scripts/bench_ppo.py`'s config, the ideal stage times the
calibration fits to, and the comparison of predicted with measured stage times."""

from __future__ import annotations

import math
import os
import runpy

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
    row[stage] = {"predicted": round(p, 4), "measured": round(m, 4), "ratio": round(p / m, 3)}
  m = measured["iteration"]
  row["iteration"] = {
    "predicted": round(plan.iteration_s, 4),
    "measured": round(m, 4),
    "ratio": round(plan.iteration_s / m, 3),
  }
  return row
