"""The sequence score: `reward.model_coef` x the reward model + `reward.fn_coef` x a rule +
`reward.role_coefs[r]` x each extra reward role r (`model.extra_roles` of kind 'reward') +
`reward.judge_coef` x a generative judge's score (`rlhfjax.cluster.judge`) +
`reward.environment_coef` x a conversation's environment rewards.

Every reward model (the built-in one, the extra ones) scores on its own mesh, wherever the
placement puts it; a rule (`reward.fn`, 'module:function') runs on the host with the token ids
of the prompts and responses, the one host round trip of scoring. Its `metadata` holds 'step',
'tokenizer' and 'records': each response's prompt record (the extra fields of its prompt line,
`rlhfjax.data.records.Record`), aligned with the responses. The environment's rewards
(`rollout.environment`) were given during the rollout (`Sequences.environment_rewards`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import numpy as np

from rlhfjax import models, tasks
from rlhfjax.cluster.cluster import Cluster, WeightSource, extra_rng, initial_rngs
from rlhfjax.cluster.judge import Judge
from rlhfjax.config import ConfigError, ExperimentConfig
from rlhfjax.placement.spec import Role
from rlhfjax.training import steps

RULE = "reward_fn"
"""The rule's stage and result name (it runs on the host)."""
ENVIRONMENT = "environment"
"""The environment rewards' stage and result name (read on the host)."""


def reward_models(cfg: ExperimentConfig) -> dict[str, float]:
  """The roles whose model scores join the reward, with their weights: the reward model (when
  `reward.model_coef` is not 0), then the extra reward roles in `reward.role_coefs`."""
  roles = {Role.REWARD: cfg.reward.model_coef} if cfg.reward.model_coef != 0.0 else {}
  return {**roles, **cfg.reward.role_coefs}


def weight_source(cfg: ExperimentConfig, role: str) -> WeightSource:
  """Where a reward model's weights come from: `init.reward` for the built-in one, an extra
  role's `init` (else its `hf`) for the others; random from `seed` when empty."""
  if role == Role.REWARD:
    rng = initial_rngs(cfg.seed)[Role.REWARD]
    return WeightSource(source=cfg.init.reward, what="init.reward", rng=rng)
  section = cfg.model.extra_roles[role]
  what = f"model.extra_roles.{role}." + ("init" if section.init or not section.hf else "hf")
  return WeightSource(source=section.init or section.hf, what=what, rng=extra_rng(cfg.seed, role))


