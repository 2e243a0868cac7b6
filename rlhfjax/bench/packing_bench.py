"""GRPO's scoring and update on a long-tailed length mix, padded against packed (`ppo.packing`).

Two runners of the same GRPO config, one padded and one packed, get the same batches: prompts
and responses with stated lengths (a log-normal response length of mean `mean_fraction` x
`max_new_tokens`, clipped to 1 .. `max_new_tokens`; prompt lengths uniform in the upper half of
`max_prompt_len`; random tokens; all from `seed`). Generation is not timed: it is the same
engine either way, and a random policy's answers would not follow a stated length mix. Each
iteration scores the batch with every role (actor, reference, reward model, rule), computes
advantages and updates the actor; the modes alternate iteration by iteration in one process, so
both see the same machine. The first iteration of each mode compiles and is not reported.

One JSON object per line: per iteration `mode`, `iteration`, `score_s`, `update_s`,
`iteration_s` (score + advantages + update), `tokens_per_s` (real tokens / iteration_s),
`fill` (real tokens / computed tokens), the update's `loss/policy` and `actor/grad_norm`; then
a summary: medians per mode, `speedup` (padded / packed score + update) and the largest
relative difference of the metrics between the modes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import runpy
import tempfile
import time
from typing import Any

import numpy as np

_GRPO_TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "grpo_tiny.py")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  iterations: int = 4
  batch: int = 64
  group: int = 4
  max_prompt_len: int = 32
  max_new_tokens: int = 512
  mean_fraction: float = 0.25
  seed: int = 0
  hidden: int = 128
  layers: int = 4
  mlp: int = 352
  devices: int = 8


def response_lengths(rng: np.random.Generator, n: int, max_len: int, mean_fraction: float):
  """Long-tailed lengths: log-normal (sigma 1) scaled so that the clipped mean is
  `mean_fraction` x `max_len` (found by bisection on the scale, for this sample)."""
  z = rng.lognormal(0.0, 1.0, n)
  lo, hi = 1e-3, float(max_len)
  for _ in range(60):
    scale = (lo + hi) / 2
    mean = np.clip(np.round(z * scale), 1, max_len).mean()
    lo, hi = (scale, hi) if mean < mean_fraction * max_len else (lo, scale)
  return np.clip(np.round(z * lo), 1, max_len).astype(np.int32)


def config(s: Settings, packing: bool):
  from rlhfjax.config import from_config_dict

  cd = runpy.run_path(os.path.normpath(_GRPO_TINY))["get_config"]("colocated")
  cd.total_steps = s.iterations
  cd.placement.num_devices = s.devices
  # The config's rollout tensor width (2) must divide the devices: one GPU runs it at 1.
  cd.placement.rollout_tensor = math.gcd(cd.placement.rollout_tensor, s.devices)
  cd.model.overrides = {
    "hidden_size": s.hidden,
    "num_layers": s.layers,
    "intermediate_size": s.mlp,
    "max_position_embeddings": s.max_prompt_len + s.max_new_tokens,
  }
  cd.rollout.batch_size = s.batch
  cd.rollout.max_prompt_len = s.max_prompt_len
  cd.rollout.max_new_tokens = s.max_new_tokens
  cd.ppo.group_size = s.group
  cd.reward.model_coef = 0.5
  cd.eval.num_prompts = 0
  cd.ppo.packing = packing
  return from_config_dict(cd)


def batch(s: Settings, iteration: int, vocab: int, pad_id: int):
  """The iteration's synthetic rollout batch (`Sequences`)."""
  from rlhfjax.flows import experience

  rng = np.random.default_rng((s.seed, iteration))
  groups = s.batch // s.group
  prompt_n = np.repeat(rng.integers(s.max_prompt_len // 2, s.max_prompt_len + 1, groups), s.group)
  prompts = [rng.integers(3, vocab, n).astype(np.int32) for n in prompt_n]
  for g in range(groups):  # a group's samples answer the same prompt
    for k in range(1, s.group):
      prompts[g * s.group + k] = prompts[g * s.group]
  lengths = response_lengths(rng, s.batch, s.max_new_tokens, s.mean_fraction)
  responses = rng.integers(3, vocab, (s.batch, s.max_new_tokens)).astype(np.int32)
  logprobs = -rng.uniform(0.5, 8.0, (s.batch, s.max_new_tokens)).astype(np.float32)
  return experience.assemble(
    prompts,
    responses,
    lengths,
    logprobs,
    prompt_len=s.max_prompt_len,
    response_len=s.max_new_tokens,
    pad_id=pad_id,
  )


def _iteration(runner, iteration: int, seqs) -> dict[str, Any]:
  import jax

  flow = runner.flow
  start = time.perf_counter()
  exp = jax.block_until_ready(flow._score(iteration, seqs, None))
  scored = time.perf_counter()
  exp, _ = flow._compute_advantages(iteration, exp)
  advantaged = time.perf_counter()
  metrics = flow._update(iteration, exp, seqs)
  end = time.perf_counter()
  real = seqs.num_tokens
  if runner.cfg.ppo.packing:
    fill = metrics["packing/actor_fill"]
  else:
    fill = real / seqs.tokens_bs.size
  return {
    "iteration": iteration,
    "score_s": scored - start,
    "update_s": end - advantaged,
    "iteration_s": end - start,
    "tokens_per_s": real / (end - start),
    "fill": fill,
    "real_tokens": real,
    "loss/policy": metrics["loss/policy"],
    "actor/grad_norm": metrics["actor/grad_norm"],
  }


def run(s: Settings, emit=print) -> dict[str, Any]:
  """Runs the benchmark, emitting each JSON line; returns the summary."""
  from rlhfjax.placement.spec import Role
  from rlhfjax.runner import Runner

  runners = {
    mode: Runner(config(s, mode == "packed"), tempfile.mkdtemp(), show_progress=False)
    for mode in ("padded", "packed")
  }
  vocab = runners["padded"].cluster.roles[Role.ACTOR].model.vocab_size
  rows: dict[str, list[dict]] = {"padded": [], "packed": []}
  for iteration in range(s.iterations):
    seqs = batch(s, iteration, vocab, pad_id=0)
    order = ("padded", "packed") if iteration % 2 == 0 else ("packed", "padded")
    for mode in order:
      row = {"mode": mode, **_iteration(runners[mode], iteration, seqs)}
      if iteration:  # the first compiles
        rows[mode].append(row)
        emit(json.dumps(row))
  median = lambda mode, key: float(np.median([r[key] for r in rows[mode]]))
  work = lambda mode: median(mode, "score_s") + median(mode, "update_s")
  diffs = [
    abs(a[k] - b[k]) / max(abs(a[k]), 1e-12)
    for a, b in zip(rows["padded"], rows["packed"], strict=True)
    for k in ("loss/policy", "actor/grad_norm")
  ]
  summary = {
    "summary": True,
    "settings": dataclasses.asdict(s),
    **{
      f"{mode}_{key}": median(mode, key)
      for mode in rows
      for key in ("score_s", "update_s", "iteration_s", "tokens_per_s", "fill")
    },
    "speedup": work("padded") / work("packed"),
    "metrics_max_rel_diff": max(diffs),
  }
  emit(json.dumps(summary))
  return summary
