"""The rollout engine's reference: generation without a KV cache.

Every response token comes from a forward over the whole sequence so far (prompt and response,
right padded; `models.forward_logits`), drawn by `rollout.sample` with the key the engine gives
that token, `fold_in(fold_in(key(seed), request id), step)`. The engine (its pages, refills,
live batches, preemption and prefix sharing) must give the same tokens, greedy and sampled, and
the same log-probs up to float rounding. The sampler itself is checked against NumPy in
tests/test_rollout.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax import models, rollout


@dataclasses.dataclass(frozen=True)
class Output:
  """The fields of `rollout.GenerateOutput` that a generation decides."""

  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  mask: np.ndarray
  stopped: np.ndarray
  observed: np.ndarray


@functools.partial(jax.jit, static_argnums=0)
def _next(config, params, tokens_bt, mask_bt, at_b, keys_b, temperature_b, top_k_b, top_p_b):
  logits_btv = models.forward_logits(config, params, tokens_bt, mask_bt)
  logits_bv = jnp.take_along_axis(logits_btv, at_b[:, None, None], axis=1)[:, 0]
  return rollout.sample(logits_bv, keys_b, temperature_b, top_k_b, top_p_b)


@functools.partial(jax.jit, static_argnums=0)
def _keys(seed, ids_b, step_b):
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(ids_b)
  return jax.vmap(jax.random.fold_in)(keys, step_b)


def generate(
  config,
  params,
  prompts: Sequence[Sequence[int]],
  sampling: rollout.SamplingParams | Sequence[rollout.SamplingParams] = rollout.GREEDY,
  *,
  max_new_tokens: int,
  seed: int = 0,
  pad_token_id: int = 0,
  turn=None,
  turn_tokens: int = 0,
) -> Output:
  """Responses to `prompts` as the engine would give them (request ids: input positions).

  `max_new_tokens`: the engine's capacity, the limit of settings that give none (and the
  width of the outputs). `turn` as `rollout.RolloutStream`'s: its observations are appended
  to the sequence, and the token after them is drawn with the key of its place in the
  response."""
  n = len(prompts)
  settings = [sampling] * n if isinstance(sampling, rollout.SamplingParams) else list(sampling)
  limit = [s.max_new_tokens or max_new_tokens for s in settings]
  stops = [config.eos_token_ids if s.stop_token_ids is None else s.stop_token_ids for s in settings]
  rows = -(-n // 8) * 8  # a few shapes, so a few compilations
  length = -(-(max(map(len, prompts)) + max_new_tokens) // 8) * 8
  per_row = lambda f, dtype: jnp.asarray([f(s) for s in settings] + [0] * (rows - n), dtype)
  temperature = per_row(lambda s: s.temperature, jnp.float32)
  top_k = per_row(lambda s: s.top_k, jnp.int32)
  top_p = per_row(lambda s: s.top_p, jnp.float32)
  ids = jnp.arange(rows, dtype=jnp.int32)
  responses: list[list[int]] = [[] for _ in range(n)]
  logprobs: list[list[float]] = [[] for _ in range(n)]
  stopped = np.zeros(n, bool)
  observed: list[list[bool]] = [[] for _ in range(n)]
  turn_start = [0] * n
  live = set(range(n))
  while live:
    tokens = np.full((rows, length), pad_token_id, np.int32)
    mask = np.zeros((rows, length), np.int32)
    at = np.zeros(rows, np.int32)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
      seq = list(p) + r
      tokens[i, : len(seq)], mask[i, : len(seq)], at[i] = seq, 1, len(seq) - 1
    steps = jnp.asarray([len(r) for r in responses] + [0] * (rows - n), jnp.int32)
    token, logprob = _next(
      config, params, tokens, mask, jnp.asarray(at), _keys(seed, ids, steps), temperature, top_k,
      top_p,
    )  # fmt: skip
    token, logprob = np.asarray(token), np.asarray(logprob)
    for i in sorted(live):
      responses[i].append(int(token[i]))
      logprobs[i].append(float(logprob[i]))
      observed[i].append(False)
      stopped[i] = int(token[i]) in stops[i]
      turn_full = turn is not None and len(responses[i]) - turn_start[i] == turn_tokens
      if stopped[i] or len(responses[i]) == limit[i] or turn_full:
        room = limit[i] - len(responses[i])
        obs = None
        if turn is not None:
          obs = turn(i, np.asarray(responses[i][turn_start[i] :]), bool(stopped[i]), room)
        if obs is None:
          live.discard(i)
          continue
        responses[i] += list(map(int, obs))
        logprobs[i] += [0.0] * len(obs)
        observed[i] += [True] * len(obs)
        turn_start[i], stopped[i] = len(responses[i]), False
  width = max(limit)
  out_tokens = np.full((n, width), pad_token_id, np.int32)
  out_logprobs = np.zeros((n, width), np.float32)
  out_observed = np.zeros((n, width), bool)
  for i, (r, lp) in enumerate(zip(responses, logprobs, strict=True)):
    out_tokens[i, : len(r)], out_logprobs[i, : len(lp)] = r, lp
    out_observed[i, : len(r)] = observed[i]
  lengths = np.asarray([len(r) for r in responses], np.int32)
  return Output(
    tokens=out_tokens,
    logprobs=out_logprobs,
    lengths=lengths,
    mask=np.arange(width)[None, :] < lengths[:, None],
    stopped=stopped,
    observed=out_observed,
  )
