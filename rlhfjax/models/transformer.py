"""A decoder-only transformer covering the Llama family, in Flax linen.

Letters in names and einsum strings: b batch, t query length, s key length, d hidden,
h query heads, k kv heads, g query heads per kv head, n head dim, f mlp, v vocab, l layers.

Parameters carry logical axis names only ('vocab', 'embed', 'heads', 'kv_heads', 'head_dim',
'mlp', 'layers', 'norm'); `rlhfjax.mesh.rules` maps them onto a mesh per layout.

One call signature serves every use:
  * a full forward (training, scoring): `cache=None`, keys are the `t` new tokens;
  * prefill and decode (rollout): `cache` holds `[l, b, s, k, n]` keys and values; the `t` new
    keys/values are written at `cache_index_b` of each row and attention runs over all `s` slots;
  * paged decode (rollout): `cache` is a `PagedKV`, pools of fixed-size pages and a page table
    per row; the new keys/values are written at logical index `cache_index_b` of each row, in the
    page its table names, and attention runs over the row's pages (`paged_attend`).
The caller supplies positions and an `attention.Mask` (segment ids and positions of the queries
and the keys, never a `[t, s]` array), so left padding, packed rows, continuous batching slots
and sliding windows are all just ids.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from rlhfjax import programs
from rlhfjax.config.model import HeadKind, LoraConfig, ModelConfig, RopeScaling
from rlhfjax.models import lora
from rlhfjax.models.attention import MASKED, Mask, attend

Params = Any
Cache = dict[str, jax.Array]  # {'k': [l, b, s, k, n], 'v': [l, b, s, k, n]}

_INIT_STD = 0.02


def _param(module: nn.Module, name: str, shape, axes, init, dtype):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _adapted(config: ModelConfig, target: str) -> LoraConfig | None:
  """The model's LoRA config where it adapts projection `target`, else None."""
  return config.lora if config.lora is not None and target in config.lora.targets else None


def _quantized(config: ModelConfig, target: str) -> str:
  """How projection `target`'s frozen base kernel is stored: `config.quantization` where
  `config.quantized` names it, else '' (in the parameters' dtype)."""
  return config.quantization if target in config.quantized else ""


def _projection(
  cfg: ModelConfig,
  target: str,
  eqn: str,
  kernel_shape: tuple[int, ...],
  kernel_axes: tuple[str, ...],
  bias_axes: tuple[str, ...] | None = None,
) -> Linear:
  """The model's projection `target` (one of `LORA_TARGETS`), module `<target>_proj`: its
  adapters (`_adapted`) and quantized base (`_quantized`) as the config says."""
  return Linear(
    eqn,
    kernel_shape,
    kernel_axes,
    bias_axes,
    dtype=jnp.dtype(cfg.dtype),
    param_dtype=jnp.dtype(cfg.param_dtype),
    lora=_adapted(cfg, target),
    quantized=_quantized(cfg, target),
    name=f"{target}_proj",
  )


