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


def test_every_algorithm_is_registered():
  assert {"ppo", "grpo", "rloo", "reinforce_pp", "dapo", "dpo", "online_dpo"} <= set(
    registry.builtin()
  )
