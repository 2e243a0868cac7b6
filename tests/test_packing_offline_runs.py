"""Packing in DPO, online DPO, SFT and reward-model training (issue 24), each flow's run: packed
against padded (fp32, 2 steps; the packed DPO, SFT and reward-model runs with each row over 2
devices, `placement.context=2`), and the token budgets checked. (The packed losses and gradients
against the padded ones: test_packing_offline.py.)"""

from __future__ import annotations

import dataclasses
import pathlib
import runpy

import numpy as np
import pytest
from runs_testing import shipped_config

from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.flows.online_dpo import refuse_offline_packing
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

RUN_RTOL = 1e-5
"""Relative, on each step's metrics: step 1's are the packed-vs-padded numbers of
test_packing_offline.py; step 2 starts from parameters one Adam step apart by rounding of that
size, and Adam's step (`m / sqrt(v)`) is scale free, so the differences stay of the same relative
size."""


def _assert_runs_close(padded, packed_rows, keys):
  assert len(padded) == len(packed_rows) == 2
  for a, b in zip(padded, packed_rows, strict=True):
    for key in keys:
      assert b[key] == pytest.approx(a[key], rel=RUN_RTOL, abs=1e-6), (a["step"], key)


def _run(cfg, tmp_path, name):
  runner = Runner(cfg, str(tmp_path / name), show_progress=False)
  for spec in runner.placement.roles.values():  # as configured, each trained role's rows split
    assert spec.context == cfg.placement.context, spec
  return runner.run()


def _supervised(path, tmp_path, **fields):
  """`configs/<path>` small: 4 devices, 8 examples of at most 48 tokens, 2 steps, fp32."""
  config = runpy.run_path(f"configs/{path}")["get_config"]().to_dict()
  config["placement"] |= {"num_devices": 4, "tensor": 2}
  config["supervised"] |= {"batch_size": 8, "micro_batches": 1, "max_len": 48}
  config["model"] |= {"dtype": "float32", "param_dtype": "float32"}
  config["eval"]["every_steps"] = 0
  config["checkpoint"] |= {"every_steps": 100, "async_save": False}
  config["data"]["data_dir"] = str(tmp_path / "data")
  config |= {"total_steps": 2, "log_every": 1}
  for section, values in fields.items():
    config[section] |= values
  return from_config_dict(config)


@pytest.mark.parametrize(
  ("path", "keys"),
  [
    ("sft_tiny.py", ("train/loss", "train/token_accuracy", "train/grad_norm", "eval/loss")),
    ("rm_tiny.py", ("train/loss", "train/accuracy", "train/margin", "train/grad_norm")),
  ],
)
def test_supervised_runs_packed_equal_padded(tmp_path, path, keys):
  padded = _run(_supervised(path, tmp_path), tmp_path, "padded")
  packing = {"packing": True, "max_tokens_per_micro_batch": 4 * 48}
  # The packed run also splits each row over 2 devices (context parallelism: fsdp 1 x
  # context 2 x tensor 2): its numbers are the padded, unsplit run's all the same.
  packed = _supervised(path, tmp_path, supervised=packing, placement={"context": 2})
  result = _run(packed, tmp_path, "packed")
  rows = lambda r: [row for row in r.metrics if "train/loss" in row]
  _assert_runs_close(rows(padded), rows(result), [k for k in keys if k.startswith("train/")])
  evals = lambda r: [row for row in r.metrics if "eval/loss" in row or "eval/accuracy" in row]
  _assert_runs_close(evals(padded)[-2:], evals(result)[-2:], [k for k in keys if "eval/" in k])
  counts = result.compilations
  assert 1 <= counts["train_step_grad"] <= 3 and counts["train_step_apply"] == 1, counts


def _dpo_config(**dpo):
  changes = {
    "total_steps": 2,
    "rollout.batch_size": 8,
    "rollout.max_prompt_len": 24,
    "rollout.max_new_tokens": 24,
    "model.dtype": "float32",
    "model.param_dtype": "float32",
  }
  return shipped_config("dpo_tiny", changes | {f"dpo.{k}": v for k, v in dpo.items()})


def test_dpo_run_packed_equals_padded(tmp_path):
  padded = _run(_dpo_config(), tmp_path, "padded").metrics
  packed = _dpo_config(packing=True, max_tokens_per_micro_batch=4 * 48)
  packed = dataclasses.replace(packed, placement=dataclasses.replace(packed.placement, context=2))
  result = _run(packed, tmp_path, "packed")  # each row over 2 devices too, as SFT's above
  keys = ("loss/dpo", "dpo/margin", "dpo/accuracy", "actor/grad_norm", "eval/margin")
  _assert_runs_close(padded, result.metrics, keys)
  assert result.metrics[0]["loss/dpo"] == pytest.approx(np.log(2), abs=1e-6)
  assert result.compilations["actor_step_apply"] == 1


def _online_config(**own):
  config = runpy.run_path("configs/online_dpo_tiny.py")["get_config"]("colocated")
  config.total_steps = 2
  config.rollout.batch_size = 8
  config.rollout.max_new_tokens = 8
  config.eval.num_prompts = 0
  config.reward.model_coef = 0.5  # continuous scores: no tied pairs
  config.model.dtype = config.model.param_dtype = "float32"
  for key, value in own.items():
    config.online_dpo[key] = value
  return from_config_dict(config)


def test_online_dpo_run_packed_equals_padded(tmp_path):
  padded = _run(_online_config(packing=False), tmp_path, "padded").metrics
  width = _online_config().rollout.max_seq_len
  result = _run(_online_config(max_tokens_per_micro_batch=2 * width), tmp_path, "packed")
  keys = ("reward/mean", "pairs/valid", "loss/dpo", "dpo/margin", "actor/grad_norm")
  _assert_runs_close(padded, result.metrics, keys)
  assert result.compilations["actor_step_apply"] == 1


def test_packing_budgets_are_checked():
  with pytest.raises(ConfigError, match=r"^'dpo.max_tokens_per_micro_batch'=50 is below one pair"):
    _dpo_config(max_tokens_per_micro_batch=50)
  with pytest.raises(
    ConfigError, match=r"^'online_dpo.max_tokens_per_micro_batch' must be >= 0, got -1$"
  ):
    _online_config(max_tokens_per_micro_batch=-1)
  with pytest.raises(ConfigError, match=r"^'supervised.max_tokens_per_micro_batch'=47 is below"):
    _supervised("sft_tiny.py", pathlib.Path("/tmp"), supervised={"max_tokens_per_micro_batch": 47})
  cfg = _online_config()
  assert cfg.online_dpo.packing and cfg.online_dpo.batch.mini_batches == 2
  cfg = dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, packing=True))
  with pytest.raises(ConfigError, match=r"^'dpo.packing'=True is offline DPO's; online DPO"):
    refuse_offline_packing(cfg)
