"""Pure prefill / insert / decode functions over a batch of decode slots with a KV cache.

Letters in names: b batch rows (decode slots, or prompts in a prefill), p prompt bucket length,
s cache length, r response capacity (max new tokens), m stop ids per row, v vocab, x words of
a PRNG key's data, l layers, k kv heads, n head dim.

A row of the cache holds `[left padding | prompt | response]`: a prompt of length `len` is
right-aligned in its bucket of `p` slots (it starts at slot `start = p - len`, position 0), and
response tokens follow at slots `p, p + 1, ...`. A query sees slots `start ..= its own`, so
stale entries past a row's end (from an earlier occupant of the slot) are never attended to.

A prefill returns a `DecodeState` of its own prompts (cache length `p`) with the first response
token already sampled; `insert` copies its rows into free slots of the decode batch. That is the
JetStream engine protocol (prefill -> insert -> generate -> slot reused) with batched prefills.

Randomness: the token a request draws at response step `i` uses `fold_in(rng, i)` with the
request's own key, so results do not depend on the slot it lands in or on its neighbours.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rlhfjax import models
from rlhfjax.config.model import ModelConfig
from rlhfjax.models.transformer import Cache
from rlhfjax.rollout import sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeState:
  """Everything the decode loop carries, one row per slot. A pytree."""

  cache: Cache
  """Keys and values `{'k', 'v'}: [l, b, s, k, n]` in the compute dtype."""
  tokens_b: jax.Array
  """The last sampled token of each row: the next decode input."""
  positions_b: jax.Array
  """Position id of `tokens_b` (prompt length + tokens generated - 1)."""
  index_b: jax.Array
  """Cache slot `tokens_b` is written to."""
  start_b: jax.Array
  """First cache slot of the prompt (slots before it are bucket padding)."""
  num_generated_b: jax.Array
  """Response tokens produced so far (the first one comes from the prefill)."""
  done_b: jax.Array
  """True when the row finished (or was never filled): the slot is free."""
  stopped_b: jax.Array
  """True when the row finished on a stop token (False: it hit its token limit)."""
  max_new_b: jax.Array
  stop_bm: jax.Array
  """Stop token ids, -1 for unused entries."""
  temperature_b: jax.Array
  top_k_b: jax.Array
  top_p_b: jax.Array
  rng_bx: jax.Array
  """Key data of each request's PRNG key (`jax.random.key_data`)."""
  out_tokens_br: jax.Array
  """Response tokens, written at `num_generated_b`; entries past it are stale."""
  out_logprobs_br: jax.Array
  """Log-prob of each response token under the distribution it was sampled from."""

  @property
  def num_slots(self) -> int:
    return self.tokens_b.shape[0]


def logical_axes(cache_axes: tuple[str, ...]) -> DecodeState:
  """Logical axis names of every field (a `DecodeState` whose leaves are tuples)."""
  row, row2 = ("batch",), ("batch", None)
  return DecodeState(
    cache={"k": cache_axes, "v": cache_axes},
    tokens_b=row,
    positions_b=row,
    index_b=row,
    start_b=row,
    num_generated_b=row,
    done_b=row,
    stopped_b=row,
    max_new_b=row,
    stop_bm=row2,
    temperature_b=row,
    top_k_b=row,
    top_p_b=row,
    rng_bx=row2,
    out_tokens_br=row2,
    out_logprobs_br=row2,
  )


