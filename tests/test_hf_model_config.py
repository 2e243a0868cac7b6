"""`model.hf`: every role's architecture from a checkpoint's config.json, and any other
architecture the config gives as well is a one-line error naming the fields."""

from __future__ import annotations

import json
import os
import runpy

import pytest
from hf_dirs import TINY_LLAMA3, TINY_QWEN2

from rlhfjax import config as config_lib
from rlhfjax.config import ConfigError
from rlhfjax.config import model as model_config
from rlhfjax.config.hf import config_to_hf
from rlhfjax.flows import registry

pytestmark = pytest.mark.pure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = model_config.get_model_config("tiny")
QWEN2 = TINY_QWEN2.replace(max_position_embeddings=32_768, eos_token_ids=(7,), pad_token_id=5)
LLAMA3 = TINY_LLAMA3.replace(bos_token_id=1, eos_token_ids=(2, 3))


def _write_config(path, model: model_config.ModelConfig, head="lm", **changes) -> str:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({**config_to_hf(model, head), **changes}, f)
  return str(path)


def _grpo(**model) -> config_lib.ExperimentConfig:
  cd = runpy.run_path(os.path.join(ROOT, "configs", "grpo_tiny.py"))["get_config"]()
  del cd.model["size"]
  cd.model.update(model)
  return config_lib.from_config_dict(cd)


@pytest.mark.parametrize("model", [QWEN2, LLAMA3], ids=["qwen2", "llama3"])
def test_every_role_runs_the_checkpoints_architecture(tmp_path, model):
  cfg = _grpo(hf=_write_config(tmp_path, model))
  for role in ("actor", "reference", "rollout", "critic", "reward"):
    assert cfg.model.for_role(role) == model
  assert cfg.init.actor == str(tmp_path)  # a model directory's weights start the actor
  assert cfg.data.tokenizer == str(tmp_path)


def test_a_bf16_checkpoint_trains_fp32_masters_and_the_frozen_roles_hold_bf16(tmp_path):
  path = _write_config(tmp_path, QWEN2, torch_dtype="bfloat16")
  dtypes = lambda cfg, role: (cfg.model.for_role(role).param_dtype, cfg.model.for_role(role).dtype)
  cfg = _grpo(hf=path)
  for role in ("actor", "critic"):
    assert dtypes(cfg, role) == ("float32", "bfloat16"), role
  for role in ("reference", "reward", "rollout"):
    assert dtypes(cfg, role) == ("bfloat16", "bfloat16"), role
  # The reward model's own flow trains it: its declaration says so (`registry.configure`).
  rm = runpy.run_path(os.path.join(ROOT, "configs", "rm_tiny.py"))["get_config"]()
  del rm.model["size"]
  rm.model.hf = path
  rm = config_lib.from_config_dict(rm)
  assert dtypes(rm, "reward") == ("bfloat16", "bfloat16")  # no flow has said it trains it
  assert dtypes(registry.configure(rm), "reward") == ("float32", "bfloat16")
  # The opt-out: pure bf16 (at a learning rate bf16 can add to a weight of 0.02).
  pure = _grpo(hf=path, fp32_masters=False)
  assert dtypes(pure, "actor") == ("bfloat16", "bfloat16")
  # A dtype the config gives wins; an fp32 checkpoint stays fp32.
  cfg = _grpo(hf=path, param_dtype="float32", roles={"actor": {"remat": "full"}})
  actor = cfg.model.for_role("actor")
  assert (actor.param_dtype, actor.dtype, actor.remat) == ("float32", "bfloat16", "full")
  assert dtypes(cfg, "reference") == ("float32", "bfloat16")
  fp32 = _grpo(hf=_write_config(tmp_path / "fp32", QWEN2, torch_dtype="float32"))
  assert {dtypes(fp32, r) for r in ("actor", "reference")} == {("float32", "float32")}


