"""Reward shaping and advantage estimators (GAE; group-relative baselines without a critic).

Letters: b batch, t response length. Responses are right-aligned to position 0: token t of a
response sits at column t and `mask_bt` is 1 on the first `length` columns.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from rlhfjax.algorithms.masked import masked_whiten


def last_token_onehot(mask_bt: jax.Array) -> jax.Array:
  """1.0 at each row's last response token (all zeros for an empty response)."""
  lengths_b = jnp.sum(mask_bt, axis=-1).astype(jnp.int32)
  columns_t = jnp.arange(mask_bt.shape[-1])
  return (columns_t[None, :] == (lengths_b[:, None] - 1)).astype(mask_bt.dtype)


def shape_rewards(
  scores_b: jax.Array, kl_bt: jax.Array, mask_bt: jax.Array, kl_coef: float | jax.Array
) -> jax.Array:
  """Per-token rewards `r_t = -beta * kl_t + score * [t is the last response token]`."""
  return (-kl_coef * kl_bt + scores_b[:, None] * last_token_onehot(mask_bt)) * mask_bt


def gae(
  rewards_bt: jax.Array, values_bt: jax.Array, mask_bt: jax.Array, *, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation (Schulman et al., 2016) over response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last token is 0)
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t

  Returns `(advantages_bt, returns_bt)`, zero outside the mask.
  """
  rewards_bt = rewards_bt * mask_bt
  values_bt = values_bt * mask_bt
  next_values_bt = jnp.pad(values_bt[:, 1:], ((0, 0), (0, 1)))
  next_mask_bt = jnp.pad(mask_bt[:, 1:], ((0, 0), (0, 1)))
  deltas_bt = rewards_bt + gamma * next_values_bt * next_mask_bt - values_bt

  def step(next_adv_b, xs):
    delta_b, next_m_b = xs
    adv_b = delta_b + gamma * lam * next_adv_b * next_m_b
    return adv_b, adv_b

  _, adv_tb = jax.lax.scan(
    step, jnp.zeros_like(deltas_bt[:, 0]), (deltas_bt.T, next_mask_bt.T), reverse=True
  )
  advantages_bt = adv_tb.T * mask_bt
  return advantages_bt, (advantages_bt + values_bt) * mask_bt


def group_relative(
  scores_b: jax.Array, mask_bt: jax.Array, *, group_size: int, eps: float = 1e-6
) -> tuple[jax.Array, jax.Array]:
  """Critic-free advantages (GRPO, Shao et al., 2024): each prompt's `group_size` samples are
  consecutive rows; `A_i = (s_i - mean(s_group)) / (std(s_group) + eps)` on every token.

  Returns `(advantages_bt, returns_bt)`; returns are the raw scores broadcast to tokens.
  """
  b = scores_b.shape[0]
  if b % group_size:
    raise ValueError(f"batch {b} is not a multiple of group_size {group_size}")
  groups = scores_b.reshape(b // group_size, group_size)
  normalised = (groups - groups.mean(-1, keepdims=True)) / (groups.std(-1, keepdims=True) + eps)
  advantages_bt = normalised.reshape(b)[:, None] * mask_bt
  return advantages_bt, scores_b[:, None] * mask_bt


def whiten_advantages(advantages_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """Zero-mean, unit-variance advantages over response tokens."""
  return masked_whiten(advantages_bt, mask_bt, shift_mean=True)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[jax.Array, jax.Array]]] = {
  "gae": gae,
  "group_relative": group_relative,
}
