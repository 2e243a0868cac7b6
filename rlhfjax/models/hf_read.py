"""Reading a Hugging Face safetensors checkpoint slice by slice, straight into shardings.

Each parameter is built device by device in its target sharding: for every device of this
process, the device's index into our layout (the stacked layers axis, `[d, h, n]`
kernels, ...) maps to the rows and columns of the HF tensors it covers; only those are read,
and that piece alone is reordered, cast and put on the device. A process therefore reads the
slices its own devices hold, and its host memory holds about one piece besides its arrays.

Files are memory-mapped and the pages a read touched are given back at once (a column slice of
a row-major tensor touches every page of it): otherwise a mapping's touched pages count toward
the process's resident memory until the file is closed.

Shape letters: l layers, v vocab, d hidden, h heads, k kv heads, n head_dim, f intermediate.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import mmap
import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tqdm

from rlhfjax.config.hf import CheckpointError
from rlhfjax.config.model import HeadKind, ModelConfig

INDEX = "model.safetensors.index.json"

# safetensors' dtype names; only floating-point weights are parameters.
_DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
}
_BLOCK_BYTES = 8 * 2**20  # of a tensor's rows mapped at once while a slice is copied out
_PROGRESS_DELAY_S = 2.0  # loads shorter than this show no progress bar


def shard_files(path: str) -> list[str]:
  """The safetensors files of a checkpoint directory: its index's files or the single file."""
  index = os.path.join(path, INDEX)
  if os.path.exists(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    return [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(single):
    return [single]
  raise CheckpointError(f"{path}: no model.safetensors or {INDEX} found")


def to_dtype(x: np.ndarray, dtype) -> np.ndarray:
  """`x` in the parameter dtype (bfloat16 through ml_dtypes)."""
  target = ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)
  return np.asarray(x, dtype=np.float32).astype(target) if x.dtype != target else x


# ---------------------------------------------------------------------------------------------
# Files.


@dataclasses.dataclass(frozen=True)
class _Entry:
  file: int
  dtype: np.dtype
  shape: tuple[int, ...]
  offset: int  # of the first byte, from the start of the file
  nbytes: int


def _parse_header(file: str, size: int, number: int) -> dict[str, _Entry]:
  """The tensors of one safetensors file: an 8-byte little-endian header length, a JSON header
  of name -> {dtype, shape, data_offsets}, then the data."""
  with open(file, "rb") as f:
    length = int.from_bytes(f.read(8), "little")
    if size < 8 or 8 + length > size:
      raise ValueError(f"header of {length} bytes in a file of {size}")
    header = json.loads(f.read(length))
  entries = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"tensor {name!r} has dtype {info['dtype']}, not a float type")
    dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
    begin, end = info["data_offsets"]
    if end - begin != math.prod(shape) * dtype.itemsize or 8 + length + end > size:
      raise ValueError(f"tensor {name!r} has data offsets {begin}..{end} outside the file")
    entries[name] = _Entry(number, dtype, shape, 8 + length + begin, end - begin)
  return entries


