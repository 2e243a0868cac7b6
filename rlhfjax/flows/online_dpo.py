"""Online DPO (as in ChatLearn): the rollout samples `online_dpo.samples_per_prompt` responses
per prompt (two by default), the reward ranks them, and the best and the worst form a preference
pair; the actor takes DPO steps (`dpo`'s loss) on the pairs, then the rollout syncs as in PPO.

Like PPO's update, the pairs of an iteration are shuffled on the actor's mesh and split into
`online_dpo.mini_batches` mini-batches (of `online_dpo.micro_batches` micro-batches), for
`online_dpo.epochs` epochs: one optimizer step per mini-batch. Pairs whose responses all score
the same carry no preference and are left out of the loss (`pairs/valid`). The pairing happens
on the actor's mesh; the reference scores the pairs on its own mesh, device to device both ways.
The `ppo` section configures none of it: a PPO field set away from its default is refused
rather than ignored.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax.cluster.cluster import WeightSource, initial_rngs
from rlhfjax.config import ConfigError, ExperimentConfig, PPOSection
from rlhfjax.costmodel import pricing
from rlhfjax.flows import stages
from rlhfjax.flows.base import Flow
from rlhfjax.flows.dpo import dpo_step_loss, pair_logprobs
from rlhfjax.flows.experience import Experience
from rlhfjax.flows.registry import policy_roles, register
from rlhfjax.flows.stages import FlowContext
from rlhfjax.placement.spec import Role
from rlhfjax.training.optimizer import make_optimizer


def make_pairs(
  tokens_bs: jax.Array,
  attention_bs: jax.Array,
  response_mask_bt: jax.Array,
  scores_b: jax.Array,
  *,
  group_size: int = 2,
) -> dict[str, jax.Array]:
  """Each group of `group_size` consecutive rows (the samples of one prompt) as one preference
  pair: the best-scored sample chosen, the worst rejected (the first of equals). `valid` is 0
  where every sample of the group scores the same: such a pair carries no preference. Loss
  masks mark the response columns."""
  b, s = tokens_bs.shape
  loss_mask = jnp.concatenate(
    [jnp.zeros((b, s - response_mask_bt.shape[1]), jnp.float32), response_mask_bt], axis=1
  )
  groups_gk = scores_b.reshape(b // group_size, group_size)
  base = jnp.arange(b // group_size) * group_size
  chosen = base + jnp.argmax(groups_gk, axis=1)
  rejected = base + jnp.argmin(groups_gk, axis=1)
  valid = jnp.max(groups_gk, axis=1) > jnp.min(groups_gk, axis=1)
  out = {"valid": valid.astype(jnp.float32)}
  for name, rows in (("chosen", chosen), ("rejected", rejected)):
    out[f"{name}_tokens"] = tokens_bs[rows]
    out[f"{name}_mask"] = attention_bs[rows]
    out[f"{name}_loss_mask"] = loss_mask[rows]
  return out


_MOVED = {
  "group_size": "samples_per_prompt",
  "ppo_epochs": "epochs",
  "mini_batches": "mini_batches",
  "micro_batches": "micro_batches",
}
"""PPO's batch fields and online DPO's own, which it reads instead."""
_RUNNER_FIELDS = ("max_skipped_updates",)
"""`ppo` fields the runner reads for every flow."""


def refuse_ppo_fields(cfg: ExperimentConfig) -> None:
  """Online DPO reads no `ppo` field but the runner's: one set away from its default would be
  ignored, so it is refused, pointing at online DPO's own field where there is one."""
  default = PPOSection()
  for field in dataclasses.fields(PPOSection):
    value = getattr(cfg.ppo, field.name)
    if field.name in _RUNNER_FIELDS or value == getattr(default, field.name):
      continue
    own = _MOVED.get(field.name)
    hint = f"set 'online_dpo.{own}'" if own else "online DPO has no such setting"
    raise ConfigError(f"'ppo.{field.name}'={value!r} is PPO's; online DPO ignores it: {hint}")


