"""Reward-model training: pairwise Bradley-Terry loss on preference pairs.

Letters: b pairs, s sequence length. A batch holds, per pair, the prompt followed by the chosen
and by the rejected response (each with EOS), right-padded to `max_len`: `chosen_tokens`,
`chosen_mask`, `rejected_tokens`, `rejected_mask` int32 [b, s], and `valid` float32 [b] (0 on
the padding rows of the last eval batch). A sequence's score is the value head's output at its
last real token, as PPO reads the reward model (`models.sequence_reward`).

`packed_preference_loss` scores a packed micro-batch's sequences at each one's last slot
(`rlhfjax.training.packed`) and weighs its pairs by their share of the batch's pairs.

The flow that trains with them is `rlhfjax.flows.rm`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rlhfjax import algorithms as alg
from rlhfjax import models
from rlhfjax.config.model import ModelConfig
from rlhfjax.training import packed


def pair_scores(
  params: Any, batch: dict[str, jax.Array], *, config: ModelConfig
) -> tuple[jax.Array, jax.Array]:
  """Scores `[b]` of the chosen and the rejected sequences, from one forward pass over both
  (concatenated along the batch), so the two halves see the same parameters and shapes."""
  tokens_2bs = jnp.concatenate([batch["chosen_tokens"], batch["rejected_tokens"]], axis=0)
  mask_2bs = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0)
  values_2bs = models.forward_values(config, params, tokens_2bs, mask_2bs)
  scores_2b = models.sequence_reward(values_2bs, mask_2bs)
  b = batch["chosen_tokens"].shape[0]
  return scores_2b[:b], scores_2b[b:]


def preference_loss(
  params: Any, batch: dict[str, jax.Array], *, config: ModelConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Bradley-Terry loss of one micro-batch of pairs, with accuracy and the mean score margin."""
  chosen_b, rejected_b = pair_scores(params, batch, config=config)
  return _pair_metrics(chosen_b, rejected_b, batch["valid"])


def _pair_metrics(chosen_b, rejected_b, valid_b, scale=1.0):
  """The Bradley-Terry loss, accuracy, margin and ties (means over the valid pairs) times
  `scale`. 'ties': pairs scored exactly equal, which the accuracy counts as wrong (a model that
  starts with its value head at zero ties every pair: accuracy 0, ties 1)."""
  loss = alg.bradley_terry_loss(chosen_b, rejected_b, valid_b) * scale
  tied_b = (chosen_b == rejected_b).astype(jnp.float32)
  return loss, {
    "loss": loss,
    "accuracy": alg.preference_accuracy(chosen_b, rejected_b, valid_b) * scale,
    "margin": alg.masked_mean(chosen_b - rejected_b, valid_b) * scale,
    "ties": alg.masked_mean(tied_b, valid_b) * scale,
  }


def packed_preference_loss(
  params: Any, micro: dict[str, jax.Array], *, config: ModelConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`preference_loss` as one packed micro-batch's contribution to the batch's pair means:
  its pairs' (`chosen`, `rejected` batch rows) mean times their share of the valid pairs."""
  scores_b = packed.last_token_values(config, params, micro)
  member_g, scale = packed.pair_scale(micro)
  return _pair_metrics(scores_b[micro["chosen"]], scores_b[micro["rejected"]], member_g, scale)


def preference_eval_sums(
  params: Any, batch: dict[str, jax.Array], *, config: ModelConfig
) -> dict[str, jax.Array]:
  """Summed loss, correct pairs and margins over the valid pairs of one eval batch."""
  _, metrics = preference_loss(params, batch, config=config)
  count = jnp.sum(batch["valid"].astype(jnp.float32))
  return {key: value * count for key, value in metrics.items()} | {"count": count}
