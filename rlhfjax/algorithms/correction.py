"""The rollout/trainer mismatch: how far the engine's token log-probs are from the trainer's,
and the importance weights that correct the policy loss for it.

The engine samples with its own numerics (bf16, another attention kernel), and with generation
ahead (`ppo.async_rollout`, `ppo.max_staleness`) with older weights too; the trainer's
recomputation `old` of the same tokens differs from the engine's `rollout` log-probs. With
`log r_t = old_t - rollout_t` over the response tokens:

  tis  w_t = min(r_t, C)                       truncated importance sampling (Yao et al., 2025)
  mis  w_t = [1/C <= r_t <= C]                  masked: tokens outside the band weigh 0
  level 'sequence': r_t replaced by the sequence's geometric mean exp(mean_t log r_t), so a
       whole response is kept, truncated or dropped together.

The weight multiplies each token's policy loss, without gradient. A masked token weighs 0 in
the loss's sum and still counts in its normaliser (`ppo.loss_agg`), as every other weight does:
the aggregation stays the same function of the batch's lengths, and packing splits it alike.
With generation ahead this is decoupled PPO (Hilton et al., 2022): `old` is the proximal policy,
the engine's weights the behaviour one.

Letters: b batch, t response length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlhfjax.algorithms.losses import padded_sequence_mean
from rlhfjax.algorithms.masked import masked_mean
from rlhfjax.config import choices


def _log_ratios(old_bt, rollout_bt, mask_bt, level: str) -> jax.Array:
  """`log r` per token: the token's own, or its sequence's mean over the response."""
  log_r_bt = (old_bt - rollout_bt) * mask_bt
  return log_r_bt if level == "token" else padded_sequence_mean(mask_bt)(log_r_bt)


def _tis(log_r_bt, cap):
  weight_bt = jnp.minimum(jnp.exp(log_r_bt), cap)
  return weight_bt, (log_r_bt > jnp.log(cap)).astype(jnp.float32)


def _mis(log_r_bt, cap):
  inside_bt = jnp.abs(log_r_bt) <= jnp.log(cap)
  return inside_bt.astype(jnp.float32), 1.0 - inside_bt.astype(jnp.float32)


def _none(log_r_bt, cap):
  del cap
  return jnp.ones_like(log_r_bt), jnp.zeros_like(log_r_bt)


CORRECTIONS = choices.implement(
  choices.ROLLOUT_CORRECTIONS, {"none": _none, "tis": _tis, "mis": _mis}
)
"""`ppo.rollout_correction` by name: `fn(log_r_bt, cap) -> (weights_bt, corrected_bt)`, where
`corrected` is 1.0 on the tokens the correction truncated or masked."""


def rollout_correction(
  old_logp_bt: jax.Array,
  rollout_logp_bt: jax.Array,
  mask_bt: jax.Array,
  *,
  kind: str,
  level: str = "token",
  cap: float = 2.0,
) -> tuple[jax.Array, jax.Array]:
  """The importance weight of each response token (module docstring; 0 off the response),
  and the fraction of response tokens the correction truncated or masked."""
  if level not in choices.CORRECTION_LEVELS:
    raise ValueError(f"unknown correction level {level!r}")
  weight_bt, corrected_bt = CORRECTIONS[kind](
    _log_ratios(old_logp_bt, rollout_logp_bt, mask_bt, level), cap
  )
  return jax.lax.stop_gradient(weight_bt * mask_bt), masked_mean(corrected_bt, mask_bt)


def mismatch_stats(
  old_logp_bt: jax.Array, rollout_logp_bt: jax.Array, mask_bt: jax.Array
) -> dict[str, jax.Array]:
  """How far the engine's log-probs are from the trainer's, over response tokens:

  - `max`, `mean`: of |old - rollout|;
  - `k3`: the mean k3 estimate of KL(engine || trainer), `r - 1 - log r` with
    `log r = old - rollout` (the tokens were sampled by the engine; >= 0, 0 when they agree);
  - `seq_k3`: the same of each sequence's geometric-mean ratio, averaged over sequences with a
    response (what the sequence-level correction weighs by)."""
  log_r_bt = (old_logp_bt - rollout_logp_bt) * mask_bt
  k3 = lambda x: jnp.expm1(x) - x  # exact near 0, where exp(x) - 1 - x cancels
  has_b = (jnp.sum(mask_bt, -1) > 0).astype(jnp.float32)
  seq_b = _log_ratios(old_logp_bt, rollout_logp_bt, mask_bt, "sequence")[:, 0]
  return {
    "max": jnp.max(jnp.abs(log_r_bt)),
    "mean": masked_mean(jnp.abs(log_r_bt), mask_bt),
    "k3": masked_mean(k3(log_r_bt), mask_bt),
    "seq_k3": jnp.sum(k3(seq_b) * has_b) / jnp.maximum(jnp.sum(has_b), 1.0),
  }
