"""Online DPO (as in ChatLearn): the rollout samples two responses per prompt, the reward
ranks them, and the actor takes a DPO step on the pair; the rollout then syncs as in PPO.

Pairs whose two responses score the same carry no preference and are left out of the loss
(`pairs/valid`). The pairing happens on the actor's mesh; the reference scores the pairs on its
own mesh, device to device both ways.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rlhfjax.cluster.cluster import WeightSource, initial_rngs
from rlhfjax.config import ConfigError
from rlhfjax.flows import stages
from rlhfjax.flows.base import Flow
from rlhfjax.flows.dpo import dpo_step_loss, pair_logprobs
from rlhfjax.flows.experience import Experience
from rlhfjax.flows.registry import policy_roles, register
from rlhfjax.flows.stages import FlowContext
from rlhfjax.placement.spec import Role
from rlhfjax.training.optimizer import make_optimizer


def make_pairs(
  tokens_bs: jax.Array, attention_bs: jax.Array, response_mask_bt: jax.Array, scores_b: jax.Array
) -> dict[str, jax.Array]:
  """Rows `2i` and `2i + 1` (two samples of one prompt) as a preference pair, the higher score
  chosen; `valid` is 0 where the scores tie. Loss masks mark the response columns."""
  b, s = tokens_bs.shape
  loss_mask = jnp.concatenate(
    [jnp.zeros((b, s - response_mask_bt.shape[1]), jnp.float32), response_mask_bt], axis=1
  )
  pairs_b2 = scores_b.reshape(b // 2, 2)
  first = pairs_b2[:, 0] >= pairs_b2[:, 1]
  base = jnp.arange(b // 2) * 2
  chosen, rejected = jnp.where(first, base, base + 1), jnp.where(first, base + 1, base)
  out = {"valid": (pairs_b2[:, 0] != pairs_b2[:, 1]).astype(jnp.float32)}
  for name, rows in (("chosen", chosen), ("rejected", rejected)):
    out[f"{name}_tokens"] = tokens_bs[rows]
    out[f"{name}_mask"] = attention_bs[rows]
    out[f"{name}_loss_mask"] = loss_mask[rows]
  return out


class OnlineDPOFlow(Flow):
  """See the module docstring."""

  def __init__(self, ctx: FlowContext):
    self.ctx = ctx
    cfg, cluster = ctx.cfg, ctx.cluster
    if cfg.ppo.group_size != 2:
      raise ConfigError(
        f"online DPO pairs two samples per prompt: 'ppo.group_size' must be 2, "
        f"got {cfg.ppo.group_size}"
      )
    if cfg.rollout.batch_size % 2:
      raise ConfigError(f"'rollout.batch_size' must be even, got {cfg.rollout.batch_size}")
    source = WeightSource(
      source=cfg.init.actor, what="init.actor", rng=initial_rngs(cfg.seed)[Role.ACTOR]
    )
    cluster.train(Role.ACTOR, source, make_optimizer(cfg.actor_optimizer, cfg.total_steps))
    cluster.freeze(Role.REFERENCE, source)
    cluster.rollout_from(Role.ACTOR, ctx.tokenizer.pad_id)
    actor, ref = cluster.roles[Role.ACTOR], cluster.roles[Role.REFERENCE]
    pairs, s = cfg.rollout.batch_size // 2, cfg.rollout.max_seq_len
    sharded = lambda shape: actor.batch_sharding(shape)
    self._pair = cluster.compile(
      "make_pairs",
      make_pairs,
      out_shardings={
        "valid": sharded((pairs,)),
        **{
          f"{n}_{k}": sharded((pairs, s))
          for n in ("chosen", "rejected")
          for k in ("tokens", "mask", "loss_mask")
        },
      },
    )
    self._ref_logprobs = cluster.compile(
      "reference_logprobs",
      functools.partial(pair_logprobs, ref.model),
      out_shardings={n: ref.batch_sharding((pairs,)) for n in ("chosen", "rejected")},
      role=Role.REFERENCE,
    )
    dpo = cfg.dpo
    loss = functools.partial(
      dpo_step_loss,
      config=actor.model,
      beta=dpo.beta,
      loss=dpo.loss,
      label_smoothing=dpo.label_smoothing,
    )
    self._step = cluster.train_step("actor_step", Role.ACTOR, loss)
    self.skipped_in_row = 0

  def iteration(self, iteration: int) -> dict[str, float]:
    ctx, cluster = self.ctx, self.ctx.cluster
    start = cluster.timeline.now()
    seqs = stages.generate_stage(ctx, iteration, stages.grouped_prompts(ctx, 2))
    exp = Experience(**cluster.upload(Role.ACTOR, Experience.from_sequences(seqs), "rollout"))
    scores = ctx.rewards.score(exp.tokens_bs, exp.attention_mask_bs, seqs, iteration)
    pairs = self._pair(exp.tokens_bs, exp.attention_mask_bs, exp.response_mask_bt, scores)

    def reference():
      ref = self._ref_logprobs(cluster.params[Role.REFERENCE], cluster.move(Role.REFERENCE, pairs))
      return {f"ref_{k}": v for k, v in ref.items()}

    (ref,) = cluster.run([cluster.stage(Role.REFERENCE, "score", reference)], iteration)
    batch = jax.tree.map(lambda x: x[None], {**pairs, **cluster.move(Role.ACTOR, ref)})

    def update():
      cluster.states[Role.ACTOR], metrics = self._step(cluster.states[Role.ACTOR], batch)
      return metrics

    (metrics,) = cluster.run([cluster.stage(Role.ACTOR, "update", update)], iteration)
    moved = cluster.sync(iteration)
    metrics, reward, valid = cluster.fetch((metrics, jnp.mean(scores), jnp.mean(pairs["valid"])))
    self.skipped_in_row = self.skipped_in_row + 1 if metrics["skipped"] else 0
    row = {
      "step": iteration,
      "reward/mean": float(reward),
      "pairs/valid": float(valid),
      "actor/grad_norm": float(metrics["grad_norm"]),
      "update/skipped_in_row": float(self.skipped_in_row),
      "sync/bytes": float(moved),
      "time/iteration": cluster.timeline.now() - start,
    }
    row.update({k: float(v) for k, v in metrics.items() if "/" in k})
    return row


@register("online_dpo", roles=lambda cfg: policy_roles(cfg, critic=False))
def make_flow(ctx: FlowContext) -> OnlineDPOFlow:
  return OnlineDPOFlow(ctx)
