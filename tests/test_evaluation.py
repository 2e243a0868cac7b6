"""Evaluation: the run's own reward where the bundled task's rule says nothing about the run,
and periodic evaluations every `eval.every_steps` iterations that a resume neither repeats nor
skips (issue 22, item 5)."""

import json
import os
import signal

import numpy as np
import pytest
from runs_testing import deterministic_rows, shipped_config

from rlhfjax.cluster.rewards import task_rule
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_SMALL = {
  "rollout.batch_size": 8,
  "rollout.max_new_tokens": 8,
  "eval.num_prompts": 8,
  "checkpoint.every_steps": 1,
}


@pytest.mark.parametrize(
  ("changes", "applies"),
  [
    ({}, True),  # bundled prompts, the task's own rule as the reward
    (
      {"reward.fn": "", "reward.model_coef": 1.0},
      True,
    ),  # a reward model (the pipeline)
    ({"data.prompts": "mine.jsonl"}, False),  # the user's prompts
    ({"reward.fn": "test_evaluation:length_reward"}, False),  # the user's reward
  ],
  ids=["task_rule", "reward_model", "own_prompts", "own_reward"],
)
def test_task_reward_only_where_the_task_rule_speaks_for_the_run(changes, applies):
  cfg = shipped_config("grpo_tiny", {**_SMALL, **changes})
  assert (task_rule(cfg) is not None) == applies


_STOP = {"calls": 0, "at": 0}


def length_reward(prompts, responses, metadata):
  """The user's reward: longer responses score more. On call `_STOP['at']` it asks the run to
  stop, as a scheduler's SIGTERM would, wherever the run then is."""
  del prompts, metadata
  _STOP["calls"] += 1
  if _STOP["calls"] == _STOP["at"]:
    os.kill(os.getpid(), signal.SIGTERM)
  return np.asarray([len(r) / 8 for r in responses], np.float32)


def _run(workdir, stop_at=0):
  _STOP.update(calls=0, at=stop_at)
  changes = {**_SMALL, "total_steps": 5, "eval.every_steps": 2}
  cfg = shipped_config("grpo_tiny", {**changes, "reward.fn": "test_evaluation:length_reward"})
  return Runner(cfg, str(workdir), show_progress=False).run()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  return workdir, _run(workdir)


def test_periodic_evaluations_report_the_runs_own_reward(uninterrupted):
  workdir, result = uninterrupted
  rows = deterministic_rows(str(workdir))
  evaluated = [r["step"] for r in rows if "eval/reward" in r]
  assert evaluated == [1, 3]  # after iterations 2 and 4; the 5th is the final evaluation's
  assert all("eval/task_reward" not in r for r in rows)
  assert "task_reward" not in result.evaluation["after"]
  assert result.evaluation["after"]["reward"] == result.evaluation["after"]["reward_fn"]
  assert 0 < rows[1]["eval/reward"] <= 1 and rows[1]["eval/response_length"] > 0


# The reward's calls in a run from step 0: 1 the evaluation before training, 2-3 iterations 0-1,
# 4 the periodic evaluation after iteration 1, 5-6 iterations 2-3, 7 the periodic evaluation
# after iteration 3, ...; resumed at step 2: 1-2 iterations 2-3, 3 the periodic evaluation after
# iteration 3, .... A stop anywhere in an iteration, its periodic evaluation included, ends the
# run after it with a checkpoint.
def test_a_resumed_run_neither_repeats_nor_skips_a_periodic_evaluation(uninterrupted, tmp_path):
  # One workdir, stopped in an iteration whose periodic evaluation is still to come, then
  # resumed and stopped in a periodic evaluation, then run to the end.
  first = _run(tmp_path, stop_at=3)
  assert first.preempted and (first.start_step, first.final_step) == (0, 2)
  second = _run(tmp_path, stop_at=3)
  assert second.preempted and (second.start_step, second.final_step) == (2, 4)
  last = _run(tmp_path)
  assert not last.preempted and (last.start_step, last.final_step) == (4, 5)
  assert deterministic_rows(str(tmp_path)) == deterministic_rows(str(uninterrupted[0]))


def test_the_run_shows_the_prompts_as_the_model_receives_them(tmp_path, capsys):
  """With a chat template: the first prompt printed once with its markers and ids, and
  eval.md's samples with the markers, not the raw prompt text."""
  cfg = shipped_config("grpo_tiny", {**_SMALL, "total_steps": 1, "data.chat_template": True})
  Runner(cfg, str(tmp_path), show_progress=True).run()
  shown = [
    x for x in capsys.readouterr().out.splitlines() if x.startswith("the first prompt as the")
  ]
  assert len(shown) == 1, shown
  assert shown[0].startswith("the first prompt as the model receives it: '<|bos|><|user|>")
  assert "<|assistant|>\\n'; ids [256, 259, 10, " in shown[0] and shown[0].endswith(" in all)]")
  samples = [x for x in (tmp_path / "eval.md").read_text().splitlines() if x.startswith("- ")]
  assert samples and all(x.startswith("- '<|bos|><|user|>") for x in samples), samples
  kept = json.loads((tmp_path / "eval.json").read_text())["before"]["samples"][0]
  assert kept["input"].startswith("<|bos|><|user|>") and "<|" not in kept["prompt"]