class Linear(nn.Module):
  """`y = einsum(eqn, x, kernel) (+ bias)` with logically named kernel axes; with `lora`, plus
  `scale * B (A x)` (`lora.adapter_delta`); `quantized`: the kernel is stored quantized, int8
  or 'nf4' codes times a scale (`kernel_scale`; for 'nf4' uint8 fractions of a float32
  `kernel_scale_max` per output channel), dequantized here (`lora.dequantize_kernel`)."""

  eqn: str
  kernel_shape: tuple[int, ...]
  kernel_axes: tuple[str, ...]
  bias_axes: tuple[str, ...] | None = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  lora: LoraConfig | None = None
  """Adapters on this projection (None: none)."""
  quantized: str = ""
  """How the kernel is stored: '' (in `param_dtype`), 'int8' (a float32 scale per output
  channel) or 'nf4' (packed 4-bit codes, a scale per block quantized again): `lora` explains
  both."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if self.quantized:
      scale_shape, scale_axes = lora.scale_layout(
        self.eqn, self.kernel_shape, self.kernel_axes, self.quantized
      )
      init, scale_init, max_init, dtype = lora.quantized_init(self.quantized, _INIT_STD, self.eqn)
      stored = lora.stored_shape(self.eqn, self.kernel_shape, self.quantized)
      q = _param(self, "kernel", stored, self.kernel_axes, init, dtype)
      scale_dtype = jnp.uint8 if self.quantized == "nf4" else jnp.float32
      scale = _param(self, lora.SCALE, scale_shape, scale_axes, scale_init, scale_dtype)
      top = None
      if self.quantized == "nf4":
        top_shape, top_axes = lora.max_layout(self.eqn, self.kernel_shape, self.kernel_axes)
        top = _param(self, lora.SCALE_MAX, top_shape, top_axes, max_init, jnp.float32)
      kernel = lora.dequantize_kernel(q, scale, top)
    else:
      kernel = _param(
        self,
        "kernel",
        self.kernel_shape,
        self.kernel_axes,
        nn.initializers.normal(_INIT_STD),
        self.param_dtype,
      )
    y = jnp.einsum(self.eqn, x.astype(self.dtype), kernel.astype(self.dtype))
    if self.lora is not None:
      y = y + lora.adapter_delta(self, self.lora, self.eqn, x, self.kernel_shape, self.kernel_axes)
    if self.bias_axes is not None:
      bias_shape = self.kernel_shape[-len(self.bias_axes) :]
      bias = _param(
        self, "bias", bias_shape, self.bias_axes, nn.initializers.zeros, self.param_dtype
      )
      y = y + bias.astype(self.dtype)
    return y


class RMSNorm(nn.Module):
  """`x / rms(x) * scale`, normalised in float32 as Hugging Face does."""

  eps: float
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_btd: jax.Array) -> jax.Array:
    scale_d = _param(
      self, "scale", (x_btd.shape[-1],), ("norm",), nn.initializers.ones, self.param_dtype
    )
    x32 = x_btd.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (scale_d.astype(jnp.float32) * x32).astype(self.dtype)


def rope_inverse_frequencies(
  head_dim: int,
  theta: float,
  scaling: RopeScaling | None = None,
  *,
  max_positions=None,
  positions_bt: jax.Array | None = None,
) -> jax.Array:
  """Float32 inverse frequencies `[n / 2]` of the rotary embedding, with `scaling` applied.

  'dynamic' scaling depends on the batch's largest position (`positions_bt`) and on the
  model's `max_positions`; the other kinds depend on neither.
  """
  n = head_dim
  exponents = jnp.arange(0, n, 2, dtype=jnp.float32) / n
  if scaling is None:
    return 1.0 / (theta**exponents)
  if scaling.type == "linear":
    return 1.0 / (theta**exponents) / scaling.factor
  if scaling.type == "dynamic":
    length = jnp.maximum(jnp.max(positions_bt) + 1, max_positions).astype(jnp.float32)
    ratio = scaling.factor * length / max_positions - (scaling.factor - 1)
    return 1.0 / ((theta * ratio ** (n / (n - 2))) ** exponents)
  # 'llama3': wavelengths longer than the original context / low_freq_factor are divided by
  # `factor`, those shorter than it / high_freq_factor kept, and the band between blended.
  inv_freq = 1.0 / (theta**exponents)
  old = scaling.original_max_position_embeddings
  low, high = scaling.low_freq_factor, scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old / low, inv_freq / scaling.factor, inv_freq)
  smooth = (old / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= old / high) & (wavelen <= old / low)
  return jnp.where(medium, blended, scaled)


def rotary(x_btxn: jax.Array, positions_bt: jax.Array, inv_freq_m: jax.Array) -> jax.Array:
  """Rotary embedding in the 'rotate half' convention of Llama: pairs (i, i + n/2)."""
  angles_bt1m = (positions_bt.astype(jnp.float32)[..., None] * inv_freq_m)[:, :, None, :]
  cos, sin = jnp.cos(angles_bt1m), jnp.sin(angles_bt1m)
  x1, x2 = jnp.split(x_btxn.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_btxn.dtype)


def _write_cache(
  cache_lbskn: jax.Array, layer: jax.Array, new_btkn: jax.Array, index_b: jax.Array
) -> jax.Array:
  """Writes each row's `t` new entries into layer `layer` at the row's own offset `index_b[row]`.

  The whole cache `[l, b, s, k, n]` is the layer scan's carry, so this is one scatter of the new
  entries into the carried buffer, in place; carried as the scan's xs/ys instead, every layer's
  slice was copied out and back (and the stacked ys copied again) at every decode step."""
  b, t = new_btkn.shape[:2]
  rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  slots_bt = index_b[:, None] + jnp.arange(t)[None, :]
  return cache_lbskn.at[layer, rows_bt, slots_bt].set(
    new_btkn.astype(cache_lbskn.dtype), indices_are_sorted=True, unique_indices=True
  )


# ---------------------------------------------------------------------------------------------
# Paged KV cache. Letters: D data replicas (each owns its own pages: page ids are local to a
# replica), c rows per replica, P pages per replica, e entries per page (the page size), w pages
# per row (the width of its page table).

PAGED_KERNELS = ("gather", "pallas_gpu", "pallas_tpu")
"""Paged attention implementations: the rows' pages gathered into a contiguous `[b, w*e, k, n]`
then `attend` (any backend, any mask), or JAX's Pallas paged-attention kernels (decode only, no
sliding window; 'pallas_gpu' runs in Pallas' interpret mode off a GPU)."""


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=("k", "v", "table_bw"), meta_fields=("kernel",)
)
@dataclasses.dataclass(frozen=True)
class PagedKV:
  """A paged KV cache as the layer scan carries it.

  Row `i` of the batch lives in replica `i // c` (rows replica-major, as a batch sharded over
  'data' is laid out), and its logical index `j` is entry `j % e` of page `table_bw[i, j // e]`
  of that replica. The pools keep kv heads before pages, the layout of JAX's Pallas kernels.
  """

  k: jax.Array
  """[D, l, k, P, e, n] keys."""
  v: jax.Array
  """[D, l, k, P, e, n] values."""
  table_bw: jax.Array
  """[b, w] int32 page ids (local to the row's replica)."""
  kernel: str = "gather"
  """One of `PAGED_KERNELS`."""


