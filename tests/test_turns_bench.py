"""scripts/bench_turns.py's rows at the smallest size: the same conversations at every
`min_yield` (tokens, observations), fewer decode steps when finished turns go on sooner, more
round trips."""

import pytest

from rlhfjax.bench import turns_bench

pytestmark = pytest.mark.unit


def test_turns_bench_compares_min_yields_on_the_same_conversations():
  bench = turns_bench.TurnsBench(
    size="tiny", slots=8, max_new_tokens=48, turn_tokens=12, min_yields=(8, 1), repeats=1
  )
  lock_step, eager = turns_bench.run(bench)
  assert (lock_step["min_yield"], eager["min_yield"]) == (8, 1)
  for key in ("generated_tokens", "observation_tokens"):
    assert lock_step[key] == eager[key] > 0
  assert eager["decode_steps"] <= lock_step["decode_steps"]
  assert eager["decode_calls"] > lock_step["decode_calls"] and eager["extend_calls"] > 0
