"""PPO losses: clipped policy surrogate, clipped value loss, entropy bonus.

Letters: b batch, t response length, v vocab. All means are token-level over the response mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax.algorithms.masked import masked_mean
from rlhfjax.config import choices


def token_mean(x_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """`sum_{i,t} x_it m_it / sum_{i,t} m_it`: every token of the batch weighs the same."""
  return masked_mean(x_bt, mask_bt)


def seq_mean_token_mean(x_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """`1/B sum_i (sum_t x_it m_it / sum_t m_it)`: every sequence weighs the same (GRPO's
  original aggregation; short responses' tokens weigh more)."""
  per_seq_b = jnp.sum(x_bt * mask_bt, -1) / jnp.maximum(jnp.sum(mask_bt, -1), 1.0)
  return jnp.mean(per_seq_b)


def seq_mean_token_sum_norm(x_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """`1/B sum_i sum_t x_it m_it / T` with `T` the response capacity (Dr. GRPO, Liu et al.,
  2025): no length normalisation per sequence, so no bias towards long wrong answers."""
  return jnp.mean(jnp.sum(x_bt * mask_bt, -1)) / x_bt.shape[-1]


def aggregation_weights(aggregation: str, lengths_b, capacity: int):
  """Per-sequence token weights `w_i` (NumPy float32) with `sum_i w_i sum_t x_it m_it` equal to
  `LOSS_AGGREGATIONS[aggregation](x_bt, mask_bt)` over the batch of these response `lengths_b`
  (`capacity`: the response length `T`). A sum of weighted tokens splits over micro-batches
  however the sequences fall into them."""
  lengths_b = np.asarray(lengths_b, np.float64)
  b = len(lengths_b)
  if aggregation == "token_mean":
    w = np.full(b, 1.0 / max(lengths_b.sum(), 1.0))
  elif aggregation == "seq_mean_token_mean":
    w = 1.0 / (b * np.maximum(lengths_b, 1.0))
  elif aggregation == "seq_mean_token_sum_norm":
    w = np.full(b, 1.0 / (b * capacity))
  else:
    raise ValueError(f"unknown loss aggregation {aggregation!r}")
  return w.astype(np.float32)


LOSS_AGGREGATIONS = choices.implement(
  choices.LOSS_AGGREGATIONS,
  {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
  },
)
"""How per-token losses reduce to one number, by name: `fn(x_bt, mask_bt) -> scalar`."""


def clipped_policy_loss(
  logp_bt: jax.Array,
  old_logp_bt: jax.Array,
  advantages_bt: jax.Array,
  mask_bt: jax.Array,
  *,
  clip_eps: float,
  weights_bt: jax.Array | None = None,
  clip_eps_high: float | None = None,
  aggregation: str = "token_mean",
  loss: str = "ppo",
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO-clip (Schulman et al., 2017):

    rho_t = exp(logp_t - old_logp_t)
    L     = agg_t max(-A_t * rho_t, -A_t * clip(rho_t, 1 - eps_low, 1 + eps_high))

  `eps_low = clip_eps`; `eps_high = clip_eps_high` when given (DAPO's decoupled clip, Yu et al.,
  2025), else `clip_eps`. `agg` is one of `LOSS_AGGREGATIONS` (default: mean over tokens).

  With `weights_bt`, each token's loss is also multiplied by its weight, without gradient: the
  rollout correction's importance weights (`rlhfjax.algorithms.correction`: the engine's
  log-probs against the trainer's, or an older policy's when generating ahead).

  `loss` names another per-token policy loss of `POLICY_LOSSES` (GSPO, CISPO) in its place.

  Returns the loss and statistics: clip fraction and the approximate KL to `old`.
  """
  per_token_bt, terms = policy_token_terms(
    logp_bt,
    old_logp_bt,
    advantages_bt,
    clip_eps=clip_eps,
    weights_bt=weights_bt,
    clip_eps_high=clip_eps_high,
    loss=loss,
    sequence_mean=padded_sequence_mean(mask_bt),
  )
  stats = {
    "clipfrac": masked_mean(terms["clipped"], mask_bt),
    "approx_kl": masked_mean(terms["approx_kl"], mask_bt),
    "ratio_max": jnp.max(jnp.where(mask_bt > 0, terms["ratio"], -jnp.inf)),
  }
  return LOSS_AGGREGATIONS[aggregation](per_token_bt, mask_bt), stats


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """A policy loss by name (`ppo.policy_loss`), registered where it is defined
  (`register_policy_loss`)."""

  terms: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
  """`fn(logp_bt, old_logp_bt, advantages_bt, *, clip_eps, clip_eps_high, sequence_mean)` ->
  (per-token loss, {'clipped': 1.0 where clipped, 'ratio': the importance ratio}). Any layout:
  `sequence_mean(x_bt)` gives each response token the mean of `x` over its sequence's response
  tokens (padded rows or packed segments alike)."""
  sequence_advantages: bool = False
  """It reads one advantage per sequence (GSPO): estimators that give per-token ones are
  refused (`AdvantageEstimator.per_sequence`)."""


POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Policy losses by name; `rlhfjax.algorithms` imports every module that registers one."""


def register_policy_loss(name: str, *, sequence_advantages: bool = False):
  """Decorator: registers a policy loss's per-token `terms` function under `name`."""

  def wrap(fn):
    if name in POLICY_LOSSES:
      raise ValueError(f"policy loss {name!r} registered twice")
    POLICY_LOSSES[name] = PolicyLoss(fn, sequence_advantages)
    return fn

  return wrap


@register_policy_loss("ppo")
def ppo_clip_terms(logp_bt, old_logp_bt, advantages_bt, *, clip_eps, clip_eps_high, sequence_mean):
  """PPO-clip per token: `max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`."""
  del sequence_mean
  return clipped_surrogate(jnp.exp(logp_bt - old_logp_bt), advantages_bt, clip_eps, clip_eps_high)


def clipped_surrogate(ratio_bt, advantages_bt, clip_eps: float, clip_eps_high: float):
  """`max(-A r, -A clip(r, 1 - clip_eps, 1 + clip_eps_high))` per token, and its terms: where
  the clipped side is taken ('clipped') and the ratio."""
  unclipped_bt = -advantages_bt * ratio_bt
  clipped_bt = -advantages_bt * jnp.clip(ratio_bt, 1.0 - clip_eps, 1.0 + clip_eps_high)
  per_token_bt = jnp.maximum(unclipped_bt, clipped_bt)
  return per_token_bt, {
    "clipped": (clipped_bt > unclipped_bt).astype(jnp.float32),
    "ratio": ratio_bt,
  }


def padded_sequence_mean(mask_bt: jax.Array) -> Callable[[jax.Array], jax.Array]:
  """`sequence_mean` of padded rows: each row's mean over its response tokens (`mask_bt`)."""

  def mean(x_bt):
    row_b = jnp.sum(x_bt * mask_bt, -1) / jnp.maximum(jnp.sum(mask_bt, -1), 1.0)
    return jnp.broadcast_to(row_b[:, None], x_bt.shape)

  return mean


def policy_token_terms(
  logp_bt: jax.Array,
  old_logp_bt: jax.Array,
  advantages_bt: jax.Array,
  *,
  clip_eps: float,
  weights_bt: jax.Array | None = None,
  clip_eps_high: float | None = None,
  loss: str = "ppo",
  sequence_mean: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`clipped_policy_loss`'s per-token loss before aggregation (the policy loss `loss` of
  `POLICY_LOSSES`), and per-token statistics: 'clipped' (1.0 where the clip binds),
  'approx_kl' and 'ratio'. Any layout (`sequence_mean`: see `PolicyLoss.terms`)."""
  high = clip_eps if clip_eps_high is None else clip_eps_high
  per_token_bt, terms = POLICY_LOSSES[loss].terms(
    logp_bt,
    old_logp_bt,
    advantages_bt,
    clip_eps=clip_eps,
    clip_eps_high=high,
    sequence_mean=sequence_mean,
  )
  if weights_bt is not None:
    per_token_bt = per_token_bt * jax.lax.stop_gradient(weights_bt)
  terms = {**terms, "approx_kl": 0.5 * jnp.square(logp_bt - old_logp_bt)}
  return per_token_bt, terms


def clipped_value_loss(
  values_bt: jax.Array,
  old_values_bt: jax.Array,
  returns_bt: jax.Array,
  mask_bt: jax.Array,
  *,
  clip_eps: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped value loss:

  V^clip_t = V^old_t + clip(V_t - V^old_t, -eps, eps)
  L        = 1/2 mean_t max((V_t - R_t)^2, (V^clip_t - R_t)^2)
  """
  err_bt, clipped_bt = value_token_terms(values_bt, old_values_bt, returns_bt, clip_eps=clip_eps)
  loss = 0.5 * masked_mean(err_bt, mask_bt)
  return loss, {"clipfrac": masked_mean(clipped_bt, mask_bt)}


def value_token_terms(
  values_bt: jax.Array, old_values_bt: jax.Array, returns_bt: jax.Array, *, clip_eps: float
) -> tuple[jax.Array, jax.Array]:
  """`clipped_value_loss`'s per-token squared error (the larger of the clipped and unclipped
  ones) and where the clipped one is larger (1.0). Any layout.

  Within the clip range the clipped value is the value itself, not `V^old + (V - V^old)`,
  whose rounding would count some unclipped tokens as clipped."""
  moved_bt = values_bt - old_values_bt
  clipped_bt = jnp.where(
    jnp.abs(moved_bt) > clip_eps, old_values_bt + jnp.clip(moved_bt, -clip_eps, clip_eps), values_bt
  )
  err_bt = jnp.square(values_bt - returns_bt)
  err_clipped_bt = jnp.square(clipped_bt - returns_bt)
  return jnp.maximum(err_bt, err_clipped_bt), (err_clipped_bt > err_bt).astype(jnp.float32)


def entropy_from_logits(logits_btv: jax.Array) -> jax.Array:
  """`H_t = -sum_v p_v log p_v` per token, computed stably from logits."""
  logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)


def entropy_bonus(logits_btv: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """Mean entropy over response tokens; PPO subtracts `coef * bonus` from the loss."""
  return masked_mean(entropy_from_logits(logits_btv), mask_bt)


def token_logprobs(logits_btv: jax.Array, tokens_bt: jax.Array) -> jax.Array:
  """`log softmax(logits)[token]` per position, in float32."""
  logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp_btv, tokens_bt[..., None], axis=-1)[..., 0]