def test_pure_bf16_at_a_learning_rate_bf16_cannot_represent_is_one_line(tmp_path):
  path = _write_config(tmp_path, QWEN2, torch_dtype="bfloat16")
  cd = runpy.run_path(os.path.join(ROOT, "configs", "grpo_tiny.py"))["get_config"]()
  del cd.model["size"]
  cd.model.hf, cd.model.fp32_masters = path, False
  cd.actor_optimizer.learning_rate = 1e-6
  with pytest.raises(ConfigError, match=r"'actor_optimizer.learning_rate'=1e-06 with 'model\."):
    config_lib.from_config_dict(cd)


def test_a_checkpoint_of_1b_parameters_gets_remat_and_chunked_logprobs(tmp_path):
  big = model_config.get_model_config("1b").replace(param_dtype="bfloat16", dtype="bfloat16")
  cfg = _grpo(hf=_write_config(tmp_path, big))
  actor, reference = cfg.model.for_role("actor"), cfg.model.for_role("reference")
  assert (actor.remat, actor.logprob_chunk_size, actor.param_dtype) == ("full", 1024, "float32")
  assert (reference.remat, reference.logprob_chunk_size) == ("none", 1024)
  small = _grpo(hf=_write_config(tmp_path / "small", QWEN2)).model.for_role("actor")
  assert (small.remat, small.logprob_chunk_size) == ("none", None)


def test_stop_tokens_are_generation_configs(tmp_path):
  path = _write_config(tmp_path, LLAMA3)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [2, 9, 10]}, f)
  assert _grpo(hf=path).model.for_role("actor").eos_token_ids == (2, 9, 10)


def test_a_size_that_is_another_model_is_one_line_naming_every_field(tmp_path):
  path = _write_config(tmp_path, TINY.replace(rope_theta=500_000.0, rms_norm_eps=1e-6))
  with pytest.raises(ConfigError) as error:
    _grpo(hf=path, size="tiny")
  assert str(error.value) == (
    f"model.hf: {path}/config.json has rope_theta=500000.0, the config has 10000.0; "
    "rms_norm_eps=1e-06, the config has 1e-05 (the size 'tiny' is another model: "
    "--config.model.size= runs the checkpoint's)"
  )
  assert _grpo(hf=_write_config(tmp_path / "tiny", TINY), size="tiny").model.size == "tiny"


def test_an_architecture_override_that_differs_is_an_error(tmp_path):
  path = _write_config(tmp_path, QWEN2)
  with pytest.raises(ConfigError, match=r"has rope_theta=1000000.0, the config has 10000.0$"):
    _grpo(hf=path, overrides={"rope_theta": 10_000.0})
  assert _grpo(hf=path, overrides={"rope_theta": 1e6}).model.for_role("actor") == QWEN2


def test_a_reward_model_from_another_directory(tmp_path):
  reward = TINY.replace(num_layers=2)
  actor_dir = _write_config(tmp_path / "actor", QWEN2)
  reward_dir = _write_config(tmp_path / "reward", reward, head="value")
  cd = runpy.run_path(os.path.join(ROOT, "configs", "grpo_tiny.py"))["get_config"]()
  cd.model.size = ""
  cd.model.hf = actor_dir
  cd.model.roles = {"reward": {"hf": reward_dir}}
  cd.reward.model_coef = 1.0
  cfg = config_lib.from_config_dict(cd)
  assert cfg.model.for_role("reward") == reward
  assert cfg.model.for_role("critic") == QWEN2
  assert (cfg.init.actor, cfg.init.reward) == (actor_dir, reward_dir)


def test_neither_size_nor_checkpoint_is_an_error():
  with pytest.raises(ConfigError, match=r"set 'model.size' .* or 'model.hf'"):
    _grpo()


def test_the_actors_checkpoint_is_only_model_hf():
  with pytest.raises(ConfigError, match=r"'model.roles.reference.hf': only the critic"):
    _grpo(size="tiny", roles={"reference": {"hf": "/x"}})


def test_a_missing_config_json_is_one_line(tmp_path):
  with pytest.raises(ConfigError, match=rf"^model: {tmp_path}/config.json: not found$"):
    _grpo(hf=str(tmp_path))
