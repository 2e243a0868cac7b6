"""Hugging Face checkpoints (Llama, Mistral, Qwen2) from and to a local directory.

A checkpoint directory holds `config.json` and either `model.safetensors` or several
`*.safetensors` shards listed in `model.safetensors.index.json`. Causal-LM checkpoints
(`*ForCausalLM`) load with the LM head; `*ForSequenceClassification` with one label loads as a
value-head model (its `score` row becomes the value head), which is how reward models are shared.

Weights are read with NumPy (no torch needed) and stacked per layer into the scanned layout of
`rlhfjax.models.transformer`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rlhfjax.models.config import ROPE_TYPES, HeadKind, ModelConfig, RopeScaling

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be read as a supported Hugging Face model."""


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
  """`rope_parameters` (transformers >= 5) merged over the older `rope_scaling`."""
  return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


def _rope_theta(hf: Mapping[str, Any]) -> float:
  return float(_rope_parameters(hf).get("rope_theta", hf.get("rope_theta", 10_000.0)))


def _rope_scaling(hf: Mapping[str, Any], path: str) -> RopeScaling | None:
  rope = _rope_parameters(hf)
  rope_type = rope.get("rope_type") or rope.get("type")
  if rope_type in (None, "default"):
    return None
  if rope_type not in ROPE_TYPES:
    raise CheckpointError(
      f"{path}: rope type {rope_type!r} is not supported (default, {', '.join(ROPE_TYPES)})"
    )
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    raise CheckpointError(f"{path}: partial_rotary_factor != 1 is not supported")
  extra = {}
  if rope_type == "llama3":
    names = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [name for name in names if name not in rope]
    if missing:
      raise CheckpointError(f"{path}: llama3 rope scaling lacks {', '.join(missing)}")
    extra = {name: rope[name] for name in names}
  try:
    return RopeScaling(type=rope_type, factor=float(rope["factor"]), **extra)
  except (KeyError, ValueError) as e:
    raise CheckpointError(f"{path}: invalid rope scaling {rope!r} ({e})") from None


def _rope_to_hf(config: ModelConfig) -> dict[str, Any]:
  rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
  scaling = config.rope_scaling
  if scaling is not None:
    rope.update(rope_type=scaling.type, factor=scaling.factor)
    if scaling.type == "llama3":
      rope.update(
        low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings,
      )
  return rope


def _sliding_window(hf: Mapping[str, Any], family: str, path: str) -> int | None:
  if family == "mistral":
    return hf.get("sliding_window")
  if family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
    kinds = set(hf.get("layer_types") or [])
    if kinds != {"sliding_attention"}:
      raise CheckpointError(
        f"{path}: Qwen2 with sliding windows on only some layers is not supported"
      )
    return hf.get("sliding_window")
  return None