class SafetensorsReader:
  """A checkpoint directory's tensors, read by slices: one open mapping per file.

  `bytes_read` counts the checkpoint bytes copied out, so a process can tell what it read.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    self.bytes_read = 0
    self._maps: list[mmap.mmap] = []
    self._entries: dict[str, _Entry] = {}
    try:
      for file in shard_files(self.path):
        self._open(file)
    except BaseException:
      self.close()
      raise
    # Classification checkpoints name the trunk `model.`; some exports drop the prefix.
    if not any(name.startswith("model.") for name in self._entries):
      self._entries = {
        (n if n.startswith(("lm_head", "score")) else "model." + n): e
        for n, e in self._entries.items()
      }

  def _open(self, file: str) -> None:
    if not os.path.exists(file):
      raise CheckpointError(f"{file}: listed in {INDEX} but missing")
    try:
      size = os.path.getsize(file)
      entries = _parse_header(file, size, len(self._maps))
      with open(file, "rb") as f:
        self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
      raise CheckpointError(f"{file}: cannot read safetensors ({e})") from None
    self._entries.update(entries)

  def names(self) -> list[str]:
    """Every tensor name of the checkpoint (a classification trunk's with its `model.`)."""
    return list(self._entries)

  def shape(self, name: str) -> tuple[int, ...] | None:
    """The tensor's shape, or None when the checkpoint has no such tensor."""
    entry = self._entries.get(name)
    return None if entry is None else entry.shape

  def read(
    self, name: str, index: tuple[slice, ...], shape: tuple[int, ...] | None = None
  ) -> np.ndarray:
    """A copy of `tensor.reshape(shape)[index]` (one slice per axis), in the file's dtype.

    Copied in blocks of rows, each block's pages released before the next is touched: a column
    slice would otherwise map the whole tensor at once.
    """
    entry = self._entries[name]
    buffer = self._maps[entry.file]
    count = entry.nbytes // entry.dtype.itemsize
    view = np.frombuffer(buffer, entry.dtype, count, entry.offset).reshape(shape or entry.shape)
    rows = range(view.shape[0])[index[0]]
    row_bytes = entry.nbytes // max(view.shape[0], 1)
    out = np.empty((len(rows), *view[(slice(0, 0), *index[1:])].shape[1:]), entry.dtype)
    step = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    for j in range(0, len(rows), step):
      block = rows[j : j + step]
      out[j : j + len(block)] = view[(slice(block.start, block.stop, block.step), *index[1:])]
      first, last = entry.offset + block[0] * row_bytes, entry.offset + (block[-1] + 1) * row_bytes
      self._release(buffer, first, last - first)
    del view  # the mapping cannot be closed while a view of it exists
    self.bytes_read += out.nbytes
    return out

  @staticmethod
  def _release(buffer: mmap.mmap, offset: int, nbytes: int) -> None:
    """Unmaps pages of a file from this process; the kernel keeps them in its page cache, so
    the next read of them is no slower."""
    if hasattr(mmap, "MADV_DONTNEED"):
      start = offset - offset % mmap.PAGESIZE
      buffer.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)

  def close(self) -> None:
    for buffer in self._maps:
      # BufferError: a view of it is alive (in an error's traceback); unmapped once freed.
      with contextlib.suppress(BufferError):
        buffer.close()
    self._maps = []

  def __enter__(self) -> SafetensorsReader:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# ---------------------------------------------------------------------------------------------
# Our layout from theirs.


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one of our parameters is made of an HF tensor: each HF axis split into `groups` (an
  empty group drops an axis of size 1), then the split axes permuted by `perm`.

  For example the q kernel `[d, h, n]` from HF's `[h*n, d]`: groups ((h, n), (d,)), perm
  (2, 0, 1). Splitting is a free reshape of the file's row-major data, so a slice of our
  layout is a slice of the split tensor, read without anything around it.
  """

  groups: tuple[tuple[int, ...], ...]
  perm: tuple[int, ...]

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return tuple(math.prod(g) for g in self.groups)

  @property
  def shape(self) -> tuple[int, ...]:
    split = [size for g in self.groups for size in g]
    return tuple(split[p] for p in self.perm)

  def read(self, reader: SafetensorsReader, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """`ours[index]` from the tensor `name`, reading only the elements it covers."""
    split_index: list[slice] = [slice(None)] * len(self.perm)
    for axis, p in enumerate(self.perm):
      split_index[p] = index[axis]
    split_shape = tuple(size for group in self.groups for size in group)
    piece = reader.read(name, tuple(split_index), shape=split_shape)
    # Contiguous: a device takes it in one copy (the CPU backend may even keep it as is).
    return np.ascontiguousarray(piece.transpose(self.perm))


def _layer_layouts(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], _Layout]]:
  """HF per-layer tensor name -> (our path under 'layers', layout of one layer's tensor)."""
  d, h, k, n = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
  f = config.intermediate_size
  table = {
    "self_attn.q_proj.weight": (("attn", "q_proj", "kernel"), _Layout(((h, n), (d,)), (2, 0, 1))),
    "self_attn.k_proj.weight": (("attn", "k_proj", "kernel"), _Layout(((k, n), (d,)), (2, 0, 1))),
    "self_attn.v_proj.weight": (("attn", "v_proj", "kernel"), _Layout(((k, n), (d,)), (2, 0, 1))),
    "self_attn.o_proj.weight": (("attn", "o_proj", "kernel"), _Layout(((d,), (h, n)), (1, 2, 0))),
    "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), _Layout(((f,), (d,)), (1, 0))),
    "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), _Layout(((f,), (d,)), (1, 0))),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), _Layout(((d,), (f,)), (1, 0))),
    "input_layernorm.weight": (("attn_norm", "scale"), _Layout(((d,),), (0,))),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), _Layout(((d,),), (0,))),
  }
  if config.qkv_bias:
    for name, heads in (("q_proj", h), ("k_proj", k), ("v_proj", k)):
      table[f"self_attn.{name}.bias"] = (("attn", name, "bias"), _Layout(((heads, n),), (0, 1)))
  if config.qk_norm:
    for name in ("q_norm", "k_norm"):
      table[f"self_attn.{name}.weight"] = (("attn", name, "scale"), _Layout(((n,),), (0,)))
  if config.o_bias:
    table["self_attn.o_proj.bias"] = (("attn", "o_proj", "bias"), _Layout(((d,),), (0,)))
  return table


