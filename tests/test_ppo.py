"""PPO end to end on every placement: same numbers everywhere, arrays where the spec says."""

import itertools
import json
import os
import pathlib
import runpy
import threading
import time

import jax
import numpy as np
import pytest
from runs_testing import LEARNING_RUN, assert_same_numbers

from rlhfjax.cluster import dispatch
from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.data import packing
from rlhfjax.observe.timeline import Timeline
from rlhfjax.placement import memory
from rlhfjax.placement.spec import Role
from rlhfjax.planner.place import place, sized
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
_VARIANTS = ("colocated", "interleaved_split", "disaggregated")
_RELEASED = "interleaved_split"
"""The variant whose rollout frees its weight copy between generations (`rollout.release`): its
rollout (tensor 2 over all 8 devices) copies the actor's weights (fsdp over 4)."""


_CONTEXT = "disaggregated"
"""The variant whose training roles split each row's tokens over 2 devices
(`placement.context`=2: fsdp 2 x context 2 on each role's 4 devices), so its numbers are those
of context parallelism against the co-located run's."""


def _config(variant: str, **changes):
  cd = runpy.run_path(str(_CONFIGS / "ppo_tiny.py"))["get_config"](variant)
  cd.total_steps = 2
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.reward.model_coef = 0.5  # exercise the reward model too
  cd.eval.num_prompts = 0  # the held-out evaluation is tested with the pipeline
  for dotted, value in changes.items():
    section, _, field = dotted.rpartition("__")
    target = cd[section] if section else cd
    target[field] = value
  return from_config_dict(cd)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = {}
  for variant in _VARIANTS:
    changes = {"rollout__release": True} if variant == _RELEASED else {}
    if variant == _CONTEXT:
      changes["placement__context"] = 2
    cfg = _config(variant, **changes)
    trainer = Runner(cfg, str(tmp_path_factory.mktemp(variant)), show_progress=False)
    out[variant] = (trainer, trainer.run())
  return out


_COMPARED = (
  "reward/mean",
  "kl/mean",
  "loss/policy",
  "loss/value",
  "policy/entropy",
  "critic/grad_norm",
  "actor/grad_norm",
)


@pytest.mark.parametrize("variant", _VARIANTS[1:])
def test_every_placement_gives_the_colocated_numbers(runs, variant):
  base = runs["colocated"][1].metrics
  other = runs[variant][1].metrics
  assert len(base) == len(other) == 2
  assert_same_numbers(base, other, _COMPARED)
  # The runs are not trivially equal: something changed between the two iterations.
  assert base[0]["loss/policy"] != base[1]["loss/policy"]


@pytest.mark.parametrize("variant", _VARIANTS)
def test_each_program_compiles_once(runs, variant):
  trainer, result = runs[variant]
  # Packed programs (the default, `ppo.packing`) compile once per row-count bucket.
  per_bucket = ("_packed", "_packed_grad", "_packed_zeros", "_gather")
  buckets = len(packing.row_buckets(trainer.cfg.rollout.batch_size, 8))
  for name, count in result.compilations.items():
    assert count <= (buckets if name.endswith(per_bucket) else 1), result.compilations
  assert {
    "actor_packed_grad",
    "critic_packed_grad",
    "actor_logprobs_packed",
    "reference_logprobs_packed",
    "critic_values_packed",
    "reward_values_packed",
    "advantages",
  } <= set(result.compilations)
  assert set(trainer.cluster.engine.compilations.values()) == {1}, (
    trainer.cluster.engine.compilations
  )


def test_a_released_rollout_frees_its_weights_between_generations_and_no_run_keeps_its_pool(runs):
  # Each generation freed the rollout's own copy: every shard of the weights the sync had to
  # move into the rollout's layout (norm scales replicated on the same devices stay the
  # actor's). The sync after the update copied them in again (the numbers are the co-located
  # run's: above).
  trainer, result = runs[_RELEASED]
  assert not trainer.cluster.rollout_reads_source
  pairs = zip(
    jax.tree.leaves(trainer.cluster.states[Role.ACTOR].params),
    jax.tree.leaves(trainer.cluster.engine.params),
    strict=True,
  )
  copy = sum(
    shard.data.nbytes
    for a, x in pairs
    if not a.sharding.is_equivalent_to(x.sharding, x.ndim)
    for shard in x.addressable_shards
  )
  assert copy > 0
  assert [row["rollout/released_bytes"] for row in result.metrics] == [copy, copy]
  assert all("rollout/released_bytes" not in row for v in _VARIANTS if v != _RELEASED
             for row in runs[v][1].metrics)  # fmt: skip
  # The KV pool lives only while a generation runs, in every run: none of the engines' pools
  # (their caches' shapes and dtypes) is alive now that the runs are done.
  pools = set()
  for variant in _VARIANTS:
    state = jax.eval_shape(runs[variant][0].cluster.engine.init_decode_state)
    pools |= {(x.shape, x.dtype) for x in jax.tree.leaves(state.cache)}
  assert pools and not pools & {(x.shape, x.dtype) for x in jax.live_arrays()}


