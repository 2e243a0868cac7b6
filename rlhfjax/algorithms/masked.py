"""Reductions over response tokens: every RL statistic here ignores prompt and pad positions.

Letters: b batch, t response length. Masks are 1.0 on response tokens, 0.0 elsewhere.
"""

import jax
import jax.numpy as jnp


def masked_sum(x_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  return jnp.sum(x_bt * mask_bt)


def masked_mean(x_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """`sum(x * m) / sum(m)`, a token-level mean (0 when the mask is empty)."""
  return masked_sum(x_bt, mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1.0)


def masked_var(x_bt: jax.Array, mask_bt: jax.Array, unbiased: bool = True) -> jax.Array:
  """Variance over masked tokens; Bessel-corrected by default, as PPO implementations do."""
  mean = masked_mean(x_bt, mask_bt)
  var = masked_mean(jnp.square(x_bt - mean), mask_bt)
  if unbiased:
    n = jnp.sum(mask_bt)
    var = var * n / jnp.maximum(n - 1.0, 1.0)
  return var


def masked_whiten(
  x_bt: jax.Array, mask_bt: jax.Array, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
  """`(x - mean) / sqrt(var + eps)` over masked tokens; `shift_mean=False` keeps the mean.

  Positions outside the mask are set to 0.
  """
  mean = masked_mean(x_bt, mask_bt)
  whitened = (x_bt - mean) * jax.lax.rsqrt(masked_var(x_bt, mask_bt) + eps)
  if not shift_mean:
    whitened = whitened + mean
  return whitened * mask_bt
