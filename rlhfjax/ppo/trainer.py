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

Checkpoints (`rlhfjax.checkpoint`) hold the actor and critic train states, the rollout weights
of an async run, the KL coefficient, the prompt iterator's state and the prompts of a batch
generated ahead; every random choice is a function of (`seed`, iteration), so a resumed run
repeats the uninterrupted one exactly. A rerun of the same command resumes from the latest
complete checkpoint, onto whatever placement the config now names.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from rlhfjax import algorithms as alg
from rlhfjax import checkpoint as ckpt
from rlhfjax import data, distributed, models, signals, tasks
from rlhfjax.config import ConfigError, ExperimentConfig
from rlhfjax.mesh import offload
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
from rlhfjax.training import weights
from rlhfjax.training.optimizer import make_optimizer

_STAGES = ("generate", "score", "advantages", "update", "sync")


@dataclasses.dataclass
class RunResult:
  metrics: list[dict[str, float]]
  """The rows of the iterations this run executed (a resumed run: from its first step on)."""
  workdir: str
  compilations: dict[str, int]
  start_step: int = 0
  """The iteration this run started at: > 0 when it resumed from a checkpoint."""
  preempted: bool = False
  """SIGTERM stopped the run early, after writing a checkpoint."""
  evaluation: dict[str, Any] = dataclasses.field(default_factory=dict)
  """'before' and 'after' PPO evaluations (see `PPOTrainer.evaluate`), when they ran."""


