"""Continuous batching: a queue of prompts served through the engine's decode slots.

The host loop:
  1. take pending prompts for the free slots; prefill them in batches of the engine's prefill
     sizes (short prompts together, so few are padded to a long bucket) and insert them;
  2. run the compiled decode loop on device until some slot finishes (or, once the queue is
     empty, until every slot does);
  3. copy the finished rows out and mark their slots free; repeat.
One short response never waits for the longest in its batch, and the device runs one program
(`generate_steps`) whatever the mix of lengths.

Each request's PRNG key is `fold_in(key(seed), index in the input)`, so a prompt's response
depends on the seed and its own index only, not on the slot count or on the other prompts.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlhfjax.rollout.sampling import GREEDY, SamplingParams

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
  inserts: np.ndarray
  """[prompts] int32: how many times each prompt was put into a slot (always 1)."""
  prefill_calls: int
  decode_calls: int
  """`generate_steps` calls: the host round trips between refills."""


def as_prompt_list(
  prompts: Any, lengths: Any = None, padding_side: str = "left"
) -> list[np.ndarray]:
  """Prompts as a list of 1-D int arrays.

  Args:
    prompts: A sequence of token id lists, or a 2-D array of padded prompts.
    lengths: For a 2-D array, the real length of each row; None: every row is full.
    padding_side: For a 2-D array, 'left' (row i is `prompts[i, -lengths[i]:]`) or 'right'
      (`prompts[i, :lengths[i]]`).
  """
  if padding_side not in ("left", "right"):
    raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
  if isinstance(prompts, np.ndarray) or hasattr(prompts, "shape"):
    array = np.asarray(prompts)
    if array.ndim != 2:
      raise ValueError(f"a prompt array must be 2-D [prompts, length], got shape {array.shape}")
    if lengths is None:
      lengths = np.full(array.shape[0], array.shape[1])
    lengths = np.asarray(lengths).reshape(-1)
    if lengths.shape[0] != array.shape[0]:
      raise ValueError(f"{lengths.shape[0]} lengths for {array.shape[0]} prompts")
    if lengths.min(initial=0) < 0 or lengths.max(initial=0) > array.shape[1]:
      raise ValueError(f"prompt lengths must be in [0, {array.shape[1]}], got {lengths}")
    if padding_side == "left":
      return [array[i, array.shape[1] - n :] for i, n in enumerate(lengths)]
    return [array[i, :n] for i, n in enumerate(lengths)]
  if lengths is not None:
    raise ValueError("lengths are only for a 2-D prompt array")
  return [np.asarray(p).reshape(-1) for p in prompts]


def _chunks(items: list[int], sizes: Sequence[int]) -> list[list[int]]:
  """Splits `items` into runs whose lengths are prefill batch sizes, largest first."""
  out, rest = [], list(items)
  while rest:
    m = max(s for s in sizes if s <= len(rest))
    out.append(rest[:m])
    rest = rest[m:]
  return out


def generate(
  engine: Engine,
  prompts: Any,
  lengths: Any = None,
  *,
  sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
  seed: int = 0,
  padding_side: str = "left",
) -> GenerateOutput:
  """Generates a response to every prompt, refilling decode slots as sequences finish.

  Args:
    engine: The engine (its mesh, weights and compiled programs).
    prompts: Token id lists, or a 2-D padded array with `lengths` (see `as_prompt_list`).
    lengths: Real lengths of the rows of a 2-D `prompts` array.
    sampling: One setting for every prompt or one per prompt (per-prompt `max_new_tokens`
      and stop ids included).
    seed: Seeds every request's PRNG key together with its index in `prompts`.
    padding_side: Where a 2-D `prompts` array is padded.

  Returns:
    The responses, in input order.
  """
  cfg = engine.config
  prompt_list = as_prompt_list(prompts, lengths, padding_side)
  num = len(prompt_list)
  if num == 0:
    raise ValueError("no prompts to generate from")
  settings = [sampling] * num if isinstance(sampling, SamplingParams) else list(sampling)
  if len(settings) != num:
    raise ValueError(f"{len(settings)} sampling settings for {num} prompts")
  for i, p in enumerate(prompt_list):
    try:
      cfg.bucket(len(p))
    except ValueError as e:
      raise ValueError(f"prompt {i}: {e}") from None
  limits = [cfg.max_new_tokens if s.max_new_tokens is None else s.max_new_tokens for s in settings]
  if max(limits) > cfg.max_new_tokens:
    raise ValueError(
      f"max_new_tokens={max(limits)} exceeds the engine's cache capacity "
      f"(EngineConfig.max_new_tokens={cfg.max_new_tokens})"
    )
  width = max(limits)

  tokens = np.full((num, width), cfg.pad_token_id, np.int32)
  logprobs = np.zeros((num, width), np.float32)
  out_lengths = np.zeros(num, np.int32)
  stopped = np.zeros(num, bool)
  inserts = np.zeros(num, np.int32)
  pending = collections.deque(range(num))
  slot_request = [-1] * cfg.num_slots
  prefill_calls = decode_calls = 0

  state = engine.init_decode_state()
  while True:
    free = [s for s, r in enumerate(slot_request) if r < 0]
    if pending and free:
      taken = [pending.popleft() for _ in range(min(len(free), len(pending)))]
      taken.sort(key=lambda i: len(prompt_list[i]))
      for chunk in _chunks(taken, cfg.prefill_batch_sizes):
        slots, free = free[: len(chunk)], free[len(chunk) :]
        prefix = engine.prefill(
          [prompt_list[i] for i in chunk],
          [settings[i] for i in chunk],
          seed=seed,
          request_ids=chunk,
        )
        state = engine.insert(prefix, state, slots)
        prefill_calls += 1
        for s, i in zip(slots, chunk, strict=True):
          slot_request[s] = i
          inserts[i] += 1
    if all(r < 0 for r in slot_request):
      break
    # With prompts still queued every slot is busy, so stop at the first that finishes.
    state, _ = engine.generate_steps(state, until_free=1 if pending else cfg.num_slots)
    decode_calls += 1
    view = engine.read(state)
    for s, i in enumerate(slot_request):
      if i >= 0 and view.done[s]:
        n = int(view.num_generated[s])
        tokens[i, :n] = view.tokens[s, :n]
        logprobs[i, :n] = view.logprobs[s, :n]
        out_lengths[i], stopped[i] = n, view.stopped[s]
        slot_request[s] = -1

  mask = np.arange(width)[None, :] < out_lengths[:, None]
  return GenerateOutput(
    tokens=tokens,
    logprobs=logprobs,
    lengths=out_lengths,
    mask=mask,
    stopped=stopped,
    inserts=inserts,
    prefill_calls=prefill_calls,
    decode_calls=decode_calls,
  )
