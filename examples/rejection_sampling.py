"""Rejection sampling (best-of-k fine-tuning) as a user's own flow, written against the public API.

Each iteration samples `ppo.group_size` responses per prompt, scores them with the configured
reward (a rule, a reward model, or both), keeps the best response of each prompt and takes one
SFT step (token NLL of the kept responses), then syncs the rollout. Every array stays on the
devices between scoring and the update; the selection happens on the actor's mesh.

  python scripts/train.py --config=configs/ppo_tiny.py --workdir=workdirs/rs \
      --config.algorithm.flow=examples.rejection_sampling:make_flow --config.ppo.group_size=4

(`examples` must be importable: run from the repository root, or put it on PYTHONPATH.) Any
placement of the config works: the flow names roles, the cluster knows where they live.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rlhfjax.cluster.cluster import WeightSource, initial_rngs
from rlhfjax.flows import stages
from rlhfjax.flows.base import Flow
from rlhfjax.flows.experience import Experience
from rlhfjax.flows.stages import FlowContext
from rlhfjax.placement.spec import Role
from rlhfjax.training import sft
from rlhfjax.training.optimizer import make_optimizer


def best_of_group(
  tokens_bs: jax.Array,
  attention_bs: jax.Array,
  response_mask_bt: jax.Array,
  scores_b: jax.Array,
  *,
  group_size: int,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """The best-scoring sample of each group of `group_size` consecutive rows, as an SFT batch of
  one micro-batch (`[1, b / group_size, ...]`; the loss covers the response tokens only)."""
  b, s = tokens_bs.shape
  t = response_mask_bt.shape[1]
  groups = scores_b.reshape(b // group_size, group_size)
  rows = jnp.argmax(groups, axis=-1) + jnp.arange(b // group_size) * group_size
  loss_mask = jnp.concatenate([jnp.zeros((b, s - t), jnp.float32), response_mask_bt], axis=1)
  batch = {
    "tokens": tokens_bs[rows][None],
    "attention_mask": attention_bs[rows][None],
    "loss_mask": loss_mask[rows][None],
  }
  return batch, {"reward/best_mean": jnp.mean(groups.max(-1)), "reward/mean": jnp.mean(scores_b)}


class RejectionSampling(Flow):
  """The flow; see the module docstring."""

  def __init__(self, ctx: FlowContext):
    self.ctx = ctx
    cfg, cluster = ctx.cfg, ctx.cluster
    self.k = cfg.ppo.group_size
    if self.k < 2 or cfg.rollout.batch_size % self.k:
      raise ValueError(
        f"rejection sampling keeps the best of ppo.group_size >= 2 samples per prompt, and "
        f"rollout.batch_size={cfg.rollout.batch_size} must be a multiple of it (got {self.k})"
      )
    source = WeightSource(
      source=cfg.init.actor, what="init.actor", rng=initial_rngs(cfg.seed)[Role.ACTOR]
    )
    cluster.train(Role.ACTOR, source, make_optimizer(cfg.actor_optimizer, cfg.total_steps))
    cluster.rollout_from(Role.ACTOR, ctx.tokenizer.pad_id)
    actor = cluster.roles[Role.ACTOR]
    kept, s = cfg.rollout.batch_size // self.k, cfg.rollout.max_seq_len
    self._select = cluster.compile(
      "select_best",
      functools.partial(best_of_group, group_size=self.k),
      out_shardings=(
        {
          n: actor.batch_sharding((1, kept, s), leading=1)
          for n in ("tokens", "attention_mask", "loss_mask")
        },
        actor.replicated,
      ),
    )
    self.skipped_in_row = 0
    self._step = cluster.train_step(
      "sft_step", Role.ACTOR, functools.partial(sft.sft_loss, config=actor.model)
    )

  def iteration(self, iteration: int) -> dict[str, float]:
    ctx, cluster = self.ctx, self.ctx.cluster
    start = cluster.timeline.now()
    seqs = stages.generate_stage(ctx, iteration, stages.grouped_prompts(ctx, self.k))
    exp = Experience(**cluster.upload(Role.ACTOR, Experience.from_sequences(seqs), "rollout"))
    scores = ctx.rewards.score(exp.tokens_bs, exp.attention_mask_bs, seqs, iteration)
    batch, stats = self._select(exp.tokens_bs, exp.attention_mask_bs, exp.response_mask_bt, scores)

    def update():
      cluster.states[Role.ACTOR], metrics = self._step(cluster.states[Role.ACTOR], batch)
      return metrics

    (metrics,) = cluster.run([cluster.stage(Role.ACTOR, "update", update)], iteration)
    cluster.sync(iteration)
    stats, metrics = cluster.fetch((stats, metrics))
    # The runner stops a run after `ppo.max_skipped_updates` non-finite updates in a row.
    self.skipped_in_row = self.skipped_in_row + 1 if metrics["skipped"] else 0
    return {
      "step": iteration,
      **{k: float(v) for k, v in stats.items()},
      "loss/sft": float(metrics["loss"]),
      "actor/grad_norm": float(metrics["grad_norm"]),
      "update/skipped_in_row": float(self.skipped_in_row),
      "time/iteration": cluster.timeline.now() - start,
    }


def make_flow(ctx: FlowContext) -> RejectionSampling:
  return RejectionSampling(ctx)
