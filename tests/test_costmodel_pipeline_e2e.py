"""`scripts/plan_pipeline.py` as a user runs it: one JSON line of the cost model's pipeline
comparison (test_costmodel_pipeline.py), and bad input in one line."""

import json
import subprocess
import sys

import pytest
from test_costmodel_pipeline import EFF, H100, REPO, WORK

from rlhfjax.costmodel import pipeline

pytestmark = pytest.mark.e2e


def _plan_pipeline(*args):
  return subprocess.run(
    [sys.executable, str(REPO / "scripts" / "plan_pipeline.py"), *args],
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_plan_pipeline_prints_one_json_line():
  out = _plan_pipeline(
    "--actor=70b",
    "--critic=70b",
    "--hardware=h100",
    "--devices=32",
    "--stages=4",
    "--micro_batches=8",
    "--optimizer_steps=8",
    "--remat=full",
  )
  assert out.returncode == 0, out.stderr
  (line,) = out.stdout.splitlines()
  got = json.loads(line)
  gain = pipeline.compare(WORK, H100, EFF, devices=32, stages=4, micro_batches=8)
  assert got == {
    "actor": "70b",
    "critic": "70b",
    "hardware": "h100",
    "devices": 32,
    **gain.to_json(),
    "memory_budget_gib": round(H100.memory_gib, 2),
  }
  assert got["two_1f1b_s"] > got["fused_s"] and got["bubble_two_1f1b"] > got["bubble_fused"]
  for field in ("bubble_1f1b", "textbook_bubble", "unpipelined_s", "gain", "memory_gib"):
    assert field in got


def test_plan_pipeline_bad_input_is_one_line():
  out = _plan_pipeline("--devices=32", "--stages=3")
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == ["error: pipeline stages=3 must divide devices=32"]
