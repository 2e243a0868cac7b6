"""PPO step functions: alignment of response positions, gradient accumulation, learning."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlhfjax import models
from rlhfjax.config import OptimizerConfig
from rlhfjax.config.model import get_model_config
from rlhfjax.training import steps
from rlhfjax.training.optimizer import make_optimizer
from rlhfjax.training.state import init_train_state

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny")
P, T = 5, 4


def _sequences(seed=0, b=4):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, CONFIG.vocab_size, (b, P + T)).astype(np.int32)
  attention = np.ones_like(tokens)
  attention[1, :2] = 0  # left-padded prompt
  response_mask = np.ones((b, T), np.float32)
  response_mask[2, 3:] = 0  # short response, right-padded
  attention[2, P + 3 :] = 0
  return jnp.asarray(tokens), jnp.asarray(attention), jnp.asarray(response_mask)


def test_response_logprobs_match_prefix_by_prefix_forward():
  params = models.init_params(CONFIG, "lm", jax.random.key(0))
  tokens, attention, _ = _sequences()
  logp = steps.response_logprobs(CONFIG, params, tokens, attention, P)
  for j in range(T):
    prefix_logits = models.forward_logits(
      CONFIG, params, tokens[:, : P + j], attention[:, : P + j]
    )[:, -1]
    expected = jax.nn.log_softmax(prefix_logits)[jnp.arange(4), tokens[:, P + j]]
    valid = np.asarray(attention[:, P + j]) > 0
    np.testing.assert_allclose(np.asarray(logp)[valid, j], np.asarray(expected)[valid], atol=1e-5)


def _actor_batch(params, seed=0, b=4):
  tokens, attention, response_mask = _sequences(seed, b)
  old = steps.response_logprobs(CONFIG, params, tokens, attention, P)
  adv = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(b, T)).astype(np.float32))
  return {
    "tokens": tokens,
    "attention_mask": attention,
    "response_mask": response_mask,
    "old_logprobs": old,
    "advantages": adv * response_mask,
  }


def test_micro_batches_accumulate_to_the_full_batch_gradient():
  params = models.init_params(CONFIG, "lm", jax.random.key(0))
  batch = _actor_batch(params)
  batch["response_mask"] = jnp.ones_like(batch["response_mask"])  # equal token counts
  tx = optax.sgd(1.0)  # params move by exactly the gradient (Adam's first step is ~sign(g))
  loss = functools.partial(
    steps.actor_loss, config=CONFIG, prompt_len=P, clip_eps=0.2, entropy_coef=0.01
  )
  step = jax.jit(functools.partial(steps.accumulate_and_apply, loss, tx))
  whole, m1 = step(init_train_state(params, tx), jax.tree.map(lambda x: x[None], batch))
  split, m2 = step(
    init_train_state(params, tx), jax.tree.map(lambda x: x.reshape(2, 2, *x.shape[1:]), batch)
  )
  np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(split.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
  assert int(whole.step) == 1 and bool(m1["grad_finite"])


def test_actor_step_raises_the_advantage_weighted_logprob():
  params = models.init_params(CONFIG, "lm", jax.random.key(0))
  batch = _actor_batch(params)
  tx = make_optimizer(OptimizerConfig(learning_rate=3e-3), 10)
  loss = functools.partial(
    steps.actor_loss, config=CONFIG, prompt_len=P, clip_eps=10.0, entropy_coef=0.0
  )
  step = jax.jit(functools.partial(steps.accumulate_and_apply, loss, tx))
  state = init_train_state(params, tx)
  objective = lambda p: float(
    jnp.sum(
      steps.response_logprobs(CONFIG, p, batch["tokens"], batch["attention_mask"], P)
      * batch["advantages"]
    )
  )
  before = objective(state.params)
  for _ in range(5):
    state, _ = step(state, jax.tree.map(lambda x: x[None], batch))
  assert objective(state.params) > before + 0.1


def test_critic_step_fits_returns():
  params = models.init_params(CONFIG, "value", jax.random.key(2))
  tokens, attention, response_mask = _sequences(3)
  old_values = steps.response_values(CONFIG, params, tokens, attention, P)
  returns = jnp.asarray(np.random.default_rng(0).normal(size=(4, T)).astype(np.float32))
  batch = {
    "tokens": tokens,
    "attention_mask": attention,
    "response_mask": response_mask,
    "old_values": old_values,
    "returns": returns * response_mask,
  }
  tx = make_optimizer(OptimizerConfig(learning_rate=3e-3), 20)
  loss = functools.partial(steps.critic_loss, config=CONFIG, prompt_len=P, clip_eps=100.0)
  step = jax.jit(functools.partial(steps.accumulate_and_apply, loss, tx))
  state = init_train_state(params, tx)
  first = None
  for _ in range(10):
    state, metrics = step(state, jax.tree.map(lambda x: x[None], batch))
    first = float(metrics["loss/value"]) if first is None else first
  assert float(metrics["loss/value"]) < 0.5 * first


@pytest.mark.parametrize("poison", ["advantages", "old_logprobs_inf"])
def test_a_non_finite_update_is_skipped_and_reported(poison):
  params = models.init_params(CONFIG, "lm", jax.random.key(0))
  batch = _actor_batch(params)
  if poison == "advantages":  # NaN gradients
    batch["advantages"] = batch["advantages"].at[0, 0].set(jnp.nan)
  else:  # an infinite ratio: the loss is not finite
    batch["old_logprobs"] = batch["old_logprobs"].at[1, 0].set(-jnp.inf)
  tx = make_optimizer(OptimizerConfig(learning_rate=3e-3), 10)
  loss = functools.partial(
    steps.actor_loss, config=CONFIG, prompt_len=P, clip_eps=0.2, entropy_coef=0.0
  )
  step = jax.jit(functools.partial(steps.accumulate_and_apply, loss, tx))
  state = init_train_state(params, tx)
  after, metrics = step(state, jax.tree.map(lambda x: x[None], batch))
  assert float(metrics["skipped"]) == 1.0
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(after.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The next finite batch updates normally.
  good = _actor_batch(params)
  after, metrics = step(after, jax.tree.map(lambda x: x[None], good))
  assert float(metrics["skipped"]) == 0.0
  moved = [
    not np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(after.params), strict=True)
  ]
  assert any(moved)
