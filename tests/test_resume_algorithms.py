"""Exact resume for the flows beyond PPO (PPO's kill -9 and SIGTERM are in test_resume.py):
a run stopped after 2 iterations and rerun to 4 repeats the uninterrupted 4-iteration run."""

import json
import pathlib
import runpy

import pytest

from rlhfjax.config import from_config_dict
from rlhfjax.runner import Runner

_ROOT = pathlib.Path(__file__).parent.parent
_VOLATILE = ("time/", "throughput/")


def _config(name: str, steps: int):
  cd = runpy.run_path(str(_ROOT / "configs" / f"{name}_tiny.py"))["get_config"]("colocated")
  cd.total_steps = steps
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.eval.num_prompts = 0
  cd.reward.model_coef = 0.5
  if name == "dpo":
    cd.rollout.max_prompt_len = 40
    cd.rollout.max_new_tokens = 40
  return from_config_dict(cd)


def _rows(workdir: pathlib.Path) -> list[dict]:
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "dapo", "dpo", "online_dpo"])
def test_stopped_and_rerun_repeats_the_uninterrupted_run(name, tmp_path):
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  Runner(_config(name, 4), str(whole), show_progress=False).run()
  Runner(_config(name, 2), str(parts), show_progress=False).run()
  resumed = Runner(_config(name, 4), str(parts), show_progress=False)
  assert resumed.start_step == 2
  resumed.run()
  assert [r["step"] for r in _rows(parts)] == [0, 1, 2, 3]
  assert _rows(parts) == _rows(whole)
