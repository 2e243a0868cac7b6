"""Chunked log-probs, entropy and LM loss equal the whole-logits results, with less memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax import models
from rlhfjax.training import sft, steps

CONFIG = models.get_model_config("tiny", attention="xla")


def _numpy_stats(logits, targets):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  probs = np.exp(logp)
  return (
    np.take_along_axis(logp, targets[..., None], -1)[..., 0],
    -(probs * logp).sum(-1),
    logits.argmax(-1),
  )


@pytest.mark.parametrize("chunk", [1, 5, 13, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_stats_equal_numpy_and_whole_logits_with_gradients(chunk, temperature):
  rng = np.random.default_rng(chunk)
  b, t, d, v = 3, 13, 7, 29
  hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)

  def whole(h, w):
    return models.logprobs.stats_from_logits(jnp.einsum("btd,vd->btv", h, w) / temperature, targets)

  def chunked(h, w):
    return models.chunked_stats(h, w, targets, chunk_size=chunk, temperature=temperature)

  got = chunked(hidden, head)
  logp, entropy, argmax = _numpy_stats(
    np.einsum("btd,vd->btv", np.asarray(hidden), np.asarray(head)) / temperature,
    np.asarray(targets),
  )
  np.testing.assert_allclose(got.logp_bt, logp, atol=1e-5)
  np.testing.assert_allclose(got.entropy_bt, entropy, atol=1e-5)
  np.testing.assert_array_equal(got.argmax_bt, argmax)

  def objective(fn):
    weights = jnp.cos(jnp.arange(b * t, dtype=jnp.float32)).reshape(b, t)
    return lambda h, w: jnp.sum(weights * (fn(h, w).logp_bt + 0.3 * fn(h, w).entropy_bt))

  g_whole = jax.grad(objective(whole), argnums=(0, 1))(hidden, head)
  g_chunk = jax.grad(objective(chunked), argnums=(0, 1))(hidden, head)
  for x, y in zip(g_whole, g_chunk, strict=True):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model(request):
  config = CONFIG.replace(tie_embeddings=request.param)
  return config, models.init_params(config, "lm", jax.random.key(5))


def _ppo_batch(config, seed=0, b=4, p=5, t=8):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.vocab_size, size=(b, p + t)).astype(np.int32)
  attention = np.ones_like(tokens)
  attention[0, :2] = 0
  response = np.ones((b, t), np.float32)
  response[1, 5:] = 0
  attention[1, p + 5 :] = 0
  return {
    "tokens": jnp.asarray(tokens),
    "attention_mask": jnp.asarray(attention),
    "response_mask": jnp.asarray(response),
    "old_logprobs": jnp.asarray(rng.normal(size=(b, t)) - 5, jnp.float32),
    "advantages": jnp.asarray(rng.normal(size=(b, t)), jnp.float32),
  }


def test_actor_loss_and_gradients_chunked_equal_unchunked(model):
  config, params = model
  batch = _ppo_batch(config)
  kw = dict(prompt_len=5, clip_eps=0.2, entropy_coef=0.01, temperature=0.9)
  grad = jax.grad(steps.actor_loss, has_aux=True)
  loss_fn = jax.jit(lambda c, p: steps.actor_loss(p, batch, config=c, **kw), static_argnums=0)
  whole_loss, whole_metrics = loss_fn(config, params)
  chunked = config.replace(logprob_chunk_size=3)  # 8 response tokens: a ragged last chunk
  loss, metrics = loss_fn(chunked, params)
  np.testing.assert_allclose(float(loss), float(whole_loss), rtol=1e-6)
  for name in whole_metrics:
    np.testing.assert_allclose(float(metrics[name]), float(whole_metrics[name]), atol=1e-6)
  g_whole, _ = grad(params, batch, config=config, **kw)
  g_chunk, _ = grad(params, batch, config=chunked, **kw)
  for x, y in zip(jax.tree.leaves(g_whole), jax.tree.leaves(g_chunk), strict=True):
    scale = float(jnp.max(jnp.abs(x)))
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=2e-6 * scale)
  logp = steps.response_logprobs(chunked, params, batch["tokens"], batch["attention_mask"], 5)
  ref = steps.response_logprobs(config, params, batch["tokens"], batch["attention_mask"], 5)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(ref), atol=1e-5)


def test_sft_loss_chunked_equals_unchunked(model):
  config, params = model
  batch = _ppo_batch(config, seed=1)
  batch = {**batch, "loss_mask": batch["attention_mask"].at[:, :5].set(0)}
  loss, metrics = sft.sft_loss(params, batch, config=config)
  loss_c, metrics_c = sft.sft_loss(params, batch, config=config.replace(logprob_chunk_size=4))
  np.testing.assert_allclose(float(loss_c), float(loss), rtol=1e-6)
  assert float(metrics_c["token_accuracy"]) == float(metrics["token_accuracy"])


def test_chunked_gradient_never_holds_the_whole_logits():
  """XLA's memory analysis of the PPO actor gradient: what a 4099-token vocabulary adds to the
  peak over a 7-token one. Whole, that is more than the batch's fp32 logits (8.4 MB); in chunks
  of 16 tokens it is a small fraction of them."""
  b, p, t = 4, 8, 512
  batch = {
    "tokens": jax.ShapeDtypeStruct((b, p + t), jnp.int32),
    "attention_mask": jax.ShapeDtypeStruct((b, p + t), jnp.int32),
    "response_mask": jax.ShapeDtypeStruct((b, t), jnp.float32),
    "old_logprobs": jax.ShapeDtypeStruct((b, t), jnp.float32),
    "advantages": jax.ShapeDtypeStruct((b, t), jnp.float32),
  }

  def temp_bytes(vocab, chunk):
    config = CONFIG.replace(vocab_size=vocab, num_layers=1, logprob_chunk_size=chunk)
    params = jax.eval_shape(lambda: models.init_params(config, "lm"))
    loss = lambda prm, bt: steps.actor_loss(
      prm, bt, config=config, prompt_len=p, clip_eps=0.2, entropy_coef=0.01
    )
    compiled = jax.jit(jax.grad(loss, has_aux=True)).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  logits_bytes = b * t * 4099 * 4
  whole = temp_bytes(4099, None) - temp_bytes(7, None)
  chunked = temp_bytes(4099, 16) - temp_bytes(7, 16)
  assert whole > logits_bytes, (whole, logits_bytes)
  assert chunked < logits_bytes / 8, (chunked, logits_bytes)


def test_bad_chunk_size_is_refused():
  with pytest.raises(ValueError, match=r"^ModelConfig\.logprob_chunk_size must be >= 1"):
    CONFIG.replace(logprob_chunk_size=0)
