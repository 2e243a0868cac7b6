"""A flow in the user's own file (examples/rejection_sampling.py, copied outside the repository),
run by scripts/train.py from the directory holding the file, as a user runs it."""

import json
import subprocess
import sys

import pytest
from test_user_flow import _FLOW, _ROOT, _user_file

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_train_script_runs_a_user_flow_from_a_file_in_the_current_directory(tmp_path):
  """As a user: their own flow file in their own directory (outside the repository, not on
  PYTHONPATH), `scripts/train.py` run from there on another placement than the runs of
  tests/test_user_flow.py."""
  _user_file(tmp_path)
  command = [
    sys.executable,
    str(_ROOT / "scripts" / "train.py"),
    f"--config={_ROOT / 'configs' / 'ppo_tiny.py'}:interleaved",
    "--workdir=run",
    f"--config.algorithm.flow={_FLOW}",
    "--config.ppo.group_size=4",
    "--config.total_steps=2",
    "--config.rollout.batch_size=8",
    "--config.rollout.max_new_tokens=8",
    "--config.eval.num_prompts=0",
  ]
  done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 1] and "loss/sft" in rows[0]
  assert rows[1]["loss/sft"] != rows[0]["loss/sft"]
