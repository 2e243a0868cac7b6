"""Supervised fine-tuning: next-token loss on the response tokens of demonstrations.

Letters: b batch, s sequence length, v vocab. A batch row is BOS, the prompt, the response and
EOS, right-padded to `max_len`: `tokens` int32 [b, s], `attention_mask` int32 [b, s] (1 on real
tokens) and `loss_mask` float32 [b, s] (1 on the response tokens and EOS, the tokens to predict).
The logits at column `j - 1` predict the token at column `j`. Prompt tokens are context only:
the policy PPO starts from should answer prompts, not learn to write them.

A packed micro-batch (`rlhfjax.training.packed`) weighs each predicted token by its share of
the whole batch's tokens (`slot_weight` = loss mask / N), so `sft_packed_loss` is the
micro-batch's contribution to the batch's token mean.

The flow that trains with them is `rlhfjax.flows.sft`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rlhfjax import algorithms as alg
from rlhfjax import models
from rlhfjax.config.model import ModelConfig


def sft_loss(
  params: Any, batch: dict[str, jax.Array], *, config: ModelConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean NLL of the response tokens (`loss_mask`) of one micro-batch, and token accuracy."""
  loss, accuracy = _nll_and_accuracy(params, batch, config)
  return loss, {"loss": loss, "token_accuracy": accuracy}


def _nll_and_accuracy(params, batch, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """Token-level mean NLL and accuracy of the `loss_mask` tokens (chunked over the sequence
  when `config.logprob_chunk_size` is set)."""
  stats = models.token_stats(config, params, batch["tokens"], batch["attention_mask"], 1)
  mask_bt = batch["loss_mask"][:, 1:].astype(jnp.float32)
  correct_bt = (stats.argmax_bt == batch["tokens"][:, 1:]).astype(jnp.float32)
  return alg.masked_mean(-stats.logp_bt, mask_bt), alg.masked_mean(correct_bt, mask_bt)


def sft_packed_loss(
  params: Any, micro: dict[str, jax.Array], *, config: ModelConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`sft_loss`'s NLL and accuracy as one packed micro-batch's contributions to the batch's
  token means (summed over micro-batches they are the batch's)."""
  stats = models.packed_token_stats(
    config, params, micro["tokens"], micro["positions"], micro["segments"]
  )
  targets_rw = jnp.pad(micro["tokens"][:, 1:], ((0, 0), (0, 1)))
  weight_rw = micro["slot_weight"]
  loss = jnp.sum(-stats.logp_bt * weight_rw)
  accuracy = jnp.sum((stats.argmax_bt == targets_rw).astype(jnp.float32) * weight_rw)
  return loss, {"loss": loss, "token_accuracy": accuracy}


def sft_eval_sums(
  params: Any, batch: dict[str, jax.Array], *, config: ModelConfig
) -> dict[str, jax.Array]:
  """Summed NLL and correct predictions over the response tokens of one eval batch, and their
  count: the split's token-level means are the sums over batches divided by the count."""
  count = jnp.sum(batch["loss_mask"][:, 1:].astype(jnp.float32))
  loss, accuracy = _nll_and_accuracy(params, batch, config)
  return {"loss": loss * count, "token_accuracy": accuracy * count, "count": count}
