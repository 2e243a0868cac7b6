"""Memory per device of one role: persistent state and the transient peak of its stage.

Counted from the shapes (no JAX): `b` sequences of a micro-batch, `s` tokens each, model width
`d`, MLP width `f`, `h` query heads and `k` KV heads of size `n`, `L` layers, vocab `v`.

- LoRA (`ModelConfig.lora`): the frozen base in `param_dtype` plus float32 adapters; moments
  and gradients of the adapters only (and of a value head). QLoRA (`ModelConfig.quantized`):
  those projections' base kernels in int8 plus a float32 scale per output channel, or in
  'nf4' (half a byte a weight, a uint8 scale per block of up to 64 and a float32 one per
  output channel).
- Persistent (lives between stages): parameters in `param_dtype`, and for trained roles the two
  Adam moments (optax keeps them in the parameters' dtype unless told otherwise), sharded over
  the layout's parameter axes. A part this role offloads (`Options.offload_params`,
  `offload_optimizer`: set per role) waits in host memory while the role is idle and comes back
  for its stage: it counts in the stage (`transient`, as `parked`), not between stages.
- Transient, trained roles (`accumulate_and_apply`): a float32 gradient accumulator and the
  averaged gradients in `param_dtype`, both sharded like the parameters; two layers' weights
  gathered whole (the layer in use and the next, as FSDP prefetches) in the compute dtype; the
  activations the backward pass keeps for one micro-batch; the logits.
- Activations per token and layer, kept for the backward pass under each remat policy:
  'none': the residual stream and norm outputs (4d), q, rotated k and v (hn + 2kn), the
  attention output (hn), the attention weights in float32 and the compute dtype (h s per token),
  and the SwiGLU intermediates gate, sigmoid(gate), silu(gate), up and their product (5f);
  'dots_saveable': matmul outputs only (hn + 2kn, 2d, scores h s, gate and up 2f);
  'full': the layer input (d) per layer, plus one layer's 'none' set while it is recomputed.
- Logits: float32 `[b, s, v]` three times (logits, log-softmax, their gradient; forwards keep
  two), or `logits_chunk` tokens at a time; the vocabulary is split over `tensor`.
- Rollout: parameters in the generation layout and the KV cache of its slots
  (`2 L k n` values per token in the compute dtype) at full length, plus decode logits.
- Context parallelism (`Sharding.context` = c): each device holds 1/c of its rows' tokens, so
  activations and logits divide by c; attention gathers the keys and values of the whole rows
  (`2 k n` values per token, over `tensor` where it divides the KV heads), once for the layer
  in use and, in a backward, once more for their gradient.
- Weight sync: the rollout receives the largest stacked parameter (an `[L, ...]` leaf) before
  it frees the old one, so one such leaf is the transfer's temporary.

Backends without native 16-bit matmuls (XLA on CPU) compute, and keep activations, in float32.

Engines with fused (flash) attention keep no `[h, s]` weights per token (`fused_attention`).

`replicated_activations` (a property of the engine): an engine whose train step sets no
sharding constraint on activations can leave XLA's propagation to keep the SwiGLU
intermediates and the logits whole on every FSDP device (the weights shard the model width;
seen in rlhfjax's compiled HLO as `[L, b, s, f]` buffers with the full micro-batch on each
device before the model constrained its residual stream). When true, those tensors are divided
by `tensor` only instead of by every device of the group. rlhfjax's step now splits them over
the batch (XLA's memory analysis of the 1b and 7b steps agrees within a few per cent).
"""

from __future__ import annotations

import dataclasses

