"""Parity with Hugging Face `transformers` (CPU torch) for Llama, Qwen2 and Mistral."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_dirs import torch, transformers

from rlhfjax import models
from rlhfjax.config.hf import CheckpointError

pytestmark = pytest.mark.unit

TOL = 1e-4

# Tiny shapes with distinct dims; head_dim differs from hidden / heads on purpose.
_DIMS = dict(
  vocab_size=331,
  hidden_size=56,
  intermediate_size=152,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=12,
  max_position_embeddings=128,
  initializer_range=0.2,
  rms_norm_eps=1e-6,
)

_FAMILIES = {
  "llama": ("LlamaConfig", dict(rope_theta=10_000.0)),
  "llama_tied_mha": (
    "LlamaConfig",
    dict(tie_word_embeddings=True, num_key_value_heads=4, rope_theta=500.0),
  ),
  "llama_bias_mqa": ("LlamaConfig", dict(attention_bias=True, num_key_value_heads=1)),
  "qwen2": ("Qwen2Config", dict(rope_theta=1_000_000.0)),
  "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
  "mistral_window": ("MistralConfig", dict(sliding_window=5)),
  # Llama 3.1-style scaling with the band edges inside head_dim 12's wavelengths (6.3 .. 13.5k):
  # one frequency kept, one blended, the rest divided by the factor.
  "llama_rope_llama3": (
    "LlamaConfig",
    dict(
      rope_parameters=dict(
        rope_type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
      )
    ),
  ),
  "llama_rope_linear": (
    "LlamaConfig",
    dict(rope_parameters=dict(rope_type="linear", factor=3.0)),
  ),
  # 13 tokens run past max_position_embeddings=8, so the dynamic base grows.
  "llama_rope_dynamic": (
    "LlamaConfig",
    dict(max_position_embeddings=8, rope_parameters=dict(rope_type="dynamic", factor=2.0)),
  ),
  "qwen3": ("Qwen3Config", dict(rope_theta=1_000_000.0)),
  "qwen3_bias": ("Qwen3Config", dict(attention_bias=True, tie_word_embeddings=True)),
}


def _hf_model(family: str, cls: str = "AutoModelForCausalLM", **extra):
  config_cls, overrides = _FAMILIES[family]
  kwargs = {**_DIMS, **overrides, **extra}
  rope = {"rope_theta": kwargs.pop("rope_theta", 10_000.0), "rope_type": "default"}
  rope.update(kwargs.pop("rope_parameters", {}))
  hf_config = getattr(transformers, config_cls)(**kwargs)
  hf_config.rope_parameters = rope
  torch.manual_seed(sum(map(ord, family)))
  model = getattr(transformers, cls).from_config(hf_config, dtype=torch.float32).eval()
  with torch.no_grad():  # non-trivial norms and biases, so a wrong mapping cannot pass
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
  return model


def _batch(vocab: int, left_pad: bool, seed: int = 0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, size=(3, 13)).astype(np.int32)
  mask = np.ones_like(tokens)
  if left_pad:
    mask[0, :4] = 0
    mask[2, :9] = 0
  return tokens, mask


def _hf_logits(model, tokens, mask):
  positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
  with torch.no_grad():
    out = model(
      input_ids=torch.tensor(tokens, dtype=torch.long),
      attention_mask=torch.tensor(mask, dtype=torch.long),
      position_ids=torch.tensor(positions, dtype=torch.long),
    )
  return out.logits.float().numpy()


def _assert_close_on_real_tokens(ours, theirs, mask):
  real = mask.astype(bool)
  err = np.max(np.abs(np.asarray(ours)[real] - theirs[real]))
  assert err <= TOL, f"max abs error {err:.2e} > {TOL}"


@pytest.mark.parametrize("family", list(_FAMILIES))
@pytest.mark.parametrize("left_pad", [False, True])
def test_logits_match_transformers(family, left_pad, tmp_path):
  hf_model = _hf_model(family)
  hf_model.save_pretrained(tmp_path)
  config, params = models.load_hf_checkpoint(tmp_path)
  assert config.architecture == family.split("_")[0]
  tokens, mask = _batch(config.vocab_size, left_pad)
  ours = models.forward_logits(config, params, jnp.asarray(tokens), jnp.asarray(mask))
  assert ours.shape == (3, 13, config.vocab_size) and ours.dtype == jnp.float32
  _assert_close_on_real_tokens(ours, _hf_logits(hf_model, tokens, mask), mask)


@pytest.mark.parametrize(
  "family", ["llama", "qwen2_tied", "mistral_window", "llama_rope_llama3", "qwen3_bias"]
)
def test_export_reloads_in_transformers(family, tmp_path):
  hf_model = _hf_model(family)
  hf_model.save_pretrained(tmp_path / "src")
  config, params = models.load_hf_checkpoint(tmp_path / "src")
  # Perturb so the export carries our values, not a copy of the source files.
  params = {**params, "embedding": params["embedding"] * 1.5}
  models.save_hf_checkpoint(config, params, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / "out", dtype=torch.float32
  ).eval()
  tokens, mask = _batch(config.vocab_size, left_pad=True, seed=1)
  ours = models.forward_logits(config, params, jnp.asarray(tokens), jnp.asarray(mask))
  _assert_close_on_real_tokens(ours, _hf_logits(reloaded, tokens, mask), mask)


def test_sharded_checkpoint_roundtrip(tmp_path):
  hf_model = _hf_model("llama")
  hf_model.save_pretrained(tmp_path / "src", max_shard_size="60KB")
  assert os.path.exists(tmp_path / "src" / "model.safetensors.index.json")
  config, params = models.load_hf_checkpoint(tmp_path / "src")
  models.save_hf_checkpoint(config, params, tmp_path / "out", max_shard_bytes=100_000)
  index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  _, again = models.load_hf_checkpoint(tmp_path / "out")
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tokens, mask = _batch(config.vocab_size, left_pad=False)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  ours = models.forward_logits(config, again, jnp.asarray(tokens), jnp.asarray(mask))
  _assert_close_on_real_tokens(ours, _hf_logits(reloaded, tokens, mask), mask)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_value_head_matches_sequence_classification(family, tmp_path):
  hf_model = _hf_model(family, "AutoModelForSequenceClassification", num_labels=1, pad_token_id=0)
  hf_model.save_pretrained(tmp_path / "rm")
  config, params = models.load_hf_checkpoint(tmp_path / "rm")
  assert models.head_kind(params) == "value"
  rng = np.random.default_rng(3)
  tokens = rng.integers(1, config.vocab_size, size=(3, 13)).astype(np.int32)
  mask = np.ones_like(tokens)
  mask[1, 8:] = 0  # right padding: HF pools the last non-pad token
  tokens[mask == 0] = 0
  values = models.forward_values(config, params, jnp.asarray(tokens), jnp.asarray(mask))
  reward = models.sequence_reward(values, jnp.asarray(mask))
  with torch.no_grad():
    hf_reward = (
      hf_model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask))
      .logits[:, 0]
      .numpy()
    )
  np.testing.assert_allclose(np.asarray(reward), hf_reward, atol=TOL, rtol=0)
  models.save_hf_checkpoint(config, params, tmp_path / "out")
  reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
  with torch.no_grad():
    again = (
      reloaded(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask))
      .logits[:, 0]
      .numpy()
    )
  np.testing.assert_allclose(again, hf_reward, atol=TOL, rtol=0)


def test_bfloat16_load(tmp_path):
  _hf_model("qwen2").save_pretrained(tmp_path)
  config, params = models.load_hf_checkpoint(tmp_path, dtype=jnp.bfloat16)
  assert config.param_dtype == config.dtype == "bfloat16"
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  _, params32 = models.load_hf_checkpoint(tmp_path)
  tokens, mask = _batch(config.vocab_size, left_pad=True)
  lo = models.forward_logits(config, params, jnp.asarray(tokens), jnp.asarray(mask))
  hi = models.forward_logits(
    config.replace(param_dtype="float32", dtype="float32"),
    params32,
    jnp.asarray(tokens),
    jnp.asarray(mask),
  )
  real = mask.astype(bool)
  # bfloat16 keeps 8 mantissa bits: the ranking of the top token mostly survives.
  agree = np.mean(np.argmax(np.asarray(lo)[real], -1) == np.argmax(np.asarray(hi)[real], -1))
  assert agree > 0.8


def test_bad_checkpoints_name_the_file(tmp_path):
  with pytest.raises(CheckpointError, match="config.json: not found"):
    models.load_hf_checkpoint(tmp_path)
  _hf_model("llama").save_pretrained(tmp_path)
  weights = tmp_path / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:100])
  with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read"):
    models.load_hf_checkpoint(tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))
  with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
    models.load_hf_checkpoint(tmp_path)
  (tmp_path / "config.json").write_text(
    json.dumps({**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
  )
  with pytest.raises(CheckpointError, match="rope type 'yarn'"):
    models.load_hf_checkpoint(tmp_path)
