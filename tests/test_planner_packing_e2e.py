"""`scripts/plan_placement.py --packed` as a user runs it (no JAX needed): packed runs priced
below padded ones, a token budget that needs --packed refused in one line."""

import json

import pytest
from runs_testing import run_plan_placement
from test_planner_packing import MAX, MEAN, PROMPT

pytestmark = pytest.mark.e2e

_GRPO = (
  "--actor=1b",
  "--algorithm=grpo",
  "--hardware=h100",
  "--devices=8",
  "--prompts=64",
  "--samples_per_prompt=8",
  f"--prompt_len={PROMPT}",
  f"--response_len_mean={MEAN}",
  f"--response_len_max={MAX}",
  "--strategy=colocated",
  "--json",
)


def test_plan_placement_packed_prices_packed_runs():
  padded, packed = (run_plan_placement(*_GRPO, *extra) for extra in ((), ("--packed",)))
  assert padded.returncode == 0 and packed.returncode == 0, padded.stderr + packed.stderr
  best = {
    name: json.loads(out.stdout.splitlines()[0])
    for name, out in (("pad", padded), ("pack", packed))
  }
  assert best["pad"]["fill"] == 0 and 0.5 < best["pack"]["fill"] < 1
  for stage in ("score", "update"):
    assert best["pack"]["stages"][stage] < best["pad"]["stages"][stage] / 2, stage
  assert best["pack"]["stages"]["generate"] == best["pad"]["stages"]["generate"]
  table = run_plan_placement(*_GRPO[:-1], "--packed", "--max_tokens_per_micro_batch=8192")
  assert table.returncode == 0, table.stderr
  assert "packed (fill " in table.stdout.splitlines()[0]
  bad = run_plan_placement(*_GRPO, "--max_tokens_per_micro_batch=8192")
  assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --max_tokens_per_micro")
  assert len(bad.stderr.strip().splitlines()) == 1