def init_paged_cache(config: ModelConfig, replicas: int, pages: int, page_size: int) -> Cache:
  """Zeroed page pools `{'k', 'v'}: [D, l, k, P, e, n]` in the compute dtype (replicas first,
  so that the per-replica scatters and gathers, vmapped over them, need no transpose)."""
  shape = (replicas, config.num_layers, config.num_kv_heads, pages, page_size, config.head_dim)
  return {name: jnp.zeros(shape, jnp.dtype(config.dtype)) for name in "kv"}


def _by_replica(x: jax.Array, replicas: int) -> jax.Array:
  """`[b, ...]` as `[D, b / D, ...]` (rows are replica-major)."""
  return x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])


def write_pages(
  pool_DlkPen: jax.Array,
  layer: jax.Array,
  new_btkn: jax.Array,
  table_bw: jax.Array,
  index_b: jax.Array,
) -> jax.Array:
  """Writes each row's `t` new entries, logical indices `index_b[row] + [0, t)`, into its pages
  of layer `layer`.

  One scatter per replica, vmapped over the replica axis so that a pool sharded over 'data'
  is updated where it lives. Page ids repeat only for page 0, the reserved page inactive rows
  write to, so any order of the writes gives the same pages to every live row."""
  replicas, e = pool_DlkPen.shape[0], pool_DlkPen.shape[4]
  t = new_btkn.shape[1]
  index_bt = index_b[:, None] + jnp.arange(t)[None, :]
  page_bt = jnp.take_along_axis(table_bw, index_bt // e, axis=1)

  def one(pool_lkPen, new_ctkn, page_ct, entry_ct):
    return pool_lkPen.at[layer, :, page_ct, entry_ct].set(new_ctkn.astype(pool_lkPen.dtype))

  return jax.vmap(one)(
    pool_DlkPen,
    _by_replica(new_btkn, replicas),
    _by_replica(page_bt, replicas),
    _by_replica(index_bt % e, replicas),
  )


def _row_pages(pool_DlkPen: jax.Array, layer: jax.Array, table_bw: jax.Array) -> jax.Array:
  """`[b, w, k, e, n]`: every row's pages of layer `layer` in the pool's own layout (vmapped
  over the replicas, like `write_pages`)."""
  replicas, _, k, _, e, n = pool_DlkPen.shape
  b, w = table_bw.shape
  one = lambda pool_lkPen, table_cw: pool_lkPen[layer, :, table_cw]  # [c, w, k, e, n]
  return jax.vmap(one)(pool_DlkPen, _by_replica(table_bw, replicas)).reshape(b, w, k, e, n)


def gather_pages(pool_DlkPen: jax.Array, layer: jax.Array, table_bw: jax.Array) -> jax.Array:
  """`[b, w*e, k, n]`: every row's pages of layer `layer` in logical order."""
  rows_bwken = _row_pages(pool_DlkPen, layer, table_bw)
  b, w, k, e, n = rows_bwken.shape
  return rows_bwken.swapaxes(2, 3).reshape(b, w * e, k, n)


def decode_attention_over_pages(
  config: ModelConfig, q_b1hn, cache: PagedKV, layer, mask: Mask
) -> jax.Array:
  """One query per row over its pages of layer `layer`, `[b, 1, h, n]`, as products and sums in
  the gathered pages' own layout `[b, w, k, e, n]` (CPU decode, `paged_attend`).

  XLA's attention transposes the gathered keys and values into its `[b, k, n, s]` layout and
  runs `b * k` matmuls of `h / k` query rows, which on a CPU took 40% of a 16M-parameter
  model's decode step at batch 64; here the products and sums read the pages in their own
  layout. (jax 0.10.2's CPU backend runs them as YNNPACK dots of the gathered pages, copied
  out; einsums over other layouts ran no faster: docs/benchmarks.md.) The same fp32 softmax as
  `attention.einsum_attention`."""
  _, _, k, _, e, n = cache.k.shape
  b, w = cache.table_bw.shape
  g = q_b1hn.shape[2] // k
  dtype = jnp.dtype(config.dtype)
  q_bkgn = q_b1hn.reshape(b, k, g, n).astype(dtype)
  keys_bwken, values_bwken = (
    _row_pages(pool, layer, cache.table_bw).astype(dtype) for pool in (cache.k, cache.v)
  )
  scores_bwkge = jnp.sum(
    q_bkgn[:, None, :, :, None, :] * keys_bwken[:, :, :, None, :, :], axis=-1, dtype=jnp.float32
  ) * (n**-0.5)
  mask_bwe = mask.allowed().reshape(b, w, e)
  scores_bwkge = jnp.where(mask_bwe[:, :, None, None, :], scores_bwkge, MASKED)
  probs_bwkge = jax.nn.softmax(scores_bwkge, axis=(1, 4)).astype(dtype)
  out_bkgn = jnp.sum(
    probs_bwkge[..., None] * values_bwken[:, :, :, None, :, :], axis=(1, 4), dtype=jnp.float32
  )
  return out_bkgn.astype(dtype).reshape(b, 1, k * g, n)


def _kernel_blocks(pages_per_row: int, most: int) -> int:
  """The largest divisor of `pages_per_row` that is at most `most` (the kernels' block sizes
  must divide the pages of a row)."""
  return max(d for d in range(1, min(most, pages_per_row) + 1) if pages_per_row % d == 0)


def gpu_kernel_blocks(pages_per_row: int) -> tuple[int, int]:
  """`(k_splits, pages_per_compute_block)` of the Pallas GPU kernel for rows of this many pages.

  Triton takes only arrays of a power-of-two size, so the pages one step loads are the largest
  power of two dividing the row's pages (at most 8); the key splits (at most 16) divide the rest.
  A width of 36 pages: 9 splits of 4 pages (12 splits of 3 did not compile on an H200).
  """
  per_block = min(pages_per_row & -pages_per_row, 8)
  return _kernel_blocks(pages_per_row // per_block, 16), per_block


def _pallas_paged(kernel: str, q_bhn, k_kPen, v_kPen, table_bw, lengths_b) -> jax.Array:
  """One replica's decode attention through a Pallas paged-attention kernel, `[b, h, n]`."""
  w = table_bw.shape[1]
  if kernel == "pallas_gpu":
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    splits, per_block = gpu_kernel_blocks(w)
    return gpu_paged.paged_attention(
      q_bhn,
      k_kPen,
      v_kPen,
      table_bw,
      lengths_b,
      block_h=16,
      pages_per_compute_block=per_block,
      k_splits=splits,
      interpret=jax.default_backend() != "gpu",
    )
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged

  return tpu_paged(
    q_bhn, k_kPen, v_kPen, lengths_b, table_bw, pages_per_compute_block=_kernel_blocks(w, 8)
  )


def pallas_paged_attention(kernel: str, q_bthn, k_DkPen, v_DkPen, table_bw, lengths_b) -> jax.Array:
  """Decode attention (`t = 1`) of each row over its first `lengths_b` logical entries through a
  Pallas kernel, `[b, 1, h, n]`.

  The kernels do not scale the scores: the queries are scaled by `n ** -0.5` here. Under a mesh
  in context (`jax.sharding.use_abstract_mesh`) the kernel runs per shard (`jax.shard_map`):
  replicas over 'data', kv heads (and their query heads) over 'tensor', so no pool leaves its
  devices."""
  b, t, h, n = q_bthn.shape
  if t != 1:
    raise ValueError(f"the Pallas paged kernels take one query per row (decode), got {t}")
  replicas, k = k_DkPen.shape[:2]
  q_Dchn = _by_replica((q_bthn[:, 0].astype(jnp.float32) * n**-0.5).astype(q_bthn.dtype), replicas)

  def per_shard(q_Dchn, k_DkPen, v_DkPen, table_Dcw, lengths_Dc):
    outs = [
      _pallas_paged(kernel, q_Dchn[d], k_DkPen[d], v_DkPen[d], table_Dcw[d], lengths_Dc[d])
      for d in range(q_Dchn.shape[0])
    ]
    return jnp.stack(outs)

  args = (
    q_Dchn,
    k_DkPen,
    v_DkPen,
    _by_replica(table_bw, replicas),
    _by_replica(lengths_b, replicas),
  )
  mesh = jax.sharding.get_abstract_mesh()
  sizes = {} if mesh.empty else dict(mesh.shape)
  if sizes and math.prod(sizes.values()) > 1:
    P = jax.sharding.PartitionSpec
    data = "data" if replicas % sizes.get("data", 1) == 0 and "data" in sizes else None
    tensor = sizes.get("tensor", 1)
    tensor = "tensor" if "tensor" in sizes and k % tensor == 0 and h % tensor == 0 else None
    rows = P(data)
    per_shard = jax.shard_map(
      per_shard,
      mesh=mesh,
      in_specs=(P(data, None, tensor), P(data, tensor), P(data, tensor), rows, rows),
      out_specs=P(data, None, tensor),
      check_vma=False,
    )
  out_Dchn = per_shard(*args)
  return out_Dchn.reshape(b, 1, h, n).astype(q_bthn.dtype)


def paged_attend(
  config: ModelConfig, q_bthn, cache: PagedKV, layer, mask: Mask, index_b
) -> jax.Array:
  """Attention of the new queries over each row's pages of layer `layer`, `[b, t, h, n]`.

  'gather' honours `mask` (keys are the `w*e` logical indices of each row); the kernels see the keys
  `[0, index_b + t)` of each row, the mask of a decode step without a sliding window."""
  if cache.kernel == "gather":
    if q_bthn.shape[1] == 1 and config.attention == "auto" and jax.default_backend() == "cpu":
      return decode_attention_over_pages(config, q_bthn, cache, layer, mask)
    keys_bskn = gather_pages(cache.k, layer, cache.table_bw)
    values_bskn = gather_pages(cache.v, layer, cache.table_bw)
    return attend(config, q_bthn, keys_bskn, values_bskn, mask)
  if config.sliding_window is not None:
    raise ValueError("the Pallas paged kernels have no sliding window: use 'gather'")
  k_DkPen, v_DkPen = (
    jax.lax.dynamic_index_in_dim(c, layer, axis=1, keepdims=False) for c in (cache.k, cache.v)
  )
  lengths_b = (index_b + q_bthn.shape[1]).astype(jnp.int32)
  return pallas_paged_attention(cache.kernel, q_bthn, k_DkPen, v_DkPen, cache.table_bw, lengths_b)


class Attention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_btd, positions_bt, mask: Mask, cache, layer, cache_index_b):
    cfg = self.config
    d, h, k, n = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bias = lambda axes: axes if cfg.qkv_bias else None
    q_bthn = _projection(
      cfg,
      "q",
      "btd,dhn->bthn",
      (d, h, n),
      ("embed", "heads", "head_dim"),
      bias(("heads", "head_dim")),
    )(x_btd)
    k_btkn = _projection(
      cfg,
      "k",
      "btd,dkn->btkn",
      (d, k, n),
      ("embed", "kv_heads", "head_dim"),
      bias(("kv_heads", "head_dim")),
    )(x_btd)
    v_btkn = _projection(
      cfg,
      "v",
      "btd,dkn->btkn",
      (d, k, n),
      ("embed", "kv_heads", "head_dim"),
      bias(("kv_heads", "head_dim")),
    )(x_btd)
    if cfg.qk_norm:
      norm = functools.partial(
        RMSNorm, cfg.rms_norm_eps, jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
      )
      q_bthn = norm(name="q_norm")(q_bthn)
      k_btkn = norm(name="k_norm")(k_btkn)
    inv_freq_m = rope_inverse_frequencies(
      n,
      cfg.rope_theta,
      cfg.rope_scaling,
      max_positions=cfg.max_position_embeddings,
      positions_bt=positions_bt,
    )
    q_bthn = rotary(q_bthn, positions_bt, inv_freq_m)
    k_btkn = rotary(k_btkn, positions_bt, inv_freq_m)

    if isinstance(cache, PagedKV):
      new_cache = dataclasses.replace(
        cache,
        k=write_pages(cache.k, layer, k_btkn, cache.table_bw, cache_index_b),
        v=write_pages(cache.v, layer, v_btkn, cache.table_bw, cache_index_b),
      )
      out_bthn = paged_attend(cfg, q_bthn, new_cache, layer, mask, cache_index_b)
    else:
      if cache is None:
        keys_bskn, values_bskn, new_cache = k_btkn, v_btkn, None
      else:
        new_cache = {
          "k": _write_cache(cache["k"], layer, k_btkn, cache_index_b),
          "v": _write_cache(cache["v"], layer, v_btkn, cache_index_b),
        }
        keys_bskn, values_bskn = (
          jax.lax.dynamic_index_in_dim(new_cache[name], layer, keepdims=False) for name in "kv"
        )
      out_bthn = attend(cfg, q_bthn, keys_bskn, values_bskn, mask)

    out_bthn = checkpoint_name(out_bthn, "attention_out")
    out_btd = _projection(
      cfg,
      "o",
      "bthn,hnd->btd",
      (h, n, d),
      ("heads", "head_dim", "embed"),
      ("embed",) if cfg.o_bias else None,
    )(out_bthn)
    return out_btd, new_cache


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_btd):
    cfg = self.config
    d, f = cfg.hidden_size, cfg.intermediate_size
    gate_btf = _projection(
      cfg,
      "gate",
      "btd,df->btf",
      (d, f),
      ("embed", "mlp"),
    )(x_btd)
    up_btf = _projection(
      cfg,
      "up",
      "btd,df->btf",
      (d, f),
      ("embed", "mlp"),
    )(x_btd)
    return _projection(
      cfg,
      "down",
      "btf,fd->btd",
      (f, d),
      ("mlp", "embed"),
    )(jax.nn.silu(gate_btf) * up_btf)