def test_release_refuses_a_rollout_that_generates_ahead(tmp_path):
  with pytest.raises(ConfigError, match="'rollout.release' frees the rollout's weights"):
    _config("disaggregated_async", rollout__release=True)


def _devices_of(tree):
  return {shard.device.id for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards}


def test_context_parallel_roles_split_their_weights_and_rows_over_context(runs):
  trainer, _ = runs[_CONTEXT]
  for role in (Role.ACTOR, Role.CRITIC, Role.REFERENCE, Role.REWARD):
    spec = trainer.placement[role]
    assert spec.axes == (("data", 1), ("fsdp", 2), ("context", 2), ("tensor", 1)), role
  width = trainer.cfg.model.for_role("actor").hidden_size
  embedding = trainer.cluster.states[Role.ACTOR].params["embedding"]
  # The width over fsdp x context: each of the 4 devices a quarter.
  assert {s.data.shape[1] for s in embedding.addressable_shards} == {width // 4}


@pytest.mark.parametrize("variant", _VARIANTS)
def test_weights_live_on_their_roles_devices(runs, variant):
  trainer, _ = runs[variant]
  ids = [d.id for d in jax.devices()]
  want = lambda role: {ids[i] for i in trainer.placement[role].devices}
  assert _devices_of(trainer.cluster.states[Role.ACTOR].params) == want(Role.ACTOR)
  assert _devices_of(trainer.cluster.states[Role.ACTOR].opt_state) == want(Role.ACTOR)
  assert _devices_of(trainer.cluster.states[Role.CRITIC].params) == want(Role.CRITIC)
  assert _devices_of(trainer.cluster.params[Role.REFERENCE]) == want(Role.REFERENCE)
  assert _devices_of(trainer.cluster.params[Role.REWARD]) == want(Role.REWARD)
  assert _devices_of(trainer.cluster.engine.params) == want(Role.ROLLOUT)
  # After the last sync the rollout holds exactly the trained actor weights.
  for a, b in zip(
    jax.tree.leaves(trainer.cluster.states[Role.ACTOR].params),
    jax.tree.leaves(trainer.cluster.engine.params),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_outputs_metrics_timeline_and_plots(runs):
  trainer, result = runs["disaggregated"]
  workdir = pathlib.Path(result.workdir)
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 1]
  required = {
    "reward/mean",
    "kl/mean",
    "loss/policy",
    "loss/value",
    "time/iteration",
    "time/generate",
    "time/score",
    "time/update",
    "time/sync",
    "throughput/tokens_per_s_per_device",
    "logprob_mismatch/max",
  }
  assert required <= set(rows[0])
  # Synchronous mode: the rollout sampled from the same weights the actor scores with.
  assert rows[1]["logprob_mismatch/max"] < 1e-4
  records = Timeline.read_json(workdir / "timeline.json")
  spec = trainer.placement
  by_stage = {(r.role, r.stage) for r in records}
  assert {
    ("rollout", "generate"),
    ("actor", "score"),
    ("reference", "score"),
    ("critic", "score"),
    ("reward", "score"),
    ("actor", "update"),
    ("critic", "update"),
    ("rollout", "sync"),
  } <= by_stage
  for r in records:
    if r.stage == "generate":
      assert r.devices == spec[Role.ROLLOUT].devices
    if r.stage == "update":
      assert r.devices == spec[Role(r.role)].devices
  for name in ("timeline.png", "reward.png"):
    assert (workdir / name).stat().st_size > 1000
  assert any(f.startswith("events") for f in os.listdir(workdir / "tb"))


def test_async_rollout_overlaps_generation_with_training(tmp_path, capsys):
  # The rollout's KV pool sized from memory (`rollout.kv_memory_fraction`): the fraction of
  # 16 GiB that leaves 8 pages and the reserved one per 'data' replica beside the rollout's
  # weights: two sequences of 56 tokens at full length, of its 4 slots, so sequences wait for
  # pages or are preempted.
  roomy = _config(
    "disaggregated_async", rollout__kv_memory_fraction=1.0, placement__memory_per_device_gb=16.0
  )
  _, pool = sized(roomy, place(roomy, 8))
  page_bytes = roomy.rollout.page_size * pool.token_bytes
  assert pool.capped and pool.tokens == 16 * pool.replicas * roomy.rollout.page_size
  fraction = (pool.resident + 9.5 * page_bytes) / (16 * memory.GIB)
  cfg = _config(
    "disaggregated_async",
    total_steps=3,
    rollout__kv_memory_fraction=fraction,
    placement__memory_per_device_gb=16.0,
  )
  trainer = Runner(cfg, str(tmp_path), show_progress=False)
  assert trainer.cluster.engine.config.num_pages == pool.replicas * 9
  assert f"rollout KV pool: {8 * pool.replicas * 16:,} tokens" in capsys.readouterr().out
  result = trainer.run()
  records = trainer.timeline.records
  generate = {r.iteration: r for r in records if r.stage == "generate"}
  assert sorted(generate) == [0, 1, 2]
  # Batch k+1 is generated while batch k is scored and trained on.
  for k in (0, 1):
    update_end = max(r.end for r in records if r.iteration == k and r.stage == "update")
    assert generate[k + 1].start < update_end
  # One step off-policy: the rollout's log-probs come from older weights than the actor's.
  assert result.metrics[1]["logprob_mismatch/max"] > 1e-4
  assert set(result.compilations.values()) == {1}


def test_async_rollout_needs_its_own_devices(tmp_path):
  with pytest.raises(ValueError, match="async_rollout needs the rollout on its own devices"):
    Runner(_config("colocated", ppo__async_rollout=True), str(tmp_path))


def _stage(role, devices, fn):
  return dispatch.Stage(role=role, name="score", devices=devices, fn=fn)


def test_disjoint_stages_run_at_the_same_time():
  both_started = threading.Barrier(2, timeout=10)
  stages = [
    _stage("reference", (0, 1, 2, 3), both_started.wait),
    _stage("reward", (4, 5, 6, 7), both_started.wait),
  ]
  # Each stage waits for the other to have started: this only finishes if they overlap.
  dispatch.run_stages(stages, Timeline(), 0)


def test_colocated_stages_run_one_after_another():
  running, overlaps = [], []

  def work():
    running.append(1)
    overlaps.append(len(running) > 1)
    time.sleep(0.05)
    running.pop()

  timeline = Timeline()
  stages = [
    _stage("actor", (0, 1), work),
    _stage("critic", (1, 2), work),
    _stage("reward", (2, 3), work),
    _stage("reference", (5,), lambda: 7),
  ]
  results = dispatch.run_stages(stages, timeline, 0)
  assert results[3] == 7 and not any(overlaps)
  assert dispatch.device_groups(stages) == [[0, 1, 2], [3]]
  ordered = sorted((r for r in timeline.records if r.role != "reference"), key=lambda r: r.start)
  assert [r.role for r in ordered] == ["actor", "critic", "reward"]
  assert all(a.end <= b.start for a, b in itertools.pairwise(ordered))


@pytest.mark.slow
def test_reward_rises(tmp_path):
  # Colocated only: every placement computes the colocated numbers
  # (test_every_placement_gives_the_colocated_numbers), and after each sync the rollout holds
  # the trained weights (test_weights_live_on_their_roles_devices), so a learning run on
  # another placement would check the same trajectory again.
  cfg = _config("colocated", reward__model_coef=0.0, **LEARNING_RUN)
  rewards = [
    r["reward/mean"] for r in Runner(cfg, str(tmp_path), show_progress=False).run().metrics
  ]
  first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
  assert last > first + 0.05 and last > 2 * first, rewards


def test_group_relative_runs_without_a_critic(tmp_path):
  cfg = _config("interleaved", ppo__advantage="group_relative", ppo__group_size=4)
  trainer = Runner(cfg, str(tmp_path), show_progress=False)
  result = trainer.run()
  assert Role.CRITIC not in trainer.cluster.states
  # No critic mesh either (the reward model scores: `reward.model_coef` is 0.5).
  assert set(trainer.placement.roles) == {Role.ACTOR, Role.REFERENCE, Role.REWARD, Role.ROLLOUT}
  assert set(trainer.cluster.roles) == set(trainer.placement.roles)
  stages = {(r.role, r.stage) for r in trainer.timeline.records}
  assert ("critic", "score") not in stages and ("critic", "update") not in stages
  assert "critic_step" not in result.compilations
  assert set(result.compilations.values()) == {1}
  assert np.isfinite(result.metrics[-1]["loss/policy"])
