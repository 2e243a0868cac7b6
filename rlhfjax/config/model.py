"""Model hyper-parameters and the registry of named sizes, without JAX.

One decoder-only transformer covers the Llama family (Llama, Mistral, Qwen2, Qwen3): the
differences are all fields here (q/k/v bias, q/k norms, tied embeddings, rotary theta, sliding
window), and each Hugging Face family says how its config.json sets them
(`rlhfjax.config.families`). Dtypes are names; the models layer makes them JAX dtypes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from rlhfjax.config import families

HeadKind = Literal["lm", "value"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes per element of each dtype a model may store or compute in."""

REMAT_POLICIES = (
  "none",
  "full",
  "dots_saveable",
  "dots_with_no_batch_dims_saveable",
  "save_attention_out",
)
"""Names of `ModelConfig.remat`: keep every activation ('none'), keep only each layer's input
('full'), keep matmul outputs ('dots_saveable'), keep matmul outputs without batch dimensions
(the weight matmuls, not attention's: 'dots_with_no_batch_dims_saveable'), or keep each layer's
attention output ('save_attention_out')."""

ATTENTION_IMPLS = ("auto", "blockwise", "pallas_gpu", "splash", "xla", "einsum")
"""Names of `ModelConfig.attention` (`rlhfjax.models.attention`): flash attention in XLA on any
backend ('blockwise': memory linear in the sequence), JAX's Pallas flash kernels with segment
ids ('pallas_gpu': Triton, no sliding window; 'splash': TPU), `jax.nn.dot_product_attention`
over a mask built from the ids ('xla') or the plain einsum-softmax-einsum path ('einsum'), both
quadratic in memory; 'auto' (a Pallas kernel where it applies, 'xla' for decode steps,
'blockwise' elsewhere)."""

