"""Supervised fine-tuning: next-token loss on the response tokens of demonstrations.

Letters: b batch, s sequence length, v vocab. A batch row is BOS, the prompt, the response and
EOS, right-padded to `max_len`: `tokens` int32 [b, s], `attention_mask` int32 [b, s] (1 on real
tokens) and `loss_mask` float32 [b, s] (1 on the response tokens and EOS, the tokens to predict).
The logits at column `j - 1` predict the token at column `j`. Prompt tokens are context only:
the policy PPO starts from should answer prompts, not learn to write them.

The trained policy is saved as the checkpoint item `SFTTrainer.item`; PPO loads its parameters
for the actor and the reference (`rlhfjax.checkpoint.restore_params`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax import algorithms as alg
from rlhfjax import models
from rlhfjax.config import SFTConfig
from rlhfjax.config.model import ModelConfig
from rlhfjax.data import pipeline
from rlhfjax.placement.spec import Role
from rlhfjax.training.supervised import Batch, SupervisedTrainer, TrainResult

__all__ = ["SFTTrainer", "TrainResult", "sft_eval_sums", "sft_loss"]


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


def sft_eval_sums(
  params: Any, batch: dict[str, jax.Array], *, config: ModelConfig
) -> dict[str, jax.Array]:
  """Summed NLL and correct predictions over the response tokens of one eval batch, and their
  count: the split's token-level means are the sums over batches divided by the count."""
  count = jnp.sum(batch["loss_mask"][:, 1:].astype(jnp.float32))
  loss, accuracy = _nll_and_accuracy(params, batch, config)
  return {"loss": loss * count, "token_accuracy": accuracy * count, "count": count}


class SFTTrainer(SupervisedTrainer):
  """SFT of the policy (the actor's model and head) on `cfg.data.demonstrations`."""

  cfg: SFTConfig

  role = Role.ACTOR
  head = "lm"
  name = "sft"
  item = "policy"
  data_kind = "demonstration"
  init_items = ("policy", "actor")
  batch_keys = ("tokens", "attention_mask", "loss_mask")
  batch_pipeline = staticmethod(pipeline.sft_batches)
  plot_key = "eval/loss"
  plot_name = "eval_loss.png"

  def data_file(self) -> str:
    return self.cfg.data.demonstrations

  def loss_fn(self, params, batch):
    return sft_loss(params, batch, config=self.model)

  def eval_sums(self, params, batch):
    return sft_eval_sums(params, batch, config=self.model)

  def tokens_per_batch(self, batch: Batch) -> int:
    return int(np.sum(batch["attention_mask"]))

  def example_batch(self, rows: int) -> Batch:
    shape = (rows, self.cfg.max_len)
    return {
      "tokens": np.zeros(shape, np.int32),
      "attention_mask": np.zeros(shape, np.int32),
      "loss_mask": np.zeros(shape, np.float32),
    }
