"""Llama-family transformers: definition, named sizes, Hugging Face checkpoints."""

from rlhfjax.models.config import (
  ModelConfig,
  get_model_config,
  kv_cache_bytes_per_token,
  model_sizes,
  param_count,
)
from rlhfjax.models.hf import (
  CheckpointError,
  head_kind,
  load_hf_checkpoint,
  save_hf_checkpoint,
)
from rlhfjax.models.logprobs import TokenStats, chunked_stats, token_stats
from rlhfjax.models.transformer import (
  Transformer,
  abstract_params,
  apply,
  causal_mask,
  forward_hidden,
  forward_logits,
  forward_values,
  init_cache,
  init_params,
  logical_axes,
  positions_from_mask,
  sequence_reward,
)

__all__ = [
  "CheckpointError",
  "TokenStats",
  "chunked_stats",
  "forward_hidden",
  "token_stats",
  "ModelConfig",
  "Transformer",
  "abstract_params",
  "apply",
  "causal_mask",
  "forward_logits",
  "forward_values",
  "get_model_config",
  "head_kind",
  "init_cache",
  "init_params",
  "kv_cache_bytes_per_token",
  "load_hf_checkpoint",
  "logical_axes",
  "model_sizes",
  "param_count",
  "positions_from_mask",
  "save_hf_checkpoint",
  "sequence_reward",
]