def config_from_hf(
  hf: Mapping[str, Any], *, dtype=jnp.float32, path: str = "config.json"
) -> tuple[ModelConfig, HeadKind]:
  """Our `ModelConfig` and head kind for a Hugging Face `config.json` dictionary."""
  family = hf.get("model_type")
  if family not in _FAMILIES:
    raise CheckpointError(
      f"{path}: model_type {family!r} is not supported; expected one of {', '.join(_FAMILIES)}"
    )
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
  if hf.get("mlp_bias"):
    raise CheckpointError(f"{path}: mlp_bias=true is not supported")
  architectures = hf.get("architectures") or [f"{_CLASS_PREFIX[family]}ForCausalLM"]
  head: HeadKind = "lm"
  if any(a.endswith("ForSequenceClassification") for a in architectures):
    if hf.get("num_labels", len(hf.get("id2label") or {0: 0})) != 1:
      raise CheckpointError(
        f"{path}: a sequence-classification checkpoint must have one label "
        "to be used as a reward or value model"
      )
    head = "value"
  heads = hf["num_attention_heads"]
  dtype_name = jnp.dtype(dtype).name
  config = ModelConfig(
    vocab_size=hf["vocab_size"],
    hidden_size=hf["hidden_size"],
    intermediate_size=hf["intermediate_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=heads,
    num_kv_heads=hf.get("num_key_value_heads") or heads,
    head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
    rope_theta=_rope_theta(hf),
    rope_scaling=_rope_scaling(hf, path),
    qk_norm=family == "qwen3",
    rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
    qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
    o_bias=family in ("llama", "qwen3") and bool(hf.get("attention_bias", False)),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    sliding_window=_sliding_window(hf, family, path),
    max_position_embeddings=hf.get("max_position_embeddings", 4096),
    param_dtype=dtype_name,
    dtype=dtype_name,
    architecture=family,
    bos_token_id=hf.get("bos_token_id"),
    eos_token_ids=_as_tuple(hf.get("eos_token_id")),
    pad_token_id=hf.get("pad_token_id"),
  )
  return config, head


def _as_tuple(ids) -> tuple[int, ...]:
  if ids is None:
    return ()
  return tuple(ids) if isinstance(ids, list | tuple) else (int(ids),)


def config_to_hf(config: ModelConfig, head: HeadKind = "lm") -> dict[str, Any]:
  """A `config.json` dictionary that `transformers` loads back into the same model."""
  family = config.architecture
  if family == "qwen2" and not config.qkv_bias:
    raise CheckpointError("a Qwen2 export needs qkv_bias=True (Qwen2 always has q/k/v bias)")
  suffix = "ForCausalLM" if head == "lm" else "ForSequenceClassification"
  hf: dict[str, Any] = {
    "architectures": [_CLASS_PREFIX[family] + suffix],
    "model_type": family,
    "vocab_size": config.vocab_size,
    "hidden_size": config.hidden_size,
    "intermediate_size": config.intermediate_size,
    "num_hidden_layers": config.num_layers,
    "num_attention_heads": config.num_heads,
    "num_key_value_heads": config.num_kv_heads,
    "head_dim": config.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": config.max_position_embeddings,
    "rms_norm_eps": config.rms_norm_eps,
    "rope_parameters": _rope_to_hf(config),
    "rope_theta": config.rope_theta,
    "tie_word_embeddings": config.tie_embeddings,
    "torch_dtype": config.param_dtype,
    "bos_token_id": config.bos_token_id,
    "eos_token_id": (
      list(config.eos_token_ids)
      if len(config.eos_token_ids) > 1
      else next(iter(config.eos_token_ids), None)
    ),
    "pad_token_id": config.pad_token_id,
  }
  if family == "llama":
    if config.qkv_bias != config.o_bias:
      raise CheckpointError("a Llama export needs qkv_bias == o_bias (one attention_bias flag)")
    hf["attention_bias"] = config.qkv_bias
    hf["mlp_bias"] = False
  elif family != "qwen3" and (config.qkv_bias and family == "mistral" or config.o_bias):
    raise CheckpointError(f"a {family} export cannot carry these attention biases")
  if family == "mistral":
    hf["sliding_window"] = config.sliding_window
  if family == "qwen3":
    if not config.qk_norm or config.qkv_bias != config.o_bias:
      raise CheckpointError("a Qwen3 export needs qk_norm=True and qkv_bias == o_bias")
    hf["attention_bias"] = config.qkv_bias
  elif config.qk_norm:
    raise CheckpointError(f"a {family} export cannot carry q/k norms (only qwen3)")
  if family in ("qwen2", "qwen3"):
    hf["use_sliding_window"] = config.sliding_window is not None
    hf["sliding_window"] = config.sliding_window
    kind = "sliding_attention" if config.sliding_window else "full_attention"
    hf["layer_types"] = [kind] * config.num_layers
  if head == "value":
    hf["num_labels"] = 1
    hf["id2label"] = {"0": "LABEL_0"}
    hf["label2id"] = {"LABEL_0": 0}
  return hf


# ---------------------------------------------------------------------------------------------
# Tensor names.


def _layer_tensors(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], Any, Any]]:
  """HF per-layer name -> (our path under 'layers', to_ours, to_hf) for one layer's tensor."""
  d, h, k, n = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
  table = {
    "self_attn.q_proj.weight": (
      ("attn", "q_proj", "kernel"),
      lambda w: w.T.reshape(d, h, n),
      lambda w: w.reshape(d, h * n).T,
    ),
    "self_attn.k_proj.weight": (
      ("attn", "k_proj", "kernel"),
      lambda w: w.T.reshape(d, k, n),
      lambda w: w.reshape(d, k * n).T,
    ),
    "self_attn.v_proj.weight": (
      ("attn", "v_proj", "kernel"),
      lambda w: w.T.reshape(d, k, n),
      lambda w: w.reshape(d, k * n).T,
    ),
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
    table["self_attn.q_proj.bias"] = (
      ("attn", "q_proj", "bias"),
      lambda b: b.reshape(h, n),
      lambda b: b.reshape(h * n),
    )
    for name in ("k_proj", "v_proj"):
      table[f"self_attn.{name}.bias"] = (
        ("attn", name, "bias"),
        lambda b: b.reshape(k, n),
        lambda b: b.reshape(k * n),
      )
  if config.qk_norm:
    for name in ("q_norm", "k_norm"):
      table[f"self_attn.{name}.weight"] = (("attn", name, "scale"), lambda w: w, lambda w: w)
  if config.o_bias:
    table["self_attn.o_proj.bias"] = (("attn", "o_proj", "bias"), lambda b: b, lambda b: b)
  return table


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


# ---------------------------------------------------------------------------------------------
# Reading.


def _shard_files(path: str) -> list[str]:
  index = os.path.join(path, _INDEX)
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
  raise CheckpointError(f"{path}: no model.safetensors or {_INDEX} found")


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  tensors = {}
  for file in _shard_files(path):
    if not os.path.exists(file):
      raise CheckpointError(f"{file}: listed in {_INDEX} but missing")
    try:
      with safe_open(file, framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
          tensors[name] = f.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types for corrupt files
      raise CheckpointError(f"{file}: cannot read safetensors ({e})") from None
  # Classification checkpoints name the trunk `model.`; some exports drop the prefix.
  if not any(n.startswith("model.") for n in tensors):
    tensors = {
      ("model." + n if not n.startswith(("lm_head", "score")) else n): t for n, t in tensors.items()
    }
  return tensors


def _to_dtype(x: np.ndarray, dtype) -> np.ndarray:
  target = ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)
  return np.asarray(x, dtype=np.float32).astype(target) if x.dtype != target else x


def params_from_hf_tensors(
  config: ModelConfig,
  head: HeadKind,
  tensors: Mapping[str, Any],
  dtype=jnp.float32,
  *,
  path: str = "checkpoint",
) -> dict:
  """Our parameter tree (NumPy leaves) from HF tensor names to arrays."""

  def take(name):
    if name not in tensors:
      raise CheckpointError(f"{path}: tensor {name!r} is missing")
    return _to_dtype(np.asarray(tensors[name]), dtype)

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


def read_hf_json(path: str | os.PathLike, name: str = "config.json") -> dict[str, Any]:
  """A JSON object of a checkpoint directory (`config.json`, `generation_config.json`, ...)."""
  file = os.path.join(os.fspath(path), name)
  try:
    with open(file, encoding="utf-8") as f:
      value = json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{file}: not found") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{file}: invalid JSON ({e})") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"{file}: not a JSON object")
  return value


