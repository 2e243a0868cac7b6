"""A GRPO-family config from scripts/train.py, as a user runs it: GSPO's (which builds on
GRPO's), on another placement than the in-process runs of test_algorithm_flows.py."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

_ROOT = pathlib.Path(__file__).parent.parent
_RUN = (
  "--config.total_steps=2",
  "--config.rollout.batch_size=8",
  "--config.rollout.max_new_tokens=8",
  "--config.eval.num_prompts=0",
)


def _train(config: str, workdir: pathlib.Path, *flags: str) -> list[dict]:
  command = [
    sys.executable,
    str(_ROOT / "scripts" / "train.py"),
    f"--config={config}",
    f"--workdir={workdir}",
    *_RUN,
    *flags,
  ]
  done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=_ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_script_runs_gspo_from_its_config_on_another_placement(tmp_path):
  """configs/gspo_tiny.py (GRPO's config with GSPO's loss: both files) through the script, on
  the interleaved placement; CISPO's config runs in test_algorithm_flows.py."""
  rows = _train("configs/gspo_tiny.py", tmp_path, "--config.placement.strategy=interleaved")
  assert [r["step"] for r in rows] == [0, 1]
  assert "loss/kl" not in rows[0]  # GSPO's config has no KL term
  assert all(0.0 <= r["policy/clipfrac"] <= 1.0 for r in rows)
