"""Per-token KL estimators against the reference policy, and KL coefficient controllers.

Letters: b batch, t response length. With `logr = logp_ref - logp` for tokens sampled from
the policy (Schulman, "Approximating KL divergence", 2020):
  k1 = -logr                  unbiased, high variance, can be negative;
  k2 = logr**2 / 2            biased, low variance;
  k3 = exp(logr) - 1 - logr   unbiased, low variance, always >= 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from rlhfjax.config import choices


def kl_k1(logp_bt: jax.Array, ref_logp_bt: jax.Array) -> jax.Array:
  """`k1 = logp - logp_ref`."""
  return logp_bt - ref_logp_bt


def kl_k2(logp_bt: jax.Array, ref_logp_bt: jax.Array) -> jax.Array:
  """`k2 = (logp_ref - logp)^2 / 2`."""
  return 0.5 * jnp.square(ref_logp_bt - logp_bt)


def kl_k3(logp_bt: jax.Array, ref_logp_bt: jax.Array) -> jax.Array:
  """`k3 = exp(logp_ref - logp) - 1 - (logp_ref - logp)`."""
  logr = ref_logp_bt - logp_bt
  return jnp.expm1(logr) - logr


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = choices.implement(
  choices.KL_ESTIMATORS, {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
)


def get_kl_estimator(name: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
  if name not in KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {name!r}; known: {', '.join(KL_ESTIMATORS)}")
  return KL_ESTIMATORS[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLControllerState:
  """The coefficient `beta` of the KL penalty, carried between iterations (and checkpointed)."""

  coef: float


def fixed_kl_update(
  state: KLControllerState, current_kl: float, num_samples: int, *, target: float, horizon: int
) -> KLControllerState:
  """A fixed coefficient: `beta` never changes."""
  del current_kl, num_samples, target, horizon
  return state


def adaptive_kl_update(
  state: KLControllerState, current_kl: float, num_samples: int, *, target: float, horizon: int
) -> KLControllerState:
  """Proportional controller of Ziegler et al. (2019):

    e = clip(KL / target - 1, -0.2, 0.2);   beta <- beta * (1 + e * n / horizon)

  where `n` is the number of samples in the batch just used.
  """
  error = min(max(current_kl / target - 1.0, -0.2), 0.2)
  return KLControllerState(coef=state.coef * (1.0 + error * num_samples / horizon))


KL_CONTROLLERS = choices.implement(
  choices.KL_CONTROLLERS, {"fixed": fixed_kl_update, "adaptive": adaptive_kl_update}
)
