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

With `online_dpo.packing` (the default) the host pairs the samples from their scores (fetched:
one float per sample) and plans packed micro-batches of the pairs' real tokens
(`rlhfjax.flows.packed_update`): the reference scores the valid pairs' samples packed on its
mesh, and each mini-batch (the same shuffled pairs as padded) trains on micro-batches by token
budget, a pair's two samples in one, each valid pair weighted by 1 / the mini-batch's valid
pairs. Tied pairs are not computed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax.cluster.cluster import WeightSource, initial_rngs
from rlhfjax.config import ConfigError, DPOSection, ExperimentConfig, PPOSection
from rlhfjax.costmodel import pricing
from rlhfjax.data import packed_batches
from rlhfjax.data.packing import PackedLayout
from rlhfjax.flows import packed_update, stages
from rlhfjax.flows.base import Flow
from rlhfjax.flows.dpo import dpo_step_loss, packed_programs, pair_logprobs
from rlhfjax.flows.experience import Experience, Sequences
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


def host_pairs(scores_b: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
  """`make_pairs`' choice on the host: `[g, 2]` rows (chosen, rejected) and `valid_g`."""
  groups_gk = np.asarray(scores_b).reshape(-1, group_size)
  base = np.arange(len(groups_gk)) * group_size
  rows_g2 = np.stack([base + groups_gk.argmax(axis=1), base + groups_gk.argmin(axis=1)], axis=1)
  return rows_g2, (groups_gk.max(axis=1) > groups_gk.min(axis=1)).astype(np.float32)


def refuse_offline_packing(cfg: ExperimentConfig) -> None:
  """`dpo.packing` and `dpo.max_tokens_per_micro_batch` are offline DPO's: refused, not
  ignored."""
  for name in ("packing", "max_tokens_per_micro_batch"):
    value = getattr(cfg.dpo, name)
    if value != getattr(DPOSection(), name):
      raise ConfigError(
        f"'dpo.{name}'={value!r} is offline DPO's; online DPO ignores it: set 'online_dpo.{name}'"
      )


def plan_pairs(
  seqs: Sequences,
  rows_g2: np.ndarray,
  pair_weight_g: np.ndarray | None,
  *,
  max_rows: int,
  multiple: int,
  pad_id: int,
) -> list[dict[str, np.ndarray]]:
  """Packed micro-batches (host) of the rollout's samples: the pairs (chosen, rejected rows
  `rows_g2`) of non-zero `pair_weight_g`, with `chosen` and `rejected` (`[g]`); or, without
  weights, the samples of rows `rows_g2` (`[n, 1]`) for scoring."""
  p, t = seqs.prompt_len, seqs.response_mask_bt.shape[1]
  prompt_lens = np.array([len(x) for x in seqs.prompts], np.int32)
  response_lens = np.array([len(x) for x in seqs.responses], np.int32)
  micros = packed_batches.plan_micro_batches(
    seqs.tokens_bs,
    prompt_lens + response_lens,
    rows_g2,
    seqs.response_mask_bt,
    layout_of=lambda packing, rows_n: PackedLayout.create(
      packing, rows_n, prompt_lens[rows_n], response_lens[rows_n], prompt_len=p, response_len=t
    ),
    width=p + t,
    max_rows=max_rows,
    multiple=multiple,
    pad_id=pad_id,
    pair_weight_g=pair_weight_g,
  )
  if pair_weight_g is None:
    return micros
  rows = {"chosen": rows_g2[:, 0].astype(np.int32), "rejected": rows_g2[:, 1].astype(np.int32)}
  return [{**m, **rows} for m in micros]


class OnlineDPOFlow(Flow):
  """See the module docstring."""

  def __init__(self, ctx: FlowContext):
    self.ctx = ctx
    cfg, cluster, own = ctx.cfg, ctx.cluster, ctx.cfg.online_dpo
    refuse_ppo_fields(cfg)
    refuse_offline_packing(cfg)
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
    if own.packing:
      self._packed_step, self._packed_ref = packed_programs(
        cluster, dpo, actor, ref, "online_dpo.packing"
      )

  def _packed_updates(self, iteration: int, seqs: Sequences, scores) -> tuple[list, float]:
    """The iteration's updates on packed micro-batches; returns their metrics and the fraction
    of valid pairs."""
    cluster, cfg, own = self.ctx.cluster, self.ctx.cfg, self.ctx.cfg.online_dpo
    rows_g2, valid_g = host_pairs(cluster.fetch(scores, "scores"), own.samples_per_prompt)
    pairs = len(rows_g2)
    scored = np.unique(rows_g2[valid_g > 0])[:, None]
    ref_micros = plan_pairs(
      seqs,
      scored,
      None,
      max_rows=cfg.rollout.score_rows_packed,
      multiple=packed_update.rows_multiple(cluster, Role.REFERENCE),
      pad_id=self.ctx.tokenizer.pad_id,
    )

    def reference():
      on_ref = packed_update.upload(cluster, Role.REFERENCE, ref_micros, "pairs")
      return self._packed_ref(on_ref, len(seqs.tokens_bs))

    (ref,) = cluster.run([cluster.stage(Role.REFERENCE, "score", reference)], iteration)
    ref = cluster.move(Role.ACTOR, ref)
    size = pairs // own.mini_batches
    max_rows = packed_update.max_rows(
      own.max_tokens_per_micro_batch, cfg.rollout.max_seq_len, 2 * size // own.micro_batches
    )
    with cluster.host("pair_order"):
      step = int(cluster.states[Role.ACTOR].step)
    updates = []
    for _ in range(own.epochs):
      # The padded splitter's permutation (`stages.minibatch_splitter`), on the host.
      with cluster.host("pair_order"):
        order = np.asarray(
          jax.random.permutation(jax.random.fold_in(jax.random.key(cfg.seed), step), pairs)
        )
      for k in range(own.mini_batches):
        mini = order[k * size : (k + 1) * size]
        weight_g = np.zeros(pairs, np.float32)
        weight_g[mini] = valid_g[mini] / max(float(valid_g[mini].sum()), 1.0)
        micros = plan_pairs(
          seqs,
          rows_g2,
          weight_g,
          max_rows=max_rows,
          multiple=packed_update.rows_multiple(cluster, Role.ACTOR),
          pad_id=self.ctx.tokenizer.pad_id,
        )
        micros = packed_update.upload(cluster, Role.ACTOR, micros, "pairs")
        micros = [{**m, "ref_seq": ref} for m in micros]
        stage = cluster.update_stage(Role.ACTOR, self._packed_step, micros)
        updates += cluster.run([stage], iteration)
        step += 1
    return updates, float(np.mean(valid_g))

  def iteration(self, iteration: int) -> dict[str, float]:
    ctx, cluster, own = self.ctx, self.ctx.cluster, self.ctx.cfg.online_dpo
    start = cluster.timeline.now()
    prompts = stages.grouped_prompts(ctx, own.samples_per_prompt)
    seqs = stages.generate_stage(ctx, iteration, prompts)
    exp = Experience(**cluster.upload(Role.ACTOR, Experience.from_sequences(seqs), "rollout"))
    scores = ctx.rewards.score(exp.tokens_bs, exp.attention_mask_bs, seqs, iteration)
    if own.packing:
      updates, valid = self._packed_updates(iteration, seqs, scores)
    else:
      updates, valid = self._padded_updates(iteration, exp, scores)
    moved = cluster.sync(iteration)
    updates, reward, valid = cluster.fetch((updates, jnp.mean(scores), valid))
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
      **stages.release_metrics(ctx),
      "time/iteration": cluster.timeline.now() - start,
    }
    row.update({k: mean(k) for k in updates[0] if "/" in k})
    return row

  def _padded_updates(self, iteration: int, exp: Experience, scores) -> tuple[list, jax.Array]:
    """The iteration's updates on padded pairs; returns their metrics and the fraction of valid
    pairs (on device)."""
    cluster, own = self.ctx.cluster, self.ctx.cfg.online_dpo
    pairs = self._pair(exp.tokens_bs, exp.attention_mask_bs, exp.response_mask_bt, scores)

    def reference():
      ref = self._ref_logprobs(cluster.weights(Role.REFERENCE), cluster.move(Role.REFERENCE, pairs))
      return {f"ref_{k}": v for k, v in ref.items()}

    (ref,) = cluster.run([cluster.stage(Role.REFERENCE, "score", reference)], iteration)
    batch = {**pairs, **cluster.move(Role.ACTOR, ref)}

    updates = []
    for _ in range(own.epochs):
      minis = self._split(batch, cluster.states[Role.ACTOR].step)
      for mini in minis:
        updates += cluster.run([cluster.update_stage(Role.ACTOR, self._step, mini)], iteration)
    return updates, jnp.mean(pairs["valid"])


@register(
  "online_dpo",
  roles=lambda cfg: policy_roles(cfg, critic=False),
  trains=(Role.ACTOR,),
  pricing=pricing.ONLINE_DPO,
  section="online_dpo",
)
def make_flow(ctx: FlowContext) -> OnlineDPOFlow:
  return OnlineDPOFlow(ctx)
