"""Reward shaping and advantage estimators: GAE with a critic; critic-free GRPO, RLOO and
REINFORCE++.

Letters: b batch, t response length. Responses are right-aligned to position 0: token t of a
response sits at column t and `mask_bt` is 1 on its tokens the policy sampled: the first
`length` columns, less a conversation's observations (`rlhfjax.flows.environments`), which
the estimators step over as if absent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from rlhfjax.algorithms.masked import masked_whiten


def last_token_onehot(mask_bt: jax.Array) -> jax.Array:
  """1.0 at each row's last masked token (all zeros for an empty response)."""
  columns_t = jnp.arange(mask_bt.shape[-1])
  last_b = jnp.max(jnp.where(mask_bt > 0, columns_t[None, :], -1), axis=-1)
  return (columns_t[None, :] == last_b[:, None]).astype(mask_bt.dtype)


def shape_rewards(
  scores_b: jax.Array, kl_bt: jax.Array, mask_bt: jax.Array, kl_coef: float | jax.Array
) -> jax.Array:
  """Per-token rewards `r_t = -beta * kl_t + score * [t is the last response token]`; a
  `[b, t]` `scores_b` is placed on its tokens already: `r_t = -beta * kl_t + score_t`."""
  if scores_b.ndim == 2:
    return (-kl_coef * kl_bt + scores_b) * mask_bt
  return (-kl_coef * kl_bt + scores_b[:, None] * last_token_onehot(mask_bt)) * mask_bt


def place_on_tokens(
  scores_b: jax.Array, mask_bt: jax.Array, moved_b: jax.Array, moved_bt: jax.Array
) -> jax.Array:
  """`[b, t]`: each score on its last token, but the part `moved_b` of it (included in
  `scores_b`) on the tokens `moved_bt` says instead (a conversation's turn rewards, whose
  sum per row is `moved_b`)."""
  last_bt = last_token_onehot(mask_bt)
  return (scores_b - moved_b)[:, None] * last_bt + moved_bt


