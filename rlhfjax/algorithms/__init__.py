"""The RL maths of PPO and its critic-free variants, as small pure functions selected by name.

A policy loss or an advantage estimator registers itself where it is defined
(`losses.register_policy_loss`, `advantages.register_estimator`); every module of this package
is imported here, so that `POLICY_LOSSES` and `ADVANTAGE_ESTIMATORS` hold them all: a new one
is one file."""

import importlib
import pkgutil

from rlhfjax.algorithms.advantages import (
  ADVANTAGE_ESTIMATORS,
  AdvantageEstimator,
  EstimatorSettings,
  discounted_returns,
  gae,
  group_relative,
  last_token_onehot,
  leave_one_out,
  place_on_tokens,
  reinforce_pp,
  shape_rewards,
  whiten_advantages,
)
from rlhfjax.algorithms.correction import mismatch_stats, rollout_correction
from rlhfjax.algorithms.dapo import groups_with_signal, overlong_penalty
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
  LOSS_AGGREGATIONS,
  POLICY_LOSSES,
  aggregation_weights,
  clipped_policy_loss,
  clipped_value_loss,
  entropy_bonus,
  entropy_from_logits,
  padded_sequence_mean,
  policy_token_terms,
  seq_mean_token_mean,
  seq_mean_token_sum_norm,
  token_logprobs,
  token_mean,
  value_token_terms,
)
from rlhfjax.algorithms.masked import masked_mean, masked_var, masked_whiten
from rlhfjax.algorithms.objectives import (
  bradley_terry_loss,
  masked_token_nll,
  preference_accuracy,
  token_accuracy,
)
from rlhfjax.algorithms.preference import (
  DPO_LOSSES,
  dpo_ipo,
  dpo_loss,
  dpo_sigmoid,
  sequence_logprobs,
)

__all__ = [
  "POLICY_LOSSES",
  "AdvantageEstimator",
  "padded_sequence_mean",
  "mismatch_stats",
  "rollout_correction",
  "groups_with_signal",
  "overlong_penalty",
  "DPO_LOSSES",
  "dpo_ipo",
  "dpo_loss",
  "dpo_sigmoid",
  "sequence_logprobs",
  "ADVANTAGE_ESTIMATORS",
  "LOSS_AGGREGATIONS",
  "EstimatorSettings",
  "discounted_returns",
  "leave_one_out",
  "reinforce_pp",
  "seq_mean_token_mean",
  "seq_mean_token_sum_norm",
  "token_mean",
  "KL_CONTROLLERS",
  "KL_ESTIMATORS",
  "KLControllerState",
  "adaptive_kl_update",
  "bradley_terry_loss",
  "aggregation_weights",
  "clipped_policy_loss",
  "clipped_value_loss",
  "policy_token_terms",
  "value_token_terms",
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
  "place_on_tokens",
  "shape_rewards",
  "token_accuracy",
  "token_logprobs",
  "whiten_advantages",
]

for _module in pkgutil.iter_modules(__path__):
  importlib.import_module(f"{__name__}.{_module.name}")