def checkpoint_dtype(hf: Mapping[str, Any]) -> str:
  """The dtype a checkpoint was saved in (`dtype`, or the older `torch_dtype`), as a
  `ModelConfig` dtype: float16 becomes bfloat16 (same width; float16 is not supported here)."""
  name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  return "float32" if name == "float32" else "bfloat16"


def read_hf_config(path: str | os.PathLike, dtype=None) -> tuple[ModelConfig, HeadKind]:
  """The model and head a Hugging Face checkpoint directory holds, from its `config.json`.

  Args:
    path: the checkpoint directory.
    dtype: parameter and compute dtype; None: the checkpoint's own (`checkpoint_dtype`).
  """
  hf = read_hf_json(path)
  config, head = config_from_hf(
    hf,
    dtype=checkpoint_dtype(hf) if dtype is None else dtype,
    path=os.path.join(os.fspath(path), "config.json"),
  )
  return config.replace(eos_token_ids=stop_token_ids(path, config.eos_token_ids)), head


def stop_token_ids(path: str | os.PathLike, default: tuple[int, ...]) -> tuple[int, ...]:
  """The eos ids generation stops at: generation_config.json's when it has them, else
  `default` (config.json's)."""
  if not os.path.isfile(os.path.join(os.fspath(path), "generation_config.json")):
    return default
  ids = _as_tuple(read_hf_json(path, "generation_config.json").get("eos_token_id"))
  return ids or default


