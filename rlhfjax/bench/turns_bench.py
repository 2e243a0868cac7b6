"""Conversations through the rollout engine: how soon a finished turn goes on.

A decode call returns to the host once `min_yield` requests finished (their turn, for a
conversation); only then does the host answer them and queue their next turn. With every
request's turn awaited (`min_yield` = the slots) the turns advance in lock step: a request whose
turn ended early waits for the batch's longest. A smaller `min_yield` continues turns sooner at
the cost of more host round trips. Each row here is one `min_yield` on the same conversations:
every request takes up to `turns` turns of random lengths (a turn ends on one of the stop ids,
sampled at temperature 1 by a small-vocabulary model, or after `turn_tokens`), each answered by
an observation of `observation` tokens; the row reports the median wall time of `repeats`
streams, the decode calls (host round trips), the decode steps by live-batch size and the
extension calls. The conversations are the same at every `min_yield` (sampling is keyed by
request and position), so the steps compare directly.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

from rlhfjax import models
from rlhfjax.bench.rollout_bench import model_config
from rlhfjax.placement.spec import RoleSpec
from rlhfjax.rollout.engine import Engine, EngineConfig
from rlhfjax.rollout.sampling import SamplingParams
from rlhfjax.rollout.streaming import RolloutStream


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurnsBench:
  size: str = "small"
  vocab_size: int = 64
  """Small, so that the stop ids end turns often (4 of 64 ids: about 1 in 16 tokens)."""
  slots: int = 32
  prompt_len: int = 16
  turns: int = 4
  turn_tokens: int = 40
  observation: int = 3
  max_new_tokens: int = 160
  min_yields: tuple[int, ...] = (32, 8, 1)
  repeats: int = 3


class _Observations:
  """Up to `turns` turns, each answered by `observation` tokens."""

  def __init__(self, turns: int, observation: int):
    self.turns, self.observation, self.taken = turns, observation, {}

  def __call__(self, index, tokens, stopped, room):
    self.taken[index] = self.taken.get(index, 0) + 1
    if self.taken[index] >= self.turns or room <= self.observation:
      return None
    return [5 + k for k in range(self.observation)]


def run(bench: TurnsBench) -> list[dict]:
  """One row per `min_yield` (see the module docstring)."""
  config = model_config(bench.size, vocab_size=bench.vocab_size)
  params = models.init_params(config, "lm", jax.random.key(0))
  engine_config = EngineConfig(
    num_slots=bench.slots,
    prompt_buckets=(bench.prompt_len,),
    max_new_tokens=bench.max_new_tokens,
    decode_chunk=32,
  )
  engine = Engine.for_role(config, engine_config, RoleSpec.generation([0]), params)
  rng = np.random.default_rng(0)
  prompts = [
    rng.integers(0, config.vocab_size, bench.prompt_len).tolist() for _ in range(bench.slots)
  ]
  sampling = SamplingParams(temperature=1.0, stop_token_ids=(1, 2, 3, 4))
  rows = []
  for min_yield in bench.min_yields:
    times = []
    for _ in range(bench.repeats + 1):  # the first compiles
      stream = RolloutStream(
        engine, prompts, sampling=sampling, seed=1, min_yield=min_yield,
        turn=_Observations(bench.turns, bench.observation), turn_tokens=bench.turn_tokens,
      )  # fmt: skip
      start = time.perf_counter()
      finished = list(stream)
      times.append(time.perf_counter() - start)
    stats = stream.stats
    observed = sum(int(f.observed.sum()) for f in finished)
    rows.append(
      {
        "min_yield": min_yield,
        "slots": bench.slots,
        "seconds": round(statistics.median(times[1:]), 4),
        "decode_calls": stats.decode_calls,
        "decode_steps": sum(stats.decode_steps_by_batch.values()),
        "decode_steps_by_batch": dict(sorted(stats.decode_steps_by_batch.items(), reverse=True)),
        "extend_calls": stats.extend_calls,
        "generated_tokens": stats.generated_tokens,
        "observation_tokens": observed,
      }
    )
  return rows
