"""The rollout engine's compiled programs over the KV pages and the host calls that drive them.

`rlhfjax.rollout.engine.Engine` holds one of these (`Engine.paged`); the maths is
`rlhfjax.rollout.paged_decode`'s, the scheduling `rlhfjax.rollout.paging`'s.

Compiled programs, each jitted once with explicit shardings: `prefill` and `insert` per
(prefill batch size, bucket), one `init_decode_state` and one `generate_steps` per (live-batch
size, page-table width): a decode call runs only the slots the host names (its live rows and
room for its queue; `paging.live_batch_sizes`) with page tables as wide as their pages
(`paging.table_widths`), so a step costs the live rows and their lengths, not the engine's
slots and capacity. Page tables, queues and limits are data. A preempted request that has
generated tokens re-prefills prompt + tokens: in its prompt bucket when they fit, else in one
bucket of `cache_length` tokens, compiled on first use.

Every host transfer (an upload with `jax.device_put`, a read with `to_host`) is counted on the
engine (`Engine.host_transfers`), one per call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rlhfjax.mesh import rules, transfer
from rlhfjax.placement.spec import Layout
from rlhfjax.rollout import paged_decode, paging
from rlhfjax.rollout.paged_decode import PagedState, Plan, Queue

if TYPE_CHECKING:
  from rlhfjax.rollout.engine import Engine


_PLATFORM_KERNELS = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}


def resolve_kernel(
  choice: str, platform: str, sliding_window: int | None, head_dim: int, dtype: str = "float32"
) -> str:
  """The paged attention `EngineConfig.paged_attention` resolves to on `platform` for a model
  (its sliding window, head dim and compute dtype, the KV pool's).

  'pallas' is the platform's Pallas kernel, refused in one line where it cannot run: off GPU
  and TPU, with a sliding window (the kernels have none) or a head dim that is not a multiple
  of 16 (their matmul tiles). 'auto' takes it where it can run, and on TPU only with a bf16
  pool (its kernel rounds keys and values to bf16: exact for a bf16 pool, not for fp32), else
  'gather'.

  Raises:
    ValueError: 'pallas' where it cannot run, naming why and the values that work.
  """
  if choice not in ("auto", "pallas"):
    return choice
  kernel = _PLATFORM_KERNELS.get(platform)
  why = (
    f"the rollout's devices are {platform}, it needs a GPU or TPU" if kernel is None
    else "the model has a sliding window, which the kernels lack" if sliding_window is not None
    else f"the head dim {head_dim} is not a multiple of 16" if head_dim % 16
    else None
  )  # fmt: skip
  if choice == "pallas":
    if why is not None:
      raise ValueError(
        f"rollout.attention='pallas' cannot run here: {why}; set rollout.attention to 'gather' "
        "(or 'auto', which picks the kernel where it can run)"
      )
    return kernel
  if why is not None or (kernel == "pallas_tpu" and dtype != "bfloat16"):
    return "gather"
  return kernel


def _slot_state(model_config, *, num_slots: int, replicas: int, pages: int, width: int, **sizes):
  """An empty decode state whose slot `j` of each replica owns a dense row's pages (the slot
  API's page tables, `paging.slot_pages`)."""
  table_bw = paging.slot_pages(num_slots, replicas, pages, width)
  return paged_decode.empty_state(
    model_config, num_slots=num_slots, replicas=replicas, pages=pages, width=width,
    table_bw=table_bw, **sizes,
  )  # fmt: skip


class PagedPrograms:
  """The paged engine's programs on the engine's mesh, and the host calls around them."""

  def __init__(self, engine: Engine):
    cfg, model = engine.config, engine.model_config
    mesh = engine.mesh
    self._engine = engine
    self.replicas = dict(mesh.shape).get("data", 1)
    self.slots_per_replica = cfg.num_slots // self.replicas
    total = cfg.pages_total(self.replicas)
    w = cfg.pages_per_sequence
    if total % self.replicas:
      raise ValueError(
        f"EngineConfig.num_pages={total} must be a multiple of the mesh's 'data' axis "
        f"({self.replicas})"
      )
    self.pages = total // self.replicas
    if self.pages < w + 1:  # (a request alone in its replica always fits: see `paging`)
      raise ValueError(
        f"EngineConfig.num_pages={total} gives {self.pages} pages per 'data' replica; each needs "
        f"at least {w + 1} (a full sequence of {w} and the reserved page)"
      )
    self.width = w
    self.out_rows = 2 * self.slots_per_replica + 1
    self.kernel = resolve_kernel(
      cfg.paged_attention,
      mesh.devices.flat[0].platform,
      model.sliding_window,
      model.head_dim,
      model.dtype,
    )
    if self.kernel != "gather" and model.sliding_window is not None:
      raise ValueError(
        f"EngineConfig.paged_attention={self.kernel!r} has no sliding window: use 'gather'"
      )
    self.slot_table = paging.slot_pages(cfg.num_slots, self.replicas, self.pages, w)
    """The slot API's page tables: slot `j` of a replica owns a dense row's pages."""

    state_axes, _, plan_axes, requests_axes, prefix_axes, self._extension_axes = (
      paged_decode.logical_axes()
    )
    self._replicated = NamedSharding(mesh, PartitionSpec())
    # Of values only (not of this object): every engine of the same sizes shares the program.
    self._empty_state = functools.partial(
      _slot_state,
      model,
      num_slots=cfg.num_slots,
      replicas=self.replicas,
      pages=self.pages,
      page_size=cfg.page_size,
      width=self.width,
      out_rows=self.replicas * self.out_rows,
      max_new_tokens=cfg.max_new_tokens,
      max_stop_tokens=cfg.max_stop_tokens,
    )
    state_shapes = jax.eval_shape(self._empty_state)
    self.state_shardings = rules.named_shardings(state_axes, state_shapes, mesh, Layout.GENERATION)
    self.plan_shardings = rules.named_shardings(
      plan_axes, jax.eval_shape(lambda: self._host_plan(np.zeros((), np.int32))), mesh, "generation"
    )
    traces = engine.traces
    self._init_state = traces.jit(
      "init_decode_state", self._empty_state, out_shardings=self.state_shardings
    )
    self.batch_sizes = paging.live_batch_sizes(cfg.num_slots, self.replicas)
    self.widths = paging.table_widths(w, self._width_floor())
    self._slots_sharding = rules.named_shardings(
      ("batch",), jax.ShapeDtypeStruct((self.replicas,), np.int32), mesh, Layout.GENERATION
    )
    full = (cfg.num_slots, w)

    def name(size: int, width: int) -> str:  # one name per program: each compiles once
      return "generate_steps" if (size, width) == full else f"generate_steps[{size}x{width}]"

    self._generate_steps = {
      (size, width): traces.jit(
        name(size, width),
        rules.constrained(
          functools.partial(paged_decode.generate_steps, model, self.kernel, width=width),
          Layout.GENERATION,
          mesh,
        ),
        in_shardings=(
          engine.param_shardings,
          self.state_shardings,
          self.plan_shardings,
          self._slots_sharding,
        ),
        out_shardings=(self.state_shardings, self._replicated),
        donate_argnums=1,
      )
      for size in self.batch_sizes
      for width in self.widths
    }
    """The decode programs by (live-batch size, page-table width)."""
    self._prefill, self._insert = {}, {}
    self.requests_shardings, self.prefix_shardings = {}, {}
    p = cfg.prompt_buckets[-1]
    for m in cfg.prefill_batch_sizes:
      requests = paged_decode.Requests(
        **{
          name: (m, p) if name in ("tokens_bp", "stop_bm") else (m,)
          for name in paged_decode.Requests.__dataclass_fields__
        }
      )
      self.requests_shardings[m] = rules.named_shardings(
        requests_axes, requests, mesh, Layout.GENERATION
      )
      prefix_shapes = paged_decode.prefix_shapes(
        model,
        jax.tree.map(
          lambda s: jax.ShapeDtypeStruct(s, np.int32),
          requests,
          is_leaf=lambda x: isinstance(x, tuple),
        ),
      )
      self.prefix_shardings[m] = rules.named_shardings(
        prefix_axes, prefix_shapes, mesh, Layout.GENERATION
      )
      self._prefill[m] = traces.jit(
        "prefill",
        functools.partial(paged_decode.prefill, model),
        in_shardings=(engine.param_shardings, self.requests_shardings[m]),
        out_shardings=self.prefix_shardings[m],
      )
      self._insert[m] = traces.jit(
        "insert",
        paged_decode.insert,
        in_shardings=(self.prefix_shardings[m], self.state_shardings) + (self._replicated,) * 3,
        out_shardings=self.state_shardings,
        donate_argnums=1,
      )
    self._slot_plan: Plan | None = None
    self._extend: dict[tuple[int, int], Any] = {}
    """The extension programs by (rows per replica, bucket), compiled on first use."""

  def _width_floor(self) -> int:
    """The narrowest page table compiled: the pages of a smallest-bucket prompt and one
    decode chunk (narrower tables would save little and add programs)."""
    cfg = self._engine.config
    return self._pages_of(cfg.prompt_buckets[0] + min(cfg.decode_chunk, cfg.max_new_tokens))

  def _host_plan(self, limit: np.ndarray) -> Plan:
    """The slot API's plan (its fixed page tables, no queue) as host arrays."""
    cfg = self._engine.config
    return paged_decode.idle_plan(self.slot_table, self.replicas, cfg.max_stop_tokens, limit)

  def _put(self, tree: Any, shardings: Any) -> Any:
    self._engine.host_transfers += 1
    return jax.device_put(tree, shardings)

  def _read(self, tree: Any) -> Any:
    self._engine.host_transfers += 1
    return transfer.to_host(tree)

  # -------------------------------------------------------------------------------------------
  # The slot API: every slot owns a dense row's pages.

  def init_state(self) -> PagedState:
    return self._init_state()

  def prefill(
    self,
    params: Any,
    prompts: Sequence[np.ndarray],
    fields: dict[str, np.ndarray],
    seed: int,
    request_ids: Sequence[int],
    rows: int,
  ) -> tuple[paged_decode.Prefix, int]:
    """Prefills `prompts` (checked by the engine) in a batch of `rows`; returns the prefix and
    its bucket."""
    cfg = self._engine.config
    bucket = self.bucket(max(max(len(p) - 1 for p in prompts), 1))
    tokens = np.full((rows, bucket), cfg.pad_token_id, np.int32)
    lengths, last = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    for i, p in enumerate(prompts):
      tokens[i, : len(p) - 1] = p[:-1]
      lengths[i], last[i] = len(p) - 1, p[-1]
    ids = np.zeros(rows, np.int32)
    ids[: len(request_ids)] = request_ids
    host = paged_decode.Requests(
      tokens_bp=tokens,
      lengths_b=lengths,
      last_b=last,
      seed_b=np.full(rows, seed, np.int32),
      request_id_b=ids,
      **fields,
    )
    requests = self._put(host, self.requests_shardings[rows])
    return self._prefill[rows](params, requests), bucket

  def insert(self, prefix: paged_decode.Prefix, state: PagedState, slots: list[int]) -> PagedState:
    rows = prefix.num_slots
    v = self._pages_of(prefix.cache["k"].shape[2])
    if (self.slot_table[slots] == 0).any():
      raise ValueError(
        "the slot API gives every slot a dense row of pages: EngineConfig.num_pages is too "
        "small for it (generate and RolloutStream admit by pages instead)"
      )
    pages, replica, slot = (
      np.zeros((rows, v), np.int32),
      np.zeros(rows, np.int32),
      np.full(rows, -1, np.int32),
    )
    for i, s in enumerate(slots):
      pages[i], replica[i], slot[i] = self.slot_table[s, :v], s // self.slots_per_replica, s
    args = self._put((pages, replica, slot), self._replicated)
    return self._insert[rows](prefix, state, *args)

  def generate_steps(
    self, params: Any, state: PagedState, max_steps: int, until_free: int
  ) -> tuple[PagedState, jax.Array]:
    if self._slot_plan is None:
      self._slot_plan = self._put(self._host_plan(np.int32(0)), self.plan_shardings)
    return self._slot_call(params, state, max_steps, until_free, self.batch_sizes[0], self.width)

  def _slot_call(
    self, params: Any, state: PagedState, max_steps: int, until_free: int, size: int, width: int
  ) -> tuple[PagedState, jax.Array]:
    """A decode call with the slot API's plan on the live batch of the first `size` slots."""
    if self._slot_plan is None:
      self._slot_plan = self._put(self._host_plan(np.int32(0)), self.plan_shardings)
    slots = np.tile(np.arange(size // self.replicas, dtype=np.int32), self.replicas)
    limits, slots = self._put(
      (
        (np.int32(max_steps), np.int32(until_free), np.int32(paging._NEVER)),
        slots,
      ),
      (self._replicated, self._slots_sharding),
    )
    plan = Plan(
      **{
        name: getattr(self._slot_plan, name)
        for name in ("table_bw", "evict_b", "count_d", "queue", "shrink_after")
      },
      max_steps=limits[0],
      until_free=limits[1],
      until_finished=limits[2],
    )
    return self._generate_steps[size, width](params, state, plan, slots)

  def read_slots(self, state: PagedState) -> dict[str, np.ndarray]:
    got = self._read(
      {
        name: getattr(state, name)
        for name in (
          "done_b",
          "stopped_b",
          "num_generated_b",
          "out_tokens_or",
          "out_logprobs_or",
          "tokens_b",
          "row_b",
        )
      }
    )
    rows = self._global_rows(got["row_b"])
    got["out_tokens_or"] = got["out_tokens_or"][rows]
    got["out_logprobs_or"] = got["out_logprobs_or"][rows]
    return got

  def _global_rows(self, row_b: np.ndarray) -> np.ndarray:
    return np.arange(len(row_b)) // self.slots_per_replica * self.out_rows + row_b

  # -------------------------------------------------------------------------------------------
  # The paged stream's calls.

  def bucket(self, length: int) -> int:
    """The prefill bucket of `length` tokens: a prompt bucket, or the cache length beyond."""
    cfg = self._engine.config
    return cfg.bucket(length) if length <= cfg.prompt_buckets[-1] else cfg.cache_length

  def _pages_of(self, bucket: int) -> int:
    return -(-bucket // self._engine.config.page_size)

  def prefill_pages(
    self, params: Any, state: PagedState, items: Sequence[paging.PrefillItem]
  ) -> PagedState:
    """Prefills `items` (one bucket, at most the largest prefill batch) into their pages."""
    cfg = self._engine.config
    rows = next(m for m in cfg.prefill_batch_sizes if m >= len(items))
    bucket = self.bucket(max(len(it.tokens) for it in items))
    tokens = np.full((rows, bucket), cfg.pad_token_id, np.int32)
    lengths = np.zeros(rows, np.int32)
    pages = np.zeros((rows, self._pages_of(bucket)), np.int32)
    replica = np.zeros(rows, np.int32)
    for i, it in enumerate(items):
      tokens[i, : len(it.tokens)], lengths[i] = it.tokens, len(it.tokens)
      pages[i, : len(it.pages)], replica[i] = it.pages, it.replica
    zeros = np.zeros(rows, np.int32)
    host = paged_decode.Requests(
      tokens_bp=tokens,
      lengths_b=lengths,
      last_b=zeros,
      max_new_b=zeros,
      stop_bm=np.full((rows, cfg.max_stop_tokens), -1, np.int32),
      temperature_b=zeros.astype(np.float32),
      top_k_b=zeros,
      top_p_b=np.ones(rows, np.float32),
      seed_b=zeros,
      request_id_b=zeros,
    )
    requests = self._put(host, self.requests_shardings[rows])
    prefix = self._prefill[rows](params, requests)
    args = self._put((pages, replica, np.full(rows, -1, np.int32)), self._replicated)
    return self._insert[rows](prefix, state, *args)

  def extend_pages(
    self, params: Any, state: PagedState, items: Sequence[paging.ExtendItem]
  ) -> PagedState:
    """Writes the KV of `items` (each at most the largest prompt bucket long) after their
    sequences' KV, in one call of rows per replica (a power of two) by the smallest prompt
    bucket that holds the longest (`paged_decode.extend`)."""
    cfg, engine = self._engine.config, self._engine
    most = max(sum(it.replica == d for it in items) for d in range(self.replicas))
    per = 1 << (most - 1).bit_length()
    bucket = cfg.bucket(max(len(it.tokens) for it in items))
    rows = per * self.replicas
    tokens = np.full((rows, bucket), cfg.pad_token_id, np.int32)
    start = np.zeros(rows, np.int32)
    # As wide as a sequence and the bucket: a row's padding past its table writes to page 0.
    table = np.zeros((rows, self.width + self._pages_of(bucket)), np.int32)
    taken = [0] * self.replicas
    for it in items:
      i = it.replica * per + taken[it.replica]
      taken[it.replica] += 1
      tokens[i, : len(it.tokens)], start[i] = it.tokens, it.start
      table[i, : len(it.pages)] = it.pages
    host = paged_decode.Extension(tokens_bt=tokens, start_b=start, table_bw=table)
    key = (per, bucket)
    if key not in self._extend:
      shardings = rules.named_shardings(
        self._extension_axes, host, self._engine.mesh, Layout.GENERATION
      )
      self._extend[key] = (
        engine.traces.jit(
          f"extend[{rows}x{bucket}]",
          rules.constrained(
            functools.partial(paged_decode.extend, engine.model_config),
            Layout.GENERATION,
            engine.mesh,
          ),
          in_shardings=(engine.param_shardings, self.state_shardings, shardings),
          out_shardings=self.state_shardings,
          donate_argnums=1,
        ),
        shardings,
      )
    program, shardings = self._extend[key]
    return program(params, state, self._put(host, shardings))

  def decode(
    self, params: Any, state: PagedState, round_: paging.Round
  ) -> tuple[PagedState, jax.Array]:
    """One decode call as `round_` plans it."""
    host = Plan(
      table_bw=round_.table_bw,
      evict_b=round_.evict_b,
      count_d=round_.count_d,
      queue=Queue(**round_.queue),
      max_steps=np.int32(round_.max_steps),
      until_free=np.int32(round_.until_free),
      until_finished=np.int32(round_.until_finished),
      shrink_after=np.int32(round_.shrink_after),
    )
    plan, slots = self._put((host, round_.slots_s), (self.plan_shardings, self._slots_sharding))
    return self._generate_steps[len(round_.slots_s), round_.width](params, state, plan, slots)

  def drop(self, state: PagedState) -> None:
    """Frees a decode state's device memory now (its pages above all)."""
    for leaf in jax.tree.leaves(state):
      leaf.delete()

  def read_round(self, state: PagedState, steps: jax.Array) -> dict[str, np.ndarray]:
    """What the scheduler needs of a decode call's results, and its step count (one read)."""
    names = (
      "row_b",
      "done_b",
      "taken_d",
      "out_num_o",
      "out_done_o",
      "out_stopped_o",
      "out_tokens_or",
      "out_logprobs_or",
      "live_max",
    )
    return self._read({name: getattr(state, name) for name in names} | {"steps": steps})

  def warmup(self, params: Any, extra_bucket: bool = False) -> None:
    """Compiles every prefill and insert (writing only the reserved pages) and every decode
    program (zero steps); with `extra_bucket`, also the prefills of the bucket beyond the
    prompt buckets (`bucket`: prompt + response tokens of preempted or moved requests)."""
    cfg = self._engine.config
    state = self.init_state()
    buckets = cfg.prompt_buckets + ((cfg.cache_length,) if extra_bucket else ())
    for rows in cfg.prefill_batch_sizes:
      for bucket in buckets:
        item = paging.PrefillItem(tokens=np.zeros(bucket, np.int32), pages=[], replica=0)
        state = self.prefill_pages(params, state, [item] * rows)
    for size, width in self._generate_steps:
      state, _ = self._slot_call(params, state, 0, cfg.num_slots, size, width)
    jax.block_until_ready(state)
