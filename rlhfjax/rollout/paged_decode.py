"""Paged decode: the rollout's KV cache as fixed-size pages, decode slots refilled on device.

Letters in names: b decode slots, o output rows, q queued requests, p prompt bucket length,
w pages per sequence (the page table's width), v pages of a prompt bucket, r response capacity
(max new tokens), m stop ids per row, x words of a PRNG key's data, d 'data' replicas; in the
pool `[d, l, k, P, e, n]`: l layers, k kv heads, P pages per replica, e entries per page (the
page size), n head dim.

Layout. Each 'data' replica owns its own pages (page ids are local to a replica) and its own
rows: slot `i` of `b` lives in replica `i // (b / d)`, and so do output row `i` of `o` and queue
entry `i` of `q` (all rows replica-major, the layout of a batch sharded over 'data'). Page 0 of
every replica is reserved: free and finished rows and unused page-table entries point at it,
and writes of inactive rows land there, never in a page someone else owns. A sequence's token
`j` (prompt first, then response, no padding) sits at logical index `j`: entry `j % e` of page
`table_bw[row, j // e]`; its position id is `j`.

Prefill fills the KV of a prompt's first `L - 1` tokens (`prefill`, dense, right padded) and
`insert` copies them into pages; `extend` writes more tokens' KV after a sequence's pages (a
conversation's observation), each attending to the cached history, which is not recomputed.
The first response token is sampled by the first decode step, which feeds the last prompt
token at index `L - 1`: every token, the first included, is drawn by `decode_step` with
`fold_in(request key, step)` (`step_keys`).

A decode call (`generate_steps`) takes a `Plan` from the host: the page table of every slot,
slots to evict (preempted), and a queue of prefilled requests per replica with their pages.
Inside the compiled loop a slot whose request finished takes the next queued request of its
replica without returning to the host. Outputs live per request row (`out_*_o`), not per slot,
so a refilled slot never overwrites a finished request's tokens before the host reads them;
each replica's last output row is a garbage row inactive slots write to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax import models
from rlhfjax.config.model import ModelConfig
from rlhfjax.models.transformer import Cache, PagedKV, init_paged_cache
from rlhfjax.rollout import sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedState:
  """What the paged decode loop carries between calls. A pytree."""

  cache: Cache
  """Page pools `{'k', 'v'}: [d, l, k, P, e, n]` in the compute dtype."""
  table_bw: jax.Array
  """Each slot's page table (page ids local to its replica)."""
  tokens_b: jax.Array
  """The next decode input of each slot: the last prompt token, then the last sampled one."""
  index_b: jax.Array
  """Logical index (and position id) of `tokens_b`: where its KV is written."""
  num_generated_b: jax.Array
  done_b: jax.Array
  """True when the slot's request finished (or it was never filled): the slot is free."""
  stopped_b: jax.Array
  max_new_b: jax.Array
  stop_bm: jax.Array
  temperature_b: jax.Array
  top_k_b: jax.Array
  top_p_b: jax.Array
  rng_bx: jax.Array
  row_b: jax.Array
  """The output row of the slot's request (local to its replica)."""
  out_tokens_or: jax.Array
  """Response tokens by output row, written at each step's `num_generated`."""
  out_logprobs_or: jax.Array
  out_num_o: jax.Array
  """Response length of each output row's request."""
  out_done_o: jax.Array
  out_stopped_o: jax.Array
  taken_d: jax.Array
  """Queue entries of each replica the last decode call took into slots."""
  live_max: jax.Array
  """Most slots decoding at once during the last decode call (a scalar)."""

  @property
  def num_slots(self) -> int:
    return self.tokens_b.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Queue:
  """Prefilled requests waiting for a slot, `q / d` per replica, in the order they are taken."""

  table_qw: jax.Array
  copy_from_q: jax.Array
  """A page to copy into `copy_to_q` before decoding (a shared prompt's partly filled last page
  into the request's own), or 0 for none."""
  copy_to_q: jax.Array
  token_q: jax.Array
  index_q: jax.Array
  num_generated_q: jax.Array
  """Tokens already generated (a preempted request resumes with its count, and so its RNG)."""
  max_new_q: jax.Array
  stop_qm: jax.Array
  temperature_q: jax.Array
  top_k_q: jax.Array
  top_p_q: jax.Array
  seed_q: jax.Array
  request_id_q: jax.Array
  row_q: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """The host's input to one decode call (small int32 arrays and scalars)."""

  table_bw: jax.Array
  evict_b: jax.Array
  """Slots whose request was preempted: they stop (their pages are already freed)."""
  count_d: jax.Array
  """Queue entries of each replica."""
  queue: Queue
  max_steps: jax.Array
  until_free: jax.Array
  """Return once this many slots are free and no queued request is left to take them."""
  until_finished: jax.Array
  """Return once this many requests finished during the call."""
  shrink_after: jax.Array
  """Return once the live rows fit a live batch half the call's size (in every replica) and
  one of them may still run this many steps, so that the next call runs the smaller program
  (the host sets a decode chunk when nothing waits, else never: a return is a round trip)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Requests:
  """A prefill batch: the first `L - 1` tokens of each prompt, right padded, and its settings."""

  tokens_bp: jax.Array
  lengths_b: jax.Array
  """Tokens to prefill (`L - 1`)."""
  last_b: jax.Array
  """The prompt's last token (the first decode input)."""
  max_new_b: jax.Array
  stop_bm: jax.Array
  temperature_b: jax.Array
  top_k_b: jax.Array
  top_p_b: jax.Array
  seed_b: jax.Array
  request_id_b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Prefix:
  """A prefill's output: dense KV of the prompts and what a slot needs to decode them."""

  cache: Cache
  """`{'k', 'v'}: [l, b, p, k, n]`; entries at and past each `index_b` are padding."""
  tokens_b: jax.Array
  index_b: jax.Array
  max_new_b: jax.Array
  stop_bm: jax.Array
  temperature_b: jax.Array
  top_k_b: jax.Array
  top_p_b: jax.Array
  rng_bx: jax.Array

  @property
  def num_slots(self) -> int:
    return self.tokens_b.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Extension:
  """Tokens appended to sequences that already hold pages (a conversation's next turn: the
  model's last token and an environment's observation), `b / d` rows per replica, replica-major.

  Row `i` writes the KV of `tokens_bt[i, :t]` at logical indices `start_b[i] + [0, t)` of its
  pages `table_bw[i]`; a row's padding writes past its sequence (read by nobody before the
  decode step that reaches it writes it again) and inactive rows (table all 0) write to the
  reserved page."""

  tokens_bt: jax.Array
  start_b: jax.Array
  table_bw: jax.Array


