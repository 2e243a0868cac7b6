"""GRPO on a local Hugging Face checkpoint directory: `--config.model.hf=DIR` runs the
checkpoint's architecture from its weights, tokenizer and chat template; a checkpoint of another
architecture given to a shipped config is one line and exit status 2."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy
from hf_dirs import (
  LLAMA3_SPECIALS,
  LLAMA3_TEMPLATE,
  QWEN25_SPECIALS,
  QWEN25_TEMPLATE,
  TINY_LLAMA3,
  TINY_QWEN2,
  write_checkpoint,
  write_tokenizer,
)

from rlhfjax import export
from rlhfjax.config import from_config_dict
from rlhfjax.config import model as model_config
from rlhfjax.config.hf import read_hf_config
from rlhfjax.models import hf
from rlhfjax.placement.spec import Role
from rlhfjax.runner.loop import Runner

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = model_config.get_model_config("tiny")
# The templates' system headers make prompts longer than the tiny config's 48 tokens.
RUN_FLAGS = {
  "total_steps": 2,
  "rollout.batch_size": 8,
  "rollout.max_new_tokens": 8,
  "rollout.max_prompt_len": 128,
  "eval.num_prompts": 0,
  "data.chat_template": True,
}


def _qwen2_dir(path) -> str:
  tok = write_tokenizer(
    path, specials=QWEN25_SPECIALS, bos=None, eos="<|im_end|>", template=QWEN25_TEMPLATE
  )
  model = TINY_QWEN2.replace(
    eos_token_ids=(tok.token_to_id("<|im_end|>"),),
    pad_token_id=tok.token_to_id("<|endoftext|>"),
  )
  write_checkpoint(path, model)
  return str(path)


def _llama3_dir(path, dtype: str = "float32") -> str:
  tok = write_tokenizer(
    path,
    specials=LLAMA3_SPECIALS,
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    template=LLAMA3_TEMPLATE,
  )
  model = TINY_LLAMA3.replace(
    bos_token_id=tok.token_to_id("<|begin_of_text|>"),
    eos_token_ids=(tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")),
    param_dtype=dtype,
    dtype=dtype,
  )
  write_checkpoint(path, model, seed=3)
  return str(path)


def _train(*flags: str, config: str = "configs/grpo_tiny.py") -> subprocess.CompletedProcess:
  paths = (ROOT, os.environ.get("PYTHONPATH"))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
  command = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), f"--config={config}"]
  return subprocess.run(
    [*command, *flags], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
  )


@pytest.mark.slow
def test_train_script_runs_grpo_on_a_qwen2_checkpoint(tmp_path):
  """... on prompts that are conversations (multi-turn, some with a system message of their
  own) and plain prompts, with the config's system prompt put first where none is given."""
  path = _qwen2_dir(tmp_path / "qwen2")
  prompts = tmp_path / "prompts.jsonl"
  turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
  records = [
    {"messages": [*turns, {"role": "user", "content": f"Say a word with {k} vowels."}]}
    if k % 2
    else {"prompt": f"Name {k} vowels."}
    for k in range(16)
  ]
  records[0] = {"messages": [{"role": "system", "content": "Own system."}, *turns[:1]]}
  prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
  flags = [f"--config.{k}={v}" for k, v in RUN_FLAGS.items()]
  done = _train(
    f"--workdir={tmp_path / 'run'}",
    "--config.model.size=",
    f"--config.model.hf={path}",
    f"--config.data.prompts={prompts}",
    "--config.data.system_prompt=Be brief.",
    *flags,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 1]
  first = next(x for x in done.stdout.splitlines() if "the first prompt as the model" in x)
  assert "<|im_start|>system\\n" in first
  assert ("Own system." in first) != ("Be brief." in first), first


@pytest.mark.slow
def test_grpo_on_a_bf16_llama3_checkpoint_trains_fp32_masters_that_move_at_lr_1e6(tmp_path):
  """A checkpoint saved in bf16, as public ones are: its architecture and weights run, the
  actor trains fp32 masters over bf16 matmuls while the reference holds the bf16 weights, and
  two GRPO steps at lr 1e-6, exported in float32, differ from the source in nearly every
  projection weight (in pure bf16 an update of 1e-6 rounds away on all but the smallest)."""
  path = _llama3_dir(tmp_path / "llama3", dtype="bfloat16")
  cd = runpy.run_path(os.path.join(ROOT, "configs", "grpo_tiny.py"))["get_config"]()
  cd.model.size = ""
  cd.model.hf = path
  cd.actor_optimizer.learning_rate = 1e-6
  cd.reward.model_coef = 0.5  # continuous scores: every group has a gradient
  for dotted, value in RUN_FLAGS.items():
    section, _, field = dotted.rpartition(".")
    (cd[section] if section else cd)[field] = value
  runner = Runner(from_config_dict(cd), str(tmp_path / "run"), show_progress=False)
  expected, _ = read_hf_config(path)
  assert (expected.param_dtype, expected.dtype) == ("bfloat16", "bfloat16")
  assert runner.cluster.roles[Role.ACTOR].model == expected.replace(param_dtype="float32")
  assert runner.cluster.roles[Role.REFERENCE].model == expected
  assert expected.rope_scaling.type == "llama3" and expected.eos_token_ids == (1, 4)
  runner.run()
  # The reference is the initial policy: the checkpoint's weights, not a random draw.
  _, weights = hf.load_hf_checkpoint(path)
  reference = runner.cluster.params[Role.REFERENCE]
  np.testing.assert_array_equal(
    np.asarray(jax.device_get(reference["embedding"])), np.asarray(weights["embedding"])
  )
  out = tmp_path / "export"
  export.export(str(tmp_path / "run"), str(out), dtype="float32")
  with pytest.raises(export.ExportError, match=r"--adapter: .* trained no LoRA adapters"):
    export.export(str(tmp_path / "run"), str(tmp_path / "adapter"), part="adapter")
  source = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
  trained = safetensors.numpy.load_file(out / "model.safetensors")
  projections = [n for n in source if n.endswith("proj.weight")]
  assert len(projections) == 7 * TINY_LLAMA3.num_layers
  for name in projections:
    assert str(source[name].dtype) == "bfloat16", name
    moved = np.mean(trained[name] != source[name].astype(np.float32))
    assert trained[name].dtype == np.float32 and moved > 0.9, (name, moved)


@pytest.mark.slow
def test_a_checkpoint_of_another_architecture_is_one_line_exit_2(tmp_path):
  """The issue's reproduction, through the script: same shapes, another rope and norm eps."""
  path = tmp_path / "llama3"
  write_checkpoint(path, TINY.replace(rope_theta=500_000.0, rms_norm_eps=1e-6))
  done = _train(
    f"--workdir={tmp_path / 'run'}",
    f"--config.init.actor={path}",
    "--config.total_steps=1",
    config="configs/ppo_tiny.py",
  )
  assert done.returncode == 2, done.stderr[-3000:]
  assert done.stderr.strip().splitlines()[-1] == (
    f"error: init.actor: {path}/config.json has rope_theta=500000.0, the config has 10000.0; "
    "rms_norm_eps=1e-06, the config has 1e-05"
  )