def load_hf_checkpoint(
  path: str | os.PathLike, dtype=jnp.float32, *, shardings: Any | None = None
) -> tuple[ModelConfig, dict]:
  """Loads a local Hugging Face Llama / Mistral / Qwen2 checkpoint.

  Args:
    path: directory with `config.json` and safetensors weights (single file or sharded).
    dtype: parameter and compute dtype (float32 or bfloat16).
    shardings: optional tree of `jax.sharding.Sharding` matching the parameters; each leaf is
      placed straight onto its devices instead of the default device.

  Returns:
    `(config, params)`. A `*ForSequenceClassification` checkpoint returns value-head params
    (`params['value_head']`); `head_kind(params)` tells which.
  """
  path = os.fspath(path)
  config, head = read_hf_config(path, dtype)
  params = params_from_hf_tensors(config, head, _read_tensors(path), dtype, path=path)
  if shardings is None:
    params = jax.tree.map(jnp.asarray, params)
  else:
    params = jax.device_put(params, shardings)
  return config, params


def head_kind(params: Mapping) -> HeadKind:
  return "value" if "value_head" in params else "lm"


# ---------------------------------------------------------------------------------------------
# Writing.


def params_to_hf_tensors(config: ModelConfig, params: Mapping) -> dict[str, np.ndarray]:
  """HF tensor names to contiguous NumPy arrays, in the parameters' dtype."""
  host = jax.tree.map(np.asarray, jax.device_get(params))
  out = {
    "model.embed_tokens.weight": host["embedding"],
    "model.norm.weight": host["final_norm"]["scale"],
  }
  for hf_name, (ours, _, to_hf) in _layer_tensors(config).items():
    stacked = _get(host["layers"], ours)
    for i in range(config.num_layers):
      out[f"model.layers.{i}.{hf_name}"] = to_hf(stacked[i])
  if "value_head" in host:
    out["score.weight"] = host["value_head"].reshape(1, config.hidden_size)
  elif not config.tie_embeddings:
    out["lm_head.weight"] = host["lm_head"]["kernel"].T
  return {name: np.ascontiguousarray(t) for name, t in out.items()}


def save_hf_checkpoint(
  config: ModelConfig, params: Mapping, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30
) -> None:
  """Writes `config.json` and safetensors weights that `transformers` loads as is.

  Checkpoints larger than `max_shard_bytes` are split into numbered shards with an index.
  """
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  head = head_kind(params)
  tensors = params_to_hf_tensors(config, params)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, t in tensors.items():
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = t
    size += t.nbytes
  metadata = {"format": "pt"}
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=metadata)
  else:
    weight_map = {}
    for i, shard in enumerate(shards, 1):
      name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(path, name), metadata=metadata)
      weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, _INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_hf(config, head), f, indent=2)
