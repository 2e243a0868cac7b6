"""Token log-probs, entropies and argmaxes of the LM head, whole or in sequence chunks.

Letters: b batch, s sequence length, t predicted tokens, c tokens per chunk, m chunks,
d hidden, v vocab.

With 128k-token vocabularies the float32 logits of one 4k-token sequence take 2 GB, and the
backward pass of a softmax keeps them. The chunked path never builds them: a `lax.scan` over
chunks of `c` tokens computes one chunk's logits from the hidden states, reduces them to the
three per-token statistics, and is rematerialised (`jax.checkpoint`), so the backward pass
recomputes a chunk's logits instead of storing them. Only `[b, c, v]` logits are live at once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rlhfjax.config.model import ModelConfig
from rlhfjax.models import attention, transformer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenStats:
  """Per-token statistics of the model's distribution at each predicted position."""

  logp_bt: jax.Array
  """`log softmax(logits / T)[target]`, float32."""
  entropy_bt: jax.Array
  """Entropy of `softmax(logits / T)`, float32."""
  argmax_bt: jax.Array
  """Most likely token, int32."""


def stats_from_logits(logits_btv: jax.Array, targets_bt: jax.Array) -> TokenStats:
  """The statistics of already computed logits (float32 math)."""
  logits_btv = logits_btv.astype(jnp.float32)
  lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
  logp_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0] - lse_bt
  probs_btv = jnp.exp(logits_btv - lse_bt[..., None])
  entropy_bt = lse_bt - jnp.sum(probs_btv * logits_btv, axis=-1)
  return TokenStats(logp_bt=logp_bt, entropy_bt=entropy_bt, argmax_bt=first_argmax(logits_btv))


def first_argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` as int32 (the first largest entry; the first NaN if there is one),
  as a max and a min of indices.

  XLA's CPU backend runs `argmax`'s reduction of (value, index) pairs element by element: over a
  batch of 64 rows of an 8192-token vocabulary it took 1.16 ms, this 0.27 ms (2 cores,
  `docs/benchmarks.md`); accelerators run both as one pass."""
  v = x.shape[-1]
  hit = (x == jnp.max(x, axis=-1, keepdims=True)) | jnp.isnan(x)
  return jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def chunked_stats(
  hidden_btd: jax.Array,
  head_vd: jax.Array,
  targets_bt: jax.Array,
  *,
  chunk_size: int,
  temperature: float = 1.0,
  dtype=jnp.float32,
) -> TokenStats:
  """`stats_from_logits(hidden @ head.T / temperature, targets)`, `chunk_size` tokens at a time.

  The matmul runs in `dtype` with float32 accumulation, like the model's own head.
  """
  b, t, d = hidden_btd.shape
  # Under context parallelism (`attention.context_shards`) each of the p pieces of a row is
  # chunked on its own, the pieces side by side in every chunk: the scan then walks each
  # device's own tokens instead of gathering the row.
  p = attention.context_shards(t)
  tl = t // p
  c = min(chunk_size, tl)
  m = -(-tl // c)

  def chunks(x_bt, *rest):
    x = jnp.pad(
      x_bt.reshape(b, p, tl, *rest), ((0, 0), (0, 0), (0, m * c - tl)) + ((0, 0),) * len(rest)
    )
    return jnp.moveaxis(x.reshape(b, p, m, c, *rest), 2, 0)

  hidden_mbpcd = chunks(hidden_btd, d)
  targets_mbpc = chunks(targets_bt)
  head_vd = head_vd.astype(dtype)

  @jax.checkpoint
  def one_chunk(hidden_bpcd, targets_bpc):
    logits_bpcv = jnp.einsum(
      "bpcd,vd->bpcv", hidden_bpcd.astype(dtype), head_vd, preferred_element_type=jnp.float32
    )
    if temperature != 1.0:
      logits_bpcv = logits_bpcv / temperature
    return stats_from_logits(logits_bpcv, targets_bpc)

  _, stats_m = jax.lax.scan(lambda _, x: (None, one_chunk(*x)), None, (hidden_mbpcd, targets_mbpc))
  return jax.tree.map(
    lambda x_mbpc: jnp.moveaxis(x_mbpc, 0, 2).reshape(b, p, m * c)[:, :, :tl].reshape(b, t), stats_m
  )


def token_stats(
  config: ModelConfig,
  params,
  tokens_bs: jax.Array,
  attention_mask_bs: jax.Array,
  first: int,
  temperature: float = 1.0,
) -> TokenStats:
  """Statistics of predicting tokens `first .. s-1` (from columns `first-1 .. s-2`), `[b, s-first]`.

  Chunked when `config.logprob_chunk_size` is set, from the whole logits otherwise. A
  temperature of 0 (greedy) is scored as 1.
  """
  temperature = 1.0 if temperature in (0.0, 1.0) else temperature
  targets_bt = tokens_bs[:, first:]
  if config.logprob_chunk_size is None:
    logits_bsv = transformer.forward_logits(config, params, tokens_bs, attention_mask_bs)
    logits_btv = logits_bsv[:, first - 1 : -1]
    if temperature != 1.0:
      logits_btv = logits_btv / temperature
    return stats_from_logits(logits_btv, targets_bt)
  hidden_bsd = transformer.forward_hidden(config, params, tokens_bs, attention_mask_bs)
  chunked = functools.partial(
    chunked_stats,
    head_vd=transformer.lm_head_vd(config, params),
    chunk_size=config.logprob_chunk_size,
    temperature=temperature,
    dtype=jnp.dtype(config.dtype),
  )
  if attention.context_shards(tokens_bs.shape[1]) > 1:
    # The rows' tokens are split over 'context': chunk every column where it lies (each
    # device its own), then keep the predicted ones.
    stats = chunked(hidden_bsd, targets_bt=jnp.pad(tokens_bs[:, 1:], ((0, 0), (0, 1))))
    return jax.tree.map(lambda x_bs: x_bs[:, first - 1 : -1], stats)
  return chunked(hidden_bsd[:, first - 1 : -1], targets_bt=targets_bt)


def packed_token_stats(
  config: ModelConfig,
  params,
  tokens_bw: jax.Array,
  positions_bw: jax.Array,
  segments_bw: jax.Array,
  temperature: float = 1.0,
) -> TokenStats:
  """Statistics of packed rows (`rlhfjax.data.packing`), `[b, w]`: slot `c` is the prediction
  of the row's token `c + 1` (the last slot's, and a segment's last token's, are of no real
  token; callers read only the slots `PackedLayout.pred_src` names)."""
  temperature = 1.0 if temperature in (0.0, 1.0) else temperature
  targets_bw = jnp.pad(tokens_bw[:, 1:], ((0, 0), (0, 1)))
  hidden_only = config.logprob_chunk_size is not None
  out = transformer.forward_packed(
    config, params, tokens_bw, positions_bw, segments_bw, hidden_only=hidden_only
  )
  if not hidden_only:
    if temperature != 1.0:
      out = out / temperature
    return stats_from_logits(out, targets_bw)
  return chunked_stats(
    out,
    transformer.lm_head_vd(config, params),
    targets_bw,
    chunk_size=config.logprob_chunk_size,
    temperature=temperature,
    dtype=jnp.dtype(config.dtype),
  )