def logical_axes() -> tuple[PagedState, Queue, Plan, Requests, Prefix, Extension]:
  """Logical axis names of every field of the paged programs' pytrees (leaves are tuples)."""
  row, row2, scalar = ("batch",), ("batch", None), ()
  pool = ("batch", "layers", "kv_heads", None, None, "head_dim")
  state = PagedState(
    cache={"k": pool, "v": pool},
    table_bw=row2,
    tokens_b=row,
    index_b=row,
    num_generated_b=row,
    done_b=row,
    stopped_b=row,
    max_new_b=row,
    stop_bm=row2,
    temperature_b=row,
    top_k_b=row,
    top_p_b=row,
    rng_bx=row2,
    row_b=row,
    out_tokens_or=row2,
    out_logprobs_or=row2,
    out_num_o=row,
    out_done_o=row,
    out_stopped_o=row,
    taken_d=row,
    live_max=scalar,
  )
  queue = Queue(
    **{f.name: row for f in dataclasses.fields(Queue)} | dict(table_qw=row2, stop_qm=row2)
  )
  plan = Plan(
    table_bw=row2,
    evict_b=row,
    count_d=row,
    queue=queue,
    max_steps=scalar,
    until_free=scalar,
    until_finished=scalar,
    shrink_after=scalar,
  )
  requests = Requests(
    **{f.name: row for f in dataclasses.fields(Requests)} | dict(tokens_bp=row2, stop_bm=row2)
  )
  cache = ("layers", "batch", "kv_length", "kv_heads", "head_dim")
  prefix = Prefix(
    **{f.name: row for f in dataclasses.fields(Prefix)}
    | dict(cache={"k": cache, "v": cache}, stop_bm=row2, rng_bx=row2)
  )
  extension = Extension(tokens_bt=row2, start_b=row, table_bw=row2)
  return state, queue, plan, requests, prefix, extension


