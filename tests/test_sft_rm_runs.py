"""SFT and reward-model training in this process: the shipped configs' placements, learning on
the role's devices, checkpoint resume, and a reward model from the SFT run beating chance. (The
objectives: tests/test_sft_rm.py; the entry points: tests/test_sft_rm_e2e.py.)"""

import json
import os
import runpy

import jax
import numpy as np
import pytest

from rlhfjax import config as config_lib
from rlhfjax.placement.spec import Role
from rlhfjax.planner.place import place
from rlhfjax.runner import loop

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_config(path: str, cls=config_lib.ExperimentConfig, **fields):
  config = runpy.run_path(os.path.join(REPO, path))["get_config"]().to_dict()
  for dotted, value in fields.items():
    *parents, leaf = dotted.split("__")
    node = config
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config_lib.from_config_dict(config, cls)


@pytest.mark.parametrize(
  ("path", "role"),
  [
    ("configs/sft_tiny.py", Role.ACTOR),
    ("configs/rm_tiny.py", Role.REWARD),
  ],
)
def test_shipped_configs_load_and_validate(path, role):
  cfg = _load_config(path)
  assert cfg.model.size == "tiny" and cfg.placement.num_devices == 8
  spec = place(cfg, 8)[role]
  assert spec.axes == (("data", 1), ("fsdp", 4), ("tensor", 2))


def _small(path, cls, workdir, **fields):
  defaults = dict(
    placement__num_devices=4,
    placement__tensor=2,
    supervised__batch_size=16,
    supervised__micro_batches=2,
    supervised__max_len=48,
    eval__every_steps=0,
    log_every=1,
    data__data_dir=str(workdir.parent / "data"),
    checkpoint__every_steps=6,
    checkpoint__async_save=False,
  )
  return _load_config(path, cls, **{**defaults, **fields})


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("sft") / "run"
  cfg = _small("configs/sft_tiny.py", config_lib.ExperimentConfig, workdir, total_steps=12)
  trainer = loop.Runner(cfg, str(workdir), show_progress=False)
  return workdir, trainer, trainer.run()


def _eval_rows(result):
  return [row for row in result.metrics if any(k.startswith("eval/") for k in row)]


@pytest.mark.slow
def test_sft_run_lowers_eval_loss_on_the_role_devices(sft_run):
  workdir, trainer, result = sft_run
  evals = _eval_rows(result)
  assert [row["step"] for row in evals] == [0, 12]
  assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] - 1.0, evals
  assert result.compilations == {"eval_step": 1, "train_step": 1}
  for leaf in jax.tree.leaves(trainer.cluster.states[Role.ACTOR]):
    assert {s.device.id for s in leaf.addressable_shards} == {0, 1, 2, 3}
  assert {"loss.png", "eval_loss.png", "metrics.jsonl"} <= set(os.listdir(workdir))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "6"]


@pytest.mark.slow
def test_sft_rerun_resumes_from_the_checkpoint(sft_run):
  workdir, trainer, first = sft_run
  cfg = _small("configs/sft_tiny.py", config_lib.ExperimentConfig, workdir, total_steps=15)
  again = loop.Runner(cfg, str(workdir), show_progress=False)
  state, first_state = again.cluster.states[Role.ACTOR], trainer.cluster.states[Role.ACTOR]
  assert again.start_step == 12 and int(state.step) == 12
  # The data iterator continues where the first run stopped, not from the start.
  assert again.flow.train.get_state() == trainer.flow.train.get_state()
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(first_state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  result = again.run()
  assert (result.start_step, result.final_step) == (12, 15)
  with open(workdir / "metrics.jsonl") as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == sorted(set(steps)) and steps[-1] == 15


@pytest.mark.slow
def test_reward_model_from_sft_beats_chance_on_held_out_pairs(sft_run, tmp_path):
  sft_workdir, _, _ = sft_run
  cfg = _small(
    "configs/rm_tiny.py",
    config_lib.ExperimentConfig,
    tmp_path / "rm",
    total_steps=20,
    init__reward=str(sft_workdir / "checkpoints"),
  )
  trainer = loop.Runner(cfg, str(tmp_path / "rm"), show_progress=False)
  params = trainer.cluster.states[Role.REWARD].params
  assert not np.any(np.asarray(params["value_head"]))  # fresh head at zero
  result = trainer.run()
  first, last = _eval_rows(result)[0], _eval_rows(result)[-1]
  assert last["eval/accuracy"] > 0.6, (first, last)
  # The zero head scores every pair alike: all ties, counted as wrong (the summary says so).
  assert (first["eval/ties"], first["eval/accuracy"]) == (1.0, 0.0), first
  assert last["eval/ties"] < 1.0
  assert last["eval/loss"] < first["eval/loss"]
