"""Hugging Face checkpoints' tensors (Llama, Mistral, Qwen2, Qwen3) from and to a local directory.

A checkpoint directory holds `config.json` and either `model.safetensors` or several
`*.safetensors` shards listed in `model.safetensors.index.json`. Causal-LM checkpoints
(`*ForCausalLM`) load with the LM head; `*ForSequenceClassification` with one label loads as a
value-head model (its `score` row becomes the value head), which is how reward models are shared.

Their config.json is read and written by `rlhfjax.config.hf`. Weights are read with NumPy (no
torch needed), each process only the slices its devices hold (`rlhfjax.models.hf_read`), into
the scanned layout of `rlhfjax.models.transformer`. Written checkpoints are split by
`plan_shards` into files of whole layers, so that the processes of a job can each write the
files of the layers they hold (`rlhfjax.export`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from rlhfjax.config.hf import CheckpointError, config_to_hf, read_hf_config
from rlhfjax.config.model import HeadKind, ModelConfig
from rlhfjax.models import hf_read, transformer
from rlhfjax.models.hf_read import INDEX as _INDEX
from rlhfjax.models.hf_read import get_at as _get
from rlhfjax.models.hf_read import set_at as _set

# ---------------------------------------------------------------------------------------------
# Tensor names.


def _layer_tensors(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], Any, Any]]:
  """HF per-layer name -> (our path under 'layers', to_ours, to_hf) for one layer's tensor."""
  d, h, k, n = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim

  def in_proj(name: str, heads: int):  # HF [heads * n, d] <-> ours [d, heads, n]
    return (
      ("attn", name, "kernel"),
      lambda w: w.T.reshape(d, heads, n),
      lambda w: w.reshape(d, heads * n).T,
    )

  def in_bias(name: str, heads: int):  # HF [heads * n] <-> ours [heads, n]
    return (("attn", name, "bias"), lambda b: b.reshape(heads, n), lambda b: b.reshape(heads * n))

  table = {
    "self_attn.q_proj.weight": in_proj("q_proj", h),
    "self_attn.k_proj.weight": in_proj("k_proj", k),
    "self_attn.v_proj.weight": in_proj("v_proj", k),
    "self_attn.o_proj.weight": (
      ("attn", "o_proj", "kernel"),
      lambda w: w.T.reshape(h, n, d),
      lambda w: w.reshape(h * n, d).T,
    ),
    "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), lambda w: w.T, lambda w: w.T),
    "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), lambda w: w.T, lambda w: w.T),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), lambda w: w.T, lambda w: w.T),
    "input_layernorm.weight": (("attn_norm", "scale"), lambda w: w, lambda w: w),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), lambda w: w, lambda w: w),
  }
  if config.qkv_bias:
    for name, heads in (("q_proj", h), ("k_proj", k), ("v_proj", k)):
      table[f"self_attn.{name}.bias"] = in_bias(name, heads)
  if config.qk_norm:
    for name in ("q_norm", "k_norm"):
      table[f"self_attn.{name}.weight"] = (("attn", name, "scale"), lambda w: w, lambda w: w)
  if config.o_bias:
    table["self_attn.o_proj.bias"] = (("attn", "o_proj", "bias"), lambda b: b, lambda b: b)
  return table


def layer_projections(config: ModelConfig) -> dict[str, tuple[str, ...]]:
  """HF per-layer module name of each projection (e.g. 'self_attn.q_proj') -> our path under
  'layers' of the dict that holds its kernel (and its LoRA adapters, if any)."""
  return {
    name.removesuffix(".weight"): ours[:-1]
    for name, (ours, _, _) in _layer_tensors(config).items()
    if ours[-1] == "kernel"
  }


# ---------------------------------------------------------------------------------------------
# Reading.


