"""Critic-free flows get no critic mesh from `scripts/plan_placement.py`, as a user runs it with
`--algorithm=grpo` or `--critic=none`."""

import json

import pytest
from runs_testing import run_plan_placement

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("flags", [["--algorithm=grpo"], ["--critic=none"]])
def test_plan_placement_script_critic_free(flags):
  out = run_plan_placement(
    "--actor=7b", "--hardware=a800", "--devices=8", "--prompts=256", "--json", *flags, check=True
  )
  plans = [json.loads(line) for line in out.stdout.splitlines()]
  assert plans and plans[0]["fits"]
  for plan in plans:
    assert set(plan["mesh"]) == {"actor", "reference", "rollout"}, plan["mesh"]
    assert set(plan["devices"]) == {"actor", "reference", "rollout"}
