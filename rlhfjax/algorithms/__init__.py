"""The RL maths of PPO and its critic-free variants, as small pure functions selected by name."""

from rlhfjax.algorithms.advantages import (
  ADVANTAGE_ESTIMATORS,
  gae,
  group_relative,
  last_token_onehot,
  shape_rewards,
  whiten_advantages,
)
from rlhfjax.algorithms.kl import (
  KL_CONTROLLERS,
  KL_ESTIMATORS,
  KLControllerState,
  adaptive_kl_update,
  fixed_kl_update,
  get_kl_estimator,
  kl_k1,
  kl_k2,
  kl_k3,
)
from rlhfjax.algorithms.losses import (
  clipped_policy_loss,
  clipped_value_loss,
  entropy_bonus,
  entropy_from_logits,
  token_logprobs,
)
from rlhfjax.algorithms.masked import masked_mean, masked_var, masked_whiten
from rlhfjax.algorithms.objectives import (
  bradley_terry_loss,
  masked_token_nll,
  preference_accuracy,
  token_accuracy,
)

__all__ = [
  "ADVANTAGE_ESTIMATORS",
  "KL_CONTROLLERS",
  "KL_ESTIMATORS",
  "KLControllerState",
  "adaptive_kl_update",
  "bradley_terry_loss",
  "clipped_policy_loss",
  "clipped_value_loss",
  "entropy_bonus",
  "entropy_from_logits",
  "fixed_kl_update",
  "gae",
  "get_kl_estimator",
  "group_relative",
  "kl_k1",
  "kl_k2",
  "kl_k3",
  "last_token_onehot",
  "masked_mean",
  "masked_token_nll",
  "masked_var",
  "masked_whiten",
  "preference_accuracy",
  "shape_rewards",
  "token_accuracy",
  "token_logprobs",
  "whiten_advantages",
]
