"""Evaluation of the policy on held-out prompts, before training and after it."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from rlhfjax import distributed
from rlhfjax.data.records import PromptBatch
from rlhfjax.flows import stages
from rlhfjax.flows.stages import FlowContext


def evaluate(ctx: FlowContext, eval_prompts: PromptBatch) -> dict[str, Any]:
  """The current policy on the held-out prompts: mean rewards and a few samples.

  Responses come from the rollout engine (at `eval.temperature`; 0 is greedy) with a fixed
  seed, so the evaluations before and after training see the same prompts and randomness.
  Reports the configured reward and each of its parts, and the task's own rule (`task_reward`):
  what the task wants, which a learned reward model only approximates.
  """
  cfg = ctx.cfg
  b = cfg.rollout.batch_size
  sampling = stages.sampling(cfg, ctx.tokenizer, temperature=cfg.eval.temperature)
  parts: dict[str, list[np.ndarray]] = {}
  samples: list[dict[str, Any]] = []
  for start in range(0, len(eval_prompts), b):
    n = min(b, len(eval_prompts) - start)
    # The scorers are compiled for whole batches: the last one repeats its last prompt.
    chunk = eval_prompts.rows([start + min(i, n - 1) for i in range(b)])
    seqs = stages.generate(ctx, chunk, sampling, seed=cfg.seed + 7919)
    scores = ctx.rewards.evaluate(seqs)
    for key, value in scores.items():
      parts.setdefault(key, []).append(value[:n])
    parts.setdefault("response_length", []).append(seqs.response_mask_bt.sum(-1)[:n])
    for i in range(min(n, 8 - len(samples))):
      samples.append(
        {
          "prompt": ctx.tokenizer.decode(seqs.prompts[i]),
          # What the model was given: the template's special tokens too (eval.md shows it).
          "input": ctx.tokenizer.decode(seqs.prompts[i], skip_special_tokens=False),
          "response": ctx.tokenizer.decode(seqs.responses[i]),
          **{key: float(value[i]) for key, value in scores.items()},
        }
      )
  result: dict[str, Any] = {
    key: float(np.mean(np.concatenate(values))) for key, values in parts.items()
  }
  result["num_prompts"] = len(eval_prompts)
  result["samples"] = samples
  return result


def read_evaluation(workdir: str, start_step: int) -> dict[str, Any]:
  path = os.path.join(workdir, "eval.json")
  if start_step == 0 or not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def write_evaluation(workdir: str, evaluation: dict[str, Any]) -> None:
  """eval.json, and eval.md: a table of before / after and the samples, for people."""
  if not distributed.is_primary():
    return
  path = os.path.join(workdir, "eval.json")
  with open(path + ".tmp", "w") as f:
    json.dump(evaluation, f, indent=1)
  os.replace(path + ".tmp", path)
  with open(os.path.join(workdir, "eval.md"), "w") as f:
    f.write(format_evaluation(evaluation))


def format_evaluation(evaluation: dict[str, Any]) -> str:
  """A Markdown summary of the evaluations before and after training."""
  phases = [p for p in ("before", "after") if p in evaluation]
  keys = [
    k
    for k in (
      "task_reward",
      "reward",
      "reward_model",
      "reward_fn",
      "judge",
      "environment",
      "response_length",
    )
    if any(k in evaluation[p] for p in phases)
  ]
  lines = ["| metric | " + " | ".join(phases) + " |", "| --- |" + " --- |" * len(phases)]
  for key in keys:
    cells = [f"{evaluation[p][key]:.4f}" if key in evaluation[p] else "" for p in phases]
    lines.append(f"| {key} | " + " | ".join(cells) + " |")
  for phase in phases:
    lines += ["", f"Samples {phase} training:", ""]
    for s in evaluation[phase]["samples"]:
      shown = s.get("input", s["prompt"])  # an eval.json of an earlier version has no input
      lines.append(f"- {shown!r} -> {s['response']!r} (reward {s['reward']:.3f})")
  return "\n".join(lines) + "\n"
