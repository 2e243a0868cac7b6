"""CISPO, clipped importance-sampling policy optimization (MiniMax-M1, 2025): a REINFORCE-style
token loss weighed by the clipped importance ratio, without gradient through the weight, so no
token's gradient is dropped by the clip (PPO's clip zeroes the gradient of clipped tokens,
often the rare tokens that start a reflection).

  r_t = exp(logp_t - old_t)
  L   = agg -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t

MiniMax-M1 clips only from above: `configs/cispo_tiny.py` sets `ppo.clip_eps=1` (a lower bound
of 0, never reached) and the upper bound by `ppo.clip_eps_high`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhfjax.algorithms.losses import register_policy_loss


@register_policy_loss("cispo")
def cispo_terms(logp_bt, old_logp_bt, advantages_bt, *, clip_eps, clip_eps_high, sequence_mean):
  """Per-token CISPO loss; 'clipped' marks the tokens whose weight the clip bounds."""
  del sequence_mean
  ratio_bt = jnp.exp(logp_bt - old_logp_bt)
  weight_bt = jax.lax.stop_gradient(jnp.clip(ratio_bt, 1.0 - clip_eps, 1.0 + clip_eps_high))
  per_token_bt = -weight_bt * advantages_bt * logp_bt
  clipped = (ratio_bt < 1.0 - clip_eps) | (ratio_bt > 1.0 + clip_eps_high)
  return per_token_bt, {"clipped": clipped.astype(jnp.float32), "ratio": ratio_bt}
