"""The PPO loop over a placement: rollout, scoring, advantages, updates, weight sync.

Each role runs on its own mesh as the placement spec says. Stages on disjoint devices run at
the same time (`rlhfjax.ppo.dispatch`); co-located ones run one after another. Every stage is
recorded on the timeline. One iteration:

  1. generate   rollout mesh: KV-cache engine, continuous batching, sampled log-probs;
  2. score      actor (old log-probs), reference (log-probs), critic (values), reward model;
                a rule-based reward on the host;
  3. advantages actor mesh: KL-shaped rewards, GAE or group-relative, whitening;
  4. update     actor and critic train steps over mini-batches and epochs;
  5. sync       actor weights resharded to the rollout mesh (device to device).

With `ppo.async_rollout`, the next batch is generated (by the weights of the last sync) while
this one is scored and trained on: one step off-policy, corrected by the importance ratio to
the rollout policy's log-probs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from rlhfjax import algorithms as alg
from rlhfjax import distributed, tasks
from rlhfjax.config import ExperimentConfig
from rlhfjax.data.byte_tokenizer import ByteTokenizer
from rlhfjax.observe.compiles import TraceCounter
from rlhfjax.observe.metrics import MetricsWriter, plot_metric
from rlhfjax.observe.timeline import Timeline, plot_gantt
from rlhfjax.placement import plan_placement
from rlhfjax.placement.spec import PlacementSpec, Role
from rlhfjax.ppo import dispatch, experience, steps
from rlhfjax.ppo.experience import AdvantageSettings, Sequences
from rlhfjax.ppo.runtime import RoleRuntime
from rlhfjax.rollout.engine import Engine, EngineConfig
from rlhfjax.rollout.sampling import SamplingParams
from rlhfjax.training.optimizer import make_optimizer

_STAGES = ("generate", "score", "advantages", "update", "sync")


class PromptStream:
  """Deterministic, reshuffled-every-epoch stream of prompts; its state is two ints."""

  def __init__(self, prompts: list[list[int]], seed: int):
    if not prompts:
      raise ValueError("the prompt set is empty")
    self.prompts, self.seed = prompts, seed
    self.epoch, self.position = 0, 0

  def _order(self) -> np.ndarray:
    return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.prompts))

  def next(self, n: int) -> list[list[int]]:
    out = []
    while len(out) < n:
      order = self._order()
      take = min(n - len(out), len(order) - self.position)
      out += [self.prompts[i] for i in order[self.position : self.position + take]]
      self.position += take
      if self.position == len(order):
        self.epoch, self.position = self.epoch + 1, 0
    return out


@dataclasses.dataclass
class RunResult:
  metrics: list[dict[str, float]]
  workdir: str
  compilations: dict[str, int]


class PPOTrainer:
  """Builds every role on its mesh from an `ExperimentConfig` and runs PPO iterations."""

  def __init__(self, cfg: ExperimentConfig, workdir: str, *, show_progress: bool = True):
    self.cfg, self.workdir, self.show_progress = cfg, workdir, show_progress
    self.placement: PlacementSpec = plan_placement(cfg, len(jax.devices()))
    distributed.check_placement(self.placement)
    ppo, rollout = cfg.ppo, cfg.rollout
    if rollout.batch_size % ppo.group_size:
      raise ValueError(
        f"rollout.batch_size={rollout.batch_size} must be a multiple of "
        f"ppo.group_size={ppo.group_size}"
      )
    rows_per_update = rollout.batch_size // (ppo.mini_batches * ppo.micro_batches)
    if rows_per_update * ppo.mini_batches * ppo.micro_batches != rollout.batch_size:
      raise ValueError(
        f"rollout.batch_size={rollout.batch_size} must split into "
        f"ppo.mini_batches x ppo.micro_batches = "
        f"{ppo.mini_batches} x {ppo.micro_batches}"
      )
    if ppo.async_rollout and self.placement.colocated(Role.ROLLOUT, Role.ACTOR):
      raise ValueError(
        "ppo.async_rollout needs the rollout on its own devices "
        "(placement.strategy='disaggregated')"
      )
    self.use_critic = ppo.advantage == "gae"
    self.use_reward_model = cfg.reward.model_coef != 0.0
    self.reward_fn = tasks.load_reward_fn(cfg.reward.fn) if cfg.reward.fn else None
    self.tokenizer = ByteTokenizer()
    self.stream = PromptStream(tasks.task_prompts(cfg.data.task, self.tokenizer), cfg.seed)
    self.timeline = Timeline()
    self.traces = TraceCounter()
    self.kl_state = alg.KLControllerState(coef=ppo.kl_coef)

    self.roles = self._build_roles()
    self._build_params()
    self._compile()
    self.engine = self._build_engine()

  # -------------------------------------------------------------------------------------------
  # Set-up.

  def _build_roles(self) -> dict[Role, RoleRuntime]:
    model = self.cfg.model
    heads = {
      Role.ACTOR: "lm",
      Role.REFERENCE: "lm",
      Role.CRITIC: "value",
      Role.REWARD: "value",
      Role.ROLLOUT: "lm",
    }
    mesh_cache: dict[Any, Any] = {}
    roles = {}
    for role, head in heads.items():
      spec = self.placement[role]
      key = (spec.devices, spec.axes)
      runtime = RoleRuntime.create(
        role, spec, model.for_role(role.value), head, mesh_cache.get(key)
      )
      mesh_cache[key] = runtime.mesh
      roles[role] = runtime
    return roles

  def _build_params(self) -> None:
    rng = jax.random.key(self.cfg.seed)
    actor_rng, critic_rng, reward_rng = jax.random.split(rng, 3)
    updates = self.cfg.total_steps * self.cfg.ppo.ppo_epochs * self.cfg.ppo.mini_batches
    self.actor_tx = make_optimizer(self.cfg.actor_optimizer, updates)
    self.critic_tx = make_optimizer(self.cfg.critic_optimizer, updates)
    actor, critic = self.roles[Role.ACTOR], self.roles[Role.CRITIC]
    self.actor_state, self.actor_state_shardings = actor.init_train_state(actor_rng, self.actor_tx)
    # The reference is the initial policy: the same initialisation, in the reference's shards.
    self.reference_params = self.roles[Role.REFERENCE].init_params(actor_rng)
    self.critic_state = None
    if self.use_critic:
      self.critic_state, self.critic_state_shardings = critic.init_train_state(
        critic_rng, self.critic_tx
      )
    self.reward_params = (
      self.roles[Role.REWARD].init_params(reward_rng) if self.use_reward_model else None
    )

  def _compile(self) -> None:
    """Jits every hot function once with explicit shardings for its role's mesh."""
    cfg, ppo, roles = self.cfg, self.cfg.ppo, self.roles
    b, p, t = cfg.rollout.batch_size, cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens
    temperature = cfg.rollout.temperature

    def scorer(name, role, fn, out_shape):
      rt = roles[role]
      batch_sh = (rt.batch_sharding((b, p + t)), rt.batch_sharding((b, p + t)))
      return jax.jit(
        self.traces.wrap(name, fn),
        in_shardings=(rt.param_shardings, *batch_sh),
        out_shardings=rt.batch_sharding(out_shape),
      )

    actor_model, critic_model = roles[Role.ACTOR].model, roles[Role.CRITIC].model
    self._actor_logprobs = scorer(
      "actor_logprobs",
      Role.ACTOR,
      functools.partial(
        steps.response_logprobs, actor_model, prompt_len=p, temperature=temperature
      ),
      (b, t),
    )
    self._reference_logprobs = scorer(
      "reference_logprobs",
      Role.REFERENCE,
      functools.partial(
        steps.response_logprobs, roles[Role.REFERENCE].model, prompt_len=p, temperature=temperature
      ),
      (b, t),
    )
    self._critic_values = scorer(
      "critic_values",
      Role.CRITIC,
      functools.partial(steps.response_values, critic_model, prompt_len=p),
      (b, t),
    )
    self._reward_scores = scorer(
      "reward_scores",
      Role.REWARD,
      functools.partial(steps.sequence_scores, roles[Role.REWARD].model),
      (b,),
    )

    settings = AdvantageSettings(
      kl_estimator=ppo.kl_estimator,
      estimator=ppo.advantage,
      gamma=ppo.gamma,
      lam=ppo.lam,
      group_size=ppo.group_size,
      whiten=ppo.whiten_advantages,
    )
    actor = roles[Role.ACTOR]
    self._advantages_fn = jax.jit(
      self.traces.wrap("advantages", functools.partial(experience.compute_advantages, settings)),
      out_shardings=None,
    )

    actor_loss = functools.partial(
      steps.actor_loss,
      config=actor_model,
      prompt_len=p,
      clip_eps=ppo.clip_eps,
      entropy_coef=ppo.entropy_coef,
      temperature=temperature,
    )
    self._actor_step = jax.jit(
      self.traces.wrap(
        "actor_step", functools.partial(steps.accumulate_and_apply, actor_loss, self.actor_tx)
      ),
      in_shardings=(self.actor_state_shardings, None),
      out_shardings=(self.actor_state_shardings, actor.replicated),
      donate_argnums=0,
    )
    if self.use_critic:
      critic_loss = functools.partial(
        steps.critic_loss, config=critic_model, prompt_len=p, clip_eps=ppo.value_clip_eps
      )
      self._critic_step = jax.jit(
        self.traces.wrap(
          "critic_step", functools.partial(steps.accumulate_and_apply, critic_loss, self.critic_tx)
        ),
        in_shardings=(self.critic_state_shardings, None),
        out_shardings=(self.critic_state_shardings, roles[Role.CRITIC].replicated),
        donate_argnums=0,
      )

  def _build_engine(self) -> Engine:
    rollout = self.cfg.rollout
    slots = rollout.slots or rollout.batch_size
    engine_cfg = EngineConfig(
      num_slots=slots,
      prompt_buckets=(rollout.max_prompt_len,),
      max_new_tokens=rollout.max_new_tokens,
      pad_token_id=self.tokenizer.pad_id,
    )
    rt = self.roles[Role.ROLLOUT]
    engine = Engine(rt.model, engine_cfg, rt.mesh)
    engine.update_params(self.actor_state.params)
    return engine

  # -------------------------------------------------------------------------------------------
  # One iteration.

  def _sampling(self) -> SamplingParams:
    r = self.cfg.rollout
    return SamplingParams(
      temperature=r.temperature,
      top_k=r.top_k,
      top_p=r.top_p,
      max_new_tokens=r.max_new_tokens,
      stop_token_ids=(self.tokenizer.eos_id,),
    )

  def _generate(self, iteration: int, prompts: list[list[int]]) -> Sequences:
    rollout = self.roles[Role.ROLLOUT]
    with self.timeline.stage(iteration, "rollout", "generate", rollout.devices):
      out = self.engine.generate(
        prompts, sampling=self._sampling(), seed=(self.cfg.seed * 1_000_003 + iteration) % 2**31
      )
    r = self.cfg.rollout
    return experience.assemble(
      prompts,
      out.tokens,
      out.lengths,
      out.logprobs,
      prompt_len=r.max_prompt_len,
      response_len=r.max_new_tokens,
      pad_id=self.tokenizer.pad_id,
    )

  def _next_prompts(self) -> list[list[int]]:
    group = self.cfg.ppo.group_size
    unique = self.stream.next(self.cfg.rollout.batch_size // group)
    return [p for p in unique for _ in range(group)]

  def _score(self, iteration: int, seqs: Sequences) -> dict[str, Any]:
    roles, batch = self.roles, seqs.device_batch()
    tokens, attention = batch["tokens"], batch["attention_mask"]

    def score(role: Role, fn, params) -> dispatch.Stage:
      rt = roles[role]
      run = lambda: fn(params, *rt.put_batch((tokens, attention)))
      return dispatch.Stage(role=role.value, name="score", devices=rt.devices, fn=run)

    stages = [
      score(Role.ACTOR, self._actor_logprobs, self.actor_state.params),
      score(Role.REFERENCE, self._reference_logprobs, self.reference_params),
    ]
    if self.use_critic:
      stages.append(score(Role.CRITIC, self._critic_values, self.critic_state.params))
    if self.use_reward_model:
      stages.append(score(Role.REWARD, self._reward_scores, self.reward_params))
    if self.reward_fn is not None:
      metadata = {"step": iteration, "tokenizer": self.tokenizer}
      stages.append(
        dispatch.Stage(
          role="reward_fn",
          name="score",
          devices=(),
          fn=lambda: np.asarray(self.reward_fn(seqs.prompts, seqs.responses, metadata), np.float32),
        )
      )
    results = dispatch.run_stages(stages, self.timeline, iteration)
    out = dict(zip([s.role for s in stages], results, strict=True))
    scores = np.zeros(len(seqs.prompts), np.float32)
    if self.use_reward_model:
      scores += self.cfg.reward.model_coef * distributed.to_host(out["reward"])
    if self.reward_fn is not None:
      fn_scores = out["reward_fn"]
      if fn_scores.shape != scores.shape:
        raise ValueError(
          f"reward function {self.cfg.reward.fn!r} returned shape "
          f"{fn_scores.shape}, expected {scores.shape}"
        )
      scores += self.cfg.reward.fn_coef * fn_scores
    return {
      "old_logprobs": out["actor"],
      "ref_logprobs": out["reference"],
      "values": out.get("critic"),
      "scores": scores,
    }

  def _advantages(self, iteration: int, seqs: Sequences, scored: dict[str, Any]):
    actor = self.roles[Role.ACTOR]
    with self.timeline.stage(iteration, "actor", "advantages", actor.devices):
      mask = actor.put_batch(seqs.response_mask_bt)
      old = scored["old_logprobs"]
      ref = actor.put_batch(scored["ref_logprobs"])
      values = (
        actor.put_batch(scored["values"]) if scored["values"] is not None else jnp.zeros_like(old)
      )
      scores = actor.put_batch(scored["scores"])
      out = jax.block_until_ready(
        self._advantages_fn(old, ref, values, scores, mask, jnp.float32(self.kl_state.coef))
      )
    return out

  def _training_batches(self, seqs: Sequences, scored, adv) -> tuple[dict, dict]:
    """Actor and critic training inputs on the host, fetched from the devices once per
    iteration (every epoch re-splits the same arrays)."""
    actor = {
      **seqs.device_batch(),
      "old_logprobs": distributed.to_host(scored["old_logprobs"]),
      "advantages": distributed.to_host(adv["advantages"]),
    }
    if self.cfg.ppo.async_rollout:
      actor["behaviour_logprobs"] = seqs.rollout_logprobs_bt
    critic = {**seqs.device_batch(), "returns": distributed.to_host(adv["returns"])}
    if self.use_critic:
      critic["old_values"] = distributed.to_host(scored["values"])
    return actor, critic

  def _minibatches(self, iteration: int, epoch: int, actor_host: dict, critic_host: dict):
    """Host-side permutation and split into `[mini][micro, rows, ...]` batches."""
    ppo = self.cfg.ppo
    b = self.cfg.rollout.batch_size
    order = np.random.default_rng([self.cfg.seed, iteration, epoch]).permutation(b)
    size = b // ppo.mini_batches
    shape = lambda x: x.reshape(ppo.micro_batches, size // ppo.micro_batches, *x.shape[1:])
    for k in range(ppo.mini_batches):
      rows = order[k * size : (k + 1) * size]
      yield (
        jax.tree.map(lambda x, r=rows: shape(x[r]), actor_host),
        jax.tree.map(lambda x, r=rows: shape(x[r]), critic_host),
      )

  def _update(self, iteration: int, actor_host: dict, critic_host: dict) -> dict[str, float]:
    roles, metrics = self.roles, []
    for epoch in range(self.cfg.ppo.ppo_epochs):
      batches = self._minibatches(iteration, epoch, actor_host, critic_host)
      for actor_batch, critic_batch in batches:
        stages = [
          dispatch.Stage(
            role="actor",
            name="update",
            devices=roles[Role.ACTOR].devices,
            fn=functools.partial(self._actor_update, actor_batch),
          )
        ]
        if self.use_critic:
          stages.append(
            dispatch.Stage(
              role="critic",
              name="update",
              devices=roles[Role.CRITIC].devices,
              fn=functools.partial(self._critic_update, critic_batch),
            )
          )
        results = dispatch.run_stages(stages, self.timeline, iteration)
        merged = {}
        for result in results:
          merged.update(jax.device_get(result))
        metrics.append(merged)
    return {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}

  def _actor_update(self, batch):
    self.actor_state, metrics = self._actor_step(
      self.actor_state, self.roles[Role.ACTOR].put_batch(batch, leading=1)
    )
    return {f"actor/{k}" if "/" not in k else k: v for k, v in metrics.items()}

  def _critic_update(self, batch):
    self.critic_state, metrics = self._critic_step(
      self.critic_state, self.roles[Role.CRITIC].put_batch(batch, leading=1)
    )
    return {f"critic/{k}" if "/" not in k else k: v for k, v in metrics.items()}

  def _sync(self, iteration: int) -> int:
    devices = tuple(
      sorted(set(self.roles[Role.ROLLOUT].devices) | set(self.roles[Role.ACTOR].devices))
    )
    with self.timeline.stage(iteration, "rollout", "sync", devices):
      moved = self.engine.update_params(self.actor_state.params)
      jax.block_until_ready(self.engine.params)
    return moved

  # -------------------------------------------------------------------------------------------
  # The loop.

  def _stage_times(self, iteration: int) -> dict[str, float]:
    records = self.timeline.for_iteration(iteration)
    times = {}
    for stage in _STAGES:
      rs = [r for r in records if r.stage == stage]
      times[f"time/{stage}"] = (max(r.end for r in rs) - min(r.start for r in rs)) if rs else 0.0
    return times

  def run(self) -> RunResult:
    cfg = self.cfg
    os.makedirs(self.workdir, exist_ok=True)
    writer = MetricsWriter(self.workdir, enabled=distributed.is_primary())
    rows: list[dict[str, float]] = []
    pool = concurrent.futures.ThreadPoolExecutor(1) if cfg.ppo.async_rollout else None
    pending = None
    bar = tqdm.tqdm(
      range(cfg.total_steps),
      desc="ppo",
      disable=not (self.show_progress and distributed.is_primary()),
      dynamic_ncols=True,
    )
    try:
      for iteration in bar:
        start = self.timeline.now()
        if pending is None:
          seqs = self._generate(iteration, self._next_prompts())
        else:
          seqs = pending.result()
        bytes_synced = 0
        if pool is not None:
          # The weights of the last update go to the rollout mesh before the next batch starts.
          if iteration > 0:
            bytes_synced = self._sync(iteration)
          pending = (
            pool.submit(self._generate, iteration + 1, self._next_prompts())
            if iteration + 1 < cfg.total_steps
            else None
          )
        scored = self._score(iteration, seqs)
        adv = self._advantages(iteration, seqs, scored)
        actor_host, critic_host = self._training_batches(seqs, scored, adv)
        update_metrics = self._update(iteration, actor_host, critic_host)
        if pool is None:
          bytes_synced = self._sync(iteration)
        elapsed = self.timeline.now() - start
        row = self._iteration_metrics(
          iteration,
          seqs,
          scored["scores"],
          actor_host["old_logprobs"],
          adv,
          update_metrics,
          elapsed,
          bytes_synced,
        )
        self.kl_state = alg.KL_CONTROLLERS[cfg.ppo.kl_controller](
          self.kl_state,
          row["kl/mean"],
          cfg.rollout.batch_size,
          target=cfg.ppo.kl_target,
          horizon=cfg.ppo.kl_horizon,
        )
        rows.append(row)
        if iteration % cfg.log_every == 0 or iteration == cfg.total_steps - 1:
          writer.write(iteration, {k: v for k, v in row.items() if k != "step"})
        bar.set_postfix(reward=f"{row['reward/mean']:.3f}", kl=f"{row['kl/mean']:.3f}")
    finally:
      if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
      writer.close()
    if distributed.is_primary():
      self._write_outputs(rows)
    return RunResult(metrics=rows, workdir=self.workdir, compilations=self.traces.counts)

  def _iteration_metrics(
    self, iteration, seqs, scores, actor_logp, adv, update_metrics, elapsed, bytes_synced
  ) -> dict[str, float]:
    mask = seqs.response_mask_bt > 0
    mismatch = np.abs(actor_logp - seqs.rollout_logprobs_bt)[mask]
    num_devices = len(self.placement.devices)
    row = {
      "step": iteration,
      "reward/mean": float(np.mean(scores)),
      "reward/std": float(np.std(scores)),
      "kl/mean": float(distributed.to_host(adv["kl/mean"])),
      "kl/coef": float(self.kl_state.coef),
      "response/length": float(mask.sum(-1).mean()),
      "logprob_mismatch/max": float(mismatch.max()) if mismatch.size else 0.0,
      "logprob_mismatch/mean": float(mismatch.mean()) if mismatch.size else 0.0,
      "time/iteration": elapsed,
      "throughput/tokens_per_s_per_device": seqs.num_tokens / elapsed / num_devices,
      "sync/bytes": float(bytes_synced),
      "loss/policy": update_metrics["loss/policy"],
      "loss/value": update_metrics.get("loss/value", 0.0),
    }
    row.update(self._stage_times(iteration))
    for key, value in update_metrics.items():
      row.setdefault(key, value)
    return row

  def _write_outputs(self, rows: list[dict[str, float]]) -> None:
    self.timeline.write_json(os.path.join(self.workdir, "timeline.json"))
    last = [r for r in self.timeline.records if r.iteration >= max(len(rows) - 3, 0)]
    plot_gantt(
      last,
      os.path.join(self.workdir, "timeline.png"),
      title=f"{self.placement.strategy}: last iterations",
    )
    plot_metric(
      rows,
      "reward/mean",
      os.path.join(self.workdir, "reward.png"),
      title="mean reward per iteration",
    )