class TooManySkippedUpdates(RuntimeError):
  """Updates were skipped for non-finite losses or gradients `ppo.max_skipped_updates` times
  in a row: the run stops rather than burn compute on a diverged model."""


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
    if cfg.reward.model_coef == 0.0 and cfg.init.reward:
      raise ConfigError("'init.reward' is set but 'reward.model_coef' is 0: nothing would use it")
    self.reward_fn = tasks.load_reward_fn(cfg.reward.fn) if cfg.reward.fn else None
    self.task_reward_fn = tasks.TASK_REWARDS.get(cfg.data.task)
    self.tokenizer = data.load_tokenizer(cfg.data.tokenizer)
    if self.tokenizer.vocab_size > cfg.model.for_role("actor").vocab_size:
      raise ConfigError(
        f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocabulary "
        f"only {cfg.model.for_role('actor').vocab_size}"
      )
    self.prompts, self.eval_prompts = self._load_prompts()
    self.timeline = Timeline()
    self.traces = TraceCounter()
    self.kl_state = alg.KLControllerState(coef=ppo.kl_coef)
    self.skipped_in_row = 0
    self.pending_prompts: list[list[int]] | None = None
    """Prompts of the batch generated ahead (async rollout), saved with a checkpoint."""
    self.checkpointer = ckpt.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint)

    self.roles = self._build_roles()
    self.start_step, restored = self._build_params()
    self._compile()
    self._place_idle("idle")  # offload hook
    self.engine = self._build_engine()
    if restored.get("rollout") is not None:
      # An async run's next batch was generated by the weights of the sync before this
      # checkpoint: regenerate it with those, not with the actor's newer ones.
      self.engine.update_params(restored["rollout"])

  def _load_prompts(self) -> tuple[data.PromptIterator, list[list[int]]]:
    """The endless, shuffled training prompts and the first `eval.num_prompts` held-out ones."""
    cfg = self.cfg
    d = cfg.data
    dataset = distributed.primary_first(
      lambda: data.prepare(
        "prompt",
        d.prompts or data.bundled_path(d.task, "prompt"),
        d.data_dir or os.path.join(self.workdir, "data"),
        on_bad_record=d.on_bad_record,
      )
    )
    template = data.ChatTemplate() if d.chat_template else None
    stream = functools.partial(
      data.prompt_iterator,
      tokenizer=self.tokenizer,
      max_prompt_len=cfg.rollout.max_prompt_len,
      seed=cfg.seed,
      on_long_prompt=d.on_long_prompt,
      chat_template=template,
    )
    train = stream(dataset.source(d.train_split))
    eval_prompts = []
    if cfg.eval.num_prompts:
      held_out = stream(dataset.source(d.eval_split), repeat=False)
      for prompt in held_out:
        eval_prompts.append(prompt)
        if len(eval_prompts) == cfg.eval.num_prompts:
          break
    return train, eval_prompts

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

  def _initial_params(self, role: Role, source: str, rng: jax.Array, what: str) -> Any:
    """`role`'s first weights in its shards: random, or from a checkpoint (see `weights`)."""
    rt = self.roles[role]
    items = ("policy", "actor") if rt.head == "lm" else ("reward", "critic", "policy", "actor")
    return weights.load_params(
      source,
      model=rt.model,
      head=rt.head,
      mesh=rt.mesh,
      layout=rt.spec.layout,
      shardings=rt.param_shardings,
      rng=rng,
      items=items,
      what=what,
    )

  def _build_params(self) -> tuple[int, dict[str, Any]]:
    """Every role's weights and the trained roles' optimizer states, fresh or restored.

    Returns the iteration to start at (0, or the step of the checkpoint resumed from) and the
    restored items.
    """
    cfg = self.cfg
    rng = jax.random.key(cfg.seed)
    actor_rng, critic_rng, reward_rng = jax.random.split(rng, 3)
    updates = cfg.total_steps * cfg.ppo.ppo_epochs * cfg.ppo.mini_batches
    self.actor_tx = make_optimizer(cfg.actor_optimizer, updates)
    self.critic_tx = make_optimizer(cfg.critic_optimizer, updates)
    init = cfg.init
    # The reference is the initial policy: the same weights, in the reference's shards.
    self.reference_params = self._initial_params(
      Role.REFERENCE, init.actor, actor_rng, "init.actor"
    )
    self.reward_params = (
      self._initial_params(Role.REWARD, init.reward, reward_rng, "init.reward")
      if self.use_reward_model
      else None
    )
    resume_step = self.checkpointer.latest_step() if cfg.checkpoint.resume else None
    if resume_step is not None:
      return resume_step, self._restore(resume_step)
    self.actor_state, self.actor_state_shardings = self.roles[Role.ACTOR].train_state(
      self._initial_params(Role.ACTOR, init.actor, actor_rng, "init.actor"), self.actor_tx
    )
    self.critic_state = None
    if self.use_critic:
      # Without its own source, the critic starts from the policy's trunk (value head at 0).
      critic_source, what = (
        (init.critic, "init.critic") if init.critic else (init.actor, "init.actor")
      )
      self.critic_state, self.critic_state_shardings = self.roles[Role.CRITIC].train_state(
        self._initial_params(Role.CRITIC, critic_source, critic_rng, what), self.critic_tx
      )
    return 0, {}

  def _restore(self, step: int) -> dict[str, Any]:
    """Reads checkpoint `step` straight into this placement's shards (which may differ from
    the placement that saved it) and the loop's state from its meta."""
    abstract: dict[str, Any] = {}
    actor, critic = self.roles[Role.ACTOR], self.roles[Role.CRITIC]
    abstract["actor"] = actor.abstract_train_state(self.actor_tx)
    self.actor_state_shardings = actor.train_state_shardings(self.actor_tx)
    if self.use_critic:
      abstract["critic"] = critic.abstract_train_state(self.critic_tx)
      self.critic_state_shardings = critic.train_state_shardings(self.critic_tx)
    if self.cfg.ppo.async_rollout:
      rollout = self.roles[Role.ROLLOUT]
      abstract["rollout"] = weights.abstract_with_shardings(
        models.abstract_params(rollout.model, rollout.head), rollout.param_shardings
      )
    items, meta = self.checkpointer.restore(step, abstract)
    if meta.get("seed") != self.cfg.seed:
      raise ckpt.CheckpointError(
        f"{self.checkpointer.directory / str(step)} was written with seed {meta.get('seed')}, "
        f"the config says {self.cfg.seed}: resume with the same seed or another workdir"
      )
    self.actor_state = items["actor"]
    self.critic_state = items.get("critic")
    self.kl_state = alg.KLControllerState(coef=float(meta["kl_coef"]))
    self.prompts.set_state(meta["data"])
    self.pending_prompts = meta.get("pending_prompts")
    self.skipped_in_row = int(meta.get("skipped_in_row", 0))
    return items

  def _checkpoint_meta(self, step: int) -> dict[str, Any]:
    return {
      "step": step,
      # Every random choice derives from (seed, iteration): this is the whole RNG state.
      "seed": self.cfg.seed,
      "kl_coef": float(self.kl_state.coef),
      "data": self.prompts.get_state(),
      "pending_prompts": self.pending_prompts,
      "skipped_in_row": self.skipped_in_row,
      "placement": self.placement.strategy,
    }

  def _save(self, step: int, *, force: bool = False) -> bool:
    """Checkpoint after `step` iterations (on the schedule, or always with `force`)."""
    self._place_idle("all")  # offload hook: checkpoints read device arrays
    items = {"actor": self.actor_state}
    if self.use_critic:
      items["critic"] = self.critic_state
    if self.cfg.ppo.async_rollout:
      items["rollout"] = self.engine.params
    saved = self.checkpointer.save(step, items, self._checkpoint_meta(step), force=force)
    self._place_idle("idle")  # offload hook: `save` returns once the arrays are copied
    return saved

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
      tail_threshold=rollout.tail_threshold,
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
      return self._rollout(
        prompts, self._sampling(), seed=(self.cfg.seed * 1_000_003 + iteration) % 2**31
      )

  def _rollout(self, prompts: list[list[int]], sampling: SamplingParams, seed: int) -> Sequences:
    """Responses from the engine, laid out as sequences for the scorers."""
    out = self.engine.generate(prompts, sampling=sampling, seed=seed)
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
    unique = self.prompts.take(self.cfg.rollout.batch_size // group)
    return [p for p in unique for _ in range(group)]

  def _score(self, iteration: int, seqs: Sequences) -> dict[str, Any]:
    self._place_idle("score")  # offload hook
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
    self._place_idle("idle")  # offload hook
    out = dict(zip([s.role for s in stages], results, strict=True))
    model_scores = distributed.to_host(out["reward"]) if self.use_reward_model else None
    return {
      "old_logprobs": out["actor"],
      "ref_logprobs": out["reference"],
      "values": out.get("critic"),
      "scores": self._combined_score(len(seqs.prompts), model_scores, out.get("reward_fn")),
    }

  def _combined_score(
    self, n: int, model_scores: np.ndarray | None, fn_scores: np.ndarray | None
  ) -> np.ndarray:
    """`reward.model_coef` x reward model + `reward.fn_coef` x rule, per sequence."""
    scores = np.zeros(n, np.float32)
    if model_scores is not None:
      scores += self.cfg.reward.model_coef * model_scores
    if fn_scores is not None:
      if fn_scores.shape != scores.shape:
        raise ValueError(
          f"reward function {self.cfg.reward.fn!r} returned shape "
          f"{fn_scores.shape}, expected {scores.shape}"
        )
      scores += self.cfg.reward.fn_coef * fn_scores
    return scores

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
    self._place_idle("update")  # offload hook
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
        skipped = max(float(merged["actor/skipped"]), float(merged.get("critic/skipped", 0.0)))
        self.skipped_in_row = self.skipped_in_row + 1 if skipped else 0
        metrics.append(merged)
    out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
    out["update/skipped"] = float(
      sum(max(m["actor/skipped"], m.get("critic/skipped", 0.0)) for m in metrics)
    )
    out["update/skipped_in_row"] = float(self.skipped_in_row)
    self._place_idle("idle")  # offload hook
    return out

  def _place_idle(self, stage: str) -> None:
    """Offload hook (`rlhfjax.mesh.offload`, ChatLearn's memory sharing): the parts that
    `cfg.offload` names go to host memory unless `stage` ('score', 'update', 'all' or 'idle')
    uses them, and come back to device memory before a stage that does."""
    off = self.cfg.offload
    for role in off.params:
      move = offload.to_device if stage in ("score", "all") else offload.to_host
      setattr(self, f"{role}_params", move(getattr(self, f"{role}_params")))
    for role in off.optimizer:
      state = getattr(self, f"{role}_state")
      if state is not None:
        move = offload.to_device if stage in ("update", "all") else offload.to_host
        setattr(self, f"{role}_state", state.replace(opt_state=move(state.opt_state)))

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
    """Runs the iterations from `start_step` to `total_steps`, with an evaluation before the
    first (of a fresh run) and after the last. SIGTERM stops it after the current iteration
    with a checkpoint."""
    cfg = self.cfg
    os.makedirs(self.workdir, exist_ok=True)
    primary = distributed.is_primary()
    writer = MetricsWriter(self.workdir, enabled=primary, start_step=self.start_step)
    evaluation = self._read_evaluation()
    if self.start_step == 0 and self.eval_prompts:
      evaluation = {"before": self.evaluate()}
      self._write_evaluation(evaluation)
    rows: list[dict[str, float]] = []
    preempted = threading.Event()
    restore_handler = signals.on_stop(preempted.set, "PPO run")
    pool = concurrent.futures.ThreadPoolExecutor(1) if cfg.ppo.async_rollout else None
    pending = None
    bar = tqdm.tqdm(
      range(self.start_step, cfg.total_steps),
      desc="ppo",
      initial=self.start_step,
      total=cfg.total_steps,
      disable=not (self.show_progress and primary),
      dynamic_ncols=True,
    )
    try:
      for iteration in bar:
        row, pending = self._iteration(iteration, pool, pending)
        rows.append(row)
        if iteration % cfg.log_every == 0 or iteration == cfg.total_steps - 1:
          writer.write(iteration, {k: v for k, v in row.items() if k != "step"})
        bar.set_postfix(reward=f"{row['reward/mean']:.3f}", kl=f"{row['kl/mean']:.3f}")
        self._check_skipped(iteration)
        done = iteration + 1
        if preempted.is_set():
          self._save(done, force=True)
          break
        self._save(done, force=done == cfg.total_steps)
    finally:
      restore_handler()
      if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
      writer.close()
      self.checkpointer.wait()
    stopped_early = preempted.is_set() and (not rows or rows[-1]["step"] + 1 < cfg.total_steps)
    if not stopped_early and self.eval_prompts and "after" not in evaluation:
      evaluation["after"] = self.evaluate()
      self._write_evaluation(evaluation)
    if primary:
      self._write_outputs(writer.rows())
    self.checkpointer.close()
    return RunResult(
      metrics=rows,
      workdir=self.workdir,
      compilations=self.traces.counts,
      start_step=self.start_step,
      preempted=stopped_early,
      evaluation=evaluation,
    )

  def _iteration(self, iteration: int, pool, pending) -> tuple[dict[str, float], Any]:
    """One PPO iteration; returns its metrics row and the future of the next batch (async)."""
    cfg = self.cfg
    start = self.timeline.now()
    if pending is None:
      prompts = self.pending_prompts or self._next_prompts()
      self.pending_prompts = None
      seqs = self._generate(iteration, prompts)
    else:
      seqs = pending.result()
    bytes_synced = 0
    if pool is not None:
      # The weights of the last update go to the rollout mesh before the next batch starts.
      if iteration > 0:
        bytes_synced = self._sync(iteration)
      pending = None
      if iteration + 1 < cfg.total_steps:
        self.pending_prompts = self._next_prompts()
        pending = pool.submit(self._generate, iteration + 1, self.pending_prompts)
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
    return row, pending

  def _check_skipped(self, iteration: int) -> None:
    """Too many updates in a row skipped for non-finite values stop the run."""
    limit = self.cfg.ppo.max_skipped_updates
    if self.skipped_in_row >= limit:
      raise TooManySkippedUpdates(
        f"stopped at iteration {iteration}: the last {self.skipped_in_row} updates had a "
        "non-finite "
        f"loss or gradients and were skipped (ppo.max_skipped_updates={limit}); the weights "
        f"are those of the last finite update. Check the rewards and the learning rates."
      )

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
    row.update({f"data/{k}": float(v) for k, v in self.prompts.stats.items()})
    for key, value in update_metrics.items():
      row.setdefault(key, value)
    return row

  def _write_outputs(self, rows: list[dict[str, float]]) -> None:
    """Timeline (this run's iterations) and the reward curve (every row of metrics.jsonl, so
    a resumed run plots the whole run)."""
    self.timeline.write_json(os.path.join(self.workdir, "timeline.json"))
    newest = max((r.iteration for r in self.timeline.records), default=0)
    last = [r for r in self.timeline.records if r.iteration > newest - 3]
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

  # -------------------------------------------------------------------------------------------
  # Evaluation.

  def evaluate(self) -> dict[str, Any]:
    """The current policy on the held-out prompts: mean rewards and a few samples.

    Responses come from the rollout engine (at `eval.temperature`; 0 is greedy) with a fixed
    seed, so the evaluations before and after PPO see the same prompts and randomness. Reports
    the configured reward and each of its parts, and the task's own rule (`task_reward`): what
    the task wants, which a learned reward model only approximates.
    """
    cfg = self.cfg
    b = cfg.rollout.batch_size
    sampling = dataclasses.replace(self._sampling(), temperature=cfg.eval.temperature)
    parts: dict[str, list[np.ndarray]] = {}
    samples: list[dict[str, Any]] = []
    for start in range(0, len(self.eval_prompts), b):
      chunk = self.eval_prompts[start : start + b]
      n = len(chunk)
      chunk = chunk + [chunk[-1]] * (b - n)  # the scorers are compiled for whole batches
      seqs = self._rollout(chunk, sampling, seed=cfg.seed + 7919)
      scores = self._eval_scores(seqs)
      for key, value in scores.items():
        parts.setdefault(key, []).append(value[:n])
      parts.setdefault("response_length", []).append(seqs.response_mask_bt.sum(-1)[:n])
      for i in range(min(n, 8 - len(samples))):
        samples.append(
          {
            "prompt": self.tokenizer.decode(seqs.prompts[i]),
            "response": self.tokenizer.decode(seqs.responses[i]),
            **{key: float(value[i]) for key, value in scores.items()},
          }
        )
    result: dict[str, Any] = {
      key: float(np.mean(np.concatenate(values))) for key, values in parts.items()
    }
    result["num_prompts"] = len(self.eval_prompts)
    result["samples"] = samples
    return result

  def _eval_scores(self, seqs: Sequences) -> dict[str, np.ndarray]:
    meta = {"step": -1, "tokenizer": self.tokenizer}
    scores: dict[str, np.ndarray] = {}
    if self.use_reward_model:
      rt = self.roles[Role.REWARD]
      batch = rt.put_batch((seqs.tokens_bs, seqs.attention_mask_bs))
      self._place_idle("score")  # offload hook
      scores["reward_model"] = distributed.to_host(self._reward_scores(self.reward_params, *batch))
      self._place_idle("idle")  # offload hook
    if self.reward_fn is not None:
      scores["reward_fn"] = np.asarray(
        self.reward_fn(seqs.prompts, seqs.responses, meta), np.float32
      )
    scores["reward"] = self._combined_score(
      len(seqs.prompts), scores.get("reward_model"), scores.get("reward_fn")
    )
    if self.task_reward_fn is not None:
      scores["task_reward"] = np.asarray(
        self.task_reward_fn(seqs.prompts, seqs.responses, meta), np.float32
      )
    return scores

  def _read_evaluation(self) -> dict[str, Any]:
    path = os.path.join(self.workdir, "eval.json")
    if self.start_step == 0 or not os.path.exists(path):
      return {}
    with open(path) as f:
      return json.load(f)

  def _write_evaluation(self, evaluation: dict[str, Any]) -> None:
    """eval.json, and eval.md: a table of before / after and the samples, for people."""
    if not distributed.is_primary():
      return
    path = os.path.join(self.workdir, "eval.json")
    with open(path + ".tmp", "w") as f:
      json.dump(evaluation, f, indent=1)
    os.replace(path + ".tmp", path)
    with open(os.path.join(self.workdir, "eval.md"), "w") as f:
      f.write(format_evaluation(evaluation))


def format_evaluation(evaluation: dict[str, Any]) -> str:
  """A Markdown summary of the evaluations before and after PPO."""
  phases = [p for p in ("before", "after") if p in evaluation]
  keys = [
    k
    for k in ("task_reward", "reward", "reward_model", "reward_fn", "response_length")
    if any(k in evaluation[p] for p in phases)
  ]
  lines = ["| metric | " + " | ".join(phases) + " |", "| --- |" + " --- |" * len(phases)]
  for key in keys:
    cells = [f"{evaluation[p][key]:.4f}" if key in evaluation[p] else "" for p in phases]
    lines.append(f"| {key} | " + " | ".join(cells) + " |")
  for phase in phases:
    lines += ["", f"Samples {phase} PPO:", ""]
    for s in evaluation[phase]["samples"]:
      lines.append(f"- {s['prompt']!r} -> {s['response']!r} (reward {s['reward']:.3f})")
  return "\n".join(lines) + "\n"
