"""Low-rank adapters (LoRA) on the model's projections, and the parameter trees they make.

A projection `y = einsum(eqn, x, W)` with adapters computes `y + (alpha / r) B (A x)`: A holds
the kernel's contracted (input) dimensions and the rank, B the rank and the kernel's output
dimensions, so A and B shard like the kernel's own input and output axes and the rank is
replicated. A starts uniform in +-1/sqrt(fan_in) (PEFT's Kaiming-uniform), B at zero: the
adapted model starts as its base. Both are float32 whatever the base's dtype.

Why by hand and not `qwix` (Google's JAX quantization and LoRA library, which Tunix uses): qwix
finds a projection's weight by the identity of the einsum operand, which the model's mixed
precision breaks (the kernel is cast to the compute dtype first), and gives adapters the base
weight's dtype (bf16 adapters over a bf16 checkpoint, where they must be float32). The adapter
is two einsums in the one `Linear` every projection goes through.

A parameter tree with adapters has `lora_a` / `lora_b` leaves beside the adapted kernels;
`trainable` says which leaves train (the adapters, and a value head, which no base has), `base`
drops the adapters and `merged` folds them into the kernels (the weights a rollout or an export
without adapters runs).

QLoRA's frozen base (`ModelConfig.quantized`), in one of two forms (`ModelConfig.quantization`):

- 'int8': an adapted kernel stored as int8 `q` beside a float32 `kernel_scale` per output
  channel (the kernel's dimensions the einsum does not contract; size 1 on the contracted
  ones), `W ~ q * scale` with `scale = max |W| / 127` over the contracted dimensions (symmetric
  absmax, round to nearest: each weight within `scale / 2` of its float value).
- 'nf4': QLoRA's 4-bit NormalFloat (Dettmers et al., 2023): the weights of one output channel
  in blocks of 64 (`config.model.nf4_block`) along the last contracted dimension (fewer where
  that dimension has fewer: the largest common divisor, at least 4), each block's absmax its
  scale, each weight the nearest of the 16 `NF4_LEVELS` times that scale, the codes two to a
  byte along that dimension (uint8, the low nibble first). The scales are quantized again
  (QLoRA's double quantization): each output channel keeps the largest of its blocks' scales
  in float32 (`kernel_scale_max`, laid out as an 'int8' scale) and each block its scale as a
  uint8 fraction of it (`kernel_scale`, round to nearest: within `max / 510`; the largest
  exact), so a weight dequantizes within half the gap between its two nearest levels times its
  block's scale, plus `max / 510`. 4 + 8 / 64 + 32 / (the channel's contracted weights) bits a
  weight: 4.133 for a contracted width of 4096, where QLoRA's (FP8 scales in blocks of 256)
  is 4.127, and 4.5 with float32 scales.

The forward dequantizes in float32 and casts to the compute dtype (`dequantize_kernel`);
`quantize_base` turns a loaded float base into this form, `dequantized` back (what a rollout
or an export receives).
"""

from __future__ import annotations

import string
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from rlhfjax.config import model as model_config
from rlhfjax.config.model import LoraConfig

ADAPTER_LEAVES = ("lora_a", "lora_b")
"""The names of the adapter parameters inside an adapted projection."""
SCALE = "kernel_scale"
"""The scale beside a quantized base kernel: float32 per output channel ('int8'), or uint8
codes per block ('nf4', fractions of `SCALE_MAX`)."""
SCALE_MAX = "kernel_scale_max"
"""An 'nf4' kernel's second-level scale: the largest block scale of each output channel."""
_SCALES = (SCALE, SCALE_MAX)
_SCALE_CODES = 255.0
_INT8_MAX = 127.0
NF4_LEVELS = (
  -1.0,
  -0.6961928009986877,
  -0.5250730514526367,
  -0.39491748809814453,
  -0.28444138169288635,
  -0.18477343022823334,
  -0.09105003625154495,
  0.0,
  0.07958029955625534,
  0.16093020141124725,
  0.24611230194568634,
  0.33791524171829224,
  0.44070982933044434,
  0.5626170039176941,
  0.7229568362236023,
  1.0,
)
"""The 16 values of QLoRA's NormalFloat4 (the paper's appendix E; bitsandbytes' `NF4`): quantiles
of a standard normal scaled to [-1, 1], with an exact 0."""
ALWAYS_TRAINED = ("value_head",)
"""Parameters that train with the adapters: a value head is new, no base holds it."""


