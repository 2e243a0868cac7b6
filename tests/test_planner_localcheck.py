"""The planner against this machine: the host-shared cost terms, the sync's buffers, the fit,
the calibration and the local check's assertions. The check itself times the machine, so it is
a benchmark, not a test: `scripts/bench_ppo.py --check=6`, which exits 1 when a stage or the
order is not met and which CI (`.ci/run`) runs alone after the suite."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax.bench import calibrate, localcheck
from rlhfjax.cluster.cluster import Cluster, engine_config
from rlhfjax.costmodel.hardware import PRESETS, Hardware
from rlhfjax.mesh import transfer
from rlhfjax.placement.spec import Role
from rlhfjax.placement.strategies import build_placement
from rlhfjax.planner import auto, sync

pytestmark = pytest.mark.integration

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


def test_engine_cost_times_the_runs_own_engine_at_full_length_on_the_rollouts_layout():
  config = localcheck.bench_config("colocated", **SMALL)
  four = jax.devices()[:4]
  step = localcheck.engine_cost(config, four)
  assert step.sizes == [1, 2, 4]
  # As the rollout's mesh: 'tensor' as wide as the run's (2), 'data' replicas over the rest.
  assert config.placement.rollout_tensor == 2
  assert [dict(m.shape) for m in step.meshes] == [
    {"data": 1, "tensor": 1},
    {"data": 1, "tensor": 2},
    {"data": 2, "tensor": 2},
  ]
  assert [list(m.devices.flat) for m in step.meshes] == [four[:1], four[:2], four]
  for engine in step._engines:  # every answer runs to the run's length (no stop token)
    replicas = dict(engine.mesh.shape)["data"]
    assert engine.config == engine_config(config.rollout, 0, replicas)  # the run's own engine
    out = step._generate(engine)
    assert out.lengths.tolist() == [config.rollout.max_new_tokens] * config.rollout.batch_size
    assert not out.stopped.any()
  relative = calibrate.DeviceCost.relative(step.seconds())
  assert relative[0] == 1.0 and len(relative) == 3 and all(r > 0 for r in relative)
  base = dataclasses.replace(HOST, device_cost=(), step_cost=())
  moments = calibrate.AtMoments(base, four, step=step)
  moments.sample()
  assert len(moments.samples["step_cost"][0]) == 3  # the engine's sizes, not the stand-in's
  assert len(moments.hardware().step_cost) == 3


def _boxes(indices, shape):
  """{device id: (start, stop) per dimension} of a `devices_indices_map`'s items."""
  return {d: tuple(s.indices(n)[:2] for s, n in zip(i, shape, strict=True)) for d, i in indices}


@pytest.mark.parametrize("variant", ["colocated", "interleaved_split", "disaggregated"])
def test_sync_buffers_are_the_buffers_the_mover_makes(variant, monkeypatch):
  config = localcheck.bench_config(variant, **SMALL)
  spec = build_placement(config.placement, 8)
  cluster = Cluster(config, spec)
  actor, rollout = cluster.roles[Role.ACTOR], cluster.roles[Role.ROLLOUT]
  # The planner's view of each role's sharding (device indices, no devices) is the real one.
  for (shape, axes), x, y in zip(
    sync._arrays(actor.model, "lm"),
    jax.tree.leaves(cluster._abstract(Role.ACTOR)),
    jax.tree.leaves(cluster._abstract(Role.ROLLOUT)),
    strict=True,
  ):
    for role, real in ((spec[Role.ACTOR], x.sharding), (spec[Role.ROLLOUT], y.sharding)):
      mine = sync._sharding(role, shape, axes).devices_indices_map(shape)
      theirs = {d.id: i for d, i in real.devices_indices_map(shape).items()}
      assert _boxes(mine.items(), shape) == _boxes(theirs.items(), shape)
  # A real sync, writing into the previous weights as the engine does: every piece the mover
  # cuts and every copy it makes, counted as they happen.
  made = []
  cut_all, copy_all = transfer._cut_all, transfer._copy_all
  monkeypatch.setattr(
    transfer, "_cut_all", lambda shards, cuts: made.append(len(cuts)) or cut_all(shards, cuts)
  )
  monkeypatch.setattr(
    transfer, "_copy_all", lambda xs, devices: made.append(len(xs)) or copy_all(xs, devices)
  )
  params = actor.init_params(jax.random.key(0))
  old = jax.tree.map(jnp.zeros_like, transfer.transfer(params, rollout.param_shardings)[0])
  made.clear()
  moved, _ = transfer.transfer(params, rollout.param_shardings, into=old)
  leaves, shardings = jax.tree.leaves(params), jax.tree.leaves(rollout.param_shardings)
  moving = [
    x for x, s in zip(leaves, shardings, strict=True) if not x.sharding.is_equivalent_to(s, x.ndim)
  ]
  # Replicated norm scales on the same devices stay where they are; onto other devices all move.
  assert (len(moving) == len(leaves)) == (variant == "disaggregated")
  devices = len(set(actor.devices) | set(rollout.devices))
  counted = sync.buffers(actor.model, spec[Role.ACTOR], spec[Role.ROLLOUT])
  assert counted == len(moving) * devices + sum(made)
  for x, y in zip(leaves, jax.tree.leaves(moved), strict=True):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_host_shared_sync_charges_transfer_s_per_buffer_accelerators_per_device():
  base = dataclasses.replace(calibrate.IDEAL, stage_s=0.0)
  eff = dataclasses.replace(base, transfer_s=1e-3)
  counts = {}
  for v in ("colocated", "disaggregated"):
    config = localcheck.bench_config(v, **SMALL)
    spec = build_placement(config.placement, 8)
    counts[v] = sync.buffers(config.model.for_role("actor"), spec[Role.ACTOR], spec[Role.ROLLOUT])
    for hw, expected in ((HOST, counts[v]), (PRESETS["a100_80gb"], 8)):  # accelerators: per device
      sync_s = lambda e, hw=hw, config=config: auto.predict(config, 8, hw, e).stages["sync"]
      assert (sync_s(eff) - sync_s(base)) / 1e-3 == pytest.approx(expected), (v, hw.name)
  # Both syncs touch 8 devices; the disaggregated one (fsdp 4 -> 2 replicas x tensor 2) makes
  # fewer buffers than the co-located one (fsdp 8 -> 4 replicas x tensor 2).
  assert counts["disaggregated"] < 0.75 * counts["colocated"]


def test_resync_samples_take_every_cluster_in_turn_in_alternating_order():
  calls = []

  class Fake:
    def __init__(self, name, seconds):
      self.name, self.seconds = name, seconds

    def resync(self):
      calls.append(self.name)
      return self.seconds

  samples = localcheck.resync_samples([Fake("a", 1.0), Fake("b", 2.0), Fake("c", 3.0)], 3)
  assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
  assert samples == [[1.0] * 3, [2.0] * 3, [3.0] * 3]
