"""PPO over the cluster: generate, score, advantages, update, sync.

  1. generate   rollout mesh: KV-cache engine, continuous batching, sampled log-probs;
  2. score      actor (old log-probs), reference (log-probs), critic (values), reward model,
                each on its own mesh, concurrently where the meshes are disjoint; a rule reward
                on the host;
  3. advantages actor mesh: KL-shaped rewards, GAE or group-relative, whitening;
  4. update     actor and critic train steps over mini-batches shuffled on their meshes;
  5. sync       actor weights resharded to the rollout mesh (device to device).

The experience (`rlhfjax.flows.experience.Experience`) is uploaded to the actor's mesh once
and stays on devices until the update; the host sees the rollout's token ids (rule reward) and
the metric scalars.

With `ppo.async_rollout`, the next batch is generated (by the weights of the last sync) while
this one is scored and trained on: one step off-policy, corrected by the importance ratio to
the rollout policy's log-probs. With `ppo.max_staleness` = k, a worker thread generates up to
k batches ahead and each sync lands mid-batch, between two decode calls
(`rlhfjax.flows.partial`): every token keeps the log-prob of the weights that sampled it, and
none is more than k iterations old when trained.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from rlhfjax import algorithms as alg
from rlhfjax import distributed, signals
from rlhfjax.algorithms import correction
from rlhfjax.algorithms.masked import masked_mean
from rlhfjax.cluster.cluster import WeightSource, initial_rngs
from rlhfjax.config import ConfigError
from rlhfjax.costmodel import pricing
from rlhfjax.data.records import PromptBatch
from rlhfjax.flows import experience, packed, packed_update, partial, scoring, stages
from rlhfjax.flows.experience import Experience, Sequences
from rlhfjax.flows.registry import policy_roles, register
from rlhfjax.flows.stages import FlowContext
from rlhfjax.placement.spec import Role
from rlhfjax.training import steps
from rlhfjax.training.optimizer import make_optimizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageSettings:
  """Static settings of `compute_advantages` (hashable: part of the compiled program)."""

  kl_estimator: str
  estimator: str
  """A name in `alg.ADVANTAGE_ESTIMATORS`."""
  settings: alg.EstimatorSettings
  whiten: bool
  overlong_buffer: int = 0
  """DAPO's soft overlong punishment added to the scores (0: none)."""
  correction: str = "none"
  """`ppo.correction`: the rollout correction's kind (`alg.correction.CORRECTIONS`)."""
  correction_level: str = "token"
  correction_cap: float = 2.0
  environment_coef: float = 1.0
  """`reward.environment_coef`: the weight of a conversation's environment rewards in the
  scores, which a token-level estimator reads on the tokens that ended their turns."""


def advantage_settings(ppo, estimator: str, environment_coef: float = 1.0) -> AdvantageSettings:
  """The `compute_advantages` settings of a PPO-family flow: `ppo`'s, with its estimator (and
  `reward.environment_coef`)."""
  return AdvantageSettings(
    environment_coef=environment_coef,
    kl_estimator=ppo.kl_estimator,
    estimator=estimator,
    settings=alg.EstimatorSettings(
      gamma=ppo.gamma,
      lam=ppo.lam,
      group_size=ppo.group_size,
      normalize_std=ppo.normalize_group_std,
    ),
    whiten=ppo.whiten_advantages,
    overlong_buffer=ppo.overlong_buffer,
    correction=ppo.correction,
    correction_level=ppo.rollout_correction_level,
    correction_cap=ppo.rollout_correction_cap,
  )


def compute_advantages(
  settings: AdvantageSettings, exp: Experience, kl_coef: jax.Array
) -> tuple[Experience, dict[str, jax.Array]]:
  """KL to the reference, then advantages and returns, masked to response tokens.

    kl_t = estimator(logp_t, logp_ref_t);  r_t = -beta * kl_t + score * [t last]
  then the named estimator (`alg.ADVANTAGE_ESTIMATORS`: GAE over `r` with the critic's values,
  or a critic-free baseline). A conversation's environment rewards (their weighted sum a part
  of the score) go, for an estimator that reads rewards per token (`token_rewards`: GAE,
  REINFORCE++), on the tokens that ended their turns instead of the last. Also the batch
  statistics the metrics report (reductions on the devices).
  """
  mask_bt, old_bt = exp.response_mask_bt, exp.old_logprobs_bt
  scores_b = exp.scores_b
  if settings.overlong_buffer:
    scores_b = scores_b + alg.overlong_penalty(
      jnp.sum(mask_bt, -1), max_len=mask_bt.shape[-1], buffer=settings.overlong_buffer
    )
  kl_bt = alg.get_kl_estimator(settings.kl_estimator)(old_bt, exp.ref_logprobs_bt) * mask_bt
  estimator = alg.ADVANTAGE_ESTIMATORS[settings.estimator]
  placed = scores_b
  if exp.environment_rewards_bt is not None and estimator.token_rewards:
    turns_bt = settings.environment_coef * exp.environment_rewards_bt * mask_bt
    placed = alg.place_on_tokens(scores_b, mask_bt, jnp.sum(turns_bt, axis=-1), turns_bt)
  rewards_bt = alg.shape_rewards(placed, kl_bt, mask_bt, kl_coef)
  # A flow without a critic has no values: zeros here, in the program (made on the host, they
  # would be an unnamed upload each iteration).
  values_bt = jnp.zeros_like(old_bt) if exp.values_bt is None else exp.values_bt
  advantages_bt, returns_bt = estimator.estimate(
    placed, kl_bt, values_bt, mask_bt, kl_coef, settings.settings
  )
  if settings.whiten:
    advantages_bt = alg.whiten_advantages(advantages_bt, mask_bt)
  mismatch = correction.mismatch_stats(old_bt, exp.rollout_logprobs_bt, mask_bt)
  is_weights_bt, corrected = correction.rollout_correction(
    old_bt,
    exp.rollout_logprobs_bt,
    mask_bt,
    kind=settings.correction,
    level=settings.correction_level,
    cap=settings.correction_cap,
  )
  stats = {
    "reward/mean": jnp.mean(exp.scores_b),
    "reward/std": jnp.std(exp.scores_b),
    "kl/mean": jnp.sum(kl_bt) / jnp.maximum(jnp.sum(mask_bt[:, :1]), 1.0),
    "kl/per_token": masked_mean(kl_bt, mask_bt),
    "reward/shaped_mean": jnp.mean(jnp.sum(rewards_bt, axis=-1)),
    "reward/overlong_mean": jnp.mean(scores_b - exp.scores_b),
    **{f"logprob_mismatch/{k}": v for k, v in mismatch.items()},
    "rollout_correction/corrected_frac": corrected,
  }
  exp = exp.replace(
    values_bt=values_bt,
    advantages_bt=advantages_bt,
    returns_bt=returns_bt,
    is_weights_bt=is_weights_bt,
  )
  return exp, stats


