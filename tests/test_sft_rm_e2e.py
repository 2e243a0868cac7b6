"""The SFT and reward-model entry points (scripts/train_sft.py, scripts/train_rm.py) as a user runs
them: trained end to end from another directory and resumed onto the planner's split
(`placement.strategy=auto`), and a bad config in one line."""

import functools
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import runs_testing

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name, *args, workdir, cwd=REPO):
  return subprocess.run(
    [sys.executable, os.path.join(REPO, "scripts", name), f"--workdir={workdir}", *args],
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  ("script", "config", "metric"),
  [
    ("train_sft.py", "configs/sft_tiny.py", "eval/loss"),
    ("train_rm.py", "configs/rm_tiny.py", "eval/accuracy"),
  ],
)
def test_scripts_train_end_to_end(tmp_path, script, config, metric):
  """From another current directory, with a relative workdir and data directory (orbax wants
  absolute paths: the entry point makes them so), then resumed the same way onto the split
  `placement.strategy=auto` chooses (printed with the runner-up), which restores the checkpoint
  onto its own meshes."""
  run = functools.partial(
    _script,
    script,
    f"--config={os.path.join(REPO, config)}",
    "--config.placement.num_devices=2",
    "--config.placement.tensor=1",
    "--config.supervised.batch_size=8",
    "--config.supervised.micro_batches=1",
    "--config.data.data_dir=data",
    workdir="runs/run",
    cwd=tmp_path,
  )
  result = run("--config.total_steps=3")
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(rf"{metric} [\d.]+ -> [\d.]+; steps 0 -> 3", result.stdout), result.stdout
  assert os.path.isdir(tmp_path / "runs" / "run" / "checkpoints" / "3")
  assert os.path.isdir(tmp_path / "data")
  auto = ("--config.placement.strategy=auto", "--config.placement.hardware=h100")
  resumed = run("--config.total_steps=4", *auto)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "steps 3 -> 4" in resumed.stdout, resumed.stdout
  assert os.path.isdir(tmp_path / "runs" / "run" / "checkpoints" / "4")
  chosen = [line for line in resumed.stdout.splitlines() if line.startswith("placement auto ")]
  assert chosen[0].startswith("placement auto chosen: data="), resumed.stdout
  assert chosen[1].startswith("placement auto runner-up: "), resumed.stdout
  rows = runs_testing.rows(str(tmp_path / "runs" / "run"))
  values = [r[metric] for r in rows if metric in r]
  assert len(values) >= 2 and all(np.isfinite(values)), rows


@pytest.mark.parametrize(
  ("script", "args", "pattern"),
  [
    (
      "train_sft.py",
      ["--config.supervised.batch_sise=4"],
      r"--config\.supervised\.batch_sise: no such field; did you mean "
      r"--config\.supervised\.batch_size\?",
    ),
    ("train_rm.py", ["--config.supervised.micro_batches=3"], r"'micro_batches'=3 must divide"),
    ("train_sft.py", ["--config.placement.tensor=3"], r"tensor=3 does not divide"),
  ],
)
def test_scripts_fail_in_one_line_on_bad_config(tmp_path, script, args, pattern):
  config = "configs/sft_tiny.py" if script == "train_sft.py" else "configs/rm_tiny.py"
  result = _script(script, f"--config={config}", *args, workdir=tmp_path)
  assert result.returncode == 2, (result.stdout, result.stderr)
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  assert re.search(pattern, lines[0], flags=re.IGNORECASE), lines[0]
