"""GSPO, group sequence policy optimization (Zheng et al., 2025, Qwen): the importance ratio
and its clip are per sequence, not per token.

  s_i = exp(1/|y_i| sum_t (logp_it - old_it))        the length-normalised sequence ratio
  L   = agg max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))

in its token form (GSPO-token, the paper's section 4.3): each token's ratio is
`sg(s_i) * exp(logp_it - sg(logp_it))`, equal to `s_i` in value, whose gradient is
`s_i * grad logp_it`; averaged over a sequence's tokens (`ppo.loss_agg` seq_mean_token_mean, as
the shipped config) the gradient is GSPO's own, and the clip keeps or drops whole sequences.
The advantage must be one per sequence (group-relative or leave-one-out): the paper's clip
ranges are about 3e-4 and 4e-4 (`configs/gspo_tiny.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhfjax.algorithms.losses import clipped_surrogate, register_policy_loss


@register_policy_loss("gspo", sequence_advantages=True)
def gspo_terms(logp_bt, old_logp_bt, advantages_bt, *, clip_eps, clip_eps_high, sequence_mean):
  """Per-token GSPO-token loss; 'ratio' is the sequence's `s_i` on each of its tokens."""
  sg = jax.lax.stop_gradient
  log_s_bt = sequence_mean(sg(logp_bt - old_logp_bt))
  ratio_bt = jnp.exp(log_s_bt + logp_bt - sg(logp_bt))
  return clipped_surrogate(ratio_bt, advantages_bt, clip_eps, clip_eps_high)
