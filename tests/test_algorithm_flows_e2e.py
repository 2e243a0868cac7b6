"""GRPO-family configs from scripts/train.py, as a user runs them: GSPO's and CISPO's (which
build on GRPO's), on another placement than the in-process runs of test_algorithm_flows.py."""

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
def test_train_script_runs_gspo_and_cispo_from_their_configs(tmp_path):
  """configs/gspo_tiny.py and configs/cispo_tiny.py (GRPO's config with another policy loss:
  GRPO's file runs too) on the interleaved placement: the same first batch, another loss."""
  # The reward model's continuous scores beside the rule: advantages that are not all 0.
  scores = "--config.reward.model_coef=0.5"
  # Both on the interleaved placement: the second run finds every program but its update in
  # the persistent compilation cache.
  interleaved = "--config.placement.strategy=interleaved"
  rows = {
    name: _train(f"configs/{name}_tiny.py", tmp_path / name, scores, interleaved)
    for name in ("gspo", "cispo")
  }
  for name, run in rows.items():
    assert [r["step"] for r in run] == [0, 1], name
    assert "loss/kl" not in run[0]  # neither config has a KL term
    assert all(0.0 <= r["policy/clipfrac"] <= 1.0 for r in run)
    assert run[0]["loss/policy"] != run[1]["loss/policy"]
  gspo, cispo = rows["gspo"][0], rows["cispo"][0]
  assert gspo["reward/mean"] == cispo["reward/mean"]
  assert gspo["loss/policy"] != pytest.approx(cispo["loss/policy"], abs=1e-6)
