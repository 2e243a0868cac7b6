"""`scripts/export_hf.py` on runs of this process: a run's policy reloads in `transformers` with
our logits, scores and token ids; shards, pipelines and one-line errors."""

import json
import os
import pathlib
import re
import runpy
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_dirs import torch, transformers
from jax.sharding import SingleDeviceSharding
from test_export import _LAYERS, _SHARD

from rlhfjax import checkpoint as ckpt
from rlhfjax import config as config_lib
from rlhfjax import export, models
from rlhfjax.config.hf import CheckpointError, config_to_hf
from rlhfjax.config.model import get_model_config
from rlhfjax.data.byte_tokenizer import ByteTokenizer
from rlhfjax.runner import Runner

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "export_hf.py"
# fp32 on both sides; XLA and torch sum in different orders. On these tiny models (hidden 56,
# 4 layers, logits of magnitude ~1) the reordering moves a logit by a few float32 ulps per
# reduction, ~1e-6 measured: 1e-4 leaves a margin of two orders while any wrong tensor mapping
# (a transposed or misplaced weight) moves logits by O(0.1). As test_hf_parity.
TOL = 1e-4


def _supervised(path: str, workdir: pathlib.Path, **fields):
  config = runpy.run_path(str(ROOT / path))["get_config"]().to_dict()
  config["placement"].update(num_devices=4, tensor=2)
  config["model"]["overrides"] = {"num_layers": _LAYERS}
  # The held-out pass runs before and after training: a few rows keep it short.
  config["data"].update(data_dir=str(workdir.parent / "data"), eval_split="train[:8]")
  config["checkpoint"]["async_save"] = False
  config["supervised"].update(batch_size=16, micro_batches=2, max_len=48)
  config["eval"]["every_steps"] = 0
  config.update(log_every=1, total_steps=1, **fields)
  return config_lib.from_config_dict(config)


def one_step_runs(root: pathlib.Path, kinds=("sft", "rm", "grpo")) -> pathlib.Path:
  """One SFT, one reward-model and one GRPO run of one step each (those of `kinds`), in
  `root`/{sft,rm,grpo}."""
  for kind in ("sft", "rm"):
    if kind in kinds:
      cfg = _supervised(f"configs/{kind}_tiny.py", root / kind)
      Runner(cfg, str(root / kind), show_progress=False).run()
  if "grpo" not in kinds:
    return root
  cd = runpy.run_path(str(ROOT / "configs" / "grpo_tiny.py"))["get_config"]("colocated")
  cd.total_steps = 1
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.eval.num_prompts = 0
  cd.model.overrides = {"num_layers": _LAYERS}
  Runner(config_lib.from_config_dict(cd), str(root / "grpo"), show_progress=False).run()
  return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One SFT, one reward-model and one GRPO run of one step each."""
  return one_step_runs(tmp_path_factory.mktemp("export"))


def _restored(workdir: pathlib.Path, item: str, head: str):
  """The run's parameters on one device, read independently of the export's shardings, and
  the model the run's config builds."""
  model = get_model_config("tiny", num_layers=_LAYERS)
  device = SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
    models.abstract_params(model, head),
  )
  return model, ckpt.restore_params(workdir / "checkpoints", abstract, item)