def params_from_hf_tensors(
  config: ModelConfig,
  head: HeadKind,
  tensors: Mapping[str, Any],
  dtype=jnp.float32,
  *,
  path: str = "checkpoint",
) -> dict:
  """Our parameter tree (NumPy leaves) from HF tensor names to whole arrays in memory.

  `load_hf_checkpoint` reads a directory by slices instead (`hf_read.read_params`).
  """

  def take(name):
    if name not in tensors:
      raise CheckpointError(f"{path}: tensor {name!r} is missing")
    return hf_read.to_dtype(np.asarray(tensors[name]), dtype)

  params: dict = {
    "embedding": take("model.embed_tokens.weight"),
    "final_norm": {"scale": take("model.norm.weight")},
  }
  for hf_name, (ours, to_ours, _) in _layer_tensors(config).items():
    per_layer = [to_ours(take(f"model.layers.{i}.{hf_name}")) for i in range(config.num_layers)]
    _set(params, ("layers", *ours), np.stack(per_layer))
  if head == "value":
    params["value_head"] = take("score.weight").reshape(config.hidden_size)
  elif not config.tie_embeddings:
    params["lm_head"] = {"kernel": take("lm_head.weight").T}
  expected = params["embedding"].shape
  if expected != (config.vocab_size, config.hidden_size):
    raise CheckpointError(
      f"{path}: embed_tokens has shape {expected}, config.json says "
      f"{(config.vocab_size, config.hidden_size)}"
    )
  return params


def load_hf_checkpoint(
  path: str | os.PathLike, dtype=jnp.float32, *, shardings: Any | None = None
) -> tuple[ModelConfig, dict]:
  """Loads a local Hugging Face Llama / Mistral / Qwen2 checkpoint.

  Args:
    path: directory with `config.json` and safetensors weights (single file or sharded).
    dtype: parameter and compute dtype (float32 or bfloat16).
    shardings: optional tree of `jax.sharding.Sharding` matching the parameters; each process
      reads only the slices of each leaf that its devices hold, straight into them. None: every
      leaf whole on the first local device.

  Returns:
    `(config, params)`. A `*ForSequenceClassification` checkpoint returns value-head params
    (`params['value_head']`); `head_kind(params)` tells which.
  """
  path = os.fspath(path)
  config, head = read_hf_config(path, jnp.dtype(dtype).name)
  with hf_read.SafetensorsReader(path) as reader:
    params = hf_read.read_params(reader, config, head, dtype, shardings=shardings)
  return config, params


def head_kind(params: Mapping) -> HeadKind:
  return "value" if "value_head" in params else "lm"


# ---------------------------------------------------------------------------------------------
# Writing.


def _top_paths(config: ModelConfig, head: HeadKind) -> dict[str, tuple[str, ...]]:
  """HF name -> our path of the tensors outside the layers."""
  paths = {
    "model.embed_tokens.weight": ("embedding",),
    "model.norm.weight": ("final_norm", "scale"),
  }
  if head == "value":
    paths["score.weight"] = ("value_head",)
  elif not config.tie_embeddings:
    paths["lm_head.weight"] = ("lm_head", "kernel")
  return paths


def top_hf_tensors(config: ModelConfig, params: Mapping) -> dict[str, Any]:
  """The HF tensors outside the layers (embedding, final norm, LM or score head) of `params`
  (host or device arrays; `params['layers']` is not read)."""
  out = {}
  for name, path in _top_paths(config, head_kind(params)).items():
    x = _get(params, path)
    if name == "score.weight":
      x = x.reshape(1, config.hidden_size)
    elif name == "lm_head.weight":
      x = x.T
    out[name] = x
  return out


def layer_hf_tensors(config: ModelConfig, layers: Mapping, first: int = 0) -> dict[str, Any]:
  """The HF tensors of the stacked host `layers` (a block of layers `first`, `first + 1`, ...)."""
  out = {}
  for hf_name, (ours, _, to_hf) in _layer_tensors(config).items():
    stacked = _get(layers, ours)
    for i in range(stacked.shape[0]):
      out[f"model.layers.{first + i}.{hf_name}"] = to_hf(stacked[i])
  return out


def params_to_hf_tensors(config: ModelConfig, params: Mapping) -> dict[str, np.ndarray]:
  """HF tensor names to contiguous NumPy arrays, in the parameters' dtype."""
  host = jax.tree.map(np.asarray, jax.device_get(params))
  out = {**top_hf_tensors(config, host), **layer_hf_tensors(config, host["layers"])}
  return {name: np.ascontiguousarray(t) for name, t in out.items()}


@dataclasses.dataclass(frozen=True)
class ShardFile:
  """One safetensors file of an export: whole layers `layers`, or tensors outside the layers."""

  name: str
  layers: range
  top: tuple[str, ...]
  nbytes: int


