"""DPO on preference data: the actor trained against the frozen reference, no rollout.

Each iteration takes one batch of (prompt, chosen, rejected) pairs of `data.preferences`,
computes the reference's sequence log-probs once on the reference's own mesh, moves them to the
actor's mesh (device to device) and takes one optimizer step of `alg.dpo_loss`. Every iteration
also scores one held-out batch of the eval split (its reference log-probs computed once per
run): `eval/accuracy` and `eval/margin` of the implicit rewards.

With `dpo.packing` the reference scores and the actor trains on packed micro-batches of the
batch's sequences (`rlhfjax.flows.packed_update`), a pair's two in one micro-batch, each pair
weighted by 1 / the batch's pairs: the padded step's numbers up to float rounding. The held-out
batch stays padded.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax

from rlhfjax import algorithms as alg
from rlhfjax import data, distributed, models
from rlhfjax.cluster.cluster import WeightSource, initial_rngs
from rlhfjax.config import DPOSection
from rlhfjax.config.model import ModelConfig
from rlhfjax.costmodel import pricing
from rlhfjax.data import packed_batches
from rlhfjax.flows import packed_update
from rlhfjax.flows.base import Flow
from rlhfjax.flows.registry import policy_roles, register
from rlhfjax.flows.stages import FlowContext
from rlhfjax.placement.spec import Role
from rlhfjax.training import packed
from rlhfjax.training.optimizer import make_optimizer

_SIDES = ("chosen", "rejected")


def pair_logprobs(config: ModelConfig, params: Any, batch: dict[str, jax.Array]):
  """Sequence log-probs `[b]` of the chosen and the rejected responses of a batch."""

  def side(name):
    logits_bsv = models.forward_logits(
      config, params, batch[f"{name}_tokens"], batch[f"{name}_mask"]
    )
    return alg.sequence_logprobs(logits_bsv, batch[f"{name}_tokens"], batch[f"{name}_loss_mask"])

  return {name: side(name) for name in _SIDES}


def dpo_step_loss(params, batch, *, config, beta, loss, label_smoothing):
  """`alg.dpo_loss` of one micro-batch, the reference's log-probs in `batch['ref_*']`."""
  policy = pair_logprobs(config, params, batch)
  value, stats = alg.dpo_loss(
    policy["chosen"],
    policy["rejected"],
    batch["ref_chosen"],
    batch["ref_rejected"],
    batch["valid"],
    beta=beta,
    loss=loss,
    label_smoothing=label_smoothing,
  )
  return _dpo_metrics(value, stats)


def _dpo_metrics(value, stats, scale=1.0):
  value = value * scale
  return value, {"loss/dpo": value, **{f"dpo/{k}": v * scale for k, v in stats.items()}}


def packed_dpo_step_loss(params, micro, *, config, beta, loss, label_smoothing):
  """`dpo_step_loss` as one packed micro-batch's contribution to its batch's pair means: the
  sequence log-probs summed by segment (`packed.sequence_logprobs`; `micro['ref_seq']` the
  reference's, `[B]`), its pairs' (`chosen`, `rejected` rows) mean times their share of the
  valid pairs."""
  policy_b, ref_b = packed.sequence_logprobs(config, params, micro), micro["ref_seq"]
  chosen, rejected = micro["chosen"], micro["rejected"]
  member_g, scale = packed.pair_scale(micro)
  value, stats = alg.dpo_loss(
    policy_b[chosen],
    policy_b[rejected],
    ref_b[chosen],
    ref_b[rejected],
    member_g,
    beta=beta,
    loss=loss,
    label_smoothing=label_smoothing,
  )
  return _dpo_metrics(value, stats, scale)


def packed_programs(cluster, dpo: DPOSection, actor, ref, field: str) -> tuple[Any, Any]:
  """The packed actor step of `dpo`'s loss and the packed reference scorer (offline and online
  DPO; `actor`, `ref` their roles' runtimes; `field` the config field that asked to pack)."""
  loss = functools.partial(
    packed_dpo_step_loss,
    config=actor.model,
    beta=dpo.beta,
    loss=dpo.loss,
    label_smoothing=dpo.label_smoothing,
  )
  scorer = functools.partial(packed.sequence_logprobs, ref.model)
  return (
    packed_update.PackedStep(cluster, Role.ACTOR, "actor_step", loss, field=field),
    packed_update.sequence_scorer(cluster, Role.REFERENCE, "reference_logprobs_packed", scorer),
  )


