"""What a Hugging Face model family is in `ModelConfig` terms: one module per family says it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
  """One family's names and how its config.json says what differs between families.

  The fields config.json holds under one name in every family are declared at `ModelConfig`'s
  fields; rotary settings, dtypes and stop tokens are common too (`rlhfjax.config.hf`).
  """

  model_type: str
  """config.json's `model_type`, and `ModelConfig.architecture`."""
  class_prefix: str
  """Of its `architectures`: `<prefix>ForCausalLM`, `<prefix>ForSequenceClassification`."""
  read: Callable[[Mapping[str, Any]], dict[str, Any]]
  """The fields a config.json sets its family's way (`qkv_bias`, `o_bias`, `qk_norm`,
  `sliding_window`) where they differ from `ModelConfig`'s defaults; ValueError for a variant
  the model cannot run."""
  write: Callable[[Any], dict[str, Any]]
  """The family's own config.json keys of a `ModelConfig`; ValueError for a model the family
  cannot express (transformers would load other weights or drop some)."""
