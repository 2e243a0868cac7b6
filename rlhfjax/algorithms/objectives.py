"""Supervised objectives of the models PPO starts from: SFT token NLL and Bradley-Terry.

Letters: b batch, s sequence length, v vocab. Sequences are right-padded token rows; the logits
at column `j - 1` predict the token at column `j`, so column 0 (BOS) is never a target. A loss
mask marks, per column, the tokens to predict (SFT: the response and its EOS, not the prompt).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhfjax.algorithms.losses import token_logprobs
from rlhfjax.algorithms.masked import masked_mean


def _shifted(logits_bsv: jax.Array, tokens_bs: jax.Array, loss_mask_bs: jax.Array):
  """Predictions of columns 1..s-1 (from logits 0..s-2), their targets and mask."""
  return logits_bsv[:, :-1], tokens_bs[:, 1:], loss_mask_bs[:, 1:].astype(jnp.float32)


def masked_token_nll(
  logits_bsv: jax.Array, tokens_bs: jax.Array, loss_mask_bs: jax.Array
) -> jax.Array:
  """Mean negative log-likelihood of the masked tokens given their prefixes:

    L = sum_{b,j} m_{b,j} * -log p(x_{b,j} | x_{b,<j}) / sum_{b,j} m_{b,j},   j >= 1

  A token-level mean, so long responses weigh more than short ones (as in causal-LM
  pre-training); 0 when the mask is empty.
  """
  logits_btv, targets_bt, mask_bt = _shifted(logits_bsv, tokens_bs, loss_mask_bs)
  return masked_mean(-token_logprobs(logits_btv, targets_bt), mask_bt)


def token_accuracy(
  logits_bsv: jax.Array, tokens_bs: jax.Array, loss_mask_bs: jax.Array
) -> jax.Array:
  """Fraction of the masked tokens that are the arg-max of their prediction (greedy agreement)."""
  logits_btv, targets_bt, mask_bt = _shifted(logits_bsv, tokens_bs, loss_mask_bs)
  correct_bt = (jnp.argmax(logits_btv, axis=-1) == targets_bt).astype(jnp.float32)
  return masked_mean(correct_bt, mask_bt)


def bradley_terry_loss(chosen_b: jax.Array, rejected_b: jax.Array, valid_b: jax.Array) -> jax.Array:
  """Pairwise preference loss of a reward model (Bradley and Terry, 1952; Ouyang et al., 2022):

    L = mean_{valid b} -log sigmoid(r_chosen_b - r_rejected_b)

  computed as `softplus(r_rejected - r_chosen)`, which stays finite for any margin. Rows with
  `valid_b = 0` (padding of the last evaluation batch) do not count.
  """
  margin_b = chosen_b.astype(jnp.float32) - rejected_b.astype(jnp.float32)
  return masked_mean(jax.nn.softplus(-margin_b), valid_b.astype(jnp.float32))


def preference_accuracy(
  chosen_b: jax.Array, rejected_b: jax.Array, valid_b: jax.Array
) -> jax.Array:
  """Fraction of valid pairs whose chosen response scores strictly above the rejected one (a
  tie counts as wrong, so a constant reward model scores 0, not 0.5)."""
  correct_b = (chosen_b > rejected_b).astype(jnp.float32)
  return masked_mean(correct_b, valid_b.astype(jnp.float32))
