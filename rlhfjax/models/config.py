"""Model hyper-parameters and the registry of named sizes.

One decoder-only transformer covers the Llama family (Llama, Mistral, Qwen2): the differences
are all fields here (q/k/v bias, tied embeddings, rotary theta, sliding window).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

Architecture = Literal["llama", "mistral", "qwen2"]
HeadKind = Literal["lm", "value"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Shape and numerics of one decoder-only transformer."""

  vocab_size: int
  """Rows of the token embedding (and columns of the LM head)."""
  hidden_size: int
  """Width of the residual stream, `d` in einsum strings."""
  intermediate_size: int
  """Width of the SwiGLU MLP, `f` in einsum strings."""
  num_layers: int
  num_heads: int
  """Query heads."""
  num_kv_heads: int
  """Key/value heads (grouped-query attention); must divide `num_heads`."""
  head_dim: int
  rope_theta: float = 10_000.0
  rms_norm_eps: float = 1e-5
  qkv_bias: bool = False
  """Bias on the q/k/v projections (Qwen2; Llama with `attention_bias`)."""
  o_bias: bool = False
  """Bias on the attention output projection (Llama with `attention_bias`, not Qwen2)."""
  tie_embeddings: bool = False
  """LM head reuses the input embedding matrix."""
  sliding_window: int | None = None
  """Mistral-style local attention: a query sees at most this many most recent keys."""
  max_position_embeddings: int = 4096
  param_dtype: str = "float32"
  """Storage dtype of parameters: 'float32' or 'bfloat16'."""
  dtype: str = "float32"
  """Compute dtype of activations and matmuls: 'float32' or 'bfloat16'."""
  architecture: Architecture = "llama"
  """Hugging Face family used when exporting."""
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  """Stop tokens the checkpoint declares (HF `eos_token_id`, one or several)."""
  pad_token_id: int | None = None

  def __post_init__(self):
    positive = (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
    )
    for name in positive:
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
      )
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(
          f"ModelConfig.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}"
        )
    if self.architecture not in ("llama", "mistral", "qwen2"):
      raise ValueError(
        f"ModelConfig.architecture must be llama, mistral or qwen2, got {self.architecture!r}"
      )

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def param_bytes_per_element(self) -> int:
    return jnp.dtype(self.jnp_param_dtype).itemsize

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


def param_count(config: ModelConfig, head: HeadKind = "lm") -> int:
  """Number of parameters of the model with the given head."""
  d, f, h, kv, hd = (
    config.hidden_size,
    config.intermediate_size,
    config.num_heads,
    config.num_kv_heads,
    config.head_dim,
  )
  attn = d * h * hd + 2 * d * kv * hd + h * hd * d
  if config.qkv_bias:
    attn += h * hd + 2 * kv * hd
  if config.o_bias:
    attn += d
  mlp = 3 * d * f
  norms = 2 * d
  per_layer = attn + mlp + norms
  embed = config.vocab_size * d
  if head == "lm":
    out = 0 if config.tie_embeddings else d * config.vocab_size
  else:
    out = d  # scalar value head, no bias (as HF's *ForSequenceClassification `score`)
  return embed + config.num_layers * per_layer + d + out


def kv_cache_bytes_per_token(config: ModelConfig) -> int:
  """Bytes of K and V cached per token, over all layers, in the compute dtype."""
  itemsize = jnp.dtype(config.jnp_dtype).itemsize
  return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


# Named sizes. `tiny` uses distinct dimensions (so a transposed axis cannot pass a test) that
# still divide 2, 4 and 8 where they get sharded. The real shapes follow the public configs of
# Llama-2 (7B, 13B, 70B) and Llama-3.2-1B, and an OPT-125m-sized Llama.
_SIZES: dict[str, ModelConfig] = {
  "tiny": ModelConfig(
    vocab_size=328,
    hidden_size=56,
    intermediate_size=152,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    max_position_embeddings=512,
  ),
  "125m": ModelConfig(
    vocab_size=32_000,
    hidden_size=768,
    intermediate_size=2048,
    num_layers=12,
    num_heads=12,
    num_kv_heads=12,
    head_dim=64,
  ),
  "1b": ModelConfig(
    vocab_size=128_256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500_000.0,
    tie_embeddings=True,
    param_dtype="bfloat16",
    dtype="bfloat16",
    rms_norm_eps=1e-5,
  ),
  "7b": ModelConfig(
    vocab_size=32_000,
    hidden_size=4096,
    intermediate_size=11_008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    param_dtype="bfloat16",
    dtype="bfloat16",
    rms_norm_eps=1e-5,
  ),
  "13b": ModelConfig(
    vocab_size=32_000,
    hidden_size=5120,
    intermediate_size=13_824,
    num_layers=40,
    num_heads=40,
    num_kv_heads=40,
    head_dim=128,
    param_dtype="bfloat16",
    dtype="bfloat16",
    rms_norm_eps=1e-5,
  ),
  "70b": ModelConfig(
    vocab_size=32_000,
    hidden_size=8192,
    intermediate_size=28_672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    param_dtype="bfloat16",
    dtype="bfloat16",
    rms_norm_eps=1e-5,
  ),
}


def model_sizes() -> tuple[str, ...]:
  return tuple(_SIZES)


def get_model_config(size: str, **overrides) -> ModelConfig:
  """The registered config called `size`, with optional field overrides."""
  if size not in _SIZES:
    raise ValueError(f"unknown model size {size!r}; known sizes: {', '.join(_SIZES)}")
  return _SIZES[size].replace(**overrides) if overrides else _SIZES[size]