class DPOFlow(Flow):
  """Offline DPO; see the module docstring."""

  def __init__(self, ctx: FlowContext):
    self.ctx = ctx
    cfg, cluster, d = ctx.cfg, ctx.cluster, ctx.cfg.data
    rngs = initial_rngs(cfg.seed)
    actor_source = WeightSource(source=cfg.init.actor, what="init.actor", rng=rngs[Role.ACTOR])
    cluster.train(Role.ACTOR, actor_source, make_optimizer(cfg.actor_optimizer, cfg.total_steps))
    cluster.freeze(Role.REFERENCE, actor_source)
    workdir_data = d.data_dir or os.path.join(ctx.workdir, "data")
    dataset = distributed.primary_first(
      lambda: data.prepare(
        "preference",
        d.preferences or data.bundled_path(d.task, "preference"),
        workdir_data,
        on_bad_record=d.on_bad_record,
      )
    )
    batches = functools.partial(
      data.preference_batches,
      tokenizer=ctx.tokenizer,
      batch_size=cfg.rollout.batch_size,
      max_len=cfg.rollout.max_seq_len,
      seed=cfg.seed,
      on_long_prompt=d.on_long_prompt,
    )
    self.train = batches(dataset.source(d.train_split))
    self.held_out = next(iter(batches(dataset.source(d.eval_split), repeat=False)))
    self._compile()
    self._held_out_dev = None
    self.skipped_in_row = 0

  def _compile(self) -> None:
    cfg, cluster = self.ctx.cfg, self.ctx.cluster
    b = cfg.rollout.batch_size
    ref = cluster.roles[Role.REFERENCE]
    self._ref_logprobs = cluster.compile(
      "reference_logprobs",
      functools.partial(pair_logprobs, ref.model),
      out_shardings={name: ref.batch_sharding((b,)) for name in _SIDES},
      role=Role.REFERENCE,
    )
    actor = cluster.roles[Role.ACTOR]
    loss = functools.partial(
      dpo_step_loss,
      config=actor.model,
      beta=cfg.dpo.beta,
      loss=cfg.dpo.loss,
      label_smoothing=cfg.dpo.label_smoothing,
    )
    self._step = cluster.train_step("actor_step", Role.ACTOR, loss)
    if cfg.dpo.packing:
      self._packed_step, self._packed_ref = packed_programs(
        cluster, cfg.dpo, actor, ref, "dpo.packing"
      )
    self._eval = cluster.compile(
      "held_out",
      lambda params, batch: loss(params, batch)[1],
      out_shardings=actor.replicated,
      role=Role.ACTOR,
    )

  def _with_reference(self, host_batch: dict, name: str = "batch") -> dict[str, jax.Array]:
    """The batch on the actor's mesh with the reference's log-probs, computed on its mesh."""
    cluster = self.ctx.cluster
    on_ref = cluster.upload(Role.REFERENCE, host_batch, name)
    ref = self._ref_logprobs(cluster.weights(Role.REFERENCE), on_ref)
    ref = {f"ref_{k}": v for k, v in ref.items()}
    return {**cluster.move(Role.ACTOR, on_ref), **cluster.move(Role.ACTOR, ref)}

  def packed_micro_batches(self, host_batch: dict) -> list[dict]:
    """The packed micro-batches of a host batch of pairs (`dpo.max_tokens_per_micro_batch`)."""
    cfg = self.ctx.cfg
    width = cfg.rollout.max_seq_len
    sides = tuple((f"{n}_tokens", f"{n}_mask") for n in _SIDES)
    return packed_batches.right_padded_micro_batches(
      host_batch,
      sides,
      tuple(f"{n}_loss_mask" for n in _SIDES),
      max_len=width,
      max_rows=packed_update.max_rows(
        cfg.dpo.max_tokens_per_micro_batch, width, 2 * cfg.rollout.batch_size
      ),
      multiple=packed_update.rows_multiple(self.ctx.cluster, Role.ACTOR),
      pad_id=self.ctx.tokenizer.pad_id,
    )

  def _packed_with_reference(self, host_batch: dict) -> list[dict[str, jax.Array]]:
    """The packed micro-batches on the actor's mesh, each with the reference's sequence
    log-probs (`ref_seq`), scored packed on its mesh."""
    cluster = self.ctx.cluster
    micros = self.packed_micro_batches(host_batch)
    ref = self._packed_ref(
      packed_update.upload(cluster, Role.REFERENCE, micros, "batch"),
      2 * host_batch["valid"].shape[0],
    )
    ref = cluster.move(Role.ACTOR, ref)
    return [
      {**m, "ref_seq": ref} for m in packed_update.upload(cluster, Role.ACTOR, micros, "batch")
    ]

  def iteration(self, iteration: int) -> dict[str, float]:
    cluster = self.ctx.cluster
    start = cluster.timeline.now()
    actor_devices = cluster.roles[Role.ACTOR].devices
    if self._held_out_dev is None:
      self._held_out_dev = cluster.run(
        [
          cluster.stage(
            Role.REFERENCE, "score", lambda: self._with_reference(self.held_out, "batch")
          )
        ],
        iteration,
      )[0]
    # A stage of the cluster: an offloaded reference comes to device memory for it.
    score = self._packed_with_reference if self.ctx.cfg.dpo.packing else self._with_reference
    (batch,) = cluster.run(
      [cluster.stage(Role.REFERENCE, "score", lambda: score(next(self.train)))], iteration
    )
    if self.ctx.cfg.dpo.packing:
      step, micro = self._packed_step, batch
    else:
      step, micro = self._step, jax.tree.map(lambda x: x[None], batch)

    (metrics,) = cluster.run([cluster.update_stage(Role.ACTOR, step, micro)], iteration)
    with cluster.timeline.stage(iteration, "actor", "evaluate", actor_devices):
      held_out = self._eval(cluster.states[Role.ACTOR].params, self._held_out_dev)
    metrics, held_out = cluster.fetch((metrics, held_out))
    self.skipped_in_row = self.skipped_in_row + 1 if metrics["skipped"] else 0
    row = {"step": iteration, "time/iteration": cluster.timeline.now() - start}
    row.update({k: float(v) for k, v in metrics.items() if "/" in k})
    row["actor/grad_norm"] = float(metrics["grad_norm"])
    row["update/skipped_in_row"] = float(self.skipped_in_row)
    row["eval/accuracy"] = float(held_out["dpo/accuracy"])
    row["eval/margin"] = float(held_out["dpo/margin"])
    return row

  def meta(self) -> dict[str, Any]:
    return {**super().meta(), "preference_data": self.train.get_state()}

  def restore(self, items: dict[str, Any], meta: dict[str, Any]) -> None:
    super().restore(items, meta)
    self.train.set_state(meta["preference_data"])


@register(
  "dpo",
  roles=lambda cfg: policy_roles(cfg, critic=False, rollout=False),
  trains=(Role.ACTOR,),
  pricing=pricing.DPO,
  section="dpo",
)
def make_flow(ctx: FlowContext) -> DPOFlow:
  return DPOFlow(ctx)