@dataclasses.dataclass(frozen=True)
class _Source:
  """Where one parameter comes from: the tensor `name` (with `{layer}` for stacked layers)."""

  path: tuple[str, ...]
  name: str
  layout: _Layout
  num_layers: int = 0  # 0: not stacked

  @property
  def shape(self) -> tuple[int, ...]:
    return (self.num_layers, *self.layout.shape) if self.num_layers else self.layout.shape

  def names(self) -> list[str]:
    if not self.num_layers:
      return [self.name]
    return [self.name.format(layer=i) for i in range(self.num_layers)]

  def read(self, reader: SafetensorsReader, index: tuple[slice, ...], dtype) -> np.ndarray:
    if not self.num_layers:
      return to_dtype(self.layout.read(reader, self.name, index), dtype)
    layers = range(self.num_layers)[index[0]]
    out = None
    for j, i in enumerate(layers):
      piece = to_dtype(self.layout.read(reader, self.name.format(layer=i), index[1:]), dtype)
      if out is None:
        out = np.empty((len(layers), *piece.shape), piece.dtype)
      out[j] = piece
    return out


def _sources(config: ModelConfig, head: HeadKind) -> list[_Source]:
  """Every parameter of a `head` model and the tensors it is read from."""
  v, d = config.vocab_size, config.hidden_size
  sources = [
    _Source(("embedding",), "model.embed_tokens.weight", _Layout(((v,), (d,)), (0, 1))),
    _Source(("final_norm", "scale"), "model.norm.weight", _Layout(((d,),), (0,))),
  ]
  for hf_name, (ours, layout) in _layer_layouts(config).items():
    name = "model.layers.{layer}." + hf_name
    sources.append(_Source(("layers", *ours), name, layout, config.num_layers))
  if head == "value":
    sources.append(_Source(("value_head",), "score.weight", _Layout(((), (d,)), (0,))))
  elif not config.tie_embeddings:
    sources.append(_Source(("lm_head", "kernel"), "lm_head.weight", _Layout(((v,), (d,)), (1, 0))))
  return sources


_UNREAD_ALLOWED = ("lm_head.weight",)
"""Tensors a checkpoint may hold that the model does not read: a causal LM's head under a
value head (a reward model's trunk from a causal LM) or beside tied embeddings."""


