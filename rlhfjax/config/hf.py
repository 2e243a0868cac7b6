"""A Hugging Face checkpoint's config.json (and generation_config.json) as a `ModelConfig`, and
back, without JAX: a config naming `model.hf` is checked from these files alone.

The fields every family stores alike are declared at `ModelConfig`'s fields (`_hf`); what
differs between families is said by each family's module (`rlhfjax.config.families`). The
tensors are read and written by `rlhfjax.models.hf`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from rlhfjax.config.families import FAMILIES
from rlhfjax.config.model import ROPE_TYPES, HeadKind, ModelConfig, RopeScaling


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be read as a supported Hugging Face model."""


_PLAIN = tuple(f for f in dataclasses.fields(ModelConfig) if "hf" in f.metadata)
"""The fields config.json holds as they are, under one name in every family."""


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


def _plain_field(hf: Mapping[str, Any], field: dataclasses.Field) -> Any:
  value = hf.get(field.metadata["hf"])
  if value is None:
    if field.metadata["missing"] is not None:
      return field.metadata["missing"](hf)
    if field.default is dataclasses.MISSING:
      return hf[field.metadata["hf"]]  # KeyError: config.json lacks a required key
    return field.default
  return bool(value) if field.type == "bool" else value


def config_from_hf(
  hf: Mapping[str, Any], *, dtype: str = "float32", path: str = "config.json"
) -> tuple[ModelConfig, HeadKind]:
  """Our `ModelConfig` (with parameter and compute dtype `dtype`) and head kind for a Hugging
  Face `config.json` dictionary."""
  family = FAMILIES.get(hf.get("model_type"))
  if family is None:
    raise CheckpointError(
      f"{path}: model_type {hf.get('model_type')!r} is not supported; expected one of "
      f"{', '.join(FAMILIES)}"
    )
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
  if hf.get("mlp_bias"):
    raise CheckpointError(f"{path}: mlp_bias=true is not supported")
  architectures = hf.get("architectures") or [f"{family.class_prefix}ForCausalLM"]
  head: HeadKind = "lm"
  if any(a.endswith("ForSequenceClassification") for a in architectures):
    if hf.get("num_labels", len(hf.get("id2label") or {0: 0})) != 1:
      raise CheckpointError(
        f"{path}: a sequence-classification checkpoint must have one label "
        "to be used as a reward or value model"
      )
    head = "value"
  try:
    own = family.read(hf)
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}") from None
  config = ModelConfig(
    **{field.name: _plain_field(hf, field) for field in _PLAIN},
    **own,
    rope_theta=_rope_theta(hf),
    rope_scaling=_rope_scaling(hf, path),
    param_dtype=dtype,
    dtype=dtype,
    architecture=family.model_type,
    eos_token_ids=_as_tuple(hf.get("eos_token_id")),
  )
  return config, head


def _as_tuple(ids) -> tuple[int, ...]:
  if ids is None:
    return ()
  return tuple(ids) if isinstance(ids, list | tuple) else (int(ids),)


def config_to_hf(config: ModelConfig, head: HeadKind = "lm") -> dict[str, Any]:
  """A `config.json` dictionary that `transformers` loads back into the same model.

  Raises:
    CheckpointError: the family cannot express the model (say q/k norms in a Llama).
  """
  family = FAMILIES[config.architecture]
  try:
    own = family.write(config)
  except ValueError as e:
    raise CheckpointError(str(e)) from None
  suffix = "ForCausalLM" if head == "lm" else "ForSequenceClassification"
  hf: dict[str, Any] = {
    "architectures": [family.class_prefix + suffix],
    "model_type": family.model_type,
    **{field.metadata["hf"]: getattr(config, field.name) for field in _PLAIN},
    "hidden_act": "silu",
    "rope_parameters": _rope_to_hf(config),
    "rope_theta": config.rope_theta,
    "torch_dtype": config.param_dtype,
    "eos_token_id": (
      list(config.eos_token_ids)
      if len(config.eos_token_ids) > 1
      else next(iter(config.eos_token_ids), None)
    ),
    **own,
  }
  if head == "value":
    hf["num_labels"] = 1
    hf["id2label"] = {"0": "LABEL_0"}
    hf["label2id"] = {"LABEL_0": 0}
  return hf


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


def read_hf_config(
  path: str | os.PathLike, dtype: str | None = None
) -> tuple[ModelConfig, HeadKind]:
  """The model and head a Hugging Face checkpoint directory holds, from its `config.json`.

  Args:
    path: the checkpoint directory.
    dtype: parameter and compute dtype ('float32' or 'bfloat16'); None: the checkpoint's own
      (`checkpoint_dtype`).
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