ROPE_TYPES = ("llama3", "linear", "dynamic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Rotary frequency scaling, as Hugging Face's `rope_parameters` / `rope_scaling`.

  * 'linear': every inverse frequency divided by `factor` (positions interpolated);
  * 'dynamic': NTK scaling of the base when a batch runs past `max_position_embeddings`:
    `theta * (factor * L / max_pos - (factor - 1)) ** (n / (n - 2))`, `L` = the batch's
    largest position + 1 (stateless: Hugging Face's model keeps a grown base afterwards);
  * 'llama3': low frequencies divided by `factor`, high ones kept, a smooth blend between
    (Llama 3.1 / 3.2 / 3.3).
  """

  type: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.type not in ROPE_TYPES:
      raise ValueError(
        f"RopeScaling.type must be one of {', '.join(ROPE_TYPES)}, got {self.type!r}"
      )
    if self.factor < 1:
      raise ValueError(f"RopeScaling.factor must be >= 1, got {self.factor}")
    if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
      raise ValueError(
        "RopeScaling needs high_freq_factor > low_freq_factor > 0 for 'llama3', got "
        f"{self.high_freq_factor} and {self.low_freq_factor}"
      )


def _hf(key: str, *, missing: Callable[[Mapping[str, Any]], Any] | None = None, **field) -> Any:
  """A field a Hugging Face config.json holds as is under `key` (`rlhfjax.config.hf` reads and
  writes every such field); `missing(config_json)` is its value when config.json has none."""
  return dataclasses.field(metadata={"hf": key, "missing": missing}, **field)


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The projections LoRA adapts by default: attention's q/k/v/o and the MLP's gate/up/down."""
LORA_EXTRA_TARGETS = ("lm_head",)
"""Adaptable on request: the LM head (an untied one), PEFT's `lm_head` target."""
QUANTIZATIONS = ("int8", "nf4")
"""Stored forms of a QLoRA base's kernels (`ModelConfig.quantization`)."""
NF4_BLOCK = 64
"""Weights per absmax scale of an 'nf4' kernel, along its last contracted dimension."""


def nf4_block(n: int) -> int:
  """Weights per scale of an 'nf4' kernel whose last contracted dimension has `n`:
  `gcd(n, NF4_BLOCK)`, at least 4 (two codes a byte, and blocks of two would be ambiguous)."""
  block = math.gcd(n, NF4_BLOCK)
  if block < 4:
    raise ValueError(f"nf4 quantizes blocks of 4 to {NF4_BLOCK} weights: {n} is not divisible by 4")
  return block


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """Low-rank adapters on the projections: `W x + (alpha / rank) B (A x)`, A `[in, rank]`
  random and B `[rank, out]` zero at the start (the model starts as its base), both float32;
  the base weights stay frozen (`rlhfjax.models.lora`)."""

  rank: int
  alpha: float = 16.0
  targets: tuple[str, ...] = LORA_TARGETS
  """Which projections carry adapters (`LORA_TARGETS`)."""

  def __post_init__(self):
    if self.rank < 1:
      raise ValueError(f"LoraConfig.rank must be >= 1, got {self.rank}")
    if not self.alpha > 0:
      raise ValueError(f"LoraConfig.alpha must be > 0, got {self.alpha}")
    known = LORA_TARGETS + LORA_EXTRA_TARGETS
    unknown = [t for t in self.targets if t not in known]
    if unknown or not self.targets:
      raise ValueError(
        f"LoraConfig.targets must name some of {', '.join(known)}, got {self.targets}"
      )

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Shape and numerics of one decoder-only transformer."""

  vocab_size: int = _hf("vocab_size")
  """Rows of the token embedding (and columns of the LM head)."""
  hidden_size: int = _hf("hidden_size")
  """Width of the residual stream, `d` in einsum strings."""
  intermediate_size: int = _hf("intermediate_size")
  """Width of the SwiGLU MLP, `f` in einsum strings."""
  num_layers: int = _hf("num_hidden_layers")
  num_heads: int = _hf("num_attention_heads")
  """Query heads."""
  num_kv_heads: int = _hf("num_key_value_heads", missing=lambda hf: hf["num_attention_heads"])
  """Key/value heads (grouped-query attention); must divide `num_heads`."""
  head_dim: int = _hf("head_dim", missing=lambda hf: hf["hidden_size"] // hf["num_attention_heads"])
  rope_theta: float = 10_000.0
  rms_norm_eps: float = _hf("rms_norm_eps", default=1e-5, missing=lambda hf: 1e-6)  # HF's default
  qkv_bias: bool = False
  """Bias on the q/k/v projections (Qwen2; Llama with `attention_bias`)."""
  o_bias: bool = False
  """Bias on the attention output projection (Llama with `attention_bias`, not Qwen2)."""
  tie_embeddings: bool = _hf("tie_word_embeddings", default=False)
  """LM head reuses the input embedding matrix."""
  sliding_window: int | None = None
  """Mistral-style local attention: a query sees at most this many most recent keys."""
  max_position_embeddings: int = _hf("max_position_embeddings", default=4096)
  param_dtype: str = "float32"
  """Storage dtype of parameters: 'float32' or 'bfloat16'."""
  dtype: str = "float32"
  """Compute dtype of activations and matmuls: 'float32' or 'bfloat16'."""
  remat: str = "none"
  """Rematerialisation of each scanned layer in the backward pass: one of `REMAT_POLICIES`."""
  attention: str = "auto"
  """Attention kernel: one of `ATTENTION_IMPLS`."""
  rope_scaling: RopeScaling | None = None
  logprob_chunk_size: int | None = None
  """Compute log-probs, entropy and the LM loss `logprob_chunk_size` tokens at a time from the
  hidden states (the fp32 logits of one chunk live at once, recomputed in the backward pass);
  None: the whole `[b, t, v]` logits at once."""
  qk_norm: bool = False
  """RMSNorm over the head dimension of queries and keys before the rotary (Qwen3)."""
  architecture: str = "llama"
  """The Hugging Face family (`rlhfjax.config.families`) used when exporting."""
  bos_token_id: int | None = _hf("bos_token_id", default=None)
  eos_token_ids: tuple[int, ...] = ()
  """Stop tokens the checkpoint declares (HF `eos_token_id`, one or several)."""
  pad_token_id: int | None = _hf("pad_token_id", default=None)
  lora: LoraConfig | None = None
  """Low-rank adapters over frozen base weights (`LoraConfig`); None: every weight trains."""
  quantized: tuple[str, ...] = ()
  """Projections (names of `LORA_TARGETS` and `lm_head`) whose frozen base kernels are stored
  quantized (`quantization`) and dequantized in the forward (QLoRA's memory saving,
  `rlhfjax.models.lora.quantize_kernel`): the adapted projections of a run with
  `model.lora.quantize`, and the same of a reference that scores the actor's base."""
  quantization: str = "int8"
  """How the `quantized` kernels are stored: 'int8' (a float32 scale per output channel) or
  'nf4' (QLoRA's 4-bit NormalFloat, two codes a byte, a uint8 scale per block of up to 64
  contracted weights and a float32 one per output channel); one of `QUANTIZATIONS`."""

  def __post_init__(self):
    unknown = [t for t in self.quantized if t not in LORA_TARGETS + LORA_EXTRA_TARGETS]
    if unknown:
      raise ValueError(f"ModelConfig.quantized names unknown projections {unknown}")
    if self.quantization not in QUANTIZATIONS:
      raise ValueError(
        f"ModelConfig.quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
      )
    if self.quantization == "nf4":
      # Each quantized kernel's last contracted dimension splits into blocks (`nf4_block`).
      for target in self.quantized:
        size = {"o": "head_dim", "down": "intermediate_size"}.get(target, "hidden_size")
        if getattr(self, size) % 4:
          raise ValueError(
            f"nf4 quantizes {target}_proj in blocks of 4 to {NF4_BLOCK} along its {size}, "
            f"{getattr(self, size)}, which is not divisible by 4"
          )
    for name in SHAPE_FIELDS:
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
      )
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in DTYPE_BYTES:
        raise ValueError(
          f"ModelConfig.{name} must be one of {sorted(DTYPE_BYTES)}, got {getattr(self, name)!r}"
        )
    if self.architecture not in families.FAMILIES:
      raise ValueError(
        f"ModelConfig.architecture must be one of {', '.join(families.FAMILIES)}, "
        f"got {self.architecture!r}"
      )
    if self.remat not in REMAT_POLICIES:
      raise ValueError(
        f"ModelConfig.remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}"
      )
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(
        f"ModelConfig.attention must be one of {', '.join(ATTENTION_IMPLS)}, got {self.attention!r}"
      )
    if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
      raise ValueError(
        f"ModelConfig.logprob_chunk_size must be >= 1 or None, got {self.logprob_chunk_size}"
      )
    if self.lora is not None:
      if not isinstance(self.lora, LoraConfig):
        raise ValueError(f"ModelConfig.lora must be a LoraConfig or None, got {self.lora!r}")
      if "lm_head" in self.lora.targets and self.tie_embeddings:
        raise ValueError("LoRA target 'lm_head': this model's head is its tied embedding")
      smallest = min(self.hidden_size, self.num_kv_heads * self.head_dim)
      if self.lora.rank > smallest:
        raise ValueError(
          f"LoRA rank {self.lora.rank} exceeds the smallest adapted projection's dimension "
          f"({smallest})"
        )
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(
        f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
      )

  @property
  def param_bytes_per_element(self) -> int:
    return DTYPE_BYTES[self.param_dtype]

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


SHAPE_FIELDS = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
)
"""The fields that fix the parameters' shapes (each >= 1)."""
NUMERICS_FIELDS = ("dtype", "param_dtype", "remat", "attention", "logprob_chunk_size")
"""How a model is computed: a user may choose them for any checkpoint, and a resume may change
them."""
TOKEN_FIELDS = ("bos_token_id", "eos_token_ids", "pad_token_id")
"""The special token ids a checkpoint declares: the tokenizer's, not the network's."""
# The family name only picks the export format: with the fields above excepted, what is left
# is what the network computes from given weights.
ADAPTER_FIELDS = ("lora", "quantized", "quantization")
"""What a run trains on top of the weights (not the weights' architecture)."""
ARCHITECTURE_FIELDS = tuple(
  f.name
  for f in dataclasses.fields(ModelConfig)
  if f.name not in (*NUMERICS_FIELDS, *TOKEN_FIELDS, *ADAPTER_FIELDS, "architecture")
)
"""The fields a checkpoint's weights are trained for: two models run the same weights the same
way only when these agree (`check_same_architecture`)."""


