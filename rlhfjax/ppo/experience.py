"""Experience: rollout outputs laid out as sequences, and the advantages computed from scores.

Letters: b batch, p prompt length, t response length, s = p + t. Prompts are left padded to
`p`, responses right padded to `t`, so response token `j` of every row sits at column `p + j`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax import algorithms as alg
from rlhfjax.algorithms.masked import masked_mean


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sequences:
  """One rollout batch on the host, ready to be sent to every scoring role."""

  prompts: list[np.ndarray]
  responses: list[np.ndarray]
  tokens_bs: np.ndarray
  """int32 prompt + response tokens."""
  attention_mask_bs: np.ndarray
  """int32, 1 on real tokens."""
  response_mask_bt: np.ndarray
  """float32, 1 on response tokens."""
  rollout_logprobs_bt: np.ndarray
  """float32 log-probs of the sampled tokens under the rollout policy's sampling distribution."""

  @property
  def prompt_len(self) -> int:
    return self.tokens_bs.shape[1] - self.response_mask_bt.shape[1]

  @property
  def num_tokens(self) -> int:
    """Real prompt and response tokens: what tokens/s counts."""
    return int(self.attention_mask_bs.sum())

  def device_batch(self) -> dict[str, np.ndarray]:
    return {
      "tokens": self.tokens_bs,
      "attention_mask": self.attention_mask_bs,
      "response_mask": self.response_mask_bt,
    }


def assemble(
  prompts: Sequence[Sequence[int]],
  response_tokens: np.ndarray,
  response_lengths: np.ndarray,
  response_logprobs: np.ndarray,
  *,
  prompt_len: int,
  response_len: int,
  pad_id: int,
) -> Sequences:
  """Lays prompts (left padded) and responses (right padded) out as `[b, p + t]` sequences."""
  b = len(prompts)
  tokens = np.full((b, prompt_len + response_len), pad_id, np.int32)
  attention = np.zeros((b, prompt_len + response_len), np.int32)
  response_mask = np.zeros((b, response_len), np.float32)
  logprobs = np.zeros((b, response_len), np.float32)
  prompt_arrays, response_arrays = [], []
  for i, prompt in enumerate(prompts):
    prompt = np.asarray(prompt, np.int32)
    if not 0 < len(prompt) <= prompt_len:
      raise ValueError(f"prompt {i} has {len(prompt)} tokens; expected 1 to {prompt_len}")
    n = int(response_lengths[i])
    tokens[i, prompt_len - len(prompt) : prompt_len] = prompt
    attention[i, prompt_len - len(prompt) : prompt_len + n] = 1
    tokens[i, prompt_len : prompt_len + n] = response_tokens[i, :n]
    response_mask[i, :n] = 1.0
    logprobs[i, :n] = response_logprobs[i, :n]
    prompt_arrays.append(prompt)
    response_arrays.append(np.asarray(response_tokens[i, :n], np.int32))
  return Sequences(
    prompts=prompt_arrays,
    responses=response_arrays,
    tokens_bs=tokens,
    attention_mask_bs=attention,
    response_mask_bt=response_mask,
    rollout_logprobs_bt=logprobs,
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageSettings:
  """Static settings of `compute_advantages` (hashable: part of the compiled program)."""

  kl_estimator: str
  estimator: str
  gamma: float
  lam: float
  group_size: int
  whiten: bool


def compute_advantages(
  settings: AdvantageSettings,
  old_logp_bt: jax.Array,
  ref_logp_bt: jax.Array,
  values_bt: jax.Array,
  scores_b: jax.Array,
  mask_bt: jax.Array,
  kl_coef: jax.Array,
) -> dict[str, jax.Array]:
  """KL-shaped rewards, then advantages and returns, masked to response tokens.

    kl_t = estimator(logp_t, logp_ref_t);  r_t = -beta * kl_t + score * [t last]
  then GAE over `r` with the critic's values, or group-relative advantages of the scores.
  """
  kl_bt = alg.get_kl_estimator(settings.kl_estimator)(old_logp_bt, ref_logp_bt) * mask_bt
  rewards_bt = alg.shape_rewards(scores_b, kl_bt, mask_bt, kl_coef)
  if settings.estimator == "gae":
    advantages_bt, returns_bt = alg.gae(
      rewards_bt, values_bt, mask_bt, gamma=settings.gamma, lam=settings.lam
    )
  else:
    # Critic-free: the KL penalty enters each sample's score as its sum over tokens.
    total_b = scores_b - kl_coef * jnp.sum(kl_bt, axis=-1)
    advantages_bt, returns_bt = alg.group_relative(total_b, mask_bt, group_size=settings.group_size)
  if settings.whiten:
    advantages_bt = alg.whiten_advantages(advantages_bt, mask_bt)
  return {
    "advantages": advantages_bt,
    "returns": returns_bt,
    "kl/mean": jnp.sum(kl_bt) / jnp.maximum(jnp.sum(mask_bt[:, :1]), 1.0),
    "kl/per_token": masked_mean(kl_bt, mask_bt),
    "reward/shaped_mean": jnp.mean(jnp.sum(rewards_bt, axis=-1)),
  }
