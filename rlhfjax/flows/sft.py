"""Supervised fine-tuning of the policy on demonstrations: the actor trained on the next-token
loss of the response tokens (`rlhfjax.training.sft`).

  python scripts/train_sft.py --config=configs/sft_tiny.py --workdir=workdirs/sft

The trained policy is the checkpoint item 'actor'; PPO starts its actor and reference from it
(`init.actor`), the reward model its trunk (`init.reward`).
"""

from __future__ import annotations

import numpy as np

from rlhfjax import data
from rlhfjax.flows.registry import register
from rlhfjax.flows.stages import FlowContext
from rlhfjax.flows.supervised import SupervisedFlow, one_model
from rlhfjax.placement.spec import Role
from rlhfjax.training import sft


class SFTFlow(SupervisedFlow):
  """SFT of the actor on `data.demonstrations`."""

  role = Role.ACTOR
  optimizer_section = "actor_optimizer"
  data_kind = "demonstration"
  data_field = "demonstrations"
  batch_dtypes = {"tokens": np.int32, "attention_mask": np.int32, "loss_mask": np.float32}
  token_masks = ("attention_mask",)
  batch_pipeline = staticmethod(data.sft_batches)
  sides = (("tokens", "attention_mask"),)
  loss_masks = ("loss_mask",)
  loss = staticmethod(sft.sft_loss)
  packed_loss = staticmethod(sft.sft_packed_loss)
  eval_sums = staticmethod(sft.sft_eval_sums)
  headline = "eval/loss"
  plot_file = "eval_loss.png"


@register("sft", **one_model(Role.ACTOR))
def make_flow(ctx: FlowContext) -> SFTFlow:
  return SFTFlow(ctx)