def _batch(vocab: int, pad_id: int):
  """Right-padded rows of distinct lengths; pads carry `pad_id` (HF's classifier finds the
  last real token by it)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=(3, 11)).astype(np.int32)
  mask = np.ones_like(tokens)
  for row, length in enumerate((11, 7, 4)):
    mask[row, length:] = 0
    tokens[row, length:] = pad_id
  assert tokens.max() < vocab
  return tokens, mask


def _hf_out(model, tokens, mask):
  with torch.no_grad():
    out = model(
      input_ids=torch.tensor(tokens, dtype=torch.long),
      attention_mask=torch.tensor(mask, dtype=torch.long),
    )
  return out.logits.float().numpy()


def _export(workdir, out, *args):
  return subprocess.run(
    [sys.executable, str(SCRIPT), f"--workdir={workdir}", f"--out={out}", *args],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
  )


def _assert_lm_matches(workdir: pathlib.Path, out: pathlib.Path, item: str):
  model, params = _restored(workdir, item, "lm")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  tokens, mask = _batch(model.vocab_size, ByteTokenizer().pad_id)
  ours = np.asarray(models.forward_logits(model, params, jnp.asarray(tokens), jnp.asarray(mask)))
  theirs = _hf_out(reloaded, tokens, mask)
  real = mask.astype(bool)
  err = np.max(np.abs(ours[real] - theirs[real]))
  assert err <= TOL, f"max abs logit error {err:.2e} > {TOL}"
  assert np.ptp(ours[real]) > 100 * TOL  # not trivially equal


def test_sft_export_reloads_in_transformers(runs, tmp_path):
  result = _export(runs / "sft", tmp_path / "hf")
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().splitlines()[-1] == (
    f"exported the actor of {runs / 'sft'} at step 1 as float32: wrote model.safetensors to "
    f"{tmp_path / 'hf'}"
  )
  files = set(os.listdir(tmp_path / "hf"))
  assert {"model.safetensors", "config.json", "generation_config.json"} <= files
  assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= files
  _assert_lm_matches(runs / "sft", tmp_path / "hf", "actor")
  ours = ByteTokenizer()
  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
  text = "Name three vowels: a, é, ü — and 日本語 ✓\n"
  assert theirs(text)["input_ids"] == ours.encode(text)
  assert theirs.decode(ours.encode(text), skip_special_tokens=True) == text
  generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
  assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (
    ours.bos_id,
    ours.eos_id,
    ours.pad_id,
  )


def test_reward_model_exports_as_sequence_classification(runs, tmp_path):
  assert _export(runs / "rm", tmp_path / "hf").returncode == 0
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert config["architectures"] == ["LlamaForSequenceClassification"]
  model, params = _restored(runs / "rm", "reward", "value")
  reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(
    tmp_path / "hf", dtype=torch.float32
  ).eval()
  tokens, mask = _batch(model.vocab_size, ByteTokenizer().pad_id)
  values = models.forward_values(model, params, jnp.asarray(tokens), jnp.asarray(mask))
  ours = np.asarray(models.sequence_reward(values, jnp.asarray(mask)))
  theirs = _hf_out(reloaded, tokens, mask)
  assert theirs.shape == (3, 1)
  np.testing.assert_allclose(theirs[:, 0], ours, atol=TOL, rtol=0)
  assert np.ptp(ours) > 10 * TOL  # the rows' scores differ: the head is not zero


def test_grpo_export_is_the_actor_and_a_pipeline_defaults_to_its_rl_stage(runs, tmp_path):
  # A pipeline workdir: its stages in sft/, rm/ and ppo/.
  pipeline = tmp_path / "pipeline"
  pipeline.mkdir()
  for stage, run in (("sft", "sft"), ("rm", "rm"), ("ppo", "grpo")):
    (pipeline / stage).symlink_to(runs / run)
  result = _export(pipeline, tmp_path / "hf", "--dtype=bfloat16")
  assert result.returncode == 0, result.stderr
  said = result.stdout.strip().splitlines()[-1]
  assert re.fullmatch(
    rf"exported the actor of {re.escape(str(pipeline / 'ppo'))} \(stage ppo\) at step \d+ as "
    rf"bfloat16: wrote model.safetensors to {re.escape(str(tmp_path / 'hf'))}",
    said,
  ), said
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
  with open(tmp_path / "hf" / "model.safetensors", "rb") as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
  assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
  assert _export(pipeline, tmp_path / "f32").returncode == 0
  _assert_lm_matches(runs / "grpo", tmp_path / "f32", "actor")
  assert export.run_directory(str(pipeline), "rm") == str(pipeline / "rm")


def test_large_exports_are_sharded_with_an_index(runs, tmp_path):
  assert _export(runs / "sft", tmp_path / "hf", f"--max_shard_size={_SHARD}").returncode == 0
  index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert files == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
  assert sorted(f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")) == files
  assert all(os.path.getsize(tmp_path / "hf" / f) <= 150_000 for f in files)
  _assert_lm_matches(runs / "sft", tmp_path / "hf", "actor")


def test_errors_name_the_flag_and_the_values(runs, tmp_path):
  (tmp_path / "empty").mkdir()
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("")
  cases = {
    (tmp_path / "empty", tmp_path / "a", None): "no complete checkpoint in .*empty/checkpoints",
    (runs / "sft", tmp_path / "b", 7): r"--step=7: no complete checkpoint .*; steps: 1$",
    (runs / "sft", tmp_path / "full", None): "full exists and is not empty; .* --overwrite",
    (tmp_path / "none", tmp_path / "d", None): "--workdir .*none does not exist",
  }
  for (workdir, out, step), expected in cases.items():
    with pytest.raises(export.ExportError, match=expected):
      export.export(str(workdir), str(out), step=step)
  with pytest.raises(export.ExportError, match="'lots' is not a size such as 2GB"):
    export.parse_size("lots")
  with pytest.raises(CheckpointError, match="cannot carry q/k norms"):
    config_to_hf(get_model_config("tiny", qk_norm=True))
  # The script: one line, exit status 2.
  result = _export(runs / "sft", tmp_path / "full")
  assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
  assert result.stderr.startswith("error: --out ") and "--overwrite" in result.stderr
  # An earlier sharded export's index would make transformers load the old shards.
  (tmp_path / "full" / "model.safetensors.index.json").write_text("{}")
  (tmp_path / "full" / "model-00001-of-00002.safetensors").write_text("")
  assert _export(runs / "sft", tmp_path / "full", "--overwrite").returncode == 0
  assert sorted(f for f in os.listdir(tmp_path / "full") if "safetensors" in f) == [
    "model.safetensors"
  ]
