"""Continuous batching: `generate`, the synchronous rollout, waits for every response.

It consumes the stream of `rlhfjax.rollout.streaming` (prompts served through the engine's
decode slots, refilled as sequences finish) and puts the responses back in input order. One
short response never waits for the longest in its batch, and the device runs the same
programs (`generate_steps`, one per live-batch size and page-table width) whatever the mix of
lengths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlhfjax.rollout import paging, streaming
from rlhfjax.rollout.sampling import GREEDY, SamplingParams
from rlhfjax.rollout.streaming import as_prompt_list

__all__ = ["GenerateOutput", "as_prompt_list", "generate"]

if TYPE_CHECKING:
  from rlhfjax.rollout.engine import Engine


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOutput:
  """Responses in the order of the input prompts (host arrays)."""

  tokens: np.ndarray
  """[prompts, r] int32 response tokens, `pad_token_id` past each length; `r` is the largest
  `max_new_tokens` asked for."""
  logprobs: np.ndarray
  """[prompts, r] float32 log-prob of each token under the distribution it was sampled from
  (greedy: the model's distribution); 0 past each length."""
  lengths: np.ndarray
  """[prompts] int32 response lengths, a final stop token included."""
  mask: np.ndarray
  """[prompts, r] bool: True on response tokens."""
  stopped: np.ndarray
  """[prompts] bool: the response ended with a stop token (else it hit `max_new_tokens`)."""
  versions: np.ndarray
  """[prompts, r] int32: `Engine.params_version` of the weights that sampled each token (the
  version current at the decode call that produced it); -1 past each length and on
  observations."""
  observed: np.ndarray
  """[prompts, r] bool: True on observations a `turn` function appended (all False without
  one); `mask & ~observed` are the sampled tokens."""
  inserts: np.ndarray
  """[prompts] int32: how many times each prompt was put into a slot (1, plus one per
  preemption)."""
  prefill_calls: int
  prefill_rows: int
  """Sequences prefilled (with shared prefixes, one per distinct prompt and replica)."""
  prefill_tokens: int
  """Tokens the prefill calls ran over (compiled rows times prompt bucket, padding included)."""
  extend_calls: int
  extended_tokens: int
  """Observation tokens (and each turn's last) whose KV was written after the history's."""
  decode_calls: int
  """`generate_steps` calls: the host round trips between refills."""
  host_transfers: int
  """Uploads and reads between host and devices, one per call."""
  generated_tokens: int
  max_live: int
  """Most requests decoding at once."""
  max_pages_in_use: int
  """Most KV pages held at once."""
  preemptions: int
  decode_steps_by_batch: dict[int, int]
  """Decode steps run at each live-batch size."""


def generate(
  engine: Engine,
  prompts: Any,
  lengths: Any = None,
  *,
  sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
  seed: int = 0,
  padding_side: str = "left",
  on_decode_call: Callable[[], None] | None = None,
  turn: paging.TurnFn | None = None,
  turn_tokens: int = 0,
) -> GenerateOutput:
  """Generates a response to every prompt, refilling decode slots as sequences finish.

  A consumer of `rlhfjax.rollout.streaming.RolloutStream` that waits for every response and
  makes as few host round trips as it can (it drains the queue in one decode call); with
  `turn`, a call also returns once a quarter of the slots ended a turn, so those go on.

  The arguments are those of `RolloutStream`.

  Returns:
    The responses, in input order.
  """
  stream = streaming.RolloutStream(
    engine,
    prompts,
    lengths,
    sampling=sampling,
    seed=seed,
    padding_side=padding_side,
    # One answer each: a call returns once every slot's request finished (fewest round trips).
    # Conversations: once a quarter did, so that finished turns go on sooner than in lock step
    # with the batch's longest (`scripts/bench_turns.py`: 15% fewer decode steps, 8% less time
    # for 32 slots on a CPU, against 1: more round trips than steps saved).
    min_yield=engine.config.num_slots if turn is None else max(1, engine.config.num_slots // 4),
    on_decode_call=on_decode_call,
    turn=turn,
    turn_tokens=turn_tokens,
  )
  num, width = stream.num_prompts, stream.width
  tokens = np.full((num, width), engine.config.pad_token_id, np.int32)
  logprobs = np.zeros((num, width), np.float32)
  out_lengths = np.zeros(num, np.int32)
  stopped = np.zeros(num, bool)
  versions = np.full((num, width), -1, np.int32)
  observed = np.zeros((num, width), bool)
  for done in stream:
    tokens[done.indices] = done.tokens
    logprobs[done.indices] = done.logprobs
    out_lengths[done.indices] = done.lengths
    stopped[done.indices] = done.stopped
    versions[done.indices] = done.versions
    if done.observed is not None:
      observed[done.indices] = done.observed
  mask = np.arange(width)[None, :] < out_lengths[:, None]
  stats = stream.stats
  return GenerateOutput(
    tokens=tokens,
    logprobs=logprobs,
    lengths=out_lengths,
    mask=mask,
    stopped=stopped,
    versions=versions,
    observed=observed,
    inserts=stats.inserts,
    prefill_calls=stats.prefill_calls,
    prefill_rows=stats.prefill_rows,
    prefill_tokens=stats.prefill_tokens,
    extend_calls=stats.extend_calls,
    extended_tokens=stats.extended_tokens,
    decode_calls=stats.decode_calls,
    host_transfers=stats.host_transfers,
    generated_tokens=stats.generated_tokens,
    max_live=stats.max_live,
    max_pages_in_use=stats.max_pages_in_use,
    preemptions=stats.preemptions,
    decode_steps_by_batch=dict(stats.decode_steps_by_batch),
  )
