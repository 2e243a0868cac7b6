"""Attention kernels and rematerialisation policies give the plain path's results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax import models, rollout
from rlhfjax.config import ConfigError, ModelSection, RoleModelSection
from rlhfjax.config.model import REMAT_POLICIES, get_model_config
from rlhfjax.placement.spec import RoleSpec

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny", attention="einsum")


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, "lm", jax.random.key(3))


def _batch(seed=0, b=3, t=17):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CONFIG.vocab_size, size=(b, t)).astype(np.int32)
  mask = np.ones_like(tokens)
  mask[0, :5] = 0  # left padding: pad queries see no key at all
  mask[2, :11] = 0
  return jnp.asarray(tokens), jnp.asarray(mask)


def _loss(config, params, tokens, mask):
  logits = models.forward_logits(config, params, tokens, mask)
  weights = jnp.sin(jnp.arange(logits.size, dtype=jnp.float32)).reshape(logits.shape)
  return jnp.sum(logits * weights * mask[..., None])


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
@pytest.mark.parametrize("window", [None, 5])
def test_attention_kernels_equal_einsum_through_the_model(params, window, impl, attention_block):
  """The whole model's logits and parameter gradients on a left-padded batch."""
  # 17 tokens in blocks of 5: three full blocks and a padded one, by queries and by keys.
  attention_block(5)
  tokens, mask = _batch()
  plain = CONFIG.replace(sliding_window=window)
  fused = plain.replace(attention=impl)
  a = models.forward_logits(plain, params, tokens, mask)
  b = models.forward_logits(fused, params, tokens, mask)
  assert np.all(np.isfinite(np.asarray(b)))
  real = np.asarray(mask).astype(bool)
  np.testing.assert_allclose(np.asarray(b)[real], np.asarray(a)[real], atol=2e-5, rtol=0)
  ga = jax.grad(_loss, argnums=1)(plain, params, tokens, mask)
  gb = jax.grad(_loss, argnums=1)(fused, params, tokens, mask)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
    scale = float(jnp.max(jnp.abs(x)))
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5 * scale, rtol=0)


def test_model_config_checks_its_names():
  with pytest.raises(ValueError, match=r"^ModelConfig\.attention must be one of"):
    CONFIG.replace(attention="flash")
  with pytest.raises(ValueError, match=r"^ModelConfig\.remat must be one of"):
    CONFIG.replace(remat="some")


@pytest.mark.parametrize("window", [None, 4])
def test_decode_attention_of_every_kind_equals_einsum(params, window):
  """The engine's decode with XLA's attention over the gathered pages ('xla') and with the
  CPU's products and sums in the pages' layout ('auto', `decode_attention_over_pages`) gives
  the einsum path's tokens and log-probs, across page boundaries and a sliding window."""
  prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6], [11, 12, 13, 14], [3, 1, 4, 1, 5, 9, 2]]
  setting = rollout.SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=())
  engine = rollout.EngineConfig(
    num_slots=4, prompt_buckets=(9,), max_new_tokens=6, prefill_batch_sizes=(1, 4), page_size=4
  )
  outs = []
  for kind in ("einsum", "xla", "auto"):
    config = CONFIG.replace(attention=kind, sliding_window=window)
    spec = RoleSpec.generation([0], data=1, tensor=1)
    outs.append(
      rollout.Engine.for_role(config, engine, spec, params).generate(
        prompts, sampling=setting, seed=4
      )
    )
  for out in outs[1:]:
    np.testing.assert_array_equal(out.tokens, outs[0].tokens)
    np.testing.assert_allclose(out.logprobs, outs[0].logprobs, atol=2e-5, rtol=0)


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_policies_give_the_same_loss_and_gradients(params, policy):
  tokens, mask = _batch(seed=1)
  base = CONFIG.replace(attention="xla")
  value, grads = jax.value_and_grad(_loss, argnums=1)(base, params, tokens, mask)
  value_r, grads_r = jax.value_and_grad(_loss, argnums=1)(
    base.replace(remat=policy), params, tokens, mask
  )
  np.testing.assert_allclose(float(value_r), float(value), rtol=1e-6)
  for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r), strict=True):
    scale = float(jnp.max(jnp.abs(x)))
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-6 * scale, rtol=0)


def test_full_remat_lowers_the_compiled_peak(params):
  """XLA's own memory analysis of the gradient: remat='full' keeps less alive than 'none'."""
  config = CONFIG.replace(attention="xla", num_layers=6)
  p6 = jax.eval_shape(lambda: models.init_params(config, "lm"))
  tokens = jax.ShapeDtypeStruct((4, 256), jnp.int32)

  def temp_bytes(remat):
    grad = jax.jit(jax.grad(_loss, argnums=1), static_argnums=0)
    compiled = grad.lower(config.replace(remat=remat), p6, tokens, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  none, full = temp_bytes("none"), temp_bytes("full")
  assert full < 0.7 * none, (full, none)


def test_bf16_compute_with_fp32_master_parameters(params):
  """Mixed precision: fp32 parameters and gradients, bf16 matmuls close to the fp32 result."""
  tokens, mask = _batch(seed=2)
  mixed = CONFIG.replace(attention="xla", dtype="bfloat16")
  assert mixed.param_dtype == "float32"
  grads = jax.grad(_loss, argnums=1)(mixed, params, tokens, mask)
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  lo = models.forward_logits(mixed, params, tokens, mask)
  hi = models.forward_logits(CONFIG, params, tokens, mask)
  real = np.asarray(mask).astype(bool)
  err = np.max(np.abs(np.asarray(lo)[real] - np.asarray(hi)[real]))
  assert 0 < err < 0.05 * float(np.max(np.abs(np.asarray(hi)[real])))


def test_per_role_model_settings_and_their_checks():
  section = ModelSection(
    size="7b",
    roles={
      "reference": RoleModelSection(param_dtype="bfloat16", remat="none"),
      "actor": RoleModelSection(remat="dots_saveable", logprob_chunk_size=512),
    },
  )
  actor, reference = section.for_role("actor"), section.for_role("reference")
  assert (actor.param_dtype, actor.dtype, actor.remat) == ("float32", "bfloat16", "dots_saveable")
  assert actor.logprob_chunk_size == 512
  assert (reference.param_dtype, reference.remat) == ("bfloat16", "none")
  assert section.for_role("rollout").param_dtype == "float32"  # the real sizes' fp32 masters
  with pytest.raises(ConfigError, match="the rollout's param_dtype float32 is wider than"):
    ModelSection(size="7b", roles={"actor": RoleModelSection(param_dtype="bfloat16")})
  with pytest.raises(ConfigError, match=r"unknown role 'critc' in 'model\.roles'"):
    ModelSection(size="7b", roles={"critc": RoleModelSection()})
  with pytest.raises(ConfigError, match=r"^'remat' must be one of none, full"):
    RoleModelSection(remat="half")