LayersFn = Callable[[jax.Array, jax.Array, Mask], jax.Array]
"""`(x_btd, positions_bt, mask) -> x_btd`: what runs in place of the layer stack."""

_LAYERS_REPLACED: contextvars.ContextVar[LayersFn | None] = contextvars.ContextVar(
  "layers_replaced", default=None
)


ACTIVATION_AXES = ("batch", "length", "activation_embed")
"""Logical axes of the residual stream `[b, t, d]`: sharded over the batch only."""


def constrain_activations(x_btd: jax.Array) -> jax.Array:
  """Pins the residual stream's layout to `ACTIVATION_AXES` under the caller's
  `nn.logical_axis_rules` and mesh context (a no-op without one). Without it XLA's sharding
  propagation may follow the FSDP-sharded weights and replicate the batch.

  Not inside a pipeline stage (`layers_replaced`): there the stage runs in a branch of the
  schedule's `lax.switch`, where XLA 0.10.2's partitioner fails on sharding constraints
  (a failed check in `spmd_partitioner_util.cc`, or an "inconsistent conditional sharding"
  from the verifier, on a stage x fsdp x tensor mesh), so the layout is left to propagation."""
  if _LAYERS_REPLACED.get() is not None:
    return x_btd
  return nn.with_logical_constraint(x_btd, ACTIVATION_AXES)


