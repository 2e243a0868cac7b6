"""The README's main job, scripts/run_pipeline.py, end to end on short schedules: SFT, reward
model and PPO chained through their checkpoints, the outputs a user reads, and a rerun that
resumes instead of training again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = (
  "--config.sft.total_steps=4",
  "--config.sft.eval_every=0",
  "--config.rm.total_steps=4",
  "--config.rm.eval_every=0",
  "--config.ppo.total_steps=2",
  "--config.ppo.rollout.batch_size=8",
  "--config.ppo.rollout.max_new_tokens=8",
  "--config.ppo.eval.num_prompts=8",
)


def _run(workdir: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
  command = [
    sys.executable,
    os.path.join(ROOT, "scripts", "run_pipeline.py"),
    f"--config={os.path.join(ROOT, 'configs', 'pipeline_tiny.py')}",
    f"--workdir={workdir}",
    *SHORT,
  ]
  return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=cwd)


@pytest.mark.slow
def test_pipeline_chains_the_stages_and_resumes(tmp_path):
  # As the README runs it: a relative workdir (here from another current directory).
  workdir = str(tmp_path / "workdirs" / "pipeline")
  done = _run("workdirs/pipeline", cwd=str(tmp_path))
  assert done.returncode == 0, done.stderr[-3000:]
  for name in ("summary.md", "reward.png", "eval.md", "timeline.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0, name
  # PPO started from the SFT policy and the trained reward model: both stages' checkpoints
  # exist, and PPO scored with the reward model (its evaluation reports it).
  for stage, item in (("sft", "policy_params"), ("rm", "reward_params")):
    assert os.path.isdir(os.path.join(workdir, stage, "checkpoints", "4", item))
  with open(os.path.join(workdir, "ppo", "eval.json")) as f:
    evaluation = json.load(f)
  assert set(evaluation) == {"before", "after"}
  for phase in evaluation.values():
    assert {"reward_model", "task_reward", "response_length"} <= set(phase)
    assert phase["num_prompts"] == 8 and len(phase["samples"]) == 8
  with open(os.path.join(workdir, "summary.md")) as f:
    summary = f.read()
  assert "Reward model held-out accuracy" in summary and "| task_reward |" in summary

  # A rerun finds every stage complete: nothing is trained again, the outputs are rewritten.
  again = _run("workdirs/pipeline", cwd=str(tmp_path))
  assert again.returncode == 0, again.stderr[-3000:]
  with open(os.path.join(workdir, "ppo", "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [0, 1]
  with open(os.path.join(workdir, "ppo", "eval.json")) as f:
    assert json.load(f) == evaluation