def _einsum_parts(eqn: str) -> tuple[str, str, str]:
  lhs, rest = eqn.split(",")
  rhs, out = rest.split("->")
  return lhs, rhs, out


def adapter_delta(
  module: nn.Module,
  lora: LoraConfig,
  eqn: str,
  x: jax.Array,
  kernel_shape: tuple[int, ...],
  kernel_axes: tuple[str, ...],
) -> jax.Array:
  """`(alpha / r) B (A x)` of the projection `einsum(eqn, x, kernel)`, in `module`'s compute
  dtype, creating `lora_a` and `lora_b` (float32) in `module`."""
  lhs, rhs, out = _einsum_parts(eqn)
  rank = "r" if "r" not in eqn else sorted(set(string.ascii_letters) - set(eqn))[0]
  contracted = [i for i, c in enumerate(rhs) if c in lhs]
  produced = [i for i, c in enumerate(rhs) if c not in lhs]
  a_shape = tuple(kernel_shape[i] for i in contracted) + (lora.rank,)
  b_shape = (lora.rank,) + tuple(kernel_shape[i] for i in produced)
  a_axes = tuple(kernel_axes[i] for i in contracted) + (None,)
  b_axes = (None,) + tuple(kernel_axes[i] for i in produced)
  fan_in = tuple(range(len(a_shape) - 1))
  # Kaiming-uniform with a = sqrt(5) (PEFT's and torch.nn.Linear's): bound 1 / sqrt(fan_in).
  a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=fan_in)
  lora_a = module.param(
    "lora_a", nn.with_logical_partitioning(a_init, a_axes), a_shape, jnp.float32
  )
  lora_b = module.param(
    "lora_b", nn.with_logical_partitioning(nn.initializers.zeros, b_axes), b_shape, jnp.float32
  )
  dtype = module.dtype
  kept = "".join(c for c in lhs if c not in rhs or c in out)
  a_str = "".join(rhs[i] for i in contracted) + rank
  b_str = rank + "".join(rhs[i] for i in produced)
  z = jnp.einsum(f"{lhs},{a_str}->{kept}{rank}", x.astype(dtype), lora_a.astype(dtype))
  delta = jnp.einsum(f"{kept}{rank},{b_str}->{out}", z, lora_b.astype(dtype))
  return delta * jnp.asarray(lora.scale, dtype)


def _contracted(eqn: str) -> list[int]:
  """The kernel's dimensions the einsum contracts with the input."""
  lhs, rhs, _ = _einsum_parts(eqn)
  return [i for i, c in enumerate(rhs) if c in lhs]