def empty_state(
  config: ModelConfig,
  num_slots: int,
  cache_length: int,
  max_new_tokens: int,
  max_stop_tokens: int,
) -> DecodeState:
  """A decode batch with every slot free."""
  b = num_slots
  zeros = lambda dtype: jnp.zeros((b,), dtype)
  rng_x = jax.random.key_data(jax.random.key(0))
  return DecodeState(
    cache=models.init_cache(config, b, cache_length),
    tokens_b=zeros(jnp.int32),
    positions_b=zeros(jnp.int32),
    index_b=zeros(jnp.int32),
    start_b=zeros(jnp.int32),
    num_generated_b=zeros(jnp.int32),
    done_b=jnp.ones((b,), bool),
    stopped_b=zeros(bool),
    max_new_b=zeros(jnp.int32),
    stop_bm=jnp.full((b, max_stop_tokens), -1, jnp.int32),
    temperature_b=zeros(jnp.float32),
    top_k_b=zeros(jnp.int32),
    top_p_b=jnp.ones((b,)),
    rng_bx=jnp.zeros((b, *rng_x.shape), rng_x.dtype),
    out_tokens_br=jnp.zeros((b, max_new_tokens), jnp.int32),
    out_logprobs_br=jnp.zeros((b, max_new_tokens), jnp.float32),
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Requests:
  """A batch of prompts with their settings, as device arrays (the input of a prefill)."""

  tokens_bp: jax.Array
  """Prompts right-aligned in the bucket (left padded with anything)."""
  lengths_b: jax.Array
  max_new_b: jax.Array
  stop_bm: jax.Array
  temperature_b: jax.Array
  top_k_b: jax.Array
  top_p_b: jax.Array
  seed_b: jax.Array
  """Seed and request id name a request's PRNG key: `fold_in(key(seed), request_id)`."""
  request_id_b: jax.Array


def _step_rngs(rng_bx: jax.Array, step_b: jax.Array) -> jax.Array:
  keys_b = jax.random.wrap_key_data(rng_bx)
  return jax.vmap(jax.random.fold_in)(keys_b, step_b)


def _finished(token_b, num_generated_b, max_new_b, stop_bm):
  stopped_b = jnp.any(token_b[:, None] == stop_bm, axis=-1)
  return stopped_b | (num_generated_b >= max_new_b), stopped_b


def prefill(config: ModelConfig, max_new_tokens: int, params, requests: Requests) -> DecodeState:
  """Runs the prompts through the model, fills their cache and samples each first token."""
  b, p = requests.tokens_bp.shape
  slot_p = jnp.arange(p)
  start_b = p - requests.lengths_b
  positions_bp = jnp.maximum(slot_p[None, :] - start_b[:, None], 0)
  sees_pp = slot_p[None, :] <= slot_p[:, None]
  if config.sliding_window is not None:
    sees_pp &= slot_p[:, None] - slot_p[None, :] < config.sliding_window
  mask_bpp = sees_pp[None] & (slot_p >= start_b[:, None])[:, None, :]
  logits_bpv, cache = models.apply(
    config,
    params,
    requests.tokens_bp,
    positions_bp,
    mask_bpp,
    cache=models.init_cache(config, b, p),
    cache_index_b=jnp.zeros((b,), jnp.int32),
  )

  keys_b = jax.vmap(lambda s, r: jax.random.fold_in(jax.random.key(s), r))(
    requests.seed_b, requests.request_id_b
  )
  rng_bx = jax.random.key_data(keys_b)
  zero_b = jnp.zeros((b,), jnp.int32)
  token_b, logprob_b = sampling.sample(
    logits_bpv[:, -1],
    _step_rngs(rng_bx, zero_b),
    requests.temperature_b,
    requests.top_k_b,
    requests.top_p_b,
  )
  done_b, stopped_b = _finished(token_b, zero_b + 1, requests.max_new_b, requests.stop_bm)
  first_br = jnp.arange(max_new_tokens)[None, :] == 0
  return DecodeState(
    cache=cache,
    tokens_b=token_b,
    positions_b=requests.lengths_b,
    index_b=zero_b + p,
    start_b=start_b,
    num_generated_b=zero_b + 1,
    done_b=done_b,
    stopped_b=stopped_b,
    max_new_b=requests.max_new_b,
    stop_bm=requests.stop_bm,
    temperature_b=requests.temperature_b,
    top_k_b=requests.top_k_b,
    top_p_b=requests.top_p_b,
    rng_bx=rng_bx,
    out_tokens_br=jnp.where(first_br, token_b[:, None], 0),
    out_logprobs_br=jnp.where(first_br, logprob_b[:, None], 0.0),
  )


def insert(prefix: DecodeState, state: DecodeState, slots_c: jax.Array) -> DecodeState:
  """Copies prefix row `i` into slot `slots_c[i]` of the decode batch.

  Written as a gather plus a select over slots rather than a scatter, so a batch sharded over
  'data' updates each shard locally. Only the first `p` cache slots of a row are rewritten; the
  rest is stale and masked out by the row's `index_b`.
  """
  b, p = state.num_slots, prefix.cache["k"].shape[2]
  match_bc = slots_c[None, :] == jnp.arange(b)[:, None]
  take_b = jnp.any(match_bc, axis=-1)
  row_b = jnp.argmax(match_bc, axis=-1)

  def put(dst, src, batch_axis=0):
    gathered = jnp.take(src, row_b, axis=batch_axis)
    shape = [1] * dst.ndim
    shape[batch_axis] = b
    return jnp.where(take_b.reshape(shape), gathered, dst)

  cache = {
    name: c.at[:, :, :p].set(put(c[:, :, :p], prefix.cache[name], batch_axis=1))
    for name, c in state.cache.items()
  }
  rows = {
    f.name: put(getattr(state, f.name), getattr(prefix, f.name))
    for f in dataclasses.fields(DecodeState)
    if f.name != "cache"
  }
  return DecodeState(cache=cache, **rows)


def decode_step(config: ModelConfig, params, state: DecodeState) -> DecodeState:
  """Feeds every row's last token, samples the next; finished and free rows stay as they are."""
  s = state.cache["k"].shape[2]
  r = state.out_tokens_br.shape[1]
  slot_s = jnp.arange(s)
  sees_bs = (slot_s[None, :] >= state.start_b[:, None]) & (
    slot_s[None, :] <= state.index_b[:, None]
  )
  if config.sliding_window is not None:
    sees_bs &= state.index_b[:, None] - slot_s[None, :] < config.sliding_window
  logits_b1v, cache = models.apply(
    config,
    params,
    state.tokens_b[:, None],
    state.positions_b[:, None],
    sees_bs[:, None, :],
    cache=state.cache,
    cache_index_b=state.index_b,
  )
  token_b, logprob_b = sampling.sample(
    logits_b1v[:, 0],
    _step_rngs(state.rng_bx, state.num_generated_b),
    state.temperature_b,
    state.top_k_b,
    state.top_p_b,
  )
  active_b = ~state.done_b
  write_br = active_b[:, None] & (jnp.arange(r)[None, :] == state.num_generated_b[:, None])
  num_generated_b = state.num_generated_b + active_b
  finished_b, stopped_b = _finished(token_b, num_generated_b, state.max_new_b, state.stop_bm)
  step_b = active_b.astype(jnp.int32)
  return dataclasses.replace(
    state,
    cache=cache,
    tokens_b=jnp.where(active_b, token_b, state.tokens_b),
    positions_b=state.positions_b + step_b,
    index_b=state.index_b + step_b,
    num_generated_b=num_generated_b,
    done_b=state.done_b | (active_b & finished_b),
    stopped_b=state.stopped_b | (active_b & stopped_b),
    out_tokens_br=jnp.where(write_br, token_b[:, None], state.out_tokens_br),
    out_logprobs_br=jnp.where(write_br, logprob_b[:, None], state.out_logprobs_br),
  )


def generate_steps(
  config: ModelConfig,
  params,
  state: DecodeState,
  max_steps: jax.Array,
  until_free: jax.Array,
) -> tuple[DecodeState, jax.Array]:
  """Decode steps on device until `max_steps` ran or at least `until_free` slots are free.

  `until_free = 1` returns as soon as any slot finishes (so the host can refill it);
  `until_free = num_slots` runs until every row is done. Returns the state and the number of
  steps taken.
  """

  def cond(carry):
    step, st = carry
    return (step < max_steps) & (jnp.sum(st.done_b) < until_free)

  def body(carry):
    step, st = carry
    return step + 1, decode_step(config, params, st)

  steps, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
  return state, steps