def empty_state(
  config: ModelConfig,
  *,
  num_slots: int,
  replicas: int,
  pages: int,
  page_size: int,
  width: int,
  out_rows: int,
  max_new_tokens: int,
  max_stop_tokens: int,
  table_bw: jax.Array,
) -> PagedState:
  """Every slot free, every page zero; `table_bw` is the slots' page table (`pages` is per
  replica, `out_rows` in all, the garbage rows included)."""
  b, o = num_slots, out_rows
  zeros = lambda n, dtype: jnp.zeros((n,), dtype)
  rng_x = jax.random.key_data(jax.random.key(0))
  del width  # the table's shape carries it
  return PagedState(
    cache=init_paged_cache(config, replicas, pages, page_size),
    table_bw=jnp.asarray(table_bw, jnp.int32),
    tokens_b=zeros(b, jnp.int32),
    index_b=zeros(b, jnp.int32),
    num_generated_b=zeros(b, jnp.int32),
    done_b=jnp.ones((b,), bool),
    stopped_b=zeros(b, bool),
    max_new_b=zeros(b, jnp.int32),
    stop_bm=jnp.full((b, max_stop_tokens), -1, jnp.int32),
    temperature_b=zeros(b, jnp.float32),
    top_k_b=zeros(b, jnp.int32),
    top_p_b=jnp.ones((b,), jnp.float32),
    rng_bx=jnp.zeros((b, *rng_x.shape), rng_x.dtype),
    row_b=jnp.arange(b, dtype=jnp.int32) % (b // replicas),
    out_tokens_or=jnp.zeros((o, max_new_tokens), jnp.int32),
    out_logprobs_or=jnp.zeros((o, max_new_tokens), jnp.float32),
    out_num_o=zeros(o, jnp.int32),
    out_done_o=jnp.ones((o,), bool),
    out_stopped_o=zeros(o, bool),
    taken_d=zeros(replicas, jnp.int32),
    live_max=jnp.zeros((), jnp.int32),
  )


def slot_tokens(state: PagedState) -> jax.Array:
  """`[b, r]` response tokens of each slot's request (its output row)."""
  replicas = state.taken_d.shape[0]
  rows_d = _by_replica(state.out_tokens_or, replicas)
  return _flat(jax.vmap(lambda out, row: out[row])(rows_d, _by_replica(state.row_b, replicas)))


def idle_plan(table_bw: np.ndarray, replicas: int, max_stop_tokens: int, limit: np.ndarray) -> Plan:
  """A plan with page tables `table_bw`, an empty queue (of the `2 * b` entries every plan
  has), no eviction, every limit `limit` and no return to shrink, as host arrays."""
  b, w = table_bw.shape
  q = 2 * b
  ints = lambda *shape: np.zeros(shape, np.int32)
  queue = Queue(
    **{name: ints(q) for name in Queue.__dataclass_fields__}
    | dict(
      table_qw=ints(q, w),
      stop_qm=np.full((q, max_stop_tokens), -1, np.int32),
      temperature_q=np.zeros(q, np.float32),
      top_p_q=np.ones(q, np.float32),
    )
  )
  return Plan(
    table_bw=table_bw,
    evict_b=np.zeros(b, bool),
    count_d=ints(replicas),
    queue=queue,
    max_steps=limit,
    until_free=limit,
    until_finished=limit,
    shrink_after=np.int32(np.iinfo(np.int32).max),
  )


def step_keys(rng_bx: jax.Array, step_b: jax.Array) -> jax.Array:
  """Each row's PRNG key for its response token `step_b`: its request's key folded with it."""
  keys_b = jax.random.wrap_key_data(rng_bx)
  return jax.vmap(jax.random.fold_in)(keys_b, step_b)


def finished_rows(token_b, num_generated_b, max_new_b, stop_bm) -> tuple[jax.Array, jax.Array]:
  """(finished, on a stop token) of rows that just sampled `token_b` as their
  `num_generated_b`-th token."""
  stopped_b = jnp.any(token_b[:, None] == stop_bm, axis=-1)
  return stopped_b | (num_generated_b >= max_new_b), stopped_b


def _request_keys(seed_b: jax.Array, request_id_b: jax.Array) -> jax.Array:
  keys_b = jax.vmap(lambda s, r: jax.random.fold_in(jax.random.key(s), r))(seed_b, request_id_b)
  return jax.random.key_data(keys_b)


def prefill(config: ModelConfig, params, requests: Requests) -> Prefix:
  """The KV of each prompt's first `L - 1` tokens (right padded, causal); samples nothing."""
  b, p = requests.tokens_bp.shape
  slot_bp = jnp.broadcast_to(jnp.arange(p), (b, p))
  written_bp = slot_bp < requests.lengths_b[:, None]
  mask = models.Mask.over_keys(
    jnp.ones((b, p)), slot_bp, written_bp, slot_bp, config.sliding_window
  )
  _, cache = models.apply(
    config,
    params,
    requests.tokens_bp,
    slot_bp,
    mask,
    cache=models.init_cache(config, b, p),
    cache_index_b=jnp.zeros((b,), jnp.int32),
  )
  return _prefix(cache, requests)


def prefix_shapes(config: ModelConfig, requests: Requests) -> Prefix:
  """The shapes and dtypes of `prefill`'s output for `requests` (arrays or shapes), without
  tracing the model: its cache is the zeroed one it writes into, in place."""
  b, p = requests.tokens_bp.shape
  return jax.eval_shape(lambda r: _prefix(models.init_cache(config, b, p), r), requests)


def _prefix(cache: Cache, requests: Requests) -> Prefix:
  return Prefix(
    cache=cache,
    tokens_b=requests.last_b,
    index_b=requests.lengths_b,
    max_new_b=requests.max_new_b,
    stop_bm=requests.stop_bm,
    temperature_b=requests.temperature_b,
    top_k_b=requests.top_k_b,
    top_p_b=requests.top_p_b,
    rng_bx=_request_keys(requests.seed_b, requests.request_id_b),
  )


def extend(config: ModelConfig, params, state: PagedState, ext: Extension) -> PagedState:
  """Writes the KV of `ext`'s tokens into their rows' pages, each token attending to its
  sequence's KV so far and to the tokens before it: the history is never prefilled again.
  Samples nothing (the next decode step feeds the sequence's last token)."""
  b, t = ext.tokens_bt.shape
  e = state.cache["k"].shape[4]
  positions_bt = ext.start_b[:, None] + jnp.arange(t)[None, :]
  slot_bs = jnp.broadcast_to(jnp.arange(ext.table_bw.shape[1] * e), (b, ext.table_bw.shape[1] * e))
  # A key is there once written: the sequence so far and this call's tokens (padding too, so
  # that a padding query always has a key: the causal mask keeps real queries off it).
  written_bs = slot_bs < (ext.start_b + t)[:, None]
  mask = models.Mask.over_keys(
    jnp.ones((b, t)), positions_bt, written_bs, slot_bs, config.sliding_window
  )
  paged = PagedKV(k=state.cache["k"], v=state.cache["v"], table_bw=ext.table_bw, kernel="gather")
  _, paged = models.apply(
    config, params, ext.tokens_bt, positions_bt, mask, cache=paged, cache_index_b=ext.start_b
  )
  return dataclasses.replace(state, cache={"k": paged.k, "v": paged.v})


def _by_replica(x: jax.Array, replicas: int) -> jax.Array:
  return x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])


