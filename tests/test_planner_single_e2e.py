"""`placement.strategy=auto` for SFT and reward-model training, run by scripts/train_sft.py and
scripts/train_rm.py as a user runs them: the planner's split printed with the runner-up, and
trained on."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize(
  ("script", "config", "metric"),
  [
    ("train_sft.py", "configs/sft_tiny.py", "eval/loss"),
    ("train_rm.py", "configs/rm_tiny.py", "eval/accuracy"),
  ],
)
def test_scripts_run_the_auto_split(tmp_path, script, config, metric):
  out = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "scripts", script),
      f"--config={os.path.join(REPO, config)}",
      f"--workdir={tmp_path / 'run'}",
      "--config.placement.strategy=auto",
      "--config.placement.hardware=h100",
      "--config.supervised.batch_size=8",
      "--config.supervised.micro_batches=1",
      "--config.total_steps=2",
      f"--config.data.data_dir={tmp_path / 'data'}",
    ],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  chosen = [line for line in out.stdout.splitlines() if line.startswith("placement auto ")]
  assert chosen[0].startswith("placement auto chosen: data=")
  assert chosen[1].startswith("placement auto runner-up: ")
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  values = [r[metric] for r in rows if metric in r]
  assert values and all(np.isfinite(values))
