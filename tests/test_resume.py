"""Checkpoint and resume of PPO runs in this process: saved under one placement, resumed under
another; non-finite updates skipped, then the run stopped. (kill -9, Ctrl-C and bad checkpoints
through scripts/train_ppo.py: tests/test_resume_e2e.py.)"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
import runs_testing

from rlhfjax import config as config_lib
from rlhfjax import runner as trainer_lib
from rlhfjax.placement.spec import Role

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(strategy: str, steps: int, reward=None, **ppo) -> config_lib.ExperimentConfig:
  import runpy

  cd = runpy.run_path(os.path.join(ROOT, "configs", "ppo_tiny.py"))["get_config"](strategy)
  cd.total_steps = steps
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.ppo.ppo_epochs = 1
  cd.checkpoint = {"every_steps": 2, "async_save": True}
  cd.eval = {"num_prompts": 0}
  cd.ppo.update(ppo)
  if reward:
    cd.reward.update(reward)
  return config_lib.from_config_dict(cd)


@pytest.mark.slow
def test_saved_under_colocated_resumes_under_disaggregated(tmp_path):
  workdir = str(tmp_path)
  first = trainer_lib.Runner(_config("colocated", 2), workdir, show_progress=False)
  first.run()
  saved = jax.device_get(first.cluster.states[Role.ACTOR].params)
  saved_critic = jax.device_get(first.cluster.states[Role.CRITIC].params)

  second = trainer_lib.Runner(_config("disaggregated", 3), workdir, show_progress=False)
  assert second.start_step == 2
  actor_devices = {jax.devices()[i] for i in second.placement[Role.ACTOR].devices}
  assert actor_devices != set(jax.devices())  # the actor really moved to a sub-mesh
  for state, want, role in (
    (second.cluster.states[Role.ACTOR], saved, Role.ACTOR),
    (second.cluster.states[Role.CRITIC], saved_critic, Role.CRITIC),
  ):
    devices = {jax.devices()[i] for i in second.placement[role].devices}
    for leaf, expected, sharding in zip(
      jax.tree.leaves(state.params),
      jax.tree.leaves(want),
      jax.tree.leaves(second.cluster.roles[role].param_shardings),
      strict=True,
    ):
      assert leaf.sharding == sharding
      assert {s.device for s in leaf.addressable_shards} == devices
      for shard in leaf.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
  # The rollout engine starts from the restored weights, and the run continues.
  result = second.run()
  assert [r["step"] for r in result.metrics] == [2]
  assert [r["step"] for r in runs_testing.rows(workdir)] == [0, 1, 2]


def huge_reward(prompts, responses, metadata):
  """Finite scores (a NaN one is refused when the reward function returns it) whose sums
  overflow float32: the advantages and the value loss become non-finite."""
  del responses, metadata
  return np.full(len(prompts), 3e38, np.float32)


@pytest.mark.slow
def test_non_finite_updates_are_skipped_then_the_run_stops(tmp_path):
  cfg = _config("colocated", 4, reward={"fn": "test_resume:huge_reward"}, max_skipped_updates=3)
  trainer = trainer_lib.Runner(cfg, str(tmp_path), show_progress=False)
  before = jax.device_get(trainer.cluster.states[Role.ACTOR].params)
  with pytest.raises(trainer_lib.TooManySkippedUpdates, match="non-finite"):
    trainer.run()
  rows = runs_testing.rows(str(tmp_path))
  # Two updates per iteration (mini_batches=2): the limit of 3 is reached in iteration 1.
  assert [r["step"] for r in rows] == [0, 1]
  assert rows[0]["update/skipped"] == 2 and rows[1]["update/skipped_in_row"] == 4
  after = jax.device_get(trainer.cluster.states[Role.ACTOR].params)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(a, b)