def gae(
  rewards_bt: jax.Array, values_bt: jax.Array, mask_bt: jax.Array, *, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation (Schulman et al., 2016) over response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last token is 0)
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t

  `t + 1` is the next masked token: unmasked ones (a conversation's observations) are stepped
  over, as if the sequence were the masked tokens alone. Returns `(advantages_bt, returns_bt)`,
  zero outside the mask.
  """
  values_bt = values_bt * mask_bt

  def step(carry, xs):
    next_adv_b, next_value_b = carry
    reward_b, value_b, m_b = xs
    adv_b = reward_b + gamma * next_value_b - value_b + gamma * lam * next_adv_b
    on_b = m_b > 0
    carry = (jnp.where(on_b, adv_b, next_adv_b), jnp.where(on_b, value_b, next_value_b))
    return carry, adv_b * m_b

  zeros_b = jnp.zeros_like(values_bt[:, 0])
  _, adv_tb = jax.lax.scan(
    step, (zeros_b, zeros_b), (rewards_bt.T * mask_bt.T, values_bt.T, mask_bt.T), reverse=True
  )
  advantages_bt = adv_tb.T
  return advantages_bt, (advantages_bt + values_bt) * mask_bt


def _groups(scores_b: jax.Array, group_size: int) -> jax.Array:
  b = scores_b.shape[0]
  if b % group_size:
    raise ValueError(f"batch {b} is not a multiple of group_size {group_size}")
  return scores_b.reshape(b // group_size, group_size)


def group_relative(
  scores_b: jax.Array,
  mask_bt: jax.Array,
  *,
  group_size: int,
  eps: float = 1e-6,
  normalize_std: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """Critic-free advantages (GRPO, Shao et al., 2024): each prompt's `group_size` samples are
  consecutive rows; `A_i = (s_i - mean(s_group)) / (std(s_group) + eps)` on every token.
  `normalize_std=False` keeps `A_i = s_i - mean(s_group)` (Dr. GRPO, Liu et al., 2025).

  Returns `(advantages_bt, returns_bt)`; returns are the raw scores broadcast to tokens.
  """
  groups = _groups(scores_b, group_size)
  centred = groups - groups.mean(-1, keepdims=True)
  if normalize_std:
    centred = centred / (groups.std(-1, keepdims=True) + eps)
  advantages_bt = centred.reshape(-1)[:, None] * mask_bt
  return advantages_bt, scores_b[:, None] * mask_bt


def leave_one_out(
  scores_b: jax.Array, mask_bt: jax.Array, *, group_size: int
) -> tuple[jax.Array, jax.Array]:
  """RLOO (Ahmadian et al., 2024): each sample's baseline is the mean score of the other
  `k - 1` samples of its prompt,

    A_i = s_i - 1/(k-1) sum_{j != i} s_j = k/(k-1) (s_i - mean(s_group)),

  on every token. Needs `group_size` >= 2. Returns `(advantages_bt, returns_bt)`.
  """
  if group_size < 2:
    raise ValueError(f"leave-one-out baselines need group_size >= 2, got {group_size}")
  groups = _groups(scores_b, group_size)
  others = (groups.sum(-1, keepdims=True) - groups) / (group_size - 1)
  advantages_bt = (groups - others).reshape(-1)[:, None] * mask_bt
  return advantages_bt, scores_b[:, None] * mask_bt


def discounted_returns(rewards_bt: jax.Array, mask_bt: jax.Array, *, gamma: float) -> jax.Array:
  """`R_t = sum_{k >= t} gamma^(k - t) r_k` over each row's response tokens: as `gae`, the
  unmasked ones (a conversation's observations) are stepped over, `k` counting masked tokens."""

  def step(next_b, xs):
    r_b, m_b = xs
    ret_b = (r_b + gamma * next_b) * m_b
    return jnp.where(m_b > 0, ret_b, next_b), ret_b

  _, ret_tb = jax.lax.scan(
    step, jnp.zeros_like(rewards_bt[:, 0]), ((rewards_bt * mask_bt).T, mask_bt.T), reverse=True
  )
  return ret_tb.T * mask_bt


def reinforce_pp(
  rewards_bt: jax.Array, mask_bt: jax.Array, *, gamma: float
) -> tuple[jax.Array, jax.Array]:
  """REINFORCE++ (Hu, 2025): returns of the KL-shaped token rewards, whitened over every
  response token of the batch (the baseline is the batch, not a critic or a group),

    R_t = sum_{k >= t} gamma^(k-t) r_k;   A_t = (R_t - mean_batch R) / std_batch R.

  Returns `(advantages_bt, returns_bt)`.
  """
  returns_bt = discounted_returns(rewards_bt, mask_bt, gamma=gamma)
  return masked_whiten(returns_bt, mask_bt), returns_bt


def whiten_advantages(advantages_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """Zero-mean, unit-variance advantages over response tokens."""
  return masked_whiten(advantages_bt, mask_bt, shift_mean=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EstimatorSettings:
  """Static settings of the estimators (hashable: part of a compiled program)."""

  gamma: float = 1.0
  lam: float = 0.95
  group_size: int = 1
  normalize_std: bool = True


Estimator = Callable[..., tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
  """An advantage estimator by name (`ppo.advantage`), registered where it is defined
  (`register_estimator`)."""

  estimate: Estimator
  """`fn(scores_b, kl_bt, values_bt, mask_bt, kl_coef, settings) -> (advantages_bt,
  returns_bt)`. The KL to the reference enters as a reward (`kl_coef`, 0 when it is a loss
  term): per token for the token-level estimators (GAE, REINFORCE++), summed per sample for
  the sample-level ones (GRPO, RLOO). With `token_rewards`, `scores_b` may be `[b, t]`: each
  sample's score placed on its tokens (`shape_rewards`)."""
  critic: bool = False
  """It reads the critic's values: the flow places and trains a critic."""
  per_sequence: bool = False
  """It gives each sample one advantage, on all its tokens (what GSPO reads)."""
  groups: bool = False
  """It compares the samples of a prompt: `ppo.group_size` must be at least 2."""
  token_rewards: bool = False
  """It reads rewards per token: a conversation's environment rewards go on the tokens that
  ended their turns (`scores_b` `[b, t]`) instead of all on the last token."""


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
"""Advantage estimators by name; `rlhfjax.algorithms` imports every module that registers one."""


def register_estimator(name: str, **properties: bool):
  """Decorator: registers an advantage estimator under `name` with its `AdvantageEstimator`
  properties (`critic`, `per_sequence`, `groups`, `token_rewards`)."""

  def wrap(fn: Estimator) -> Estimator:
    if name in ADVANTAGE_ESTIMATORS:
      raise ValueError(f"advantage estimator {name!r} registered twice")
    ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(fn, **properties)
    return fn

  return wrap


@register_estimator("gae", critic=True, token_rewards=True)
def _gae_of_scores(scores_b, kl_bt, values_bt, mask_bt, kl_coef, s: EstimatorSettings):
  rewards_bt = shape_rewards(scores_b, kl_bt, mask_bt, kl_coef)
  return gae(rewards_bt, values_bt, mask_bt, gamma=s.gamma, lam=s.lam)


@register_estimator("group_relative", per_sequence=True, groups=True)
def _grpo_of_scores(scores_b, kl_bt, values_bt, mask_bt, kl_coef, s: EstimatorSettings):
  del values_bt
  total_b = scores_b - kl_coef * jnp.sum(kl_bt, axis=-1)
  return group_relative(total_b, mask_bt, group_size=s.group_size, normalize_std=s.normalize_std)


@register_estimator("rloo", per_sequence=True, groups=True)
def _rloo_of_scores(scores_b, kl_bt, values_bt, mask_bt, kl_coef, s: EstimatorSettings):
  del values_bt
  total_b = scores_b - kl_coef * jnp.sum(kl_bt, axis=-1)
  return leave_one_out(total_b, mask_bt, group_size=s.group_size)


@register_estimator("reinforce_pp", token_rewards=True)
def _reinforce_pp_of_scores(scores_b, kl_bt, values_bt, mask_bt, kl_coef, s: EstimatorSettings):
  del values_bt
  rewards_bt = shape_rewards(scores_b, kl_bt, mask_bt, kl_coef)
  return reinforce_pp(rewards_bt, mask_bt, gamma=s.gamma)
