"""A strategy added with `register_strategy` reaches `scripts/plan_placement.py`, run in a process
of its own that registers it first (test_planner_registries.py's `_TOY`)."""

import json
import pathlib
import subprocess
import sys

import pytest
from runs_testing import run_plan_placement
from test_planner_registries import _TOY

pytestmark = pytest.mark.e2e

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_a_registered_strategy_reaches_plan_placement_script():
  run = "\n".join(
    [
      _TOY,
      "strategies.register_strategy('rollout_first', rollout_first)",
      "import runpy, sys",
      "sys.argv = ['plan_placement.py', *sys.argv[1:]]",
      f"runpy.run_path({str(REPO / 'scripts' / 'plan_placement.py')!r}, run_name='__main__')",
    ]
  )
  for strategy in ("rollout_first", "auto"):
    out = subprocess.run(
      [sys.executable, "-c", run, "--actor=1b", "--devices=8", "--json", f"--strategy={strategy}"],
      capture_output=True,
      text=True,
      check=True,
      timeout=120,
      cwd=REPO,
    )
    plans = [json.loads(line) for line in out.stdout.splitlines()]
    assert "rollout_first" in {p["strategy"] for p in plans}, strategy
  bad = run_plan_placement("--strategy=nope")
  assert bad.returncode != 0 and "unknown strategy 'nope'" in bad.stderr