class ArchitectureMismatch(ValueError):
  """A checkpoint's architecture differs from the config's."""


def architecture_diff(
  found: ModelConfig, expected: ModelConfig
) -> list[tuple[str, object, object]]:
  """(field, found, expected) for every architecture field where the two configs differ."""
  return [
    (name, getattr(found, name), getattr(expected, name))
    for name in ARCHITECTURE_FIELDS
    if getattr(found, name) != getattr(expected, name)
  ]


def check_same_architecture(found: ModelConfig, expected: ModelConfig, where: str) -> None:
  """Raises `ArchitectureMismatch`, one line naming every differing field and both values:
  `where` (a checkpoint's config.json) has ..., the config has ...

  Raises:
    ArchitectureMismatch: the configs differ in an architecture field.
  """
  diff = architecture_diff(found, expected)
  if diff:
    parts = "; ".join(f"{name}={a}, the config has {b}" for name, a, b in diff)
    raise ArchitectureMismatch(f"{where} has {parts}")


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
  norms = 2 * d + (2 * hd if config.qk_norm else 0)
  per_layer = attn + mlp + norms
  embed = config.vocab_size * d
  if head == "lm":
    out = 0 if config.tie_embeddings else d * config.vocab_size
  else:
    out = d  # scalar value head, no bias (as HF's *ForSequenceClassification `score`)
  return embed + config.num_layers * per_layer + d + out


