"""A resume refuses a checkpoint that another kind of run wrote (issue 28, item 3): another
algorithm or flow, other roles, another model architecture, another tokenizer or template;
each is one line naming the field and both values. Allowed changes resume."""

import pathlib
import re
import runpy
import shutil

import pytest
from runs_testing import shipped_config

from rlhfjax import errors
from rlhfjax.config import from_config_dict
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_ROOT = pathlib.Path(__file__).parent.parent


def _config(algorithm="grpo", **changes):
  common = {"rollout.batch_size": 8, "rollout.max_new_tokens": 8, "eval.num_prompts": 0}
  changes = {"algorithm.name": algorithm, "total_steps": 1, **common, **changes}
  return shipped_config("grpo_tiny", {k.replace("__", "."): v for k, v in changes.items()})


@pytest.fixture(scope="module")
def grpo_workdir(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("grpo")
  Runner(_config(), str(workdir), show_progress=False).run()
  return workdir


@pytest.mark.parametrize(
  ("algorithm", "changes", "message"),
  [
    ("rloo", {}, r"algorithm.name: the checkpoint has 'grpo', this run 'rloo'"),
    ("ppo", {}, r"roles: the checkpoint has \['actor', 'reference', 'rollout'\], this run \["),
    ("dpo", {}, r"algorithm.name: the checkpoint has 'grpo', this run 'dpo'"),
    (
      "grpo",
      {"algorithm__flow": "examples.rejection_sampling:make_flow"},
      r"algorithm.flow: the checkpoint has '', this run 'examples.rejection_sampling:make_flow'",
    ),
    (
      "grpo",
      {"model__overrides": {"max_position_embeddings": 256}},
      r"model.actor.max_position_embeddings: the checkpoint has 512, this run 256",
    ),
    ("grpo", {"data__chat_template": True}, r"the tokenizer or chat template .* encodes prompts"),
    (
      "grpo",
      {"model__param_dtype": "bfloat16"},
      r"model.actor.param_dtype: the checkpoint has 'float32', this run 'bfloat16'",
    ),
    (
      "grpo",
      {"model__lora__rank": 4},
      r"model.actor.lora: the checkpoint has None, this run \{'rank': 4, 'alpha': 16.0",
    ),
  ],
  ids=[
    "rloo",
    "ppo_adds_a_critic",
    "dpo",
    "user_flow",
    "architecture",
    "chat_template",
    "precision",
    "lora",
  ],
)
def test_resume_refuses_a_checkpoint_of_another_kind_of_run(
  grpo_workdir, algorithm, changes, message, monkeypatch
):
  monkeypatch.syspath_prepend(str(_ROOT))  # examples/ importable, as from the repository root
  cfg = _config(algorithm, total_steps=2, **changes)
  with pytest.raises(ValueError) as caught:
    Runner(cfg, str(grpo_workdir), show_progress=False)
  line, status = errors.describe(caught.value)
  assert status == errors.USER_ERROR, line
  assert "was written by another kind of run, so this one cannot resume it" in line, line
  assert re.search(message, line), line
  assert "A resume may change total_steps, the placement" in line


def test_resume_allows_more_steps_and_another_placement(grpo_workdir, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(grpo_workdir, workdir)
  cfg = _config(total_steps=2, placement__strategy="interleaved", model__dtype="bfloat16")
  runner = Runner(cfg, str(workdir), show_progress=False)
  assert runner.start_step == 1


def _supervised(name: str, **changes):
  """`configs/{name}.py` (SFT or the reward model) shrunk to a one-step run on 2 devices."""
  cd = runpy.run_path(str(_ROOT / "configs" / f"{name}.py"))["get_config"]()
  small = {
    "total_steps": 1,
    "placement.num_devices": 2,
    "placement.tensor": 1,
    "supervised.batch_size": 8,
    "supervised.max_len": 32,
    "eval.every_steps": 0,
    "data.eval_split": "train[:8]",
    "checkpoint.async_save": False,
  }
  for dotted, value in {**small, **changes}.items():
    *sections, field = dotted.split(".")
    node = cd
    for section in sections:
      node = node[section]
    node[field] = value
  return from_config_dict(cd)


@pytest.mark.parametrize(("first", "then"), [("sft_tiny", "rm_tiny"), ("rm_tiny", "sft_tiny")])
def test_sft_and_the_reward_model_refuse_each_others_checkpoints(tmp_path, first, then):
  Runner(_supervised(first), str(tmp_path), show_progress=False).run()
  with pytest.raises(ValueError) as caught:
    Runner(_supervised(then, total_steps=2), str(tmp_path), show_progress=False)
  line, status = errors.describe(caught.value)
  assert status == errors.USER_ERROR and "\n" not in line, line
  assert "was written by another kind of run, so this one cannot resume it" in line, line
  names = {"sft_tiny": "sft", "rm_tiny": "rm"}
  assert f"algorithm.name: the checkpoint has {names[first]!r}, this run {names[then]!r}" in line
  assert "roles: the checkpoint has" in line, line
