"""The planner against this machine: the host-shared cost terms, the fit, and the local check's
assertions (`scripts/bench_ppo.py --check=N` runs the check itself; it is not a CI test: on
2 shared cores its stages vary by more than 30% from round to round, see the README)."""

import dataclasses

import pytest

from rlhfjax.planner import auto, calibrate, localcheck
from rlhfjax.planner.hardware import PRESETS, Hardware

# Small enough to compile quickly: bench_ppo's default model at half the width and half the layers.
SMALL = dict(hidden=64, layers=2, mlp=176, batch=16, new_tokens=16)

HOST = Hardware(
  name="local",
  half_flops=5e10,
  float_flops=5e10,
  memory_gib=16.0,
  memory_bw=8e9,
  intra_node_bw=3e9,
  inter_node_bw=3e9,
  devices_per_node=8,
  native_half=False,
  host_shared=True,
  device_cost=(1.0, 1.7, 1.9, 3.1),
  step_cost=(1.0, 2.3, 2.9, 5.3),
)


def test_per_device_cost_interpolates_the_measured_sizes():
  assert [HOST.per_device(g) for g in (1, 2, 4, 8)] == [1.0, 1.7, 1.9, 3.1]
  assert HOST.per_device(6) == pytest.approx(1.9 + (3.1 - 1.9) * 0.5849625, rel=1e-6)
  assert HOST.per_device(16) == pytest.approx(6.2)  # beyond the measured: per device
  assert HOST.per_device(8, step=True) == 5.3
  assert dataclasses.replace(HOST, device_cost=()).per_device(8) == 1.0
  assert PRESETS["h100"].per_device(8) == 1.0  # real devices run their copies at once


def test_fixed_costs_grow_with_the_group_on_a_shared_host():
  # The same config on 8 and 4 devices: its fixed costs follow device_cost (decode steps:
  # step_cost), its FLOPs do not.
  config = localcheck.bench_config("colocated", **SMALL)
  split = localcheck.bench_config("disaggregated", **SMALL)
  base = dataclasses.replace(calibrate.IDEAL, layer_s=0.0)
  eff = dataclasses.replace(base, layer_s=1e-3, update_s=2e-3, decode_step_s=1e-3)
  extra = {}
  for name, c in (("8", config), ("4", split)):
    with_costs = auto.predict(c, 8, HOST, eff).stages
    without = auto.predict(c, 8, HOST, base).stages
    extra[name] = {s: with_costs[s] - without[s] for s in ("generate", "score", "update")}
  for stage in ("score", "update"):
    assert extra["4"][stage] / extra["8"][stage] == pytest.approx(1.9 / 3.1, rel=1e-6), stage
  assert extra["4"]["generate"] / extra["8"]["generate"] == pytest.approx(2.9 / 5.3, rel=1e-6)


@pytest.mark.parametrize("hw", [HOST, PRESETS["a100_80gb"]], ids=["host_shared", "a100"])
def test_fit_recovers_the_factors_a_run_was_predicted_with(hw):
  config = localcheck.bench_config("colocated", **SMALL)
  if hw.host_shared:
    true = dataclasses.replace(
      calibrate.IDEAL,
      stage_s=3e-3,
      layer_s=7e-4,
      update_s=1.1e-2,
      decode_step_s=2.3e-3,
      transfer_s=1.3e-3,
    )
  else:
    true = dataclasses.replace(
      calibrate.IDEAL,
      stage_s=3e-3,
      forward_mfu=0.37,
      train_mfu=0.29,
      decode_step_s=2.3e-3,
      transfer_bw=0.41,
    )
  measured = dict(auto.predict(config, 8, hw, true).stages)
  fitted = localcheck.fit(config, hw, 8, measured)
  for _, factor in localcheck.FITTED[hw.host_shared]:
    assert getattr(fitted, factor) == pytest.approx(getattr(true, factor), rel=1e-4), factor


def test_agreements_assert_every_stage_of_every_checked_placement():
  stages = {s: 1.0 for s in (*localcheck.COMPARED, "iteration")}
  result = localcheck.Check(
    predicted={"a": stages, "b": {**stages, "update": 1.5, "iteration": 1.2}},
    measured={"a": stages, "b": {**stages, "iteration": 2.0}},
    spread={"a": {s: 0.1 for s in stages}, "b": {s: 5.0 for s in stages}},
    samples={},
    fitted_on="a",
    efficiency=calibrate.IDEAL,
    hardware=HOST,
    scaling_samples={},
  )
  found = localcheck.agreements(result)
  # A noisy stage is still asserted; the fitted placement is not (its ratios are 1 by fit).
  assert [ok for _, ok in found["stages"]] == [True, True, False, True]
  assert all(what.startswith("b ") for what, _ in found["stages"])
  assert found["order"] == []  # the gap (100%) is inside b's spread (500%)


def test_calibration_at_moments_takes_the_medians_on_a_shared_host_only():
  import jax

  two = jax.devices()[:2]
  base = dataclasses.replace(HOST, device_cost=(), step_cost=())
  moments = calibrate.AtMoments(base, two)
  for _ in range(3):
    moments.sample()
  hw = moments.hardware()
  assert [len(rows) for rows in moments.samples.values()] == [3, 3]
  assert len(hw.device_cost) == len(hw.step_cost) == 2  # 1 and 2 devices
  assert hw.device_cost[0] == hw.step_cost[0] == 1.0
  assert hw.float_flops != base.float_flops and hw.half_flops == hw.float_flops
  accelerator = calibrate.AtMoments(PRESETS["h100"], two)  # nothing timed again
  accelerator.sample()
  assert accelerator.samples == {} and accelerator.hardware() is PRESETS["h100"]
