"""The sequence score: `reward.model_coef` x the reward model + `reward.fn_coef` x a rule +
`reward.environment_coef` x a conversation's environment rewards.

The reward model scores on its own mesh; a rule (`reward.fn`, 'module:function') runs on the
host with the token ids of the prompts and responses, the one host round trip of scoring. Its
`metadata` holds 'step', 'tokenizer' and 'records': each response's prompt record (the extra
fields of its prompt line, `rlhfjax.data.records.Record`), aligned with the responses. The
environment's rewards (`rollout.environment`) were given during the rollout
(`Sequences.environment_rewards`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from rlhfjax import models, tasks
from rlhfjax.cluster.cluster import Cluster, WeightSource, initial_rngs
from rlhfjax.config import ConfigError, ExperimentConfig
from rlhfjax.placement.spec import Role
from rlhfjax.training import steps


class Rewards:
  """Scores sequences with the configured reward parts; see the module docstring."""

  def __init__(self, cfg: ExperimentConfig, cluster: Cluster, tokenizer: Any):
    self.cfg, self.cluster, self.tokenizer = cfg, cluster, tokenizer
    reward = cfg.reward
    self.use_model = reward.model_coef != 0.0
    if not self.use_model and cfg.init.reward:
      raise ConfigError("'init.reward' is set but 'reward.model_coef' is 0: nothing would use it")
    self.fn = tasks.load_reward_fn(reward.fn) if reward.fn else None
    self.use_environment = bool(cfg.rollout.environment)
    self.task_fn = task_rule(cfg)
    b = cfg.rollout.batch_size
    self._packed = None
    if self.use_model:
      source = WeightSource(
        source=cfg.init.reward, what="init.reward", rng=initial_rngs(cfg.seed)[Role.REWARD]
      )
      cluster.freeze(Role.REWARD, source)
      self._model_scores = self._model_program(b)
      self._micro_scores: dict[int, Any] = {b: self._model_scores}
    coefs = [
      coef
      for coef, used in (
        (reward.model_coef, self.use_model),
        (reward.fn_coef, self.fn is not None),
        (reward.environment_coef, self.use_environment),
      )
      if used
    ]

    def combine(*parts):
      return sum(c * p for c, p in zip(coefs, parts, strict=True))

    actor = cluster.roles[Role.ACTOR]
    self._combine = cluster.compile(
      "combine_scores", combine, out_shardings=actor.batch_sharding((b,))
    )

  def _model_program(self, rows: int) -> Any:
    """The reward model's `fn(params, tokens_bs, attention_bs) -> scores_b` for `rows` rows."""
    rt, s = self.cluster.roles[Role.REWARD], self.cfg.rollout.max_seq_len
    batch = (rt.batch_sharding((rows, s)), rt.batch_sharding((rows, s)))
    tag = "" if rows == self.cfg.rollout.batch_size else f"_{rows}rows"
    return self.cluster.scorer(
      "reward_scores" + tag,
      functools.partial(steps.sequence_scores, rt.model),
      in_shardings=(rt.param_shardings, *batch),
      out_shardings=rt.batch_sharding((rows,)),
      role=Role.REWARD,
    )

  def stages(self, inputs: tuple[jax.Array, ...], seqs: Any, iteration: int):
    """Scoring stages of some rows (the batch, or a micro-batch of fused scoring): the reward
    model on its mesh (from the inputs on any mesh), the rule on the host (from the rollout's
    token ids).

    `inputs`: `(tokens_bs, attention_bs)`, the model's result the scores `[b]`; or packed rows
    `(tokens, positions, segments)` (`rlhfjax.flows.packed`), its result the values `[r, w]`,
    read at each sample's last token by the caller."""
    out = []
    if self.use_model:
      if len(inputs) == 3:
        if self._packed is None:
          rt = self.cluster.roles[Role.REWARD]
          self._packed = self.cluster.compile(
            "reward_values_packed",
            functools.partial(models.forward_packed, rt.model, head="value"),
            in_shardings=(rt.param_shardings, None, None, None),
            role=Role.REWARD,
          )
        program = self._packed
      else:
        rows = inputs[0].shape[0]
        if rows not in self._micro_scores:
          self._micro_scores[rows] = self._model_program(rows)
        program = self._micro_scores[rows]

      def model():
        # The weights as they are when the stage runs (offload may have moved them since).
        return program(self.cluster.params[Role.REWARD], *self.cluster.move(Role.REWARD, inputs))

      out.append(self.cluster.stage(Role.REWARD, "score", model))
    if self.fn is not None:
      metadata = self.metadata(iteration, seqs)
      out.append(
        self.cluster.stage("reward_fn", "score", lambda: self._rule(self.fn, seqs, metadata))
      )
    if self.use_environment:
      out.append(self.cluster.stage("environment", "score", lambda: self._environment(seqs)))
    return out

  def score(self, tokens_bs: jax.Array, attention_bs: jax.Array, seqs: Any, iteration: int):
    """`stages` run on their own, then `combine`d: the score `[b]` on the actor's mesh."""
    todo = self.stages((tokens_bs, attention_bs), seqs, iteration)
    results = self.cluster.run(todo, iteration)
    return self.combine(dict(zip([s.role for s in todo], results, strict=True)))

  def combine(self, results: dict[str, Any]) -> jax.Array:
    """The combined score `[b]` on the actor's mesh, from the results of `stages` by role."""
    parts = []
    if self.use_model:
      parts.append(self.cluster.move(Role.ACTOR, results["reward"]))
    if self.fn is not None:
      parts.append(self.cluster.upload(Role.ACTOR, results["reward_fn"], "reward_fn scores"))
    if self.use_environment:
      parts.append(self.cluster.upload(Role.ACTOR, results["environment"], "environment rewards"))
    return self._combine(*parts)

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
    """Every part of the reward, their combination and the task's own rule, on the host."""
    meta = self.metadata(-1, seqs)
    scores: dict[str, np.ndarray] = {}
    n = len(seqs.prompts)
    combined = np.zeros(n, np.float32)
    if self.use_model:
      rt = self.cluster.roles[Role.REWARD]
      with self.cluster.host("evaluation"):
        batch = rt.put_batch((seqs.tokens_bs, seqs.attention_mask_bs))
        scores["reward_model"] = self.cluster.fetch(
          self._model_scores(self.cluster.params[Role.REWARD], *batch), "evaluation"
        )
      combined += self.cfg.reward.model_coef * scores["reward_model"]
    if self.fn is not None:
      scores["reward_fn"] = self._rule(self.fn, seqs, meta)
      combined += self.cfg.reward.fn_coef * scores["reward_fn"]
    if self.use_environment:
      scores["environment"] = self._environment(seqs)
      combined += self.cfg.reward.environment_coef * scores["environment"]
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
