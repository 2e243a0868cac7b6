"""Reward-model training on preference pairs: the reward role (a value head) trained on the
Bradley-Terry loss of the chosen over the rejected sequence (`rlhfjax.training.reward_model`).

  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm

The trained model is the checkpoint item 'reward'; PPO's reward role loads it (`init.reward`).
Its trunk may start from an SFT run or a Hugging Face causal LM (`init.reward`): the LM head
is dropped and the value head starts at zero.
"""

from __future__ import annotations

import numpy as np

from rlhfjax import data
from rlhfjax.flows.registry import register
from rlhfjax.flows.stages import FlowContext
from rlhfjax.flows.supervised import SupervisedFlow, one_model
from rlhfjax.placement.spec import Role
from rlhfjax.training import reward_model

_SEQUENCES = ("chosen_tokens", "chosen_mask", "rejected_tokens", "rejected_mask")


class RewardModelFlow(SupervisedFlow):
  """Trains the reward role on `data.preferences`."""

  role = Role.REWARD
  optimizer_section = "reward_optimizer"
  data_kind = "preference"
  data_field = "preferences"
  batch_dtypes = {**dict.fromkeys(_SEQUENCES, np.int32), "valid": np.float32}
  token_masks = ("chosen_mask", "rejected_mask")
  batch_pipeline = staticmethod(data.preference_batches)
  sides = (("chosen_tokens", "chosen_mask"), ("rejected_tokens", "rejected_mask"))
  loss = staticmethod(reward_model.preference_loss)
  packed_loss = staticmethod(reward_model.packed_preference_loss)
  eval_sums = staticmethod(reward_model.preference_eval_sums)
  headline = "eval/accuracy"
  plot_file = "eval_accuracy.png"


@register("rm", **one_model(Role.REWARD))
def make_flow(ctx: FlowContext) -> RewardModelFlow:
  return RewardModelFlow(ctx)