def plan_shards(
  config: ModelConfig, head: HeadKind, itemsize: int, max_shard_bytes: int
) -> list[ShardFile]:
  """The files of a checkpoint of `itemsize`-byte elements, each at most `max_shard_bytes`
  (unless one tensor is larger).

  A layer never spans two files, and every layer file holds the same number of layers (the
  largest divisor of `num_layers` that fits), so that the processes of a job holding equal
  blocks of layers can each write whole files (`rlhfjax.export`). One file when all fits.
  """
  shapes = transformer.abstract_params(config, head)
  paths = _top_paths(config, head)
  top = {n: math.prod(_get(shapes, p).shape) * itemsize for n, p in paths.items()}
  per_layer = sum(math.prod(x.shape[1:]) * itemsize for x in jax.tree.leaves(shapes["layers"]))
  total = sum(top.values()) + per_layer * config.num_layers
  if total <= max_shard_bytes:
    return [ShardFile("model.safetensors", range(config.num_layers), tuple(top), total)]
  groups: list[list[str]] = [[]]
  size = 0
  for name, nbytes in top.items():
    if groups[-1] and size + nbytes > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(name)
    size += nbytes
  layers = config.num_layers
  fits = [d for d in range(1, layers + 1) if layers % d == 0 and d * per_layer <= max_shard_bytes]
  k = max(fits, default=1)
  count = len(groups) + layers // k
  name = lambda i: f"model-{i + 1:05d}-of-{count:05d}.safetensors"  # noqa: E731
  files = [
    ShardFile(name(i), range(0), tuple(g), sum(top[n] for n in g)) for i, g in enumerate(groups)
  ]
  for j in range(layers // k):
    files.append(ShardFile(name(len(files)), range(j * k, (j + 1) * k), (), k * per_layer))
  return files


def shard_tensors(
  config: ModelConfig, shard: ShardFile, params: Mapping, layers: Mapping, first: int
) -> dict[str, np.ndarray]:
  """The host tensors of file `shard`: its top tensors from `params`, its layers from the
  block `layers` that starts at layer `first`."""
  out = {n: t for n, t in top_hf_tensors(config, params).items() if n in shard.top}
  if shard.layers:
    lo, hi = shard.layers.start - first, shard.layers.stop - first
    block = jax.tree.map(lambda x: x[lo:hi], layers)
    out.update(layer_hf_tensors(config, block, shard.layers.start))
  return {n: np.ascontiguousarray(np.asarray(t)) for n, t in out.items()}


def write_shard(path: str, shard: ShardFile, tensors: Mapping[str, np.ndarray]) -> None:
  file = os.path.join(path, shard.name)
  save_file(dict(tensors), file, metadata={"format": "pt"})
  # safetensors creates the file private (0600): give it the permissions of any other file.
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(file, 0o666 & ~umask)


def write_index(path: str, config: ModelConfig, shards: list[ShardFile]) -> None:
  """`model.safetensors.index.json` of a sharded checkpoint (nothing for one file)."""
  if len(shards) == 1:
    return
  weight_map = {}
  for shard in shards:
    names = list(shard.top) + [
      f"model.layers.{i}.{n}" for i in shard.layers for n in _layer_tensors(config)
    ]
    weight_map.update(dict.fromkeys(names, shard.name))
  total = sum(s.nbytes for s in shards)
  with open(os.path.join(path, _INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def write_config(path: str, config: ModelConfig, head: HeadKind) -> None:
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_hf(config, head), f, indent=2)


def save_hf_checkpoint(
  config: ModelConfig, params: Mapping, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30
) -> None:
  """Writes `config.json` and safetensors weights that `transformers` loads as is, from one
  process holding all of `params`.

  Checkpoints larger than `max_shard_bytes` are split into numbered shards with an index
  (`plan_shards`).
  """
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  head = head_kind(params)
  host = jax.tree.map(np.asarray, jax.device_get(params))
  itemsize = host["embedding"].dtype.itemsize
  shards = plan_shards(config, head, itemsize, max_shard_bytes)
  for shard in shards:
    write_shard(path, shard, shard_tensors(config, shard, host, host["layers"], 0))
  write_index(path, config, shards)
  write_config(path, config, head)
