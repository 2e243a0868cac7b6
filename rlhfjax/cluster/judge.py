"""A generative judge (LLM-as-judge) as a part of the reward: `reward.judge` names an extra role
of kind 'judge' (`model.extra_roles`), placed like any role.

For each response the judge reads `reward.judge_template` with `{prompt}` and `{response}`
replaced by their texts, generates a verdict (greedy, at most its role's `max_new_tokens`
tokens) with its own rollout engine on its own devices (its weights in the generation layout
over them: tensor parallel as the role's mesh is, data parallel over the rest; the frozen copy
the role was loaded into is released once the engine has its own), and
`reward.judge_parser` ('module:function', as `reward.fn` is) turns the verdict's text into a
score. A verdict the parser rejects (it raises, or returns no finite number) scores
`reward.judge_failure_score` and is counted (`reward/judge_failures`). The score joins the
reward with `reward.judge_coef` (`rlhfjax.cluster.rewards`); under fused scoring the judge
scores each micro-batch of finished samples as the other scorers do.

A judge prompt longer than its engine's bucket (its role's `max_prompt_len`; by default the
rollout's prompt and response capacity plus 64 tokens for the template) keeps its first token (a
BOS) and its last ones: the response and the end of the template, which asks for the verdict.
The memory check counts the engine as it is: its weights in the generation layout and its KV
pool (`rlhfjax.placement.memory.judge_memory`).
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import numpy as np

from rlhfjax import tasks
from rlhfjax.placement import memory
from rlhfjax.rollout.engine import Engine, EngineConfig
from rlhfjax.rollout.sampling import SamplingParams

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def first_number(verdict: str) -> float:
  """The default parser: the first number in the verdict ('7', '-1.5', 'Score: 8/10' -> 8.0).

  Raises:
    ValueError: the verdict holds no number.
  """
  match = _NUMBER.search(verdict)
  if match is None:
    raise ValueError(f"no number in the verdict {verdict!r:.60}")
  return float(match[0])


class Judge:
  """The judge of one run: its engine (built on first use, from the role's frozen weights),
  prompts, verdicts and scores."""

  def __init__(self, cfg: Any, cluster: Any, tokenizer: Any):
    reward = cfg.reward
    self.role, self.cfg, self.cluster, self.tokenizer = reward.judge, cfg, cluster, tokenizer
    self.parser = tasks.load_callable(reward.judge_parser, "judge parser")
    self.failures = 0
    """Verdicts the parser rejected since `take_failures` last read them."""
    self.section = cfg.model.extra_roles[reward.judge]
    self.max_prompt_len = self.section.judge_engine(cfg.rollout, 1)[1]
    """The engine's one prompt bucket (`ExtraRoleSection.max_prompt_len`)."""
    self._engine: Engine | None = None

  @property
  def engine(self) -> Engine:
    if self._engine is None:
      rt = self.cluster.roles[self.role]
      spec = memory.judge_spec(rt.spec)
      slots, capacity, verdict = self.section.judge_engine(self.cfg.rollout, spec.axis_size("data"))
      config = EngineConfig(
        num_slots=slots,
        prompt_buckets=(capacity,),
        max_new_tokens=verdict,
        pad_token_id=self.tokenizer.pad_id,
        share_prefixes=False,
        page_size=memory.JUDGE_PAGE_SIZE,
      )
      self._engine = Engine.for_role(rt.model, config, spec, self.cluster.params[self.role])
      # The engine's weights, in the generation layout, are the judge's only use of them: the
      # role's frozen copy (the training layout it was loaded in) goes, but for the arrays the
      # engine adopted as they were (its shardings the same), which it holds.
      self.cluster.params.pop(self.role)
    return self._engine

  def prompts(self, seqs: Any) -> list[list[int]]:
    """The judge's prompt of each response: the template filled with the texts (see the module
    docstring for one too long)."""
    decode, template = self.tokenizer.decode, self.cfg.reward.judge_template
    out = []
    for prompt, response in zip(seqs.prompts, seqs.responses, strict=True):
      text = template.replace("{prompt}", decode(prompt)).replace("{response}", decode(response))
      ids = self.tokenizer.encode(text, add_bos=True)
      if len(ids) > self.max_prompt_len:
        ids = ids[:1] + ids[len(ids) - self.max_prompt_len + 1 :]
      out.append(ids)
    return out

  def verdicts(self, seqs: Any) -> list[str]:
    """The judge's verdict on each response, greedy, up to its stop token."""
    sampling = SamplingParams(
      temperature=0.0,
      max_new_tokens=self.section.max_new_tokens,
      stop_token_ids=(self.tokenizer.eos_id,),
    )
    out = self.engine.generate(self.prompts(seqs), sampling=sampling)
    return tasks.response_texts(
      [out.tokens[i, : out.lengths[i]] for i in range(len(out.lengths))], self.tokenizer
    )

  def scores_of(self, verdicts: list[str]) -> np.ndarray:
    """`[b]` float32: each verdict parsed; `reward.judge_failure_score` where the parser
    rejects it (counted in `failures`)."""
    failure, scores = self.cfg.reward.judge_failure_score, []
    for verdict in verdicts:
      try:
        score = float(self.parser(verdict))
        if not math.isfinite(score):
          raise ValueError(f"not a finite number: {score}")
      except Exception as e:  # noqa: BLE001 (a parser's fault on a verdict: the configured score)
        log.debug("judge parser %s on %r: %s", self.cfg.reward.judge_parser, verdict, e)
        self.failures += 1
        score = failure
      scores.append(score)
    return np.asarray(scores, np.float32)

  def score(self, seqs: Any) -> np.ndarray:
    """`[b]` float32: the judge's score of each response of `seqs`."""
    return self.scores_of(self.verdicts(seqs))

  def take_failures(self) -> int:
    """Parse failures since the last call."""
    failures, self.failures = self.failures, 0
    return failures
