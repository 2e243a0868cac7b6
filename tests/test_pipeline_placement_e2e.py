"""`scripts/show_placement.py` with two pipeline stages, as a user runs it: the `stage` axis in
every training role's mesh, the critic's stages reversed on the actor's devices."""

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_show_placement_with_two_stages():
  result = subprocess.run(
    [
      sys.executable,
      "scripts/show_placement.py",
      "--config=configs/ppo_tiny.py",
      "--config.placement.pipeline_stages=2",
      "--config.model.overrides={'num_layers': 4}",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  rows = {}
  for line in result.stdout.splitlines():  # the first table's rows (the options table follows)
    if line:
      rows.setdefault(line.split()[0], line.split()[1:7])
  mesh = ["stage=2", "data=1", "fsdp=4", "tensor=1", "training"]
  assert rows["actor"] == ["0-7", *mesh]
  assert rows["critic"] == ["4-7,0-3", *mesh]
  # Co-located: the peak device holds both.
  (summary,) = [line for line in result.stdout.splitlines() if line.startswith("summary:")]
  assert "(actor+critic+reference+rollout)" in summary, summary
