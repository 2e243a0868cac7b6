"""Chunked log-probs, entropy and LM loss equal the whole-logits results, with less memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax import models
from rlhfjax.config.model import get_model_config
from rlhfjax.training import sft, steps

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny", attention="xla")


_U = np.finfo(np.float32).eps / 2  # fp32's unit roundoff


def _gamma(n):
  """Higham's bound on the relative rounding error of n fp32 operations in sequence."""
  return n * _U / (1 - n * _U)


def _exact_stats_and_fp32_bounds(hidden, head, targets, temperature, weights):
  """Float64 log-probs, entropy and gradients of `sum(weights * (logp + 0.3 * entropy))`, and
  worst-case bounds on how far an fp32 computation of each may fall from them.

  The bounds follow the arithmetic, not a machine's rounding: a logit `z = h.w / T` of `d`
  products is off by at most `gamma(d + 1) * (|h|.|w|) / T` (Higham's dot-product bound);
  `logp = z_y - logsumexp(z)` moves by at most twice the largest logit error, plus
  `gamma(v + 4) * (1 + max|z| + |logp|)` for the fp32 log-softmax over `v` entries; the entropy
  `H = -sum(p s)` moves by `sum_v p_v |s_v + H|` times twice the logit error (its derivative),
  plus the same log-softmax rounding. The gradients are sums over the vocabulary (for the
  hidden states) or the positions (for the head) of `c = dL/dz`, whose error is its
  sensitivity to the log-probs' error plus `gamma(4)` of itself.
  """
  h, w = np.asarray(hidden, np.float64), np.asarray(head, np.float64)
  targets = np.asarray(targets)
  (b, t, d), v = h.shape, w.shape[0]
  z = np.einsum("btd,vd->btv", h, w) / temperature
  z_abs = np.einsum("btd,vd->btv", np.abs(h), np.abs(w)) / temperature
  shifted = z - z.max(-1, keepdims=True)
  s = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  p = np.exp(s)
  entropy = -(p * s).sum(-1)
  logp = np.take_along_axis(s, targets[..., None], -1)[..., 0]
  dz = _gamma(d + 1) * z_abs.max(-1)
  z_max = np.abs(z).max(-1)
  logp_err = 2 * dz + _gamma(v + 4) * (1 + z_max + np.abs(logp))
  spread = (p * np.abs(s + entropy[..., None])).sum(-1)
  entropy_err = 2 * spread * dz + _gamma(v + 4) * (1 + z_max + (p * np.abs(s)).sum(-1) + entropy)

  weights = np.asarray(weights, np.float64)[..., None]
  onehot = np.eye(v)[targets]
  c = weights * ((onehot - p) - 0.3 * p * (s + entropy[..., None])) / temperature
  softmax_err = (2 * dz + _gamma(v + 4) * (1 + z_max))[..., None]
  c_err = np.abs(weights) / temperature * p * (2 + np.abs(s) + entropy[..., None]) * softmax_err
  c_err += _gamma(4) * np.abs(c)
  grads = (np.einsum("btv,vd->btd", c, w), np.einsum("btv,btd->vd", c, h))
  grad_errs = (
    np.einsum("btv,vd->btd", c_err + _gamma(v) * np.abs(c), np.abs(w)),
    np.einsum("btv,btd->vd", c_err + _gamma(b * t) * np.abs(c), np.abs(h)),
  )
  grads_and_errs = tuple(zip(grads, grad_errs, strict=True))
  return (logp, logp_err), (entropy, entropy_err), z.argmax(-1), grads_and_errs


def _assert_within(got, want, bound):
  got = np.asarray(got, np.float64)
  excess = np.abs(got - want) - bound
  assert (excess <= 0).all(), f"off by {np.abs(got - want).max()} where the bound is {bound.max()}"


@pytest.mark.parametrize("chunk", [1, 5, 13, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_stats_equal_numpy_and_whole_logits_with_gradients(chunk, temperature):
  rng = np.random.default_rng(chunk)
  b, t, d, v = 3, 13, 7, 29
  hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
  weights = jnp.cos(jnp.arange(b * t, dtype=jnp.float32)).reshape(b, t)

  def whole(h, w):
    return models.logprobs.stats_from_logits(jnp.einsum("btd,vd->btv", h, w) / temperature, targets)

  def chunked(h, w):
    return models.chunked_stats(h, w, targets, chunk_size=chunk, temperature=temperature)

  (logp, logp_err), (entropy, entropy_err), argmax, grads = _exact_stats_and_fp32_bounds(
    hidden, head, targets, temperature, weights
  )
  got = jax.jit(chunked)(hidden, head)
  _assert_within(got.logp_bt, logp, logp_err)
  _assert_within(got.entropy_bt, entropy, entropy_err)
  np.testing.assert_array_equal(got.argmax_bt, argmax)

  def objective(fn):
    return lambda h, w: jnp.sum(weights * (fn(h, w).logp_bt + 0.3 * fn(h, w).entropy_bt))

  g_whole = jax.jit(jax.grad(objective(whole), argnums=(0, 1)))(hidden, head)
  g_chunk = jax.jit(jax.grad(objective(chunked), argnums=(0, 1)))(hidden, head)
  for x, y, (exact, err) in zip(g_whole, g_chunk, grads, strict=True):
    _assert_within(y, exact, err)
    _assert_within(y, np.asarray(x, np.float64), 2 * err)  # both fp32: each within err of exact


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
  # Compiled, not op by op (each operation would compile on its own); `c` is the config.
  loss_fn = jax.jit(lambda c, p: steps.actor_loss(p, batch, config=c, **kw), static_argnums=0)
  grad_fn = jax.jit(
    lambda c, p: jax.grad(steps.actor_loss, has_aux=True)(p, batch, config=c, **kw),
    static_argnums=0,
  )
  logp_fn = jax.jit(steps.response_logprobs, static_argnums=(0, 4))
  whole_loss, whole_metrics = loss_fn(config, params)
  chunked = config.replace(logprob_chunk_size=3)  # 8 response tokens: a ragged last chunk
  loss, metrics = loss_fn(chunked, params)
  np.testing.assert_allclose(float(loss), float(whole_loss), rtol=1e-6)
  for name in whole_metrics:
    np.testing.assert_allclose(float(metrics[name]), float(whole_metrics[name]), atol=1e-6)
  g_whole, _ = grad_fn(config, params)
  g_chunk, _ = grad_fn(chunked, params)
  for x, y in zip(jax.tree.leaves(g_whole), jax.tree.leaves(g_chunk), strict=True):
    scale = float(jnp.max(jnp.abs(x)))
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=2e-6 * scale)
  logp = logp_fn(chunked, params, batch["tokens"], batch["attention_mask"], 5)
  ref = logp_fn(config, params, batch["tokens"], batch["attention_mask"], 5)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(ref), atol=1e-5)


def test_sft_loss_chunked_equals_unchunked(model):
  config, params = model
  batch = _ppo_batch(config, seed=1)
  batch = {**batch, "loss_mask": batch["attention_mask"].at[:, :5].set(0)}
  loss_fn = jax.jit(lambda c, p: sft.sft_loss(p, batch, config=c), static_argnums=0)
  loss, metrics = loss_fn(config, params)
  loss_c, metrics_c = loss_fn(config.replace(logprob_chunk_size=4), params)
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