def _flat(x: jax.Array) -> jax.Array:
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _select(take: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
  return jnp.where(take.reshape(take.shape + (1,) * (old.ndim - take.ndim)), new, old)


def insert(
  prefix: Prefix,
  state: PagedState,
  pages_bv: jax.Array,
  replica_b: jax.Array,
  slots_b: jax.Array,
) -> PagedState:
  """Copies prefix row `i`'s KV into pages `pages_bv[i]` of replica `replica_b[i]` (0 entries:
  none), and with `slots_b[i] >= 0` makes slot `slots_b[i]` decode it (the slot API).

  The pages are written per replica (vmapped over the replica axis): each replica writes the
  rows addressed to it and sends the others to its reserved page 0."""
  replicas = state.taken_d.shape[0]
  layers, b, p, k, n = prefix.cache["k"].shape
  e, v = state.cache["k"].shape[4], pages_bv.shape[1]
  pad = v * e - p

  def pages(kv_lbpkn):
    kv = jnp.pad(kv_lbpkn, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
    return kv.reshape(layers, b, v, e, k, n).transpose(0, 4, 1, 2, 3, 5)  # [l, k, b, v, e, n]

  def write(pool_dlkPen, kv_lkbven):
    def one(pool_lkPen, d):
      dst_bv = jnp.where((replica_b == d)[:, None], pages_bv, 0)
      return pool_lkPen.at[:, :, dst_bv].set(kv_lkbven.astype(pool_lkPen.dtype))

    return jax.vmap(one)(pool_dlkPen, jnp.arange(replicas))

  cache = {name: write(state.cache[name], pages(prefix.cache[name])) for name in state.cache}

  slots = state.num_slots
  match_sb = slots_b[None, :] == jnp.arange(slots)[:, None]
  take_s = jnp.any(match_sb, axis=-1)
  src_s = jnp.argmax(match_sb, axis=-1)
  put = lambda new, old: _select(take_s, jnp.take(new, src_s, axis=0), old)
  zero_s = jnp.zeros((slots,), jnp.int32)
  return dataclasses.replace(
    state,
    cache=cache,
    tokens_b=put(prefix.tokens_b, state.tokens_b),
    index_b=put(prefix.index_b, state.index_b),
    num_generated_b=jnp.where(take_s, zero_s, state.num_generated_b),
    done_b=state.done_b & ~take_s,
    stopped_b=state.stopped_b & ~take_s,
    max_new_b=put(prefix.max_new_b, state.max_new_b),
    stop_bm=put(prefix.stop_bm, state.stop_bm),
    temperature_b=put(prefix.temperature_b, state.temperature_b),
    top_k_b=put(prefix.top_k_b, state.top_k_b),
    top_p_b=put(prefix.top_p_b, state.top_p_b),
    rng_bx=put(prefix.rng_bx, state.rng_bx),
    row_b=jnp.where(take_s, jnp.arange(slots) % (slots // replicas), state.row_b),
  )


def _begin(state: PagedState, plan: Plan) -> PagedState:
  """Takes the host's page tables and evictions; copies queued requests' shared last prompt
  page into their own (per replica)."""
  replicas = state.taken_d.shape[0]
  copy_from = _by_replica(plan.queue.copy_from_q, replicas)
  copy_to = _by_replica(plan.queue.copy_to_q, replicas)

  def copy(pool_dlkPen):
    def one(pool_lkPen, from_q, to_q):
      return pool_lkPen.at[:, :, to_q].set(pool_lkPen[:, :, from_q])

    return jax.vmap(one)(pool_dlkPen, copy_from, copy_to)

  return dataclasses.replace(
    state,
    cache={name: copy(c) for name, c in state.cache.items()},
    table_bw=plan.table_bw,
    done_b=state.done_b | plan.evict_b,
    taken_d=jnp.zeros_like(state.taken_d),
    live_max=jnp.zeros_like(state.live_max),
  )


_FROM_QUEUE = {
  "table_bw": "table_qw",
  "tokens_b": "token_q",
  "index_b": "index_q",
  "num_generated_b": "num_generated_q",
  "max_new_b": "max_new_q",
  "stop_bm": "stop_qm",
  "temperature_b": "temperature_q",
  "top_k_b": "top_k_q",
  "top_p_b": "top_p_q",
  "row_b": "row_q",
}


def _refill(state: PagedState, plan: Plan) -> PagedState:
  """Free slots take their replica's next queued requests, in slot order."""
  replicas = state.taken_d.shape[0]
  rows = lambda x: _by_replica(x, replicas)
  queue = {slot: rows(getattr(plan.queue, q)) for slot, q in _FROM_QUEUE.items()}
  queue["rng_bx"] = rows(_request_keys(plan.queue.seed_q, plan.queue.request_id_q))
  slots = {name: rows(getattr(state, name)) for name in queue}

  def one(done_c, taken, count, slots, queue):
    rank_c = jnp.cumsum(done_c) - 1
    pick_c = taken + rank_c
    take_c = done_c & (pick_c < count)
    src_c = jnp.clip(pick_c, 0, queue["row_b"].shape[0] - 1)
    new = {name: _select(take_c, queue[name][src_c], slots[name]) for name in slots}
    return take_c, taken + jnp.sum(take_c), new

  take_dc, taken_d, new = jax.vmap(one)(
    rows(state.done_b), state.taken_d, plan.count_d, slots, queue
  )
  take_b = _flat(take_dc)
  out_num, out_done, out_stopped = _write_rows(
    state,
    take_b,
    (state.out_num_o, _flat(new["num_generated_b"])),
    (state.out_done_o, jnp.zeros_like(take_b)),
    (state.out_stopped_o, jnp.zeros_like(take_b)),
    row_b=_flat(new["row_b"]),
  )
  return dataclasses.replace(
    state,
    **{name: _flat(x) for name, x in new.items()},
    done_b=state.done_b & ~take_b,
    stopped_b=state.stopped_b & ~take_b,
    out_num_o=out_num,
    out_done_o=out_done,
    out_stopped_o=out_stopped,
    taken_d=taken_d,
  )


def _write_rows(state: PagedState, write_b, *updates, row_b, column_b=None) -> list[jax.Array]:
  """Per replica: each `(out_o..., new_b)` pair with `out[row_b[i]] = new[i]` where `write_b`
  (other slots write to their replica's garbage row, the last); with `column_b`, `out` is
  `[o, r]` and the write goes to column `column_b[i]`."""
  replicas = state.taken_d.shape[0]

  def one(write_c, row_c, column_c, *pairs):
    garbage = pairs[0].shape[0] - 1
    row_c = jnp.where(write_c, row_c, garbage)
    out = []
    for old, new in zip(pairs[::2], pairs[1::2], strict=True):
      index = (row_c,) if column_c is None else (row_c, column_c)
      out.append(old.at[index].set(new.astype(old.dtype)))
    return out

  flat = [x for pair in updates for x in pair]
  column = None if column_b is None else _by_replica(column_b, replicas)
  outs = jax.vmap(one, in_axes=(0, 0, None if column is None else 0) + (0,) * len(flat))(
    _by_replica(write_b, replicas),
    _by_replica(row_b, replicas),
    column,
    *(_by_replica(x, replicas) for x in flat),
  )
  return [_flat(x) for x in outs]


def decode_step(
  config: ModelConfig, kernel: str, params, state: PagedState
) -> tuple[PagedState, jax.Array]:
  """Feeds every active slot's token, samples the next; returns the state and how many
  requests finished. Free slots write to page 0 and their replica's garbage output row."""
  w, e = state.table_bw.shape[1], state.cache["k"].shape[4]
  r = state.out_tokens_or.shape[1]
  active_b = ~state.done_b
  slot_bs = jnp.broadcast_to(jnp.arange(w * e), (state.index_b.shape[0], w * e))
  index_b1 = state.index_b[:, None]
  mask = models.Mask.over_keys(
    jnp.ones_like(index_b1), index_b1, slot_bs <= index_b1, slot_bs, config.sliding_window
  )
  paged = PagedKV(
    k=state.cache["k"],
    v=state.cache["v"],
    table_bw=jnp.where(active_b[:, None], state.table_bw, 0),
    kernel=kernel,
  )
  logits_b1v, paged = models.apply(
    config,
    params,
    state.tokens_b[:, None],
    index_b1,
    mask,
    cache=paged,
    cache_index_b=state.index_b,
  )
  token_b, logprob_b = sampling.sample(
    logits_b1v[:, 0],
    step_keys(state.rng_bx, state.num_generated_b),
    state.temperature_b,
    state.top_k_b,
    state.top_p_b,
  )
  num_generated_b = state.num_generated_b + active_b
  finished_b, stopped_b = finished_rows(token_b, num_generated_b, state.max_new_b, state.stop_bm)
  newly_done_b = active_b & finished_b
  column_b = jnp.minimum(state.num_generated_b, r - 1)
  out_tokens, out_logprobs = _write_rows(
    state,
    active_b,
    (state.out_tokens_or, token_b),
    (state.out_logprobs_or, logprob_b),
    row_b=state.row_b,
    column_b=column_b,
  )
  out_num, out_done, out_stopped = _write_rows(
    state,
    active_b,
    (state.out_num_o, num_generated_b),
    (state.out_done_o, finished_b),
    (state.out_stopped_o, stopped_b),
    row_b=state.row_b,
  )
  step_b = active_b.astype(jnp.int32)
  state = dataclasses.replace(
    state,
    cache={"k": paged.k, "v": paged.v},
    tokens_b=jnp.where(active_b, token_b, state.tokens_b),
    index_b=state.index_b + step_b,
    num_generated_b=num_generated_b,
    done_b=state.done_b | newly_done_b,
    stopped_b=state.stopped_b | (active_b & stopped_b),
    out_tokens_or=out_tokens,
    out_logprobs_or=out_logprobs,
    out_num_o=out_num,
    out_done_o=out_done,
    out_stopped_o=out_stopped,
  )
  return state, jnp.sum(newly_done_b).astype(jnp.int32)


_SLOT_FIELDS = tuple(
  f.name for f in dataclasses.fields(PagedState) if f.name.endswith(("_b", "_bm", "_bw", "_bx"))
)
"""The fields of `PagedState` with one row per decode slot."""


def _live_batch(state: PagedState, slots_s: jax.Array, width: int) -> PagedState:
  """The state of the `s` slots `slots_s` (slot ids local to their replica, `s / d` per
  replica, replica-major) with page tables `width` wide: their rows of the per-slot fields,
  gathered within each replica; the pools and output rows are the same arrays."""
  replicas = state.taken_d.shape[0]
  slots_dc = _by_replica(slots_s, replicas)
  take = lambda x: _flat(jax.vmap(lambda x_c, i_c: x_c[i_c])(_by_replica(x, replicas), slots_dc))
  rows = {name: take(getattr(state, name)) for name in _SLOT_FIELDS}
  rows["table_bw"] = rows["table_bw"][:, :width]
  return dataclasses.replace(state, **rows)


def _scatter_back(full: PagedState, live: PagedState, slots_s: jax.Array) -> PagedState:
  """`full` with the live batch's rows written back to their slots (page tables zero past the
  live batch's width: the host sized it to cover every page a row holds) and the live batch's
  pools, outputs and counters."""
  replicas = full.taken_d.shape[0]
  slots_dc = _by_replica(slots_s, replicas)
  w = full.table_bw.shape[1]

  def put(old, new):
    if new.shape[1:] != old.shape[1:]:  # the page table
      new = jnp.pad(new, ((0, 0), (0, w - new.shape[1])))
    one = lambda o_c, i_c, n_c: o_c.at[i_c].set(n_c)
    return _flat(jax.vmap(one)(_by_replica(old, replicas), slots_dc, _by_replica(new, replicas)))

  rows = {name: put(getattr(full, name), getattr(live, name)) for name in _SLOT_FIELDS}
  return dataclasses.replace(live, **rows)


def _worth_halving(state: PagedState, after: jax.Array) -> jax.Array:
  """True when every replica's live rows fit half its rows of the batch and one of them may
  still run `after` steps (False when half the batch is no live-batch size: an odd number of
  rows per replica)."""
  replicas = state.taken_d.shape[0]
  per = state.num_slots // replicas
  if per % 2:
    return jnp.zeros((), bool)
  live_b = ~state.done_b
  live_d = jnp.sum(_by_replica(live_b, replicas), axis=1)
  left = jnp.max(jnp.where(live_b, state.max_new_b - state.num_generated_b, 0))
  return (jnp.max(live_d) <= per // 2) & (left >= after)


def generate_steps(
  config: ModelConfig,
  kernel: str,
  params: Any,
  state: PagedState,
  plan: Plan,
  slots_s: jax.Array | None = None,
  *,
  width: int | None = None,
) -> tuple[PagedState, jax.Array]:
  """Applies `plan`, then decode steps with on-device refill until `plan.max_steps` ran, at
  least `plan.until_free` slots are free with nothing queued for them, `plan.until_finished`
  requests finished, or the live rows fit half the live batch with `plan.shrink_after` steps
  still to run. Returns the state and the number of steps.

  The steps run on the live batch `slots_s` (local slot ids, replica-major; None: every slot)
  with page tables `width` wide (None: the full width): a step costs its rows and its table
  width, not the engine's. The host picks slots holding every live row and room for the
  queued requests, and a width covering every page those rows and the queue's hold."""
  b, w = state.num_slots, state.table_bw.shape[1]
  full = _begin(state, plan)
  if slots_s is None:
    replicas = full.taken_d.shape[0]
    slots_s = jnp.tile(jnp.arange(b // replicas, dtype=jnp.int32), replicas)
  width = w if width is None else width
  narrow = lambda table: table[:, :width]
  plan = dataclasses.replace(
    plan,
    table_bw=narrow(plan.table_bw),
    queue=dataclasses.replace(plan.queue, table_qw=narrow(plan.queue.table_qw)),
  )
  live = _refill(_live_batch(full, slots_s, width), plan)
  idle = b - slots_s.shape[0]  # slots outside the live batch: free

  def cond(carry):
    step, finished, st = carry
    return (
      (step < plan.max_steps)
      & (jnp.sum(st.done_b) + idle < plan.until_free)
      & (finished < plan.until_finished)
      & ~_worth_halving(st, plan.shrink_after)
    )

  def body(carry):
    step, finished, st = carry
    count = jnp.sum(~st.done_b).astype(jnp.int32)
    st = dataclasses.replace(st, live_max=jnp.maximum(st.live_max, count))
    st, newly = decode_step(config, kernel, params, st)
    return step + 1, finished + newly, _refill(st, plan)

  zero = jnp.zeros((), jnp.int32)
  steps, _, live = jax.lax.while_loop(cond, body, (zero, zero, live))
  return _scatter_back(full, live, slots_s), steps