class OnlineDPOFlow(Flow):
  """See the module docstring."""

  def __init__(self, ctx: FlowContext):
    self.ctx = ctx
    cfg, cluster, own = ctx.cfg, ctx.cluster, ctx.cfg.online_dpo
    stages.refuse_fused_scoring(cfg)
    refuse_ppo_fields(cfg)
    k = own.samples_per_prompt
    if cfg.rollout.batch_size % k:
      raise ConfigError(
        f"'rollout.batch_size'={cfg.rollout.batch_size} must be a multiple of "
        f"'online_dpo.samples_per_prompt'={k}"
      )
    pairs, s = cfg.rollout.batch_size // k, cfg.rollout.max_seq_len
    if pairs % (own.mini_batches * own.micro_batches):
      raise ConfigError(
        f"the {pairs} pairs of a batch ('rollout.batch_size' / 'online_dpo.samples_per_prompt') "
        f"must split into 'online_dpo.mini_batches' x 'online_dpo.micro_batches' = "
        f"{own.mini_batches} x {own.micro_batches}"
      )
    source = WeightSource(
      source=cfg.init.actor, what="init.actor", rng=initial_rngs(cfg.seed)[Role.ACTOR]
    )
    updates = cfg.total_steps * own.epochs * own.mini_batches
    cluster.train(Role.ACTOR, source, make_optimizer(cfg.actor_optimizer, updates))
    cluster.freeze(Role.REFERENCE, source)
    cluster.rollout_from(Role.ACTOR, ctx.tokenizer.pad_id)
    actor, ref = cluster.roles[Role.ACTOR], cluster.roles[Role.REFERENCE]
    sharded = lambda shape: actor.batch_sharding(shape)
    sides = [f"{n}_{k}" for n in ("chosen", "rejected") for k in ("tokens", "mask", "loss_mask")]
    self._pair = cluster.compile(
      "make_pairs",
      functools.partial(make_pairs, group_size=k),
      out_shardings={"valid": sharded((pairs,)), **{n: sharded((pairs, s)) for n in sides}},
    )
    self._ref_logprobs = cluster.compile(
      "reference_logprobs",
      functools.partial(pair_logprobs, ref.model),
      out_shardings={n: ref.batch_sharding((pairs,)) for n in ("chosen", "rejected")},
      role=Role.REFERENCE,
    )
    shapes = {
      "valid": (pairs,),
      **{n: (pairs, s) for n in sides},
      "ref_chosen": (pairs,),
      "ref_rejected": (pairs,),
    }
    self._split = stages.minibatch_splitter(
      ctx,
      Role.ACTOR,
      "pair_split",
      shapes,
      mini=own.mini_batches,
      micro=own.micro_batches,
      seed=cfg.seed,
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
    ctx, cluster, own = self.ctx, self.ctx.cluster, self.ctx.cfg.online_dpo
    start = cluster.timeline.now()
    prompts = stages.grouped_prompts(ctx, own.samples_per_prompt)
    seqs = stages.generate_stage(ctx, iteration, prompts)
    exp = Experience(**cluster.upload(Role.ACTOR, Experience.from_sequences(seqs), "rollout"))
    scores = ctx.rewards.score(exp.tokens_bs, exp.attention_mask_bs, seqs, iteration)
    pairs = self._pair(exp.tokens_bs, exp.attention_mask_bs, exp.response_mask_bt, scores)

    def reference():
      ref = self._ref_logprobs(cluster.params[Role.REFERENCE], cluster.move(Role.REFERENCE, pairs))
      return {f"ref_{k}": v for k, v in ref.items()}

    (ref,) = cluster.run([cluster.stage(Role.REFERENCE, "score", reference)], iteration)
    batch = {**pairs, **cluster.move(Role.ACTOR, ref)}

    updates = []
    for _ in range(own.epochs):
      minis = self._split(batch, cluster.states[Role.ACTOR].step)
      for mini in minis:
        updates += cluster.run([cluster.update_stage(Role.ACTOR, self._step, mini)], iteration)
    moved = cluster.sync(iteration)
    updates, reward, valid = cluster.fetch((updates, jnp.mean(scores), jnp.mean(pairs["valid"])))
    for m in updates:
      self.skipped_in_row = self.skipped_in_row + 1 if m["skipped"] else 0
    mean = lambda key: float(np.mean([m[key] for m in updates]))
    row = {
      "step": iteration,
      "reward/mean": float(reward),
      "pairs/valid": float(valid),
      "actor/grad_norm": mean("grad_norm"),
      "update/skipped": float(sum(m["skipped"] for m in updates)),
      "update/skipped_in_row": float(self.skipped_in_row),
      "sync/bytes": float(moved),
      "time/iteration": cluster.timeline.now() - start,
    }
    row.update({k: mean(k) for k in updates[0] if "/" in k})
    return row


@register(
  "online_dpo",
  roles=lambda cfg: policy_roles(cfg, critic=False),
  pricing=pricing.ONLINE_DPO,
  batch=lambda cfg: cfg.online_dpo.batch,
)
def make_flow(ctx: FlowContext) -> OnlineDPOFlow:
  return OnlineDPOFlow(ctx)