from rlhfjax.config.model import LoraConfig, ModelConfig, nf4_block, param_count

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
  """Bytes one device of a role holds, by kind. `persistent` stays between stages."""

  params: int = 0
  optimizer: int = 0
  """Adam moments (trained roles)."""
  grads: int = 0
  """Gradient accumulator and averaged gradients during the update (trained roles)."""
  gathered: int = 0
  """Whole-layer weights FSDP gathers during a pass."""
  activations: int = 0
  logits: int = 0
  kv_cache: int = 0
  """KV cache (rollout)."""
  transfer: int = 0
  """The weight sync's temporary buffer (rollout)."""
  parked: int = 0
  """Of `params` and `optimizer`, the bytes offloaded to host memory while the role is idle;
  they are back on the device during its stage."""

  @property
  def persistent(self) -> int:
    """Kept on the device while the role is idle (between its stages)."""
    return self.params + self.optimizer - self.parked

  @property
  def transient(self) -> int:
    return self.total - self.persistent

  @property
  def total(self) -> int:
    return (
      self.params
      + self.optimizer
      + self.grads
      + self.gathered
      + self.activations
      + self.logits
      + self.kv_cache
      + self.transfer
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sharding:
  """How a role's group splits its model and batch."""

  param_shards: int
  """Devices one parameter is split over (fsdp x tensor, or tensor)."""
  batch_shards: int
  """Devices the batch is split over (data x fsdp, or data)."""
  tensor: int = 1
  context: int = 1
  """Devices each row's tokens are split over (context parallelism; in `param_shards` too)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """Memory-relevant settings of the step (the config wires them; see `Workload`)."""

  remat: str = "none"
  logits_chunk: int = 0
  offload_params: bool = False
  """This role's parameters wait in host memory while it is idle (one role's setting:
  `rlhfjax.placement.memory.offload_options` sets it per role)."""
  offload_optimizer: bool = False
  """This role's optimizer moments wait in host memory while it is idle (one role's setting)."""
  optimizer_on_host: bool = False
  """The moments live and are updated in host memory (DeepSpeed's ZeRO-Offload): no device
  memory at any time."""
  optimizer_dtype: str | None = None
  native_half: bool = True
  """False on backends that run 16-bit matmuls in float32 (XLA on CPU)."""
  replicated_activations: bool = False
  fused_attention: bool = False
  """Attention weights are never materialised (flash attention): no `h s` term per token."""


def dtype_bytes(dtype: str) -> int:
  """Bytes of one element of `dtype` ('float32', 'bfloat16', 'float16')."""
  return _BYTES[dtype]


def activation_bytes(config: ModelConfig, native_half: bool) -> int:
  return _BYTES[config.dtype] if native_half else 4


def param_bytes(config: ModelConfig, head: str, shards: int) -> int:
  return _ceil_div(stored_param_bytes(config, head), shards)


def stored_param_bytes(config: ModelConfig, head: str) -> int:
  """Bytes of the parameters as stored: `param_dtype`, but for the projections in
  `config.quantized` (QLoRA's base) int8 kernels with a float32 scale per output channel, or
  'nf4' codes two a byte with a uint8 scale per block (`nf4_block` of the last contracted
  dimension) and a float32 one per output channel (double quantization)."""
  total = param_count(config, head) * _BYTES[config.param_dtype]
  if not config.quantized:
    return total
  d, f, h, k, n = _dims(config)
  shapes = {  # (kernel elements, output channels, last contracted dim) of one layer's
    "q": (d * h * n, h * n, d),
    "k": (d * k * n, k * n, d),
    "v": (d * k * n, k * n, d),
    "o": (h * n * d, d, n),
    "gate": (d * f, f, d),
    "up": (d * f, f, d),
    "down": (f * d, d, f),
  }
  for target in config.quantized:
    if target == "lm_head":
      if head != "lm" or config.tie_embeddings:
        continue
      elements, channels, contracted = d * config.vocab_size, config.vocab_size, d
    else:
      elements, channels, contracted = shapes[target]
      elements, channels = elements * config.num_layers, channels * config.num_layers
    total -= elements * _BYTES[config.param_dtype]
    if config.quantization == "nf4":  # a uint8 scale per block, a float32 one per channel
      total += elements // 2 + elements // nf4_block(contracted) + 4 * channels
    else:
      total += elements + 4 * channels
  return total


def layer_params(config: ModelConfig) -> int:
  d, f, h, k, n = _dims(config)
  return d * h * n * 2 + 2 * d * k * n + 3 * d * f + 2 * d


def train_memory(
  config: ModelConfig,
  head: str,
  sharding: Sharding,
  *,
  micro_batch: int,
  seq_len: int,
  options: Options,
) -> MemoryEstimate:
  """Per-device memory of a train step on `micro_batch` sequences per batch shard."""
  p = param_count(config, head)
  ps = sharding.param_shards
  pb = _BYTES[config.param_dtype]
  ob = _BYTES[options.optimizer_dtype or config.param_dtype]
  c = activation_bytes(config, options.native_half)
  params = _ceil_div(stored_param_bytes(config, head), ps)
  optimizer = 0 if options.optimizer_on_host else _ceil_div(2 * p * ob, ps)
  grads = _ceil_div(p * (4 + pb), ps)
  if config.lora is not None:
    # LoRA: the frozen base has no moments or gradients; the float32 adapters (and a value
    # head) have them, each adapter split as its kernel's side it shares (`_adapter_elements`).
    adapters = _adapter_elements(config, head, sharding)
    params += 4 * adapters
    trained = adapters + (_ceil_div(config.hidden_size, ps) if head == "value" else 0)
    optimizer = 0 if options.optimizer_on_host else 2 * trained * 4
    grads = trained * (4 + 4)
  if options.optimizer_on_host:
    # ZeRO-Offload (DeepSpeed ZeRO-2/3) accumulates the float32 gradients on the host and
    # partitions the 16-bit ones over every data-parallel device: each keeps its share only.
    grads = _ceil_div(p * pb, sharding.batch_shards * sharding.tensor)
  gathered = 2 * _ceil_div(layer_params(config) * c, sharding.tensor) if ps > 1 else 0
  global_tokens = micro_batch * sharding.batch_shards * seq_len
  acts = _saved_activations(config, global_tokens, seq_len, c, sharding, options)
  acts += 2 * _gathered_keys(config, micro_batch * seq_len, c, sharding)
  logits = _logits(config, head, global_tokens, sharding, options, copies=3)
  return MemoryEstimate(
    params=params,
    optimizer=optimizer,
    grads=grads,
    gathered=gathered,
    activations=acts,
    logits=logits,
    parked=_parked(params, optimizer, options),
  )


def adapter_bytes(config: ModelConfig, head: str = "lm") -> int:
  """Bytes of all of `config`'s LoRA adapters (float32), unsplit: what an adapters-only weight
  sync moves."""
  return 4 * _adapter_elements(config, head, Sharding(param_shards=1, batch_shards=1))


def _adapter_elements(config: ModelConfig, head: str, sharding: Sharding) -> int:
  """Adapter values one device holds: of each adapted projection, the factor on the model
  width (`embed`: A of q/k/v/gate/up, B of o/down) split over all the parameter axes, the
  other over `tensor` only (heads and MLP width; the rank is replicated)."""
  d, f, h, k, n = _dims(config)
  r, t = config.lora.rank, sharding.tensor
  other = {"q": h * n, "k": k * n, "v": k * n, "o": h * n, "gate": f, "up": f, "down": f}
  total = 0
  for target in config.lora.targets:
    if target == "lm_head":
      if head == "lm":  # A [d, r] over fsdp, B [r, vocab] over tensor
        total += _ceil_div(r * d, sharding.param_shards // t) + _ceil_div(r * config.vocab_size, t)
      continue
    per_layer = _ceil_div(r * d, sharding.param_shards // t) + _ceil_div(r * other[target], t)
    total += config.num_layers * per_layer
  return total


def forward_memory(
  config: ModelConfig,
  head: str,
  sharding: Sharding,
  *,
  micro_batch: int,
  seq_len: int,
  options: Options,
) -> MemoryEstimate:
  """Per-device memory of a scoring forward: parameters, one layer's working set, logits."""
  c = activation_bytes(config, options.native_half)
  global_tokens = micro_batch * sharding.batch_shards * seq_len
  per_token = _layer_activation_bytes(config, seq_len, c, sharding, options)
  gathered = (
    2 * _ceil_div(layer_params(config) * c, sharding.tensor) if sharding.param_shards > 1 else 0
  )
  params = param_bytes(config, head, sharding.param_shards)
  return MemoryEstimate(
    params=params,
    gathered=gathered,
    activations=int(global_tokens * per_token)
    + _gathered_keys(config, micro_batch * seq_len, c, sharding),
    logits=_logits(config, head, global_tokens, sharding, options, copies=2),
    parked=_parked(params, 0, options),
  )


def rollout_memory(
  config: ModelConfig,
  sharding: Sharding,
  *,
  slots: int,
  seq_len: int,
  options: Options,
  receives_sync: bool,
  cache_tokens: int | None = None,
  released: bool = False,
  sync_adapters: LoraConfig | None = None,
) -> MemoryEstimate:
  """Per-device memory of generation with `slots` sequences per data group.

  `cache_tokens`: tokens the data group's KV cache holds (a paged pool); None: every slot at
  full length, `slots x seq_len`. `released`: the weights are freed between generations
  (`rollout.release`), so they count in the generation only, as offloaded parts do.
  `sync_adapters`: the sync brings only the actor's LoRA adapters of this config, merged into
  a copy of the frozen base the rollout keeps beside its merged weights
  (`rlhfjax.cluster.adapter_sync`): the weights count twice, and the adapters arrive whole."""
  tokens = slots * seq_len if cache_tokens is None else cache_tokens
  kv_cache = tokens * kv_token_bytes(config, sharding, options)
  logits = slots * config.vocab_size * 4 * 2 // sharding.tensor
  transfer = 0
  params = param_bytes(config, "lm", sharding.param_shards)
  if receives_sync and sync_adapters is not None:
    adapters = 4 * _adapter_elements(config.replace(lora=sync_adapters), "lm", sharding)
    return MemoryEstimate(
      params=2 * params + adapters,
      kv_cache=kv_cache,
      logits=logits,
      transfer=adapters,
      parked=params if released else 0,
    )
  if receives_sync:
    d, f = config.hidden_size, config.intermediate_size
    largest = max(config.num_layers * d * f, config.vocab_size * d)
    transfer = _ceil_div(largest * _BYTES[config.param_dtype], sharding.tensor)
  return MemoryEstimate(
    params=params,
    kv_cache=kv_cache,
    logits=logits,
    transfer=transfer,
    parked=params if released else 0,
  )


def kv_token_bytes(config: ModelConfig, sharding: Sharding, options: Options) -> int:
  """Bytes one token's keys and values take on one device of the rollout: every layer's, in
  the activation dtype, the KV heads split over `tensor` where it divides them."""
  _, _, _, k, n = _dims(config)
  kv_per_token = 2 * config.num_layers * k * n * activation_bytes(config, options.native_half)
  return _ceil_div(kv_per_token, sharding.tensor if k % sharding.tensor == 0 else 1)


def _parked(params: int, optimizer: int, options: Options) -> int:
  """The bytes of `params` and `optimizer` that wait in host memory while the role is idle."""
  return (params if options.offload_params else 0) + (optimizer if options.offload_optimizer else 0)


def _dims(config: ModelConfig) -> tuple[int, int, int, int, int]:
  return (
    config.hidden_size,
    config.intermediate_size,
    config.num_heads,
    config.num_kv_heads,
    config.head_dim,
  )


def kept_activations(
  config: ModelConfig, sharding: Sharding, *, micro_batch: int, seq_len: int, options: Options
) -> int:
  """What one micro-batch's forward keeps for its backward under the remat policy, without the
  working set of a layer being recomputed ('full': the layer inputs only): the residuals a
  pipeline stage stashes per micro-batch in flight."""
  c = activation_bytes(config, options.native_half)
  global_tokens = micro_batch * sharding.batch_shards * seq_len
  if options.remat != "full":
    return _saved_activations(config, global_tokens, seq_len, c, sharding, options)
  group = sharding.batch_shards * sharding.tensor * sharding.context
  return int(config.num_layers * global_tokens * config.hidden_size * c / group)


def _gathered_keys(config, row_tokens, c, sharding) -> int:
  """One layer's keys and values of whole rows (`row_tokens` tokens) that context-parallel
  attention gathers; nothing without context parallelism."""
  if sharding.context <= 1:
    return 0
  _, _, _, k, n = _dims(config)
  return _ceil_div(row_tokens * 2 * k * n * c, sharding.tensor if k % sharding.tensor == 0 else 1)


def _saved_activations(config, global_tokens, seq_len, c, sharding, options) -> int:
  d, f, h, k, n = _dims(config)
  group = sharding.batch_shards * sharding.tensor * sharding.context
  mlp_shards = sharding.tensor if options.replicated_activations else group
  layers = config.num_layers
  if options.remat == "none":
    sharded = (4 * d + 2 * h * n + 2 * k * n) * c + _scores(h, seq_len, 4 + c, options)
    per_layer = global_tokens * (sharded / group + 5 * f * c / mlp_shards)
    return int(layers * per_layer)
  if options.remat == "dots_saveable":
    sharded = (2 * d + h * n + 2 * k * n) * c + _scores(h, seq_len, 4, options)
    per_layer = global_tokens * (sharded / group + 2 * f * c / mlp_shards)
    return int(layers * per_layer)
  # 'full': the layer inputs, and one layer's full set while it is recomputed.
  inputs = layers * global_tokens * d * c / group
  one_layer = _saved_activations(
    config.replace(num_layers=1), global_tokens, seq_len, c, sharding, _no_remat(options)
  )
  return int(inputs + one_layer)


def _layer_activation_bytes(config, seq_len, c, sharding, options) -> float:
  """Bytes per token of one layer's forward working set (nothing kept for a backward)."""
  d, f, h, k, n = _dims(config)
  group = sharding.batch_shards * sharding.tensor * sharding.context
  mlp_shards = sharding.tensor if options.replicated_activations else group
  sharded = (3 * d + 2 * h * n + 2 * k * n) * c + _scores(h, seq_len, 4 + c, options)
  return sharded / group + 3 * f * c / mlp_shards


def _scores(h: int, seq_len: int, bytes_per: int, options: Options) -> int:
  """Bytes per token of attention weights (a float32 log-sum-exp per head when fused)."""
  return h * 4 if options.fused_attention else h * seq_len * bytes_per


def _logits(config, head, global_tokens, sharding, options, *, copies) -> int:
  if head != "lm":
    return 0
  tokens = global_tokens
  if options.logits_chunk:
    # A chunk of each row piece at once (`models.logprobs.chunked_stats`).
    tokens = min(tokens, options.logits_chunk * sharding.batch_shards * sharding.context)
  shards = (
    sharding.tensor
    if options.replicated_activations
    else sharding.tensor * max(sharding.batch_shards, 1) * sharding.context
  )
  return int(copies * tokens * config.vocab_size * 4 / shards)


def _no_remat(options: Options) -> Options:
  return dataclasses.replace(options, remat="none")


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)