def kv_cache_bytes_per_token(config: ModelConfig) -> int:
  """Bytes of K and V cached per token, over all layers, in the compute dtype."""
  itemsize = DTYPE_BYTES[config.dtype]
  return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


# The real sizes train in mixed precision: fp32 master parameters (and so fp32 Adam moments),
# bf16 activations and matmuls, and every layer rematerialised in the backward pass.
_REAL_SIZE_DEFAULTS = dict(param_dtype="float32", dtype="bfloat16", remat="full")

# Named sizes. `tiny` uses distinct dimensions (so a transposed axis cannot pass a test) that
# still divide 2, 4 and 8 where they get sharded. The real shapes follow the public configs of
# Llama-2 (7B, 13B, 70B) and Llama-3.2-1B (with its llama3 rope scaling), and an OPT-125m-sized
# Llama.
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
    rms_norm_eps=1e-5,
    rope_scaling=RopeScaling(
      type="llama3",
      factor=32.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=8192,
    ),
    max_position_embeddings=131_072,
    **_REAL_SIZE_DEFAULTS,
  ),
  "7b": ModelConfig(
    vocab_size=32_000,
    hidden_size=4096,
    intermediate_size=11_008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    rms_norm_eps=1e-5,
    **_REAL_SIZE_DEFAULTS,
  ),
  "13b": ModelConfig(
    vocab_size=32_000,
    hidden_size=5120,
    intermediate_size=13_824,
    num_layers=40,
    num_heads=40,
    num_kv_heads=40,
    head_dim=128,
    rms_norm_eps=1e-5,
    **_REAL_SIZE_DEFAULTS,
  ),
  "70b": ModelConfig(
    vocab_size=32_000,
    hidden_size=8192,
    intermediate_size=28_672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    **_REAL_SIZE_DEFAULTS,
  ),
}


def model_sizes() -> tuple[str, ...]:
  return tuple(_SIZES)


def get_model_config(size: str, **overrides) -> ModelConfig:
  """The registered config called `size`, with optional field overrides."""
  if size not in _SIZES:
    raise ValueError(f"unknown model size {size!r}; known sizes: {', '.join(_SIZES)}")
  return _SIZES[size].replace(**overrides) if overrides else _SIZES[size]
