"""The SFT and reward-model entry points (scripts/train_sft.py, scripts/train_rm.py) given a bad
config: one line. (Trained end to end from another directory, interrupted, rerun and resumed
onto the planner's split: tests/test_reruns_e2e.py.)"""

import os
import re
import subprocess
import sys

import pytest

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