def scale_layout(
  eqn: str,
  kernel_shape: tuple[int, ...],
  kernel_axes: tuple[str, ...],
  quantization: str = "int8",
) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
  """Shape and logical axes of a quantized kernel's scale. 'int8': the kernel's, 1 (unsharded)
  on the dimensions the einsum contracts; 'nf4': the kernel's, the dimension its codes pack
  along (`packed_dim`) divided into blocks (`config.model.nf4_block`)."""
  contracted = _contracted(eqn)
  if quantization == "nf4":
    last = packed_dim(eqn)
    block = model_config.nf4_block
    shape = tuple(n // block(n) if i == last else n for i, n in enumerate(kernel_shape))
    return shape, tuple(kernel_axes)
  shape = tuple(1 if i in contracted else n for i, n in enumerate(kernel_shape))
  axes = tuple(None if i in contracted else a for i, a in enumerate(kernel_axes))
  return shape, axes


def packed_dim(eqn: str) -> int:
  """The kernel dimension an 'nf4' kernel packs its codes along: its last contracted one."""
  return _contracted(eqn)[-1]


def stored_shape(eqn: str, kernel_shape: tuple[int, ...], quantization: str) -> tuple[int, ...]:
  """The shape a quantized kernel is stored in: an 'nf4' one holds two codes a byte along its
  last contracted dimension."""
  if quantization != "nf4":
    return tuple(kernel_shape)
  last = packed_dim(eqn)
  model_config.nf4_block(kernel_shape[last])  # refuses a dimension that splits into no blocks
  return tuple(n // 2 if i == last else n for i, n in enumerate(kernel_shape))


def _init_step(std: float) -> float:
  """The scale of a random int8 kernel: 4 standard deviations of the float draw over 127."""
  return 4 * std / _INT8_MAX


def quantized_init(quantization: str, std: float, eqn: str):
  """`(kernel init, scale init, scale max init, kernel dtype)` of a random quantized kernel: a
  normal draw of `std` over one scale for every channel ('int8', `_init_step(std)`: `q *
  scale` is the draw rounded) or block ('nf4', 4 std, every block's code at its channel's
  `SCALE_MAX`: each weight at its nearest level, packed along `packed_dim(eqn)`)."""
  if quantization == "nf4":
    dim, scale = packed_dim(eqn), 4 * std

    def init(key, shape, dtype=jnp.uint8):
      full = tuple(n * 2 if i == dim else n for i, n in enumerate(shape))
      w = jax.random.normal(key, full, jnp.float32) * std
      return _pack(_nf4_codes(w / scale), dim).astype(dtype)

    kernel_dtype = jnp.uint8
  else:
    scale = _init_step(std)

    def init(key, shape, dtype=jnp.int8):
      w = jax.random.normal(key, shape, jnp.float32) * std
      return jnp.clip(jnp.round(w / scale), -_INT8_MAX, _INT8_MAX).astype(dtype)

    kernel_dtype = jnp.int8

  def scale_init(key, shape, dtype=jnp.float32):
    del key
    if quantization == "nf4":  # every block at the channel's largest scale
      return jnp.full(shape, _SCALE_CODES, jnp.uint8)
    return jnp.full(shape, scale, dtype)

  def max_init(key, shape, dtype=jnp.float32):
    del key
    return jnp.full(shape, scale, dtype)

  return init, scale_init, max_init, kernel_dtype


def _nf4_codes(x: jax.Array) -> jax.Array:
  """uint8 index of the nearest `NF4_LEVELS` value to each of `x` (clipped to [-1, 1]); a
  value half-way between two levels takes the lower."""
  levels = jnp.asarray(NF4_LEVELS, jnp.float32)
  midpoints = (levels[1:] + levels[:-1]) / 2
  return jnp.searchsorted(midpoints, jnp.clip(x, -1.0, 1.0), side="left").astype(jnp.uint8)


def _pack(codes: jax.Array, dim: int) -> jax.Array:
  """Two 4-bit codes a byte along `dim`: element 2i in the low nibble, 2i + 1 in the high."""
  pairs = codes.reshape(*codes.shape[:dim], codes.shape[dim] // 2, 2, *codes.shape[dim + 1 :])
  low, high = jnp.moveaxis(pairs, dim + 1, 0)
  return (low | (high << 4)).astype(jnp.uint8)


def _unpack(packed: jax.Array, dim: int) -> jax.Array:
  """The codes `_pack` packed along `dim`."""
  pairs = jnp.stack([packed & 15, packed >> 4], axis=dim + 1)
  shape = list(packed.shape)
  shape[dim] *= 2
  return pairs.reshape(shape)


def _packed_dim(stored: tuple[int, ...], scale: tuple[int, ...]) -> int:
  """The dimension an 'nf4' kernel's codes are packed along: the one its scale divides into
  blocks (every other dimension of the scale is the kernel's)."""
  (dim,) = [i for i, (n, m) in enumerate(zip(stored, scale, strict=True)) if n != m]
  return dim


def max_layout(
  eqn: str, kernel_shape: tuple[int, ...], kernel_axes: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
  """Shape and logical axes of an 'nf4' kernel's `SCALE_MAX`: one per output channel, as an
  'int8' kernel's scale."""
  return scale_layout(eqn, kernel_shape, kernel_axes, "int8")


def quantize_kernel(
  kernel: jax.Array,
  scale_shape: tuple[int, ...],
  quantization: str = "int8",
  max_shape: tuple[int, ...] | None = None,
) -> dict[str, jax.Array]:
  """The stored leaves of a float kernel. 'int8': `kernel` int8 and `SCALE`, the float32
  absmax over the dimensions of size 1 in `scale_shape` (a zero channel gets scale 1). 'nf4':
  `kernel` packed codes, `SCALE` each block's absmax (the dimension `scale_shape` divides into
  blocks) as uint8 codes of `SCALE_MAX` (of `max_shape`, `max_layout`), the float32 largest of
  them over the dimensions of size 1 there (a zero block gets scale 0, a zero channel maximum
  1)."""
  w = kernel.astype(jnp.float32)
  if quantization == "nf4":
    dim = _packed_dim(w.shape, tuple(scale_shape))
    n, blocks = w.shape[dim], scale_shape[dim]
    split = w.reshape(*w.shape[:dim], blocks, n // blocks, *w.shape[dim + 1 :])
    amax = jnp.max(jnp.abs(split), axis=dim + 1, keepdims=True)
    codes = _nf4_codes(split / jnp.where(amax > 0, amax, 1.0)).reshape(w.shape)
    amax = amax.reshape(scale_shape)
    if max_shape is None or len(max_shape) != len(scale_shape):
      raise ValueError(f"an 'nf4' kernel needs the shape of its {SCALE_MAX}, got {max_shape}")
    axes = tuple(i for i, (n, m) in enumerate(zip(scale_shape, max_shape, strict=True)) if m < n)
    top = jnp.max(amax, axis=axes, keepdims=True)
    top = jnp.where(top > 0, top, 1.0)
    return {
      "kernel": _pack(codes, dim),
      SCALE: jnp.round(amax / top * _SCALE_CODES).astype(jnp.uint8),  # 0 to 255: amax <= top
      SCALE_MAX: top,
    }
  axes = tuple(i for i, (n, m) in enumerate(zip(w.shape, scale_shape, strict=True)) if m == 1 < n)
  amax = jnp.max(jnp.abs(w), axis=axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
  q = jnp.clip(jnp.round(w / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
  return {"kernel": q, SCALE: scale.reshape(scale_shape)}


def dequantize_kernel(q: jax.Array, scale: jax.Array, scale_max: jax.Array | None = None):
  """The float32 kernel of a quantized one: int8 `q` times its scale, or uint8 'nf4' codes
  unpacked, their levels times their block's scale (its code's fraction of `scale_max`)."""
  if q.dtype != jnp.uint8:
    return q.astype(jnp.float32) * scale.astype(jnp.float32)
  dim = _packed_dim(q.shape, scale.shape)
  values = jnp.asarray(NF4_LEVELS, jnp.float32)[_unpack(q, dim)]
  n, blocks = values.shape[dim], scale.shape[dim]
  split = values.reshape(*values.shape[:dim], blocks, n // blocks, *values.shape[dim + 1 :])
  scale = scale.astype(jnp.float32) * (scale_max.astype(jnp.float32) / _SCALE_CODES)
  return (split * jnp.expand_dims(scale, dim + 1)).reshape(values.shape)


def quantize_base(params: Any, like: Any) -> Any:
  """`params` (a float base) with the kernels that `like` (a tree of the quantized layout:
  arrays or shape structs) holds quantized (`quantize_kernel`; int8 or, stored as uint8,
  'nf4')."""

  def walk(tree: Any, target: Any) -> Any:
    if not isinstance(tree, dict):
      return tree
    if "kernel" in tree and isinstance(target, dict) and SCALE in target:
      quantization = "nf4" if target["kernel"].dtype == jnp.uint8 else "int8"
      top = tuple(target[SCALE_MAX].shape) if SCALE_MAX in target else None
      return {
        **tree,
        **quantize_kernel(tree["kernel"], tuple(target[SCALE].shape), quantization, top),
      }
    return {
      k: walk(v, target.get(k) if isinstance(target, dict) else None) for k, v in tree.items()
    }

  return walk(params, like)


def dequantized(params: Any) -> Any:
  """`params` with every quantized kernel dequantized to float32 and its scale dropped."""

  def fold(proj: dict) -> dict:
    if SCALE not in proj:
      return proj
    kernel = dequantize_kernel(proj["kernel"], proj[SCALE], proj.get(SCALE_MAX))
    return {**{k: v for k, v in proj.items() if k not in _SCALES}, "kernel": kernel}

  return _map_projections(params, fold)


def without_scales(tree: Any) -> Any:
  """`tree` (any tree of the parameters' structure) without the quantized kernels' scales: the
  structure of the dequantized parameters (`dequantized`)."""
  return _map_projections(tree, lambda proj: {k: v for k, v in proj.items() if k not in _SCALES})


def base_layout(tree: Any) -> Any:
  """`tree` (any tree of the parameters' structure) as a model without adapters or quantized
  kernels holds it: the structure of `dequantized(base(params))`, what a rollout or an export
  receives."""
  return without_scales(base(tree))


def _names(path) -> tuple[str, ...]:
  return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def has_adapters(params: Any) -> bool:
  """Whether the tree holds adapter leaves."""
  return any(
    set(_names(path)) & set(ADAPTER_LEAVES)
    for path, _ in jax.tree_util.tree_leaves_with_path(params)
  )


def trainable(params: Any) -> Any:
  """A tree of bools like `params`: every leaf without adapters; with them, the adapters and the
  `ALWAYS_TRAINED` leaves only (the base frozen)."""
  if not has_adapters(params):
    return jax.tree.map(lambda _: True, params)
  keep = set(ADAPTER_LEAVES) | set(ALWAYS_TRAINED)
  return jax.tree_util.tree_map_with_path(lambda path, _: bool(set(_names(path)) & keep), params)


def split(params: Any) -> tuple[Any, Any]:
  """`(trained, frozen)`: `params` with the other kind's leaves as None (`join` undoes it)."""
  mask = trainable(params)
  trained = jax.tree.map(lambda x, m: x if m else None, params, mask)
  frozen = jax.tree.map(lambda x, m: None if m else x, params, mask)
  return trained, frozen


def join(trained: Any, frozen: Any) -> Any:
  """The whole tree from the two halves of `split`."""
  return jax.tree.map(
    lambda a, b: b if a is None else a, trained, frozen, is_leaf=lambda x: x is None
  )


def base(params: Any) -> Any:
  """`params` without the adapters: the base model's tree."""
  return _map_projections(params, lambda proj: _without(proj))


def merged(params: Any, lora: LoraConfig) -> Any:
  """`params` with each adapter folded into its kernel, `W + (alpha / r) A B` computed in
  float32 and stored in the kernel's dtype (float32 for an int8 base, dequantized), and no
  adapter leaves nor scales: the adapted model's weights for a model without adapters (the
  rollout's, an export's)."""

  def fold(proj: dict) -> dict:
    if "lora_a" not in proj:
      return proj
    a, b = proj["lora_a"], proj["lora_b"]
    kernel = dequantized(proj)["kernel"]  # float32 from an int8 base
    lead = a.ndim + b.ndim - 2 - kernel.ndim  # stacked layers in front of every one of them
    n_in = a.ndim - 1 - lead
    letters = iter(string.ascii_lowercase)
    lead_s = "".join(next(letters) for _ in range(lead))
    in_s = "".join(next(letters) for _ in range(n_in))
    out_s = "".join(next(letters) for _ in range(b.ndim - 1 - lead))
    delta = jnp.einsum(
      f"{lead_s}{in_s}r,{lead_s}r{out_s}->{lead_s}{in_s}{out_s}",
      a.astype(jnp.float32),
      b.astype(jnp.float32),
    )
    folded = (kernel.astype(jnp.float32) + lora.scale * delta).astype(kernel.dtype)
    return {**without_scales(_without(proj)), "kernel": folded}

  return _map_projections(params, fold)


def adapters(params: Any) -> dict:
  """Only the adapter leaves of `params`, in their nesting (the tree `attach` takes)."""

  def walk(tree: Any) -> dict | None:
    if not isinstance(tree, dict):
      return None
    if "lora_a" in tree:
      return {k: tree[k] for k in ADAPTER_LEAVES}
    kept = {k: sub for k, v in tree.items() if (sub := walk(v)) is not None}
    return kept or None

  return walk(params) or {}


def attach(base_params: Any, adapter_tree: dict) -> Any:
  """`base_params` (a tree without adapters) with the adapters of `adapter_tree` (`adapters`
  of a tree of the same model with them): fresh adapters over loaded weights."""

  def walk(tree: Any, found: dict | None) -> Any:
    if found is None:
      return tree
    if "lora_a" in found:
      return {**tree, **found}
    return {k: walk(v, found.get(k)) for k, v in tree.items()}

  return walk(base_params, adapter_tree)


def _without(proj: dict) -> dict:
  return {k: v for k, v in proj.items() if k not in ADAPTER_LEAVES}


def _map_projections(tree: Any, fn) -> Any:
  """`tree` (nested dicts) with `fn` applied to every dict that holds a 'kernel'."""
  if not isinstance(tree, dict):
    return tree
  if "kernel" in tree:
    return fn(tree)
  return {k: _map_projections(v, fn) for k, v in tree.items()}
