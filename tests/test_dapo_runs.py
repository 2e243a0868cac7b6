"""DAPO's flow on two placements (same numbers), with every kept group carrying a signal and
overlong responses shaped; its sampling rounds reported, and stopped by SIGTERM."""

import os
import signal

import numpy as np
import pytest
from runs_testing import assert_same_numbers, shipped_config

from rlhfjax.config import ConfigError
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration


def first_token_low(prompts, responses, metadata):
  """1 when the response starts with a byte below 64: about a quarter of random samples, so
  most groups of 4 are all 0 or all 1 (no signal) and some are mixed."""
  del prompts, metadata
  return np.array([float(len(r) > 0 and r[0] < 64) for r in responses], np.float32)


def _config(variant, reward_fn=f"{__name__}:first_token_low", **ppo):
  changes = {
    "reward.fn": reward_fn,
    "total_steps": 2,
    "rollout.batch_size": 8,
    "rollout.max_new_tokens": 8,
    "eval.num_prompts": 0,
  }
  return shipped_config("dapo_tiny", changes | {f"ppo.{k}": v for k, v in ppo.items()}, variant)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  return {
    v: Runner(_config(v), str(tmp_path_factory.mktemp(v)), show_progress=False).run()
    for v in ("colocated", "disaggregated")
  }


def test_dapo_gives_the_same_numbers_on_two_placements(runs):
  base, other = runs["colocated"].metrics, runs["disaggregated"].metrics
  keys = ("reward/mean", "loss/policy", "actor/grad_norm", "dapo/rounds", "dapo/filled_groups")
  assert_same_numbers(base, other, keys)
  assert set(runs["disaggregated"].compilations.values()) == {1}


def test_dapo_samples_groups_with_a_signal_and_shapes_overlong_responses(runs):
  rows = runs["colocated"].metrics
  assert any(row["dapo/rounds"] > 1 for row in rows)  # it had to sample more
  for row in rows:
    if row["dapo/filled_groups"] == 0:
      assert row["reward/std"] > 0  # only groups with a signal were kept
    # 8-token responses of a random policy run to the cap: the last 4 tokens are punished.
    assert row["reward/overlong_mean"] < 0
  assert any(row["dapo/filled_groups"] == 0 for row in rows)


def test_dapo_options_are_checked(tmp_path):
  with pytest.raises(ConfigError, match="overlong_buffer'=8 must be below"):
    Runner(_config("colocated", overlong_buffer=8), str(tmp_path), show_progress=False)


_CALLS = {"n": 0, "stop_at": 0}


def constant_reward(prompts, responses, metadata):
  """Every response scores 0: no group ever has a signal. On call `stop_at` it asks the run to
  stop, as SIGTERM from a scheduler would, from inside the sampling rounds."""
  del prompts, metadata
  _CALLS["n"] += 1
  if _CALLS["n"] == _CALLS["stop_at"]:
    os.kill(os.getpid(), signal.SIGTERM)
  if _CALLS["stop_at"] and _CALLS["n"] > _CALLS["stop_at"] + 2:
    raise AssertionError("still sampling rounds after SIGTERM")
  return np.zeros(len(responses), np.float32)


def _constant_run(tmp_path, rounds, stop_at=0):
  _CALLS.update(n=0, stop_at=stop_at)
  cfg = _config("colocated", f"{__name__}:constant_reward", dynamic_sampling_rounds=rounds)
  return Runner(cfg, str(tmp_path), show_progress=False).run()


def test_dapo_rounds_with_a_constant_reward_are_reported(tmp_path, capfd):
  """Issue 28, item 10: every round used and the batch filled with signal-free groups is said
  on stderr, not only in the metrics."""
  result = _constant_run(tmp_path, rounds=2)
  assert [r["dapo/rounds"] for r in result.metrics] == [3.0, 3.0]
  assert [r["dapo/filled_groups"] for r in result.metrics] == [2.0, 2.0]
  err = capfd.readouterr().err
  assert "dapo: iteration 0 used all 3 sampling rounds (ppo.dynamic_sampling_rounds=2) and " in err
  assert "filled 2 of 2 groups with equal rewards" in err


def test_dapo_sampling_rounds_stop_on_sigterm(tmp_path):
  """A million rounds allowed, a constant reward: SIGTERM during the rounds ends the iteration
  at the next round (not a million rounds later), with a checkpoint, status as a preemption."""
  result = _constant_run(tmp_path, rounds=1_000_000, stop_at=5)
  assert result.preempted
  assert [r["dapo/rounds"] for r in result.metrics] == [5.0]
  assert (tmp_path / "checkpoints" / "1").is_dir()