class Rewards:
  """Scores sequences with the configured reward parts; see the module docstring."""

  def __init__(self, cfg: ExperimentConfig, cluster: Cluster, tokenizer: Any):
    self.cfg, self.cluster, self.tokenizer = cfg, cluster, tokenizer
    reward = cfg.reward
    self.models = reward_models(cfg)
    """The reward models by role, with their weights (`reward_models`)."""
    if Role.REWARD not in self.models and cfg.init.reward:
      raise ConfigError("'init.reward' is set but 'reward.model_coef' is 0: nothing would use it")
    self.fn = tasks.load_reward_fn(reward.fn) if reward.fn else None
    self.use_environment = bool(cfg.rollout.environment)
    self.judge = None
    if reward.judge:
      cluster.freeze(reward.judge, weight_source(cfg, reward.judge))
      self.judge = Judge(cfg, cluster, tokenizer)
    self.task_fn = task_rule(cfg)
    b = cfg.rollout.batch_size
    self._packed: dict[str, Any] = {}
    self._micro_scores: dict[str, dict[int, Any]] = {}
    for role in self.models:
      cluster.freeze(role, weight_source(cfg, role))
      self._micro_scores[role] = {b: self._model_program(role, b)}
    # In the order of the module docstring's sum: the reward model, the rule, the extra roles,
    # the environment.
    self._parts = [*self.models][:1] if Role.REWARD in self.models else []
    self._parts += [RULE] if self.fn is not None else []
    self._parts += [role for role in self.models if role != Role.REWARD]
    self._parts += [reward.judge] if self.judge is not None else []
    self._parts += [ENVIRONMENT] if self.use_environment else []
    host_coefs = {RULE: reward.fn_coef, ENVIRONMENT: reward.environment_coef}
    if self.judge is not None:
      host_coefs[reward.judge] = reward.judge_coef
    self._host_parts = frozenset(host_coefs)
    """Parts whose results come to the host (the rule, the judge's verdicts, the
    environment's rewards): uploaded to the actor's mesh to be combined."""
    self._coefs = {part: {**self.models, **host_coefs}[part] for part in self._parts}
    """Each part's weight in the sum."""
    coefs = list(self._coefs.values())

    def combine(*parts):
      # Left to right, c0 * p0 + c1 * p1 + ...: with the reward model and a rule alone, the
      # expression it always was.
      return functools.reduce(
        lambda total, term: total + term, (c * p for c, p in zip(coefs, parts, strict=True))
      )

    actor = cluster.roles[Role.ACTOR]
    self._combine = cluster.compile(
      "combine_scores", combine, out_shardings=actor.batch_sharding((b,))
    )

  def _model_program(self, role: str, rows: int) -> Any:
    """Reward model `role`'s `fn(params, tokens_bs, attention_bs) -> scores_b` for `rows`
    rows."""
    rt, s = self.cluster.roles[role], self.cfg.rollout.max_seq_len
    batch = (rt.batch_sharding((rows, s)), rt.batch_sharding((rows, s)))
    tag = "" if rows == self.cfg.rollout.batch_size else f"_{rows}rows"
    prefix = "reward" if role == Role.REWARD else str(role)
    return self.cluster.scorer(
      f"{prefix}_scores{tag}",
      functools.partial(steps.sequence_scores, rt.model),
      in_shardings=(rt.param_shardings, *batch),
      out_shardings=rt.batch_sharding((rows,)),
      role=role,
    )

  def _program(self, role: str, inputs: tuple[jax.Array, ...]) -> Any:
    """Reward model `role`'s program for `inputs`: packed rows or padded ones of their count."""
    if len(inputs) == 3:
      if role not in self._packed:
        rt = self.cluster.roles[role]
        prefix = "reward" if role == Role.REWARD else str(role)
        self._packed[role] = self.cluster.compile(
          f"{prefix}_values_packed",
          functools.partial(models.forward_packed, rt.model, head="value"),
          in_shardings=(rt.param_shardings, None, None, None),
          role=role,
        )
      return self._packed[role]
    rows, programs = inputs[0].shape[0], self._micro_scores[role]
    if rows not in programs:
      programs[rows] = self._model_program(role, rows)
    return programs[rows]

  def stages(self, inputs: tuple[jax.Array, ...], seqs: Any, iteration: int):
    """Scoring stages of some rows (the batch, or a micro-batch of fused scoring): each reward
    model on its mesh (from the inputs on any mesh), the rule on the host (from the rollout's
    token ids).

    `inputs`: `(tokens_bs, attention_bs)`, a model's result the scores `[b]`; or packed rows
    `(tokens, positions, segments)` (`rlhfjax.flows.packed`), its result the values `[r, w]`,
    read at each sample's last token by the caller."""
    out = []
    for role in self.models:
      program = self._program(role, inputs)

      def model(role=role, program=program):
        # The weights as they are when the stage runs (offload may have moved them since).
        return program(self.cluster.params[role], *self.cluster.move(role, inputs))

      out.append(self.cluster.stage(role, "score", model))
    metadata = self.metadata(iteration, seqs)
    for part in (p for p in self._parts if p in self._host_parts):
      name = "judge" if self.judge is not None and part == self.judge.role else "score"
      out.append(self.cluster.stage(part, name, lambda p=part: self._host_part(p, seqs, metadata)))
    return out

  def _host_part(self, part: str, seqs: Any, metadata: dict[str, Any]) -> np.ndarray:
    """`[b]` float32 of a part computed from the host's sequences: the rule's scores, the
    environment's rewards or the judge's scores."""
    if part == RULE:
      return self._rule(self.fn, seqs, metadata)
    if part == ENVIRONMENT:
      return self._environment(seqs)
    return self.judge.score(seqs)

  def _score_name(self, part: str) -> str:
    """A part's name in `evaluate`'s scores: 'reward_model', 'reward_fn', 'judge',
    'environment', or '<role>_model' of an extra reward role."""
    names = {Role.REWARD: "reward_model", RULE: RULE, ENVIRONMENT: ENVIRONMENT}
    if self.judge is not None:
      names[self.judge.role] = "judge"
    return names.get(part, f"{part}_model")

  def score(self, tokens_bs: jax.Array, attention_bs: jax.Array, seqs: Any, iteration: int):
    """`stages` run on their own, then `combine`d: the score `[b]` on the actor's mesh."""
    todo = self.stages((tokens_bs, attention_bs), seqs, iteration)
    results = self.cluster.run(todo, iteration)
    return self.combine(dict(zip([s.role for s in todo], results, strict=True)))

  def combine(self, results: dict[str, Any]) -> jax.Array:
    """The combined score `[b]` on the actor's mesh, from the results of `stages` by role."""
    parts = [
      self.cluster.upload(Role.ACTOR, results[part], f"{part} scores")
      if part in self._host_parts
      else self.cluster.move(Role.ACTOR, results[part])
      for part in self._parts
    ]
    return self._combine(*parts)

  def take_metrics(self) -> dict[str, float]:
    """The scoring's own counts since the last call, for the iteration's row: the judge's
    parse failures."""
    if self.judge is None:
      return {}
    return {"reward/judge_failures": float(self.judge.take_failures())}

  def metadata(self, step: int, seqs: Any) -> dict[str, Any]:
    """What a rule reward gets beside the token ids: the step, the tokenizer, and one prompt
    record per response."""
    return {"step": step, "tokenizer": self.tokenizer, "records": list(seqs.records)}

  def _rule(self, fn, seqs: Any, metadata: dict) -> np.ndarray:
    scores = np.asarray(fn(seqs.prompts, seqs.responses, metadata), np.float32)
    if scores.shape != (len(seqs.prompts),):
      raise ValueError(
        f"reward function {self.cfg.reward.fn!r} returned shape "
        f"{scores.shape}, expected {(len(seqs.prompts),)}"
      )
    return scores

  def _environment(self, seqs: Any) -> np.ndarray:
    if seqs.environment_rewards is None:
      raise ValueError("rollout.environment is set but the batch holds no environment rewards")
    return seqs.environment_rewards

  def evaluate(self, seqs: Any) -> dict[str, np.ndarray]:
    """Every part of the reward ('reward_model', 'reward_fn', '<role>_model' of an extra
    role, 'environment'), their combination and the task's own rule, on the host."""
    meta = self.metadata(-1, seqs)
    scores: dict[str, np.ndarray] = {}
    n = len(seqs.prompts)
    combined = np.zeros(n, np.float32)
    for part in self._parts:
      # The rule and the environment's rewards are on the host already; the others cross.
      on_host = part in (RULE, ENVIRONMENT)
      with contextlib.nullcontext() if on_host else self.cluster.host("evaluation"):
        if part in self._host_parts:
          score = self._host_part(part, seqs, meta)
        else:
          batch = self.cluster.roles[part].put_batch((seqs.tokens_bs, seqs.attention_mask_bs))
          program = self._micro_scores[part][self.cfg.rollout.batch_size]
          score = self.cluster.fetch(program(self.cluster.params[part], *batch), "evaluation")
      scores[self._score_name(part)] = score
      combined += self._coefs[part] * score
    scores["reward"] = combined
    if self.task_fn is not None:
      scores["task_reward"] = np.asarray(
        self.task_fn(seqs.prompts, seqs.responses, meta), np.float32
      )
    return scores


def task_rule(cfg: ExperimentConfig) -> Any:
  """The bundled task's own rule, which evaluations report as `task_reward`, or None where it
  says nothing about this run: the prompts are the user's (`data.prompts`), or the reward is
  a function of the user's, which is then what the run is evaluated by."""
  rule = tasks.TASK_REWARDS.get(cfg.data.task)
  if rule is None or cfg.data.prompts:
    return None
  own = f"{rule.__module__}:{rule.__name__}"
  return rule if cfg.reward.fn in ("", own) else None
