"""GRPO from scripts/train.py, as a user runs it: its config, on another placement than the
in-process runs of test_algorithm_flows.py."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

_ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.slow
def test_train_script_runs_grpo_from_its_config(tmp_path):
  command = [
    sys.executable,
    str(_ROOT / "scripts" / "train.py"),
    "--config=configs/grpo_tiny.py",
    f"--workdir={tmp_path}",
    "--config.total_steps=2",
    "--config.rollout.batch_size=8",
    "--config.rollout.max_new_tokens=8",
    "--config.eval.num_prompts=0",
    "--config.placement.strategy=interleaved",
  ]
  done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=_ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 1] and "loss/kl" in rows[0]
