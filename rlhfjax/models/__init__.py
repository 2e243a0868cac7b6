"""Llama-family transformers: definition, log-probs, Hugging Face checkpoints' tensors.

Their hyper-parameters and named sizes are `rlhfjax.config.model`'s."""

from rlhfjax.models.attention import Mask
from rlhfjax.models.hf import (
  head_kind,
  load_hf_checkpoint,
  save_hf_checkpoint,
)
from rlhfjax.models.logprobs import TokenStats, chunked_stats, packed_token_stats, token_stats
from rlhfjax.models.transformer import (
  Transformer,
  abstract_params,
  apply,
  forward_hidden,
  forward_logits,
  forward_packed,
  forward_values,
  init_adapters,
  init_cache,
  init_params,
  logical_axes,
  positions_from_mask,
  sequence_reward,
)

__all__ = [
  "Mask",
  "TokenStats",
  "chunked_stats",
  "forward_hidden",
  "packed_token_stats",
  "token_stats",
  "Transformer",
  "abstract_params",
  "apply",
  "forward_logits",
  "forward_packed",
  "forward_values",
  "head_kind",
  "init_cache",
  "init_adapters",
  "init_params",
  "load_hf_checkpoint",
  "logical_axes",
  "positions_from_mask",
  "save_hf_checkpoint",
  "sequence_reward",
]