class Block(nn.Module):
  """Pre-norm attention and SwiGLU MLP with residuals; one layer of the scanned stack."""

  config: ModelConfig

  @nn.compact
  def __call__(self, carry, positions_bt, mask: Mask, layer, cache_index_b):
    """`carry`: the residual stream and the whole KV cache `[l, ...]` (or None), which layer
    `layer` updates in place."""
    x_btd, cache = carry
    cfg = self.config
    norm = functools.partial(
      RMSNorm, cfg.rms_norm_eps, jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    )
    attn_btd, new_cache = Attention(cfg, name="attn")(
      norm(name="attn_norm")(x_btd), positions_bt, mask, cache, layer, cache_index_b
    )
    x_btd = x_btd + attn_btd
    x_btd = x_btd + MLP(cfg, name="mlp")(norm(name="mlp_norm")(x_btd))
    return (constrain_activations(x_btd), new_cache), None


def remat_policy(name: str):
  """The `jax.checkpoint` policy called `name` (see `config.REMAT_POLICIES`)."""
  policies = jax.checkpoint_policies
  return {
    "full": policies.nothing_saveable,
    "dots_saveable": policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
    "save_attention_out": policies.save_only_these_names("attention_out"),
  }[name]


def remat_block(name: str):
  """`Block`, rematerialised under policy `name` ('none': as is), for the layer scan."""
  if name == "none":
    return Block
  return nn.remat(Block, policy=remat_policy(name), prevent_cse=False)


