"""Direct preference optimisation: DPO (sigmoid), its conservative / label-smoothed form, IPO.

Letters: b batch (preference pairs), s sequence length, v vocab. With sequence log-probs
`pi_c, pi_r` of the chosen and rejected responses under the policy and `ref_c, ref_r` under the
frozen reference, the implicit reward of a response is `beta * (pi - ref)` and

  h = (pi_c - ref_c) - (pi_r - ref_r).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from rlhfjax.algorithms.losses import token_logprobs
from rlhfjax.algorithms.objectives import _shifted
from rlhfjax.config import choices


def sequence_logprobs(logits_bsv: jax.Array, tokens_bs: jax.Array, loss_mask_bs: jax.Array):
  """`sum_j m_j log p(x_j | x_<j)` per row: a response's log-probability given its prompt
  (the loss mask marks the response tokens), `[b]`."""
  logits_btv, targets_bt, mask_bt = _shifted(logits_bsv, tokens_bs, loss_mask_bs)
  return jnp.sum(token_logprobs(logits_btv, targets_bt) * mask_bt, axis=-1)


def dpo_sigmoid(h_b: jax.Array, *, beta: float, label_smoothing: float = 0.0) -> jax.Array:
  """DPO (Rafailov et al., 2023) per pair: `-log sigmoid(beta h)`. With label smoothing `e`
  (conservative DPO, Mitchell 2023: the labels are flipped with probability `e`):
  `-(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)`."""
  return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h_b) - (
    label_smoothing * jax.nn.log_sigmoid(-beta * h_b)
  )


def dpo_ipo(h_b: jax.Array, *, beta: float, label_smoothing: float = 0.0) -> jax.Array:
  """IPO (Azar et al., 2023) per pair: `(h - 1 / (2 beta))^2`, a squared loss that does not
  push the margin to infinity on deterministic preferences."""
  del label_smoothing
  return jnp.square(h_b - 1.0 / (2.0 * beta))


DPO_LOSSES: dict[str, Callable[..., jax.Array]] = choices.implement(
  choices.DPO_LOSSES, {"sigmoid": dpo_sigmoid, "ipo": dpo_ipo}
)
"""Per-pair preference losses by name: `fn(h_b, *, beta, label_smoothing) -> loss_b`."""


def dpo_loss(
  policy_chosen_b: jax.Array,
  policy_rejected_b: jax.Array,
  ref_chosen_b: jax.Array,
  ref_rejected_b: jax.Array,
  valid_b: jax.Array,
  *,
  beta: float,
  loss: str = "sigmoid",
  label_smoothing: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean `DPO_LOSSES[loss]` over the valid pairs, and the implicit rewards' statistics:
  accuracy (chosen reward strictly above rejected) and margin (their mean difference)."""
  h_b = (policy_chosen_b - ref_chosen_b) - (policy_rejected_b - ref_rejected_b)
  per_pair_b = DPO_LOSSES[loss](h_b, beta=beta, label_smoothing=label_smoothing)
  n = jnp.maximum(jnp.sum(valid_b), 1.0)
  chosen_b = beta * (policy_chosen_b - ref_chosen_b)
  rejected_b = beta * (policy_rejected_b - ref_rejected_b)
  mean = lambda x: jnp.sum(x * valid_b) / n
  stats = {
    "accuracy": mean((chosen_b > rejected_b).astype(jnp.float32)),
    "margin": mean(chosen_b - rejected_b),
    "reward_chosen": mean(chosen_b),
    "reward_rejected": mean(rejected_b),
  }
  return mean(per_pair_b), stats
