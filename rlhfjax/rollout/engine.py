"""The rollout engine: KV-cache generation on the rollout mesh, driven through decode slots.

The slot API follows JetStream's engine protocol:

    state = engine.init_decode_state()                 # every slot free
    prefix = engine.prefill(prompts, sampling)         # batched prefill, first tokens sampled
    state = engine.insert(prefix, state, slots)        # prompts take those slots
    state, steps = engine.generate_steps(state, n)     # decode on device, all slots at once
    view = engine.read(state)                          # host: which slots are done, their tokens

A finished slot is free: the next `insert` into it replaces its row. `generate` (continuous
batching over this API, see `rlhfjax.rollout.batching`) is the call most users want;
`rlhfjax.rollout.streaming.RolloutStream` hands samples out as they finish, the tail decoding
ever smaller live batches, and with `tail_threshold` on fewer replicas
(`rlhfjax.rollout.compaction`).

Compiled programs, each jitted once with explicit in/out shardings on the engine's mesh:
`prefill` per (prefill batch size, prompt bucket), `insert` per (prefill batch size, bucket),
one `generate_steps` per live-batch size and page-table width (see
`rlhfjax.rollout.paged_engine`) and one `init_decode_state`. Sampling settings, seeds, stop ids
and token limits are data, so they never recompile; neither does `update_params`.

Layout: the generation rules of `rlhfjax.mesh.rules` (tensor parallel over heads, KV heads,
MLP and vocab; decode slots over 'data'). Prefill batches smaller than the 'data' axis are
replicated over it.

One KV cache: a pool of fixed-size pages per 'data' replica (`rlhfjax.rollout.paged_decode`).
`generate` and `RolloutStream` admit requests by free pages, share the pages of identical
prompts and refill slots on device (`rlhfjax.rollout.paging` schedules them); the slot API
gives every slot a fixed row of pages, a dense cache's memory. The prefill fills the KV of a
prompt's first `L - 1` tokens and the first decode step samples its first token. The engine is
tested against the model's forward over the whole sequence, without a cache
(tests/test_rollout.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rlhfjax import models
from rlhfjax.config.model import ModelConfig
from rlhfjax.mesh import meshes, rules, sharing, transfer
from rlhfjax.models.transformer import PAGED_KERNELS
from rlhfjax.placement.spec import LAYOUT_AXES, Layout, RoleSpec
from rlhfjax.programs import TraceCounter
from rlhfjax.rollout import batching, compaction, paged_engine, paging
from rlhfjax.rollout.paged_decode import PagedState
from rlhfjax.rollout.sampling import GREEDY, SamplingParams

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Static shapes of the rollout engine: what each compiled program is specialised to."""

  num_slots: int = 8
  """Decode batch size: sequences generated at the same time. A multiple of the 'data' axis."""
  prompt_buckets: tuple[int, ...] = (64, 128, 256, 512)
  """Prompt lengths prefill is compiled for; a prompt is left padded to the smallest that fits."""
  max_new_tokens: int = 256
  """Response capacity of the KV cache; a request may ask for fewer."""
  prefill_batch_sizes: tuple[int, ...] | None = None
  """Prompts per prefill call; None: powers of two up to `num_slots`. Must contain 1."""
  max_stop_tokens: int = 4
  """Most stop token ids one request may give."""
  pad_token_id: int = 0
  """Written into prompt padding and past the end of responses."""
  tail_threshold: float = 0.0
  """Tail compaction: once no prompt waits and at most this fraction of `num_slots` still
  runs, the running requests move onto an engine of that many slots on the first 'data'
  replicas of the mesh (`rlhfjax.rollout.compaction`), freeing the other replicas' devices. 0
  turns it off (the live batch still halves as the tail finishes, on every replica)."""
  page_size: int = 16
  """Tokens per page."""
  num_pages: int | None = None
  """Pages of the pool, over all 'data' replicas, one reserved page per replica included;
  None: the dense cache's memory, `num_slots * pages_per_sequence` plus the reserved pages. A
  smaller pool holds fewer full-length sequences; admission by pages and preemption keep any
  pool that holds one full sequence per replica working."""
  share_prefixes: bool = True
  """Requests with the same prompt (a group's samples) prefill it once and share its pages."""
  decode_chunk: int = 64
  """Most decode steps of one device call while requests wait for a slot or pages: pages for
  the response are reserved a chunk at a time."""
  paged_attention: str = "auto"
  """Attention over pages: 'gather' (the rows' pages gathered, then XLA's attention; any
  backend), 'pallas_gpu' or 'pallas_tpu' (JAX's Pallas paged-attention kernels for decode;
  'pallas_gpu' runs in Pallas' interpret mode off a GPU), 'pallas' (the kernel of the mesh's
  platform; refused where none can run) or 'auto' (`paged_engine.resolve_kernel`)."""

  def __post_init__(self):
    if self.num_slots < 1:
      raise ValueError(f"EngineConfig.num_slots must be >= 1, got {self.num_slots}")
    buckets = tuple(int(b) for b in self.prompt_buckets)
    if not buckets or min(buckets) < 1 or list(buckets) != sorted(set(buckets)):
      raise ValueError(
        "EngineConfig.prompt_buckets must be positive and strictly increasing, "
        f"got {self.prompt_buckets}"
      )
    object.__setattr__(self, "prompt_buckets", buckets)
    if self.max_new_tokens < 1:
      raise ValueError(f"EngineConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.max_stop_tokens < 1:
      raise ValueError(f"EngineConfig.max_stop_tokens must be >= 1, got {self.max_stop_tokens}")
    sizes = self.prefill_batch_sizes
    if sizes is None:
      sizes = tuple(2**i for i in range(self.num_slots.bit_length()) if 2**i <= self.num_slots)
    sizes = tuple(sorted({int(m) for m in sizes}))
    if 1 not in sizes or sizes[-1] > self.num_slots:
      raise ValueError(
        "EngineConfig.prefill_batch_sizes must contain 1 and none may exceed "
        f"num_slots={self.num_slots}, got {self.prefill_batch_sizes}"
      )
    object.__setattr__(self, "prefill_batch_sizes", sizes)
    if not 0.0 <= self.tail_threshold < 1.0:
      raise ValueError(f"EngineConfig.tail_threshold must be in [0, 1), got {self.tail_threshold}")
    if self.page_size < 1:
      raise ValueError(f"EngineConfig.page_size must be >= 1, got {self.page_size}")
    if self.num_pages is not None and self.num_pages < 2:
      raise ValueError(f"EngineConfig.num_pages must be >= 2 or None, got {self.num_pages}")
    if self.decode_chunk < 1:
      raise ValueError(f"EngineConfig.decode_chunk must be >= 1, got {self.decode_chunk}")
    if self.paged_attention not in ("auto", "pallas", *PAGED_KERNELS):
      raise ValueError(
        f"EngineConfig.paged_attention must be one of {('auto', 'pallas', *PAGED_KERNELS)}, "
        f"got {self.paged_attention!r}"
      )

  @property
  def cache_length(self) -> int:
    """Slots per row of the KV cache: the largest prompt bucket plus the response capacity."""
    return self.prompt_buckets[-1] + self.max_new_tokens

  @property
  def pages_per_sequence(self) -> int:
    """Width of a page table: the pages of one `cache_length` sequence."""
    return -(-self.cache_length // self.page_size)

  def pages_total(self, replicas: int) -> int:
    """Pages of the pool over `replicas` 'data' replicas (`num_pages`, or a dense cache's:
    every slot at full length)."""
    if self.num_pages is not None:
      return self.num_pages
    return self.num_slots * self.pages_per_sequence + replicas

  def bucket(self, prompt_length: int) -> int:
    """The smallest prompt bucket that holds `prompt_length` tokens."""
    if prompt_length < 1:
      raise ValueError("empty prompt: a prompt needs at least one token")
    for b in self.prompt_buckets:
      if prompt_length <= b:
        return b
    raise ValueError(
      f"prompt of {prompt_length} tokens is longer than the largest prompt "
      f"bucket ({self.prompt_buckets[-1]}); add a bucket to "
      "EngineConfig.prompt_buckets"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prefix:
  """Prefilled prompts waiting to be inserted into decode slots."""

  state: Any
  """The prefill's output (`rlhfjax.rollout.paged_decode.Prefix`): rows padded up to a prefill
  batch size; only the first `num_prompts` are real."""
  num_prompts: int
  bucket: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlotView:
  """A host copy of what the decode slots hold (`Engine.read`)."""

  done: np.ndarray
  """[slots] bool: finished or never filled."""
  stopped: np.ndarray
  """[slots] bool: finished on a stop token."""
  num_generated: np.ndarray
  """[slots] int32: response length so far."""
  tokens: np.ndarray
  """[slots, max_new_tokens] int32; entries at and past `num_generated` are stale."""
  logprobs: np.ndarray
  """[slots, max_new_tokens] float32."""
  last_tokens: np.ndarray
  """[slots] int32: each slot's most recent token."""


class Engine:
  """Prefill, insert and generate on one mesh in the generation layout."""

  def __init__(
    self,
    model_config: ModelConfig,
    config: EngineConfig,
    mesh: Mesh,
    params: Any | None = None,
    *,
    param_shardings: Any = None,
  ):
    """Builds the compiled programs (lazily, per shape) and optionally loads parameters.

    Args:
      model_config: The policy's architecture ('lm' head).
      config: Static engine shapes.
      mesh: The rollout mesh; its axes must be among ('data', 'tensor').
      params: Parameters to load with `update_params`, or None to load later.
      param_shardings: Shardings equivalent to the generation layout's on `mesh` (the same
        shard on every device) to compile the programs for instead, for example those of the
        co-located actor whose arrays `read_params_from` hands over as they are.
    """
    allowed = LAYOUT_AXES[Layout.GENERATION]
    if unknown := [a for a in mesh.axis_names if a not in allowed]:
      raise ValueError(f"rollout mesh axes {unknown} are not generation-layout axes {allowed}")
    data = dict(mesh.shape).get("data", 1)
    if config.num_slots % data:
      raise ValueError(
        f"EngineConfig.num_slots={config.num_slots} must be a multiple of the "
        f"mesh's 'data' axis ({data})"
      )
    if config.cache_length > model_config.max_position_embeddings:
      raise ValueError(
        f"largest prompt bucket + max_new_tokens = {config.cache_length} exceeds "
        f"the model's max_position_embeddings "
        f"({model_config.max_position_embeddings})"
      )
    self.model_config = model_config
    self.config = config
    self.mesh = mesh
    self.traces = TraceCounter()
    """Traces of every compiled program of the engine, by name."""
    self.param_logical_axes = models.logical_axes(model_config, "lm")
    self.abstract_params = models.abstract_params(model_config, "lm")
    self.param_shardings = rules.named_shardings(
      self.param_logical_axes, self.abstract_params, mesh, Layout.GENERATION
    )
    if param_shardings is not None:
      if not sharing.same_shardings(self.param_shardings, param_shardings, self.abstract_params):
        raise ValueError(
          "param_shardings must place every shard where the generation layout on the "
          "engine's mesh does"
        )
      self.param_shardings = param_shardings
    self._params = None
    self._owned: list[bool] = []
    """Per leaf of `_params`: copied by this engine (not the caller's array, adopted); empty
    while it holds none of its own."""
    self._source: Callable[[], Any] | None = None
    self.params_version = 0
    """Incremented by every `update_params` and `read_params_from`: the weights' version."""
    self.host_transfers = 0
    """Host transfers made so far (uploads and reads, one per call)."""
    self.paged = paged_engine.PagedPrograms(self)
    """The compiled programs over the KV pages and the host calls that drive them."""
    self.compactor = compaction.Compactor(self)
    """The engines the tail moves to (`tail_threshold`), built on first use."""
    self.state_shardings = self.paged.state_shardings
    self.prefix_shardings = dict(self.paged.prefix_shardings)
    """Shardings of a prefill's output, by prefill batch size."""
    if params is not None:
      self.update_params(params)

  @classmethod
  def for_role(
    cls,
    model_config: ModelConfig,
    config: EngineConfig,
    role_spec: RoleSpec,
    params: Any | None = None,
  ) -> Engine:
    """An engine on the mesh of a placement's rollout role."""
    if role_spec.layout != Layout.GENERATION:
      raise ValueError(f"the rollout role needs the generation layout, got {role_spec.layout}")
    return cls(model_config, config, meshes.make_mesh(role_spec), params)

  # -------------------------------------------------------------------------------------------
  # Shardings and bookkeeping.

  @property
  def compilations(self) -> dict[str, int]:
    """Programs traced (and so compiled) so far, by entry point."""
    return self.traces.counts

  # -------------------------------------------------------------------------------------------
  # Weights.

  @property
  def params(self) -> Any:
    if self._source is not None:
      return self._source()
    if self._params is None:
      raise RuntimeError("the engine has no parameters yet: call update_params(params) first")
    return self._params

  def update_params(self, params: Any) -> int:
    """Swaps in new weights without recompiling; returns the bytes moved to get them here.

    Arrays already laid out on the engine's mesh as the generation layout asks are used as they
    are; `jax.Array`s elsewhere are moved device to device by `rlhfjax.mesh.transfer`; host
    arrays are uploaded. Shapes and dtypes must match the model config. Ends any
    `read_params_from`.
    """
    self._source = None
    self.params_version += 1
    expected = self.abstract_params
    try:
      pairs = jax.tree.map(lambda x, e: (x, e), params, expected)
    except ValueError as e:
      raise ValueError(f"parameter tree does not match the model config: {e}") from None
    bad = [
      f"{jax.tree_util.keystr(path)}: got {np.shape(x)} {getattr(x, 'dtype', '?')}, "
      f"want {e.shape} {e.dtype}"
      for path, (x, e) in jax.tree_util.tree_leaves_with_path(
        pairs, is_leaf=lambda p: isinstance(p, tuple)
      )
      if tuple(np.shape(x)) != e.shape or getattr(x, "dtype", None) != e.dtype
    ]
    if bad:
      raise ValueError("parameters do not match the model config:\n  " + "\n  ".join(bad[:5]))
    on_host = lambda x: not isinstance(x, jax.Array)
    params = jax.tree.map(
      lambda x, s: jax.device_put(x, s) if on_host(x) else x, params, self.param_shardings
    )
    # The previous weights are dead once swapped: write the new ones into their buffers (no
    # fresh memory on the rollout devices), but only if the engine owns all of them, that is
    # the last transfer copied every leaf rather than adopting the caller's arrays.
    old = self._params if self._owned and all(self._owned) else None
    self._params = None
    moved_from = jax.tree.leaves(params)
    params, moved = transfer.transfer(params, self.param_shardings, into=old)
    self._owned = [a is not b for a, b in zip(moved_from, jax.tree.leaves(params), strict=True)]
    # Arrays the transfer left in place may carry an equivalent but different sharding object
    # (say a single-device one); relabel them so every call hits the same compiled program.
    self._params = jax.tree.map(_relabel, params, self.param_shardings)
    return moved

  @property
  def has_params(self) -> bool:
    """Whether the engine has weights to run (not before the first `update_params`, nor after
    `release_params`)."""
    return self._source is not None or self._params is not None

  def release_params(self) -> int:
    """Frees the engine's own copy of the weights (`rollout.release`): their device memory is
    free until `update_params` brings weights again. Returns the bytes freed over this
    process's devices: 0 when it reads another role's arrays (`read_params_from`); the arrays
    it adopted rather than copied (say norm scales already replicated where it needs them)
    stay with their owner."""
    if self._source is not None or self._params is None:
      return 0
    freed = 0
    for x, owned in zip(jax.tree.leaves(self._params), self._owned, strict=True):
      if owned:
        freed += sum(shard.data.nbytes for shard in x.addressable_shards)
        x.delete()
    self._params, self._owned = None, []
    return freed

  def read_params_from(self, source: Callable[[], Any]) -> None:
    """From now on every program reads `source()`'s arrays, called when it runs: no copy and
    no sync (a co-located actor's current weights, laid out exactly as `param_shardings`).

    Reading at each call, rather than holding the arrays, means an update that donates the
    previous weights never leaves the engine with deleted buffers. `update_params` ends it.
    """
    self._params, self._owned, self._source = None, [], source
    self.params_version += 1

  # -------------------------------------------------------------------------------------------
  # The slot API.

  def init_decode_state(self) -> PagedState:
    """A decode batch with every slot free, allocated on the mesh."""
    return self.paged.init_state()

  def prefill(
    self,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    *,
    seed: int = 0,
    request_ids: Sequence[int] | None = None,
  ) -> Prefix:
    """Prefills prompts (at most the largest prefill batch size): the KV of all but each one's
    last token (the first decode step feeds that one and samples the first response token).

    Args:
      prompts: Token ids, one non-empty list per prompt.
      sampling: One setting for all prompts, or one per prompt.
      seed: With `request_ids`, names each request's PRNG key
        `fold_in(key(seed), request_id)`: same seed and id, same response.
      request_ids: One int per prompt; defaults to 0, 1, ...

    Returns:
      A `Prefix` to `insert` into decode slots.
    """
    prompts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    num = len(prompts)
    sizes = self.config.prefill_batch_sizes
    if not 1 <= num <= sizes[-1]:
      raise ValueError(f"prefill takes 1 to {sizes[-1]} prompts, got {num}")
    rows = next(m for m in sizes if m >= num)
    settings = _per_prompt(sampling, num)
    request_ids = list(range(num)) if request_ids is None else [int(i) for i in request_ids]
    if len(request_ids) != num:
      raise ValueError(f"{len(request_ids)} request ids for {num} prompts")
    if not 0 <= seed <= _INT32_MAX or not all(0 <= i <= _INT32_MAX for i in request_ids):
      raise ValueError("seed and request ids must be in [0, 2**31)")
    bucket = max(self.config.bucket(len(p)) for p in prompts)
    vocab = self.model_config.vocab_size
    for i, p in enumerate(prompts):
      if p.min() < 0 or p.max() >= vocab:
        raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")

    cfg = self.config
    fields = _settings_arrays(settings, rows, cfg, self.model_config.eos_token_ids)
    state, bucket = self.paged.prefill(self.params, prompts, fields, seed, request_ids, rows)
    return Prefix(state=state, num_prompts=num, bucket=bucket)

  def insert(self, prefix: Prefix, state: PagedState, slots: Sequence[int]) -> PagedState:
    """Puts prefix row `i` into decode slot `slots[i]`. Donates `state`.

    Whatever the slots held is replaced, finished or not: the caller tracks which are free.
    """
    slots = [int(s) for s in slots]
    if len(slots) != prefix.num_prompts:
      raise ValueError(f"{len(slots)} slots for a prefix of {prefix.num_prompts} prompts")
    if len(set(slots)) != len(slots) or not all(0 <= s < self.config.num_slots for s in slots):
      raise ValueError(f"slots must be distinct and in [0, {self.config.num_slots}), got {slots}")
    return self.paged.insert(prefix.state, state, slots)

  def generate_steps(
    self, state: PagedState, max_steps: int | None = None, until_free: int | None = None
  ) -> tuple[PagedState, jax.Array]:
    """Decodes every slot on device. Donates `state`.

    Args:
      state: The decode batch.
      max_steps: Most decode steps; None: `max_new_tokens` (enough to finish every row).
      until_free: Return early once this many slots are free (done); None: all slots, that is
        run until every row is done. 1 returns as soon as any row finishes.

    Returns:
      The new state and the number of steps taken (a device scalar).
    """
    max_steps = self.config.max_new_tokens if max_steps is None else int(max_steps)
    until_free = self.config.num_slots if until_free is None else int(until_free)
    return self.paged.generate_steps(self.params, state, max_steps, until_free)

  def settings_arrays(self, settings: Sequence[SamplingParams]) -> dict[str, np.ndarray]:
    """Per-request arrays of `settings` (`max_new_b`, `stop_bm`, `temperature_b`, `top_k_b`,
    `top_p_b`), checked against the engine's capacities."""
    cfg = self.config
    return _settings_arrays(settings, len(settings), cfg, self.model_config.eos_token_ids)

  def warmup(self) -> dict[str, int]:
    """Compiles every program the engine can need, so no later call compiles
    (`rlhfjax.rollout.paged_engine.PagedPrograms.warmup`), and with `tail_threshold` those of
    its tail engine (whose prefills also take prompt + response tokens, in one bucket of
    `cache_length`). Returns `compilations` (the engine's own)."""
    self.paged.warmup(self.params)
    rows = self.compactor.rows(self.config.tail_threshold)
    if rows:
      tail = self.compactor.engine(rows)
      tail.paged.warmup(tail.params, extra_bucket=True)
    return self.compilations

  def read(self, state: PagedState) -> SlotView:
    """Copies the slots' progress and responses to the host (waits for the device)."""
    got = self.paged.read_slots(state)
    return SlotView(
      done=got["done_b"],
      stopped=got["stopped_b"],
      num_generated=got["num_generated_b"],
      tokens=got["out_tokens_or"],
      logprobs=got["out_logprobs_or"],
      last_tokens=got["tokens_b"],
    )

  def generate(
    self,
    prompts: Any,
    lengths: Any = None,
    *,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    seed: int = 0,
    padding_side: str = "left",
    on_decode_call: Callable[[], None] | None = None,
    turn: paging.TurnFn | None = None,
    turn_tokens: int = 0,
  ) -> batching.GenerateOutput:
    """Generates a response to every prompt with continuous batching over the slots.

    See `rlhfjax.rollout.batching.generate`; the output is in input order. `turn` makes
    each request a conversation (`rlhfjax.rollout.streaming.RolloutStream`).
    """
    return batching.generate(
      self,
      prompts,
      lengths,
      sampling=sampling,
      seed=seed,
      padding_side=padding_side,
      on_decode_call=on_decode_call,
      turn=turn,
      turn_tokens=turn_tokens,
    )


def _relabel(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """`x` with exactly `sharding` (equivalent to its own), reusing its buffers."""
  if x.sharding == sharding and x.committed:
    return x
  by_device = {shard.device: shard.data for shard in x.addressable_shards}
  return jax.make_array_from_single_device_arrays(
    x.shape,
    sharding,
    [by_device[d] for d in sharding.addressable_devices_indices_map(x.shape)],
    dtype=x.dtype,
  )


def _per_prompt(
  sampling: SamplingParams | Sequence[SamplingParams], num: int
) -> list[SamplingParams]:
  if isinstance(sampling, SamplingParams):
    return [sampling] * num
  settings = list(sampling)
  if len(settings) != num or not all(isinstance(s, SamplingParams) for s in settings):
    raise ValueError(
      f"sampling must be one SamplingParams or one per prompt ({num}), got {len(settings)} items"
    )
  return settings


def _settings_arrays(
  settings: Sequence[SamplingParams], rows: int, cfg: EngineConfig, eos_token_ids: Sequence[int]
) -> dict[str, np.ndarray]:
  """Per-row arrays of the sampling settings; rows past `len(settings)` are padding."""
  out = {
    "max_new_b": np.ones(rows, np.int32),
    "stop_bm": np.full((rows, cfg.max_stop_tokens), -1, np.int32),
    "temperature_b": np.zeros(rows, np.float32),
    "top_k_b": np.zeros(rows, np.int32),
    "top_p_b": np.ones(rows, np.float32),
  }
  for i, s in enumerate(settings):
    max_new = cfg.max_new_tokens if s.max_new_tokens is None else s.max_new_tokens
    if max_new > cfg.max_new_tokens:
      raise ValueError(
        f"max_new_tokens={max_new} exceeds the engine's cache capacity "
        f"(EngineConfig.max_new_tokens={cfg.max_new_tokens})"
      )
    stops = tuple(eos_token_ids) if s.stop_token_ids is None else s.stop_token_ids
    if len(stops) > cfg.max_stop_tokens:
      raise ValueError(
        f"{len(stops)} stop token ids exceed EngineConfig.max_stop_tokens={cfg.max_stop_tokens}"
      )
    out["max_new_b"][i] = max_new
    out["stop_bm"][i, : len(stops)] = stops
    out["temperature_b"][i] = s.temperature
    out["top_k_b"][i] = s.top_k
    out["top_p_b"][i] = s.top_p
  return out