def _check_shapes(reader: SafetensorsReader, sources: list[_Source]) -> None:
  """Every tensor present with the shape config.json implies, and none that it does not
  account for (more layers than `num_layers`, biases the architecture has none of: weights
  that would be dropped without a word), before anything is read."""
  expected = {name: source for source in sources for name in source.names()}
  missing = [name for name in expected if reader.shape(name) is None]
  if missing:
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    raise CheckpointError(f"{reader.path}: tensor {missing[0]!r} is missing{more}")
  for name, source in expected.items():
    shape = reader.shape(name)
    if shape != source.layout.hf_shape:
      raise CheckpointError(
        f"{reader.path}: tensor {name!r} has shape {shape}, config.json says "
        f"{source.layout.hf_shape}"
      )
  unread = sorted(
    name
    for name in reader.names()
    if name not in expected and name not in _UNREAD_ALLOWED and not name.endswith("inv_freq")
  )
  if unread:
    shown = ", ".join(repr(n) for n in unread[:3])
    more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
    raise CheckpointError(
      f"{reader.path}: tensors config.json does not account for: {shown}{more} (config.json "
      "and the weights disagree: another architecture or layer count?)"
    )


def _full_index(index: Any, ndim: int) -> tuple[slice, ...]:
  index = () if index is None else tuple(index)
  return index + (slice(None),) * (ndim - len(index))


def _leaf(reader: SafetensorsReader, source: _Source, sharding, dtype) -> jax.Array:
  """One parameter in `sharding`, built device by device: each distinct local piece is read
  once (replicated axes give several devices the same piece) and dropped after its last
  device took it, so the host holds about one piece besides the arrays, not the whole leaf
  (`jax.make_array_from_callback` keeps every piece until the end)."""
  shape = source.shape
  indices = {
    device: _full_index(index, len(shape))
    for device, index in sharding.addressable_devices_indices_map(shape).items()
  }
  keys = {d: tuple(s.indices(n) for s, n in zip(i, shape, strict=True)) for d, i in indices.items()}
  uses = collections.Counter(keys.values())
  pieces: dict[tuple, np.ndarray] = {}
  arrays = []
  for device, index in indices.items():
    key = keys[device]
    if key not in pieces:
      pieces[key] = source.read(reader, index, dtype)
    arrays.append(jax.device_put(pieces[key], device))
    uses[key] -= 1
    if not uses[key]:
      del pieces[key]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)


def set_at(tree: dict, path: tuple[str, ...], value) -> None:
  """`tree[path[0]][path[1]]... = value`, making the dictionaries on the way."""
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def get_at(tree: Mapping, path: tuple[str, ...]) -> Any:
  """`tree[path[0]][path[1]]...`."""
  for key in path:
    tree = tree[key]
  return tree


def read_params(
  reader: SafetensorsReader,
  config: ModelConfig,
  head: HeadKind,
  dtype=jnp.float32,
  *,
  shardings: Any | None = None,
) -> dict:
  """Our parameter tree, each leaf read by this process's slices into its sharding.

  Args:
    reader: the checkpoint's tensors.
    config, head: the model the checkpoint holds (from its config.json).
    dtype: parameter dtype; each slice is cast on its own.
    shardings: tree of `jax.sharding.Sharding` matching the parameters; None places every
      parameter whole on this process's first device.

  A load that lasts long shows a progress bar on process 0's stderr when it is a terminal.
  """
  sources = _sources(config, head)
  _check_shapes(reader, sources)
  single = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  itemsize = jnp.dtype(dtype).itemsize
  sizes = {s.path: math.prod(s.shape) * itemsize for s in sources}
  bar = _progress_bar(total=sum(sizes.values()), desc=f"loading {reader.path}")
  params: dict = {}
  with bar:
    for source in sources:
      sharding = single if shardings is None else get_at(shardings, source.path)
      set_at(params, source.path, _leaf(reader, source, sharding, dtype))
      bar.update(sizes[source.path])
  return params


def _progress_bar(**kwargs) -> tqdm.tqdm:
  return tqdm.tqdm(
    **kwargs,
    unit="B",
    unit_scale=True,
    file=sys.stderr,
    delay=_PROGRESS_DELAY_S,
    # None: off when stderr is not a terminal (logs, tests); other processes never show one.
    disable=None if jax.process_index() == 0 else True,
    dynamic_ncols=True,
  )