def scanned_blocks(config: ModelConfig, num_layers: int) -> type[nn.Module]:
  """`num_layers` blocks as one scanned module: parameters stacked `[num_layers, ...]` under the
  logical axis 'layers'. Called with `((x_btd, cache), positions_bt, mask, layers_l,
  cache_index_b)`."""
  return nn.scan(
    remat_block(config.remat),
    variable_axes={"params": 0},
    split_rngs={"params": True},
    in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast),
    length=num_layers,
    metadata_params={nn.PARTITION_NAME: "layers"},
  )


def apply_layers(
  config: ModelConfig, layer_params: Params, x_btd, positions_bt, mask: Mask
) -> jax.Array:
  """The residual stream after the consecutive layers whose stacked parameters are
  `layer_params` (`params['layers']`, or a pipeline stage's block of it), without a cache."""
  num_layers = jax.tree.leaves(layer_params)[0].shape[0]
  (x_btd, _), _ = scanned_blocks(config, num_layers)(config).apply(
    {"params": layer_params}, (x_btd, None), positions_bt, mask, jnp.arange(num_layers), None
  )
  return x_btd


@contextlib.contextmanager
def layers_replaced(fn: LayersFn) -> Iterator[None]:
  """Inside the block, every `Transformer` traced runs `fn` on its embedded tokens in place of
  its layer stack, whose parameters it then never reads (full forwards only, no cache).

  This is how a pipeline stage runs any loss function with only its own share of the layers
  (`rlhfjax.training.pipeline`): the loss, its masks and positions stay the loss's own.
  """
  token = _LAYERS_REPLACED.set(fn)
  try:
    yield
  finally:
    _LAYERS_REPLACED.reset(token)


class Transformer(nn.Module):
  """Token embedding, `num_layers` scanned blocks, final norm and an LM or value head.

  Returns `(out, new_cache)`: float32 logits `[b, t, v]` for the 'lm' head or float32 values
  `[b, t]` for the 'value' head, and the updated cache (None without one).
  """

  config: ModelConfig
  head: HeadKind = "lm"
  hidden_only: bool = False
  """Return the final-normed hidden states `[b, t, d]` (compute dtype) instead of the head's
  output; the head's parameters are then not touched (see `forward_hidden`)."""

  @nn.compact
  def __call__(self, tokens_bt, positions_bt, mask: Mask, cache=None, cache_index_b=None):
    cfg = self.config
    embedding_vd = _param(
      self,
      "embedding",
      (cfg.vocab_size, cfg.hidden_size),
      ("vocab", "embed"),
      nn.initializers.normal(_INIT_STD),
      jnp.dtype(cfg.param_dtype),
    )
    x_btd = jnp.take(embedding_vd, tokens_bt, axis=0).astype(jnp.dtype(cfg.dtype))
    if _LAYERS_REPLACED.get() is None:
      # The lookup comes out split like the table's width (fsdp x context). XLA moves one
      # mesh axis from a dimension to another as an all-to-all, but two at once it does by
      # gathering the whole lookup (its "involuntary full rematerialization", under context
      # parallelism): so first 'context' from the width to the tokens, then 'fsdp' to the rows.
      x_btd = nn.with_logical_constraint(x_btd, (None, "length", "embed_lookup"))
    x_btd = constrain_activations(x_btd)

    replaced = _LAYERS_REPLACED.get()
    if replaced is not None:
      if cache is not None:
        raise ValueError("a replaced layer stack runs full forwards only, without a cache")
      x_btd, new_cache = replaced(x_btd, positions_bt, mask), None
    else:
      stack = scanned_blocks(cfg, cfg.num_layers)(cfg, name="layers")
      (x_btd, new_cache), _ = stack(
        (x_btd, cache), positions_bt, mask, jnp.arange(cfg.num_layers), cache_index_b
      )
    x_btd = RMSNorm(
      cfg.rms_norm_eps, jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype), name="final_norm"
    )(x_btd)
    if self.hidden_only:
      return x_btd, new_cache

    if self.head == "value":
      w_d = _param(
        self,
        "value_head",
        (cfg.hidden_size,),
        ("embed",),
        nn.initializers.normal(_INIT_STD),
        jnp.dtype(cfg.param_dtype),
      )
      out = jnp.einsum("btd,d->bt", x_btd, w_d.astype(jnp.dtype(cfg.dtype)))
    elif cfg.tie_embeddings:
      out = jnp.einsum("btd,vd->btv", x_btd, embedding_vd.astype(jnp.dtype(cfg.dtype)))
    else:
      out = Linear(
        "btd,dv->btv",
        (cfg.hidden_size, cfg.vocab_size),
        ("embed", "vocab"),
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        lora=_adapted(cfg, "lm_head") if self.head == "lm" else None,
        quantized=_quantized(cfg, "lm_head") if self.head == "lm" else "",
        name="lm_head",
      )(x_btd)
    return out.astype(jnp.float32), new_cache


