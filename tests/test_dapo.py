"""DAPO: overlong shaping and the dynamic-sampling filter against NumPy, the rows kept from
several sampling rounds, and the registered algorithms. The flow's runs: test_dapo_runs.py."""

import numpy as np
import pytest

from rlhfjax import algorithms as alg
from rlhfjax.flows import experience, registry

pytestmark = pytest.mark.unit


def test_overlong_penalty_against_the_formula():
  max_len, buffer = 13, 5
  lengths = np.arange(0, 16)

  def want(n):
    if n <= max_len - buffer:
      return 0.0
    return (max_len - buffer - n) / buffer if n <= max_len else -1.0

  np.testing.assert_allclose(
    np.asarray(alg.overlong_penalty(lengths, max_len=max_len, buffer=buffer)),
    [want(n) for n in lengths],
    atol=1e-6,
  )


def test_groups_with_signal():
  scores = np.array([1, 1, 1, 0.5, 0.5, 0.7, 0, 0, 0], np.float32)
  np.testing.assert_array_equal(alg.groups_with_signal(scores, 3), [False, True, False])


def test_take_rows_keeps_rows_in_order():
  def batch(offset):
    return experience.assemble(
      [[1 + offset], [2 + offset], [3 + offset]],
      np.arange(6).reshape(3, 2) + 10 * offset,
      np.array([2, 1, 2]),
      np.zeros((3, 2), np.float32),
      prompt_len=2,
      response_len=2,
      pad_id=0,
    )

  a, b = batch(0), batch(1)
  out = experience.take_rows([(a, [2, 0]), (b, [1])])
  assert [p.tolist() for p in out.prompts] == [[3], [1], [3]]
  np.testing.assert_array_equal(
    out.tokens_bs, np.stack([a.tokens_bs[2], a.tokens_bs[0], b.tokens_bs[1]])
  )
  np.testing.assert_array_equal(out.response_mask_bt[:, 1], [1, 1, 0])


def test_conversation_stats_of_several_rounds_merge_by_rows():
  """DAPO's rounds each ran their own conversations: the iteration reports means weighted by
  each round's rows and the errors of all of them."""
  import dataclasses

  def batch(rows, stats):
    seqs = experience.assemble(
      [[1]] * rows,
      np.ones((rows, 2), np.int64),
      np.full(rows, 2),
      np.zeros((rows, 2), np.float32),
      prompt_len=1,
      response_len=2,
      pad_id=0,
    )
    return dataclasses.replace(seqs, conversation_stats=stats)

  a = batch(3, {"rollout/turns_mean": 2.0, "rollout/environment_errors": 1.0})
  b = batch(1, {"rollout/turns_mean": 6.0, "rollout/environment_errors": 2.0})
  merged = experience.merged_conversation_stats([a, b])
  assert merged == {"rollout/turns_mean": 3.0, "rollout/environment_errors": 3.0}
  assert experience.merged_conversation_stats([batch(2, {})]) == {}
  # A batch picked from both keeps no stats of its own: the flow sets the merged ones.
  assert experience.take_rows([(a, [0]), (b, [0])]).conversation_stats == {}


def test_every_algorithm_is_registered():
  assert {"ppo", "grpo", "rloo", "reinforce_pp", "dapo", "dpo", "online_dpo"} <= set(
    registry.builtin()
  )
