"""The arithmetic pipeline as a user runs it (scripts/run_pipeline.py with
configs/pipeline_arithmetic.py) on a short schedule: SFT then GRPO chained, the shipped evaluation
on held-out sums only, no reward model stage, and GRPO learning from the exact-match reward."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import runs_testing

from rlhfjax import tasks

pytestmark = pytest.mark.e2e

_ROOT = pathlib.Path(__file__).parent.parent


# The pipeline as shipped (400 SFT steps of the wide model, 150 GRPO iterations of 1024 samples,
# about 10 minutes on 2 cores) raises held-out exact-match accuracy, greedy on 512 held-out sums:
# 0.164 -> 0.404 (seed 0), 0.229 -> 0.428 (1), 0.266 -> 0.563 (2), not on seed 3 (0.147 ->
# 0.115). That is a study, its command and numbers in docs/data.md ("Verifiable rewards"): short
# GRPO runs leave held-out accuracy within its noise. What a short run shows is GRPO learning
# from the exact-match reward: the same command with the tiny model, 400 SFT steps of 32
# demonstrations, and 30 GRPO iterations that practise 8 of GRPO's own sums (neither demonstrated
# nor held out), 16 samples of each, 4 updates an iteration at 6e-4 after 5 warm-up updates.
_PRACTISED = slice(5000, 5008)
_SHORT = (
  *(
    f"--config.{stage}.model.overrides.{field}={value}"
    for stage in ("sft", "ppo")
    for field, value in (("hidden_size", 56), ("num_layers", 3), ("intermediate_size", 152))
  ),
  "--config.sft.total_steps=400",
  "--config.sft.supervised.batch_size=32",
  f"--config.ppo.data.train_split=train[{_PRACTISED.start}:{_PRACTISED.stop}]",
  "--config.ppo.rollout.batch_size=128",
  "--config.ppo.ppo.group_size=16",
  "--config.ppo.ppo.mini_batches=4",
  "--config.ppo.actor_optimizer.learning_rate=6e-4",
  "--config.ppo.actor_optimizer.warmup_steps=5",
  "--config.ppo.total_steps=30",
  "--config.ppo.log_every=1",
)


@pytest.mark.slow
def test_arithmetic_pipeline_grpo_learns_the_sums_it_practises(tmp_path):
  workdir = tmp_path / "arith"
  command = [
    sys.executable,
    str(_ROOT / "scripts" / "run_pipeline.py"),
    f"--config={_ROOT / 'configs' / 'pipeline_arithmetic.py'}",
    f"--workdir={workdir}",
    *_SHORT,
  ]
  done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=_ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  sums = [p["prompt"] for p in tasks.arithmetic_datasets()["prompt"]]
  demonstrated, practised, held_out = set(sums[:5000]), set(sums[_PRACTISED]), set(sums[9000:])
  assert len(practised) == 8 and not practised & (demonstrated | held_out)
  # The evaluation before and after GRPO is the shipped one: 512 held-out sums, never a
  # demonstration or a GRPO prompt, reported in summary.md. No reward model stage.
  evaluation = json.loads((workdir / "ppo" / "eval.json").read_text())
  before, after = evaluation["before"]["task_reward"], evaluation["after"]["task_reward"]
  assert evaluation["before"]["num_prompts"] == evaluation["after"]["num_prompts"] == 512
  shown = [s["prompt"] for p in ("before", "after") for s in evaluation[p]["samples"]]
  assert shown and set(shown) <= held_out
  summary = (workdir / "summary.md").read_text()
  assert f"Held-out task reward before -> after GRPO: {before:.4f} -> {after:.4f}" in summary
  assert not (workdir / "rm").exists()
  # The exact-match reward of GRPO's samples rises. The split holds the 8 practised sums alone, so
  # every iteration samples 16 answers to each: 128 draws, independent given the policy, whose mean
  # has a standard error of at most sqrt(0.25 / 128) = 0.044. Over the first 3 iterations (the
  # SFT policy, then 8 updates at warm-up's lower learning rates) at most 0.026, over the last 5
  # at most 0.020, of their difference at most 0.032. This command's rises with the suite's XLA
  # flags, seeds 0 to 3 (--config.sft.seed=S --config.ppo.seed=S): 0.115 -> 0.720, 0.052 -> 0.487,
  # 0.042 -> 0.386, 0.049 -> 0.427. A rise of 0.15 is 4.7 standard errors above no learning, and
  # the smallest of those is 6 above it.
  rewards = [row["reward/mean"] for row in runs_testing.rows(str(workdir / "ppo"))]
  assert len(rewards) == 30
  assert f"GRPO mean reward (rule): {rewards[0]:.4f} -> {rewards[-1]:.4f}" in summary
  assert np.mean(rewards[-5:]) - np.mean(rewards[:3]) >= 0.15, rewards