_CORRECTION_STATS = ("logprob_mismatch/", "rollout_correction/")
"""The rows' keys of `compute_advantages`'s mismatch and correction statistics."""


def check_batch(cfg, group_size: int, mini_batches: int, micro_batches: int) -> None:
  """The rollout batch splits into whole groups and whole mini- and micro-batches."""
  b = cfg.rollout.batch_size
  if b % group_size:
    raise ValueError(f"rollout.batch_size={b} must be a multiple of ppo.group_size={group_size}")
  if b % (mini_batches * micro_batches):
    raise ValueError(
      f"rollout.batch_size={b} must split into ppo.mini_batches x ppo.micro_batches = "
      f"{mini_batches} x {micro_batches}"
    )


class PPOFlow:
  """PPO iterations on a cluster; see the module docstring."""

  def __init__(self, ctx: FlowContext, estimator: str | None = None):
    self.ctx = ctx
    cfg, ppo, cluster = ctx.cfg, ctx.cfg.ppo, ctx.cluster
    self.estimator = check_config(cfg, estimator)
    self.off_policy = ppo.generates_ahead
    """Batches are generated ahead, by older weights: the actor's loss weighs each token by
    its importance weight against its behaviour log-prob (the rollout's; `ppo.correction`)."""
    if self.off_policy and cluster.placement.colocated(Role.ROLLOUT, Role.ACTOR):
      ahead = "ppo.async_rollout" if ppo.async_rollout else "ppo.max_staleness"
      raise ValueError(
        f"{ahead} needs the rollout on its own devices (placement.strategy='disaggregated')"
      )
    self.use_critic = alg.ADVANTAGE_ESTIMATORS[self.estimator].critic
    self.fused = ppo.fuse_actor_critic
    """Actor and critic update in one fused pipeline schedule (`Cluster.fused_train_step`)."""
    if self.fused:
      _check_fusion(cfg, self.use_critic, cluster)
    self._update_keys = (("actor", "update"),) + (
      (("critic", "update"),) if self.use_critic else ()
    )
    """The (role, stage) of the update's stages, for `Cluster.run`'s prefetch."""
    rngs = initial_rngs(cfg.seed)
    updates = cfg.total_steps * ppo.ppo_epochs * ppo.mini_batches
    init = cfg.init
    cluster.train(
      Role.ACTOR,
      WeightSource(source=init.actor, what="init.actor", rng=rngs[Role.ACTOR]),
      make_optimizer(cfg.actor_optimizer, updates),
    )
    # The reference is the initial policy: the same weights, in the reference's shards.
    cluster.freeze(
      Role.REFERENCE, WeightSource(source=init.actor, what="init.actor", rng=rngs[Role.ACTOR])
    )
    if self.use_critic:
      # Without its own source, the critic starts from the policy's trunk (value head at 0).
      source, what = (init.critic, "init.critic") if init.critic else (init.actor, "init.actor")
      cluster.train(
        Role.CRITIC,
        WeightSource(source=source, what=what, rng=rngs[Role.CRITIC]),
        make_optimizer(cfg.critic_optimizer, updates),
      )
    cluster.rollout_from(Role.ACTOR, ctx.tokenizer.pad_id)
    self._compile()
    self.kl_state = alg.KLControllerState(coef=ppo.kl_coef)
    self.skipped_in_row = 0
    self.pending_prompts: list[PromptBatch] = []
    """Prompts (and records) of the batches drawn but not trained yet, in order: those
    generated ahead (`ppo.async_rollout`, `ppo.max_staleness`), saved with a checkpoint and
    generated again on resume."""
    self._pool = concurrent.futures.ThreadPoolExecutor(1) if ppo.async_rollout else None
    self._pending: concurrent.futures.Future | None = None
    self.partial = partial.PartialRollout(ctx, ppo.max_staleness) if ppo.max_staleness else None
    """The generation worker of `ppo.max_staleness` (None: the rollout runs on this thread)."""
    self.versions_bt: np.ndarray | None = None
    """With `ppo.max_staleness`: the policy version of each response token of the batch the
    last iteration trained on (`partial.Generated.versions_bt`)."""

  def _compile(self) -> None:
    ctx, cfg, ppo, cluster = self.ctx, self.ctx.cfg, self.ctx.cfg.ppo, self.ctx.cluster
    b, p, t = cfg.rollout.batch_size, cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens
    s = p + t
    rows = cfg.rollout.scoring_rows
    tag = "" if rows >= b else f"_{rows}rows"  # scorers of micro-batches (fused scoring)
    if ppo.packing:
      self._packed = packed.Programs(ctx)
      self._actor_logprobs = stages.packed_logprob_scorer(ctx, Role.ACTOR, "actor_logprobs_packed")
      self._reference_logprobs = stages.packed_logprob_scorer(
        ctx, Role.REFERENCE, "reference_logprobs_packed"
      )
      if self.use_critic:
        self._critic_values = stages.packed_value_scorer(ctx, Role.CRITIC, "critic_values_packed")
    else:
      self._actor_logprobs = stages.logprob_scorer(ctx, Role.ACTOR, "actor_logprobs" + tag, rows)
      self._reference_logprobs = stages.logprob_scorer(
        ctx, Role.REFERENCE, "reference_logprobs" + tag, rows
      )
      if self.use_critic:
        self._critic_values = stages.value_scorer(ctx, Role.CRITIC, "critic_values" + tag, rows)
    settings = advantage_settings(ppo, self.estimator, self.ctx.cfg.reward.environment_coef)
    self._advantages = cluster.compile(
      "advantages", functools.partial(compute_advantages, settings)
    )
    actor = cluster.roles[Role.ACTOR]
    actor_model = actor.model
    if ppo.packing:
      self._compile_packed_updates()
      return
    split = functools.partial(
      stages.minibatch_splitter, ctx, mini=ppo.mini_batches, micro=ppo.micro_batches, seed=cfg.seed
    )
    shapes = {"tokens": (b, s), "attention_mask": (b, s), "response_mask": (b, t)}
    actor_shapes = {**shapes, "old_logprobs": (b, t), "advantages": (b, t), "is_weights": (b, t)}
    if ppo.kl_loss_coef:
      actor_shapes["ref_logprobs"] = (b, t)
    self._actor_split = split(Role.ACTOR, "actor_minibatches", actor_shapes)
    actor_loss = functools.partial(
      steps.actor_loss,
      config=actor_model,
      prompt_len=p,
      clip_eps=ppo.clip_eps,
      entropy_coef=ppo.entropy_coef,
      temperature=cfg.rollout.temperature,
      clip_eps_high=ppo.clip_eps_high or None,
      loss_agg=ppo.loss_agg,
      kl_loss_coef=ppo.kl_loss_coef,
      kl_estimator=ppo.kl_estimator,
      policy_loss=ppo.policy_loss,
    )
    if not self.fused:
      self._actor_step = cluster.train_step("actor_step", Role.ACTOR, actor_loss)
    if self.use_critic:
      critic = cluster.roles[Role.CRITIC]
      critic_shapes = {**shapes, "returns": (b, t), "old_values": (b, t)}
      # Fused, the critic's mini-batches are cut where the fused step runs: the actor's mesh.
      where = Role.ACTOR if self.fused else Role.CRITIC
      self._critic_split = split(where, "critic_minibatches", critic_shapes)
      critic_loss = functools.partial(
        steps.critic_loss, config=critic.model, prompt_len=p, clip_eps=ppo.value_clip_eps
      )
      if self.fused:
        self._fused_step = cluster.fused_train_step(
          "actor_critic_step", (Role.ACTOR, Role.CRITIC), (actor_loss, critic_loss)
        )
      else:
        self._critic_step = cluster.train_step("critic_step", Role.CRITIC, critic_loss)

  def _compile_packed_updates(self) -> None:
    ctx, cfg, ppo, cluster = self.ctx, self.ctx.cfg, self.ctx.cfg.ppo, self.ctx.cluster
    actor_loss = functools.partial(
      steps.packed_actor_loss,
      config=cluster.roles[Role.ACTOR].model,
      clip_eps=ppo.clip_eps,
      entropy_coef=ppo.entropy_coef,
      temperature=cfg.rollout.temperature,
      clip_eps_high=ppo.clip_eps_high or None,
      kl_loss_coef=ppo.kl_loss_coef,
      kl_estimator=ppo.kl_estimator,
      policy_loss=ppo.policy_loss,
    )
    fused = self.fused and self.use_critic
    self._actor_packed = packed.PackedUpdate(
      ctx, Role.ACTOR, "actor", actor_loss, Role.ACTOR, fused=fused
    )
    if self.use_critic:
      critic_loss = functools.partial(
        steps.packed_critic_loss,
        config=cluster.roles[Role.CRITIC].model,
        clip_eps=ppo.value_clip_eps,
      )
      self._critic_packed = packed.PackedUpdate(
        ctx, Role.CRITIC, "critic", critic_loss, Role.ACTOR, fused=fused
      )
      if fused:  # one schedule of both models' packed micro-batches (`_update_packed`)
        self._fused_packed_step = cluster.fused_train_step(
          "actor_critic_packed",
          (Role.ACTOR, Role.CRITIC),
          (packed_update.summed(actor_loss), packed_update.summed(critic_loss)),
        )

  # -------------------------------------------------------------------------------------------
  # Checkpointed state.

  def abstract_items(self) -> dict[str, Any]:
    if self.ctx.cfg.ppo.async_rollout:
      # An async run's next batch was generated by the weights of the sync before the
      # checkpoint: regenerate it with those, not with the actor's newer ones.
      return {"rollout": self.ctx.cluster.abstract_rollout()}
    return {}

  def checkpoint_items(self) -> dict[str, Any]:
    if self.ctx.cfg.ppo.async_rollout:
      return {"rollout": self.ctx.cluster.engine.params}
    return {}

  def meta(self) -> dict[str, Any]:
    pending = [batch.to_json() for batch in self.pending_prompts]
    return {
      "kl_coef": float(self.kl_state.coef),
      "pending_prompts": pending or None,
      "skipped_in_row": self.skipped_in_row,
    }

  def restore(self, items: dict[str, Any], meta: dict[str, Any]) -> None:
    self.kl_state = alg.KLControllerState(coef=float(meta["kl_coef"]))
    self.pending_prompts = partial.pending_from_json(meta.get("pending_prompts"))
    self.skipped_in_row = int(meta.get("skipped_in_row", 0))
    if items.get("rollout") is not None:
      self.ctx.cluster.engine.update_params(items["rollout"])

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
    if self.partial is not None:
      self.partial.close()

  # -------------------------------------------------------------------------------------------
  # One iteration.

  def iteration(self, iteration: int) -> dict[str, float]:
    """One PPO iteration; returns its metrics row."""
    ctx, cfg, cluster = self.ctx, self.ctx.cfg, self.ctx.cluster
    start = cluster.timeline.now()
    sampled: dict[str, float] = {}
    scores = None
    if self.partial is not None:
      seqs, sampled = self._take_partial(iteration)
    elif self._pending is None:
      prompts = (
        self.pending_prompts.pop(0)
        if self.pending_prompts
        else stages.grouped_prompts(ctx, cfg.ppo.group_size)
      )
      if cfg.rollout.fused_scoring:
        seqs, scores = self._generate_and_score(iteration, prompts)
      else:
        seqs = stages.generate_stage(ctx, iteration, prompts)
      if cfg.ppo.dynamic_sampling_rounds:
        seqs, sampled = self._dynamic_sampling(iteration, seqs)
    else:
      seqs = self._pending.result()
      self.pending_prompts.pop(0)
    bytes_synced = 0
    if self._pool is not None:
      # The weights of the last update go to the rollout mesh before the next batch starts.
      if iteration > 0:
        bytes_synced = cluster.sync(iteration)
      self._pending = None
      if iteration + 1 < cfg.total_steps:
        if not self.pending_prompts:
          self.pending_prompts.append(stages.grouped_prompts(ctx, cfg.ppo.group_size))
        self._pending = self._pool.submit(
          stages.generate_stage, ctx, iteration + 1, self.pending_prompts[0]
        )
    exp = self._score(iteration, seqs, scores)
    exp, stats = self._compute_advantages(iteration, exp)
    update_metrics = self._update(iteration, exp, seqs)
    if self.partial is not None:
      # The next update donates the weights the sync reads: wait until it has been done.
      bytes_synced = self.partial.sync(iteration + 1, iteration)
    elif self._pool is None:
      bytes_synced = cluster.sync(iteration)
    elapsed = cluster.timeline.now() - start
    stats = cluster.fetch(stats)
    row = self._row(iteration, seqs, stats, update_metrics, elapsed, bytes_synced)
    row.update(sampled)
    if cfg.ppo.overlong_buffer:
      row["reward/overlong_mean"] = float(stats["reward/overlong_mean"])
    ppo = cfg.ppo
    self.kl_state = alg.KL_CONTROLLERS[ppo.kl_controller](
      self.kl_state,
      row["kl/mean"],
      cfg.rollout.batch_size,
      target=ppo.kl_target,
      horizon=ppo.kl_horizon,
    )
    return row

  def _take_partial(self, iteration: int) -> tuple[Sequences, dict[str, float]]:
    """Batch `iteration` from the worker (`ppo.max_staleness`), once batch `iteration + k` is
    submitted (batches `iteration .. iteration + k` on the first call), with its staleness
    metrics. `pending_prompts[n]` holds the prompts of batch `iteration + n`."""
    ctx, cfg, worker = self.ctx, self.ctx.cfg, self.partial
    k = worker.max_staleness
    first = iteration + k
    if not worker.started:
      worker.start(iteration)  # the engine holds the actor's weights of this iteration
      first = iteration
    for batch in range(first, min(iteration + k, cfg.total_steps - 1) + 1):
      n = batch - iteration
      if n == len(self.pending_prompts):
        self.pending_prompts.append(stages.grouped_prompts(ctx, cfg.ppo.group_size))
      worker.submit(batch, self.pending_prompts[n])
    got = worker.take(iteration)
    self.pending_prompts.pop(0)
    self.versions_bt = got.versions_bt
    versions = got.versions_bt[got.versions_bt >= 0]
    if versions.size and not iteration - k <= versions.min() <= versions.max() <= iteration:
      raise RuntimeError(
        f"batch {iteration} holds tokens of policy versions {versions.min()} to "
        f"{versions.max()}, outside [{iteration - k}, {iteration}] (ppo.max_staleness={k})"
      )
    metrics = partial.staleness_metrics(iteration, got.versions_bt)
    metrics["rollout/syncs_mid_batch"] = float(got.syncs_mid_batch)
    return got.seqs, metrics

  def _dynamic_sampling(self, iteration: int, seqs: Sequences):
    """DAPO's dynamic sampling: keeps the groups whose scores differ and generates more groups
    (up to `ppo.dynamic_sampling_rounds` extra batches) until the batch is full of them; a batch
    still short is topped up with dropped groups (`dapo/filled`). With an environment, the
    conversation stats are over every conversation the rounds ran."""
    ctx, cluster, cfg = self.ctx, self.ctx.cluster, self.ctx.cfg
    k, b = cfg.ppo.group_size, cfg.rollout.batch_size
    kept: list[tuple[Sequences, list[int]]] = []
    dropped: list[tuple[Sequences, list[int]]] = []
    generated: list[Sequences] = []
    count, rounds, limit = 0, 0, cfg.ppo.dynamic_sampling_rounds
    progress = _RoundProgress(iteration, limit, b // k)
    for attempt in range(limit + 1):
      if attempt:
        # A stop asked for (of any process: all decide alike): the iteration ends with what it has.
        if distributed.flagged(signals.requested(), "dapo round"):
          break
        progress.show(attempt, count // k)
        prompts = stages.grouped_prompts(ctx, k)
        seqs = stages.generate_stage(ctx, iteration, prompts, attempt=attempt)
      rounds = attempt + 1
      generated.append(seqs)
      tokens = cluster.upload(Role.ACTOR, (seqs.tokens_bs, seqs.attention_mask_bs), "rollout")
      scores = cluster.fetch(ctx.rewards.score(*tokens, seqs, iteration), "dynamic sampling")
      signal = alg.groups_with_signal(scores, k)
      for g, keep in enumerate(signal):
        rows = list(range(g * k, (g + 1) * k))
        if keep and count < b:
          kept.append((seqs, rows))
          count += k
        else:
          dropped.append((seqs, rows))
      if count >= b:
        break
    filled = 0
    while count < b:
      kept.append(dropped.pop(0))
      count, filled = count + k, filled + 1
    progress.done(rounds, filled)
    out = experience.take_rows(kept)
    out = dataclasses.replace(
      out, conversation_stats=experience.merged_conversation_stats(generated)
    )
    return out, {"dapo/rounds": float(rounds), "dapo/filled_groups": float(filled)}

  def _scoring_stages(self, iteration: int) -> scoring.StagesFn:
    """The scoring stages of some samples: every role on its own mesh, the rule on the host."""
    ctx = self.ctx

    def todo(inputs: tuple[jax.Array, ...], seqs: Sequences):
      out = [
        stages.score_stage(ctx, Role.ACTOR, self._actor_logprobs, inputs),
        stages.score_stage(ctx, Role.REFERENCE, self._reference_logprobs, inputs),
      ]
      if self.use_critic:
        out.append(stages.score_stage(ctx, Role.CRITIC, self._critic_values, inputs))
      return out + ctx.rewards.stages(inputs, seqs, iteration)

    return todo

  def _generate_and_score(self, iteration: int, prompts: PromptBatch):
    """Generation with fused scoring (`rollout.fused_scoring`), padded or packed calls."""
    ctx, r = self.ctx, self.ctx.cfg.rollout
    todo = self._scoring_stages(iteration)
    if self.ctx.cfg.ppo.packing:
      rows = r.score_rows_packed
      scorer = packed.PackedScoring(ctx, iteration, todo, rows, self._packed)
      ready = packed.ready_when_full(r.max_seq_len, rows)
    else:
      scorer = scoring.MicroBatchScoring(ctx, iteration, todo, r.scoring_rows)
      ready = scoring.whole_rows(r.scoring_rows)
    return scoring.generate_and_score(ctx, iteration, prompts, scorer, ready)

  def _score(self, iteration: int, seqs: Sequences, out: dict[str, Any] | None) -> Experience:
    """The rollout batch on the actor's mesh with every role's scores (`out`: those fused
    scoring computed during generation; None: scored now, see `rlhfjax.flows.scoring`)."""
    ctx, cluster, cfg = self.ctx, self.ctx.cluster, self.ctx.cfg
    exp = Experience(**cluster.upload(Role.ACTOR, Experience.from_sequences(seqs), "rollout"))
    if out is None and cfg.ppo.packing:
      todo = self._scoring_stages(iteration)
      rows = cfg.rollout.score_rows_packed
      # The update comes next: its optimizer states (if offloaded) come back during the scoring.
      out = packed.score(ctx, iteration, seqs, todo, rows, self._packed, self._update_keys)
    elif out is None:
      rows = cfg.rollout.scoring_rows
      tokens = (exp.tokens_bs, exp.attention_mask_bs)
      # The update comes next: its optimizer states (if offloaded) come back during the scoring.
      out = scoring.score(
        ctx, iteration, seqs, self._scoring_stages(iteration), rows, tokens, self._update_keys
      )
    with cluster.timeline.stage(
      iteration, "actor", "advantages", cluster.roles[Role.ACTOR].devices
    ):
      return exp.replace(
        old_logprobs_bt=out["actor"],
        ref_logprobs_bt=cluster.move(Role.ACTOR, out["reference"]),
        values_bt=cluster.move(Role.ACTOR, out["critic"]) if self.use_critic else None,
        scores_b=ctx.rewards.combine(out),
      )

  def _compute_advantages(self, iteration: int, exp: Experience):
    cluster = self.ctx.cluster
    coef = cluster.upload(Role.ACTOR, np.float32(self.kl_state.coef), "kl_coef", replicated=True)
    with cluster.timeline.stage(
      iteration, "actor", "advantages", cluster.roles[Role.ACTOR].devices
    ):
      return jax.block_until_ready(self._advantages(exp, coef))

  def _update_fields(self, exp: Experience) -> tuple[dict, dict | None]:
    """The per-sample fields the actor's and (None without one) the critic's losses read."""
    ppo = self.ctx.cfg.ppo
    actor = {"tokens": exp.tokens_bs, "old_logprobs": exp.old_logprobs_bt}
    actor["advantages"] = exp.advantages_bt
    actor["is_weights"] = exp.is_weights_bt
    if ppo.kl_loss_coef:
      actor["ref_logprobs"] = exp.ref_logprobs_bt
    critic = None
    if self.use_critic:
      critic = {"tokens": exp.tokens_bs, "returns": exp.returns_bt, "old_values": exp.values_bt}
    return actor, critic

  def _update_packed(self, iteration: int, exp: Experience, seqs: Sequences) -> dict[str, float]:
    """`_update` on packed micro-batches (`rlhfjax.flows.packed`): the same mini-batches, each
    micro-batch gathered on the actor's mesh and moved to the critic's as packed rows."""
    # Packed losses weigh slots by `weights`, not by masks; the critic's fields stay on the
    # actor's mesh until packed.
    actor_batch, critic_batch = self._update_fields(exp)
    updates = [(Role.ACTOR, self._actor_packed, actor_batch)]
    if self.use_critic:
      updates.append((Role.CRITIC, self._critic_packed, critic_batch))

    stats = {role: ([], []) for role, _, _ in updates}  # fills, micro-batch counts

    def mini_batches(epoch: int):
      per_role = []
      for role, u, batch in updates:
        rows = packed.minibatch_rows(self.ctx, self._packed, role)
        planned = u.micro_batches(batch, seqs, rows) if self.fused else u.stages(batch, seqs, rows)
        for _, fill, count in planned:
          stats[role][0].append(fill)
          stats[role][1].append(count)
        per_role.append([stage for stage, _, _ in planned])
      roles = [role for role, _, _ in updates]
      if self.fused:
        return [self._fused_packed_stage(*pair) for pair in zip(*per_role, strict=True)]
      return [dict(zip(roles, todo, strict=True)) for todo in zip(*per_role, strict=True)]

    out = self._run_updates(iteration, mini_batches)
    for role, (fills, counts) in stats.items():
      out[f"packing/{role.value}_fill"] = float(np.mean(fills))
      out[f"packing/{role.value}_micro_batches"] = float(np.mean(counts))
    return out

  def _fused_packed_stage(self, actor_micros: list, critic_micros: list) -> dict:
    """One fused update of a mini-batch's packed micro-batches, both models' stacked alike:
    the same samples, packed by the same plan, so the same micro-batch count and rows."""
    batches = (self._actor_packed.stacked(actor_micros), self._critic_packed.stacked(critic_micros))
    shapes = [b["tokens"].shape[:2] for b in batches]
    if shapes[0] != shapes[1]:
      raise ValueError(
        f"the fused update needs the actor's and critic's packed micro-batches alike, got "
        f"{shapes[0]} and {shapes[1]} (micro-batches, rows)"
      )
    roles = (Role.ACTOR, Role.CRITIC)
    return {roles: self.ctx.cluster.fused_update_stage(roles, self._fused_packed_step, batches)}

  def _update(self, iteration: int, exp: Experience, seqs: Sequences) -> dict[str, float]:
    """Every epoch's optimizer updates of the actor (and critic) from the scored batch `exp`
    (`seqs`: its samples on the host, where packed micro-batches are planned)."""
    if self.ctx.cfg.ppo.packing:
      return self._update_packed(iteration, exp, seqs)
    cluster = self.ctx.cluster
    masks = {"attention_mask": exp.attention_mask_bs, "response_mask": exp.response_mask_bt}
    actor_batch, critic_batch = self._update_fields(exp)
    actor_batch = {**actor_batch, **masks}
    if self.use_critic:
      where = Role.ACTOR if self.fused else Role.CRITIC
      critic_batch = cluster.move(where, {**critic_batch, **masks})

    def mini_batches(epoch: int):
      actor_minis = self._actor_split(actor_batch, cluster.states[Role.ACTOR].step)
      critic_minis = None
      if self.use_critic:
        # Fused, the critic's permutation is keyed by the actor's step on the actor's mesh:
        # the two count the same updates.
        step_of = Role.ACTOR if self.fused else Role.CRITIC
        critic_minis = self._critic_split(critic_batch, cluster.states[step_of].step)
      out = []
      for k in range(len(actor_minis)):
        if self.fused:
          roles = (Role.ACTOR, Role.CRITIC)
          batches = (actor_minis[k], critic_minis[k])
          out.append({roles: cluster.fused_update_stage(roles, self._fused_step, batches)})
          continue
        todo = {Role.ACTOR: cluster.update_stage(Role.ACTOR, self._actor_step, actor_minis[k])}
        if self.use_critic:
          todo[Role.CRITIC] = cluster.update_stage(Role.CRITIC, self._critic_step, critic_minis[k])
        out.append(todo)
      return out

    return self._run_updates(iteration, mini_batches)

  def _run_updates(self, iteration: int, mini_batches) -> dict[str, float]:
    """Runs every epoch's update stages (`mini_batches(epoch)`: per mini-batch, the stages by
    role) and reduces their metrics."""
    cluster, ppo = self.ctx.cluster, self.ctx.cfg.ppo
    metrics = []
    last = (ppo.ppo_epochs - 1, ppo.mini_batches - 1)
    for epoch in range(ppo.ppo_epochs):
      for k, todo in enumerate(mini_batches(epoch)):
        then = self._update_keys if (epoch, k) != last else ()
        results = cluster.fetch(cluster.run(list(todo.values()), iteration, then=then))
        by_role = []
        for roles, result in zip(todo, results, strict=True):
          # A fused stage (keyed by its roles) returns each role's metrics.
          by_role += (
            zip(roles, result, strict=True) if isinstance(roles, tuple) else [(roles, result)]
          )
        merged = {
          name if "/" in name else f"{role.value}/{name}": value
          for role, result in by_role
          for name, value in result.items()
        }
        skipped = max(float(merged["actor/skipped"]), float(merged.get("critic/skipped", 0.0)))
        self.skipped_in_row = self.skipped_in_row + 1 if skipped else 0
        metrics.append(merged)
    out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
    out["update/skipped"] = float(
      sum(max(m["actor/skipped"], m.get("critic/skipped", 0.0)) for m in metrics)
    )
    out["update/skipped_in_row"] = float(self.skipped_in_row)
    return out

  def _row(self, iteration, seqs, stats, update_metrics, elapsed, bytes_synced):
    mask = seqs.response_mask_bt > 0
    num_devices = len(self.ctx.cluster.placement.devices)
    row = {
      "step": iteration,
      "reward/mean": float(stats["reward/mean"]),
      "reward/std": float(stats["reward/std"]),
      "kl/mean": float(stats["kl/mean"]),
      "kl/coef": float(self.kl_state.coef),
      "response/length": float(mask.sum(-1).mean()),
      **seqs.conversation_stats,
      **self.ctx.rewards.take_metrics(),
      **{k: float(v) for k, v in stats.items() if k.startswith(_CORRECTION_STATS)},
      "time/iteration": elapsed,
      "throughput/tokens_per_s_per_device": seqs.num_tokens / elapsed / num_devices,
      "sync/bytes": float(bytes_synced),
      "loss/policy": update_metrics["loss/policy"],
      **stages.release_metrics(self.ctx),
    }
    # The critic's metrics (loss/value, value/*, critic/*) come only from a critic's update:
    # a critic-free flow has none to log, not zeros.
    for key, value in update_metrics.items():
      row.setdefault(key, value)
    return row


def check_config(cfg, estimator: str | None = None) -> str:
  """What a PPO-family flow checks of its config before anything is built (the flow's
  `FlowSpec.check`, run by `registry.configure`): the estimator its name fixes or
  `ppo.advantage` names, registered and fed by whole groups; the batch's splits; the options
  that do not combine. Returns the estimator's name."""
  ppo = cfg.ppo
  chosen = _estimator_of(cfg, estimator)
  if alg.ADVANTAGE_ESTIMATORS[chosen].groups and ppo.group_size < 2:
    raise ConfigError(
      f"{chosen!r} advantages compare the samples of a prompt: 'ppo.group_size' must "
      f"be >= 2, got {ppo.group_size}"
    )
  check_batch(cfg, ppo.group_size, ppo.mini_batches, ppo.micro_batches)
  ahead = "ppo.async_rollout" if ppo.async_rollout else "ppo.max_staleness"
  if ppo.dynamic_sampling_rounds and (ppo.async_rollout or ppo.max_staleness):
    raise ConfigError(f"'ppo.dynamic_sampling_rounds' needs a synchronous rollout, not '{ahead}'")
  if ppo.overlong_buffer >= cfg.rollout.max_new_tokens:
    raise ConfigError(
      f"'ppo.overlong_buffer'={ppo.overlong_buffer} must be below "
      f"'rollout.max_new_tokens'={cfg.rollout.max_new_tokens}"
    )
  if cfg.rollout.fused_scoring and (
    ppo.async_rollout or ppo.max_staleness or ppo.dynamic_sampling_rounds
  ):
    raise ConfigError(
      "'rollout.fused_scoring' scores each batch while it generates, with the actor's "
      "weights of this iteration: it does not combine with 'ppo.async_rollout', "
      "'ppo.max_staleness' or 'ppo.dynamic_sampling_rounds'"
    )
  _check_policy_loss(ppo.policy_loss, chosen)
  return chosen


def _estimator_of(cfg, estimator: str | None) -> str:
  """The registered estimator a PPO-family flow runs: the one its name fixes, else
  `ppo.advantage`'s."""
  advantage = cfg.ppo.advantage
  if estimator is not None and advantage not in ("gae", estimator):
    raise ConfigError(
      f"'ppo.advantage'={advantage!r} is PPO's choice; algorithm {cfg.algorithm.name!r} "
      f"estimates advantages with {estimator!r}"
    )
  chosen = estimator or advantage
  if chosen not in alg.ADVANTAGE_ESTIMATORS:
    known = ", ".join(sorted(alg.ADVANTAGE_ESTIMATORS))
    raise ConfigError(f"'ppo.advantage' must be one of {known}, got {chosen!r}")
  return chosen


def _check_policy_loss(name: str, estimator: str) -> None:
  """`ppo.policy_loss` is registered (`alg.POLICY_LOSSES`), and one that reads an advantage per
  sequence has an estimator that gives one."""
  if name not in alg.POLICY_LOSSES:
    known = ", ".join(sorted(alg.POLICY_LOSSES))
    raise ConfigError(f"'ppo.policy_loss' must be one of {known}, got {name!r}")
  if (
    alg.POLICY_LOSSES[name].sequence_advantages
    and not alg.ADVANTAGE_ESTIMATORS[estimator].per_sequence
  ):
    usable = " or ".join(sorted(k for k, e in alg.ADVANTAGE_ESTIMATORS.items() if e.per_sequence))
    raise ConfigError(
      f"'ppo.policy_loss'={name!r} weighs whole sequences by one advantage each: "
      f"'ppo.advantage'={estimator!r} gives one per token; use {usable} (e.g. "
      "--config.algorithm.name=grpo)"
    )


def _check_fusion(cfg, use_critic: bool, cluster) -> None:
  """`ppo.fuse_actor_critic` needs a critic, and its parameters and optimizer state in device
  memory (the fused stage is the actor's, whose prefetch knows nothing of the critic's)."""
  if not use_critic:
    raise ConfigError(
      f"'ppo.fuse_actor_critic' fuses the actor's and the critic's updates; "
      f"{cfg.algorithm.name!r} trains no critic"
    )
  if Role.CRITIC.value in cfg.offload.optimizer:
    raise ConfigError("'ppo.fuse_actor_critic' keeps the critic's optimizer state on the devices")
  if Role.CRITIC.value in cfg.offload.params:
    raise ConfigError("'ppo.fuse_actor_critic' keeps the critic's parameters on the devices")
  if not cluster.placement.colocated(Role.ACTOR, Role.CRITIC):
    raise ConfigError(
      "'ppo.fuse_actor_critic' runs actor and critic on the same devices: "
      "'placement.split_actor_critic' must be False"
    )


def _family(estimator: str | None = None) -> dict[str, Any]:
  """The `FlowSpec` of a PPO-family flow whose name fixes `estimator` (None: `ppo.advantage`'s,
  PPO itself): a critic placed, trained and priced only for a critic estimator (GAE)."""

  def critic(cfg) -> bool:
    return alg.ADVANTAGE_ESTIMATORS[_estimator_of(cfg, estimator)].critic

  return {
    "roles": lambda cfg: policy_roles(cfg, critic=critic(cfg)),
    "trains": (Role.ACTOR, Role.CRITIC) if estimator is None else (Role.ACTOR,),
    "pricing": pricing.PPO if estimator is None else pricing.CRITIC_FREE,
    "check": lambda cfg: check_config(cfg, estimator),
    "fused_scoring": True,
  }


@register("ppo", **_family())
def make_flow(ctx: FlowContext) -> PPOFlow:
  """PPO with `ppo.advantage`'s estimator (GAE and a critic by default)."""
  return PPOFlow(ctx)


@register("grpo", **_family("group_relative"))
def make_grpo(ctx: FlowContext) -> PPOFlow:
  """GRPO: group-normalised advantages, no critic; KL in the loss (`ppo.kl_loss_coef`) or in
  the reward (`ppo.kl_coef`); `ppo.loss_agg` and `ppo.normalize_group_std` select Dr. GRPO."""
  return PPOFlow(ctx, estimator="group_relative")


@register("dapo", **_family("group_relative"))
def make_dapo(ctx: FlowContext) -> PPOFlow:
  """DAPO: GRPO's group-relative advantages with decoupled clipping (`ppo.clip_eps_high`),
  dynamic sampling (`ppo.dynamic_sampling_rounds`) and soft overlong punishment
  (`ppo.overlong_buffer`), token-mean loss, no KL."""
  return PPOFlow(ctx, estimator="group_relative")


@register("rloo", **_family("rloo"))
def make_rloo(ctx: FlowContext) -> PPOFlow:
  """RLOO: leave-one-out baselines within each prompt's group, no critic."""
  return PPOFlow(ctx, estimator="rloo")


@register("reinforce_pp", **_family("reinforce_pp"))
def make_reinforce_pp(ctx: FlowContext) -> PPOFlow:
  """REINFORCE++: batch-whitened returns of KL-shaped token rewards, no critic."""
  return PPOFlow(ctx, estimator="reinforce_pp")


class _RoundProgress:
  """DAPO's sampling rounds of one iteration, shown on stderr (process 0) when they run long:
  a line every `every_s` seconds, and one when the iteration used every round it may
  (`ppo.dynamic_sampling_rounds`) and still filled the batch with equal-reward groups."""

  def __init__(self, iteration: int, limit: int, groups: int, every_s: float = 10.0):
    self.iteration, self.limit, self.groups, self.every_s = iteration, limit, groups, every_s
    self.start = self.last = time.monotonic()
    self.shown = distributed.is_primary()

  def show(self, attempt: int, kept: int) -> None:
    now = time.monotonic()
    if self.shown and now - self.last >= self.every_s:
      self.last = now
      tqdm.tqdm.write(
        f"dapo: iteration {self.iteration}, sampling round {attempt + 1} of at most "
        f"{self.limit + 1} ({now - self.start:.0f} s): {kept} of {self.groups} groups with "
        "rewards that differ so far",
        file=sys.stderr,
      )

  def done(self, rounds: int, filled: int) -> None:
    if self.shown and filled and rounds == self.limit + 1:
      tqdm.tqdm.write(
        f"dapo: iteration {self.iteration} used all {rounds} sampling rounds "
        f"(ppo.dynamic_sampling_rounds={self.limit}) and filled {filled} of {self.groups} "
        "groups with equal rewards (no learning signal): the reward may be constant",
        file=sys.stderr,
      )