# ---------------------------------------------------------------------------------------------
# Masks and positions.


def positions_from_mask(attention_mask_bt: jax.Array) -> jax.Array:
  """Position ids that start at 0 on each row's first real token (left padding safe)."""
  mask = attention_mask_bt.astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


def last_token_index(attention_mask_bt: jax.Array) -> jax.Array:
  """Index of each row's last real token (works for left and right padding)."""
  t = attention_mask_bt.shape[-1]
  return t - 1 - jnp.argmax(jnp.flip(attention_mask_bt.astype(bool), axis=-1), axis=-1)


# ---------------------------------------------------------------------------------------------
# Functional entry points.


def _dummy_inputs():
  tokens = jnp.zeros((1, 1), jnp.int32)
  return tokens, tokens, Mask.packed(jnp.ones((1, 1), jnp.int32), tokens)


def init_params(
  config: ModelConfig,
  head: HeadKind = "lm",
  rng: jax.Array | None = None,
  *,
  shardings: Any | None = None,
):
  """Randomly initialised parameters (plain arrays, no partitioning boxes).

  With `shardings` (a tree of `jax.sharding.Sharding` matching the parameters), each array is
  created directly in its shards by a jitted init: no device ever holds the whole model.
  """
  rng = jax.random.key(0) if rng is None else rng
  init = functools.partial(_init, config, head)
  if shardings is None:
    return init(rng)
  cpu = jax.default_backend() == "cpu"
  options = _COMPILED_FOR_COMPILE_TIME if cpu else None
  return programs.jit(init, "init_params", out_shardings=shardings, compiler_options=options)(rng)


def init_adapters(config: ModelConfig, head: HeadKind, rng: jax.Array, *, shardings: Any) -> dict:
  """The random adapters of `config`'s model alone (`lora.adapters` of `init_params`), in their
  shards of `shardings` (the whole model's): the program computes nothing else."""
  options = _COMPILED_FOR_COMPILE_TIME if jax.default_backend() == "cpu" else None
  return programs.jit(
    functools.partial(_init_adapters, config, head),
    "init_adapters",
    out_shardings=lora.adapters(shardings),
    compiler_options=options,
  )(rng)


_COMPILED_FOR_COMPILE_TIME = {
  "xla_backend_optimization_level": 0,
  "xla_cpu_use_fusion_emitters": False,
}
"""XLA's CPU code generation for a program that runs once per role (the random initialization,
a random-bits hash per element of every array): LLVM at -O0 and the loop emitters. With XLA's
defaults a 4-layer model's init compiles in 2.2 s and runs in 0.05 s; with these in 0.5 s and
0.27 s (`localcheck.bench_config`'s actor on 8 devices)."""


def _boxed(config: ModelConfig, head: HeadKind, rng: jax.Array):
  """The parameters with their partitioning boxes (logical axis names)."""
  return Transformer(config, head).init(rng, *_dummy_inputs())["params"]


def _init(config: ModelConfig, head: HeadKind, rng: jax.Array):
  if config.lora is None:
    return nn.unbox(_boxed(config, head, rng))
  # The base weights of a seed are the model's without adapters (flax draws a module's
  # parameters in turn, so adapters beside a kernel would change it), the adapters another
  # draw: an adapted model and its base start from the same weights.
  base = nn.unbox(_boxed(config.replace(lora=None), head, rng))
  adapted = nn.unbox(_boxed(config, head, jax.random.fold_in(rng, 1)))
  return lora.attach(base, lora.adapters(adapted))


def _init_adapters(config: ModelConfig, head: HeadKind, rng: jax.Array):
  return lora.adapters(_init(config, head, rng))


@functools.cache
def abstract_params(config: ModelConfig, head: HeadKind = "lm"):
  """`jax.ShapeDtypeStruct` tree of the parameters, with no allocation (traced once per model
  and head in a process: do not change the tree you get)."""
  return jax.eval_shape(functools.partial(_init, config, head), jax.random.key(0))


@functools.cache
def logical_axes(config: ModelConfig, head: HeadKind = "lm"):
  """Tree matching the parameters whose leaves are tuples of logical axis names (traced once
  per model and head in a process: do not change the tree you get)."""
  boxed = jax.eval_shape(functools.partial(_boxed, config, head), jax.random.key(0))
  specs = nn.get_partition_spec(boxed)
  return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def apply(
  config: ModelConfig,
  params: Params,
  tokens_bt,
  positions_bt,
  mask: Mask,
  *,
  head: HeadKind = "lm",
  cache: Cache | None = None,
  cache_index_b=None,
):
  """`Transformer.apply` with explicit positions, mask and optional KV cache."""
  return Transformer(config, head).apply(
    {"params": params}, tokens_bt, positions_bt, mask, cache, cache_index_b
  )


def forward_hidden(
  config: ModelConfig, params: Params, tokens_bt, attention_mask_bt=None, head: HeadKind = "lm"
) -> jax.Array:
  """Final-normed hidden states `[b, t, d]` in the compute dtype: the input of the head."""
  if attention_mask_bt is None:
    attention_mask_bt = jnp.ones(tokens_bt.shape, jnp.int32)
  positions_bt = positions_from_mask(attention_mask_bt)
  mask = Mask.packed(attention_mask_bt, positions_bt, config.sliding_window)
  x_btd, _ = Transformer(config, head, hidden_only=True).apply(
    {"params": params}, tokens_bt, positions_bt, mask
  )
  return x_btd


def forward_packed(
  config: ModelConfig,
  params: Params,
  tokens_bt: jax.Array,
  positions_bt: jax.Array,
  segments_bt: jax.Array,
  *,
  head: HeadKind = "lm",
  hidden_only: bool = False,
) -> jax.Array:
  """The head's output (or the final hidden states) of packed rows: segments attend only
  within themselves, positions restart at each segment's start (`attention.Mask`)."""
  mask = Mask.packed(segments_bt, positions_bt, config.sliding_window)
  out, _ = Transformer(config, head, hidden_only=hidden_only).apply(
    {"params": params}, tokens_bt, positions_bt, mask
  )
  return out


def lm_head_vd(config: ModelConfig, params: Params) -> jax.Array:
  """The LM head as a `[v, d]` matrix (the embedding itself when tied)."""
  if config.tie_embeddings:
    return params["embedding"]
  head = params["lm_head"]
  if "lora_a" in head:  # an adapted head, merged: `W + scale A B`
    return lora.merged({"lm_head": head}, config.lora)["lm_head"]["kernel"].T
  return lora.dequantized({"lm_head": head})["lm_head"]["kernel"].T  # int8: dequantized


def init_cache(config: ModelConfig, batch: int, length: int) -> Cache:
  """Zeroed KV cache `[l, b, s, k, n]` in the compute dtype."""
  shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
  return {
    "k": jnp.zeros(shape, jnp.dtype(config.dtype)),
    "v": jnp.zeros(shape, jnp.dtype(config.dtype)),
  }


def _full_forward(config, params, tokens_bt, attention_mask_bt, head):
  if attention_mask_bt is None:
    attention_mask_bt = jnp.ones(tokens_bt.shape, jnp.int32)
  positions_bt = positions_from_mask(attention_mask_bt)
  mask = Mask.packed(attention_mask_bt, positions_bt, config.sliding_window)
  out, _ = apply(config, params, tokens_bt, positions_bt, mask, head=head)
  return out


_jitted_forward = jax.jit(_full_forward, static_argnums=(0, 4))


def _forward(config, params, tokens, attention_mask, head):
  # `jax.jit` caches a trace by its arguments alone, so under `layers_replaced` (whose `fn` is
  # no argument) the forward is traced in place instead of through the cache.
  if _LAYERS_REPLACED.get() is not None:
    return _full_forward(config, params, tokens, attention_mask, head)
  return _jitted_forward(config, params, tokens, attention_mask, head)


def forward_logits(
  config: ModelConfig, params: Params, tokens: jax.Array, attention_mask: jax.Array | None = None
) -> jax.Array:
  """Float32 logits `[b, t, vocab]` for int32 tokens `[b, t]` (compiled once per shape).

  `attention_mask` (`[b, t]`, 1 = real token) handles padded batches, left padding included:
  positions restart at 0 on each row's first real token and pads are never attended to.
  """
  return _forward(config, params, tokens, attention_mask, "lm")


def forward_values(
  config: ModelConfig, params: Params, tokens: jax.Array, attention_mask: jax.Array | None = None
) -> jax.Array:
  """Float32 per-token values `[b, t]` from a value-head model (critic, reward), compiled once
  per shape."""
  return _forward(config, params, tokens, attention_mask, "value")


def sequence_reward(values_bt: jax.Array, attention_mask_bt: jax.Array) -> jax.Array:
  """A sequence's reward: the value at its last non-pad token."""
  idx_b = last_token_index(attention_mask_bt)
  return jnp.take_along_axis(values_bt, idx_b[:, None], axis=-1)[:, 0]
