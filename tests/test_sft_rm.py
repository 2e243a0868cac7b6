"""SFT and reward-model training's pieces: the objectives against NumPy, the losses on the model,
one SFT step on 1 device against the step on 8. (The runs: tests/test_sft_rm_runs.py; the entry
points: tests/test_sft_rm_e2e.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlhfjax import algorithms as alg
from rlhfjax import models
from rlhfjax.cluster.role import RoleRuntime
from rlhfjax.config.model import get_model_config
from rlhfjax.placement.spec import Role, RoleSpec
from rlhfjax.training import reward_model, sft, steps
from rlhfjax.training.state import init_train_state

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny")


# ---------------------------------------------------------------------------------------------
# Objectives against NumPy.


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _sft_case(seed=0, b=3, s=7, v=11):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(b, s, v)).astype(np.float32) * 3
  tokens = rng.integers(0, v, (b, s)).astype(np.int32)
  mask = np.zeros((b, s), np.float32)
  mask[0, 3:6] = 1
  mask[1, 1:7] = 1
  mask[2, 5:6] = 1
  return logits, tokens, mask


def _numpy_nll_and_accuracy(logits, tokens, mask):
  nll, correct, n = 0.0, 0.0, 0.0
  for i in range(tokens.shape[0]):
    for j in range(1, tokens.shape[1]):
      if mask[i, j]:
        nll -= _log_softmax(logits[i, j - 1].astype(np.float64))[tokens[i, j]]
        correct += float(np.argmax(logits[i, j - 1]) == tokens[i, j])
        n += 1
  return nll / n, correct / n


def test_masked_token_nll_and_accuracy_match_numpy():
  logits, tokens, mask = _sft_case()
  nll, accuracy = _numpy_nll_and_accuracy(logits, tokens, mask)
  np.testing.assert_allclose(alg.masked_token_nll(logits, tokens, mask), nll, rtol=1e-5)
  np.testing.assert_allclose(alg.token_accuracy(logits, tokens, mask), accuracy, rtol=1e-6)


def test_masked_token_nll_ignores_prompt_predictions_and_empty_masks():
  logits, tokens, mask = _sft_case()
  loss = alg.masked_token_nll(logits, tokens, mask)
  changed_logits, changed_tokens = logits.copy(), tokens.copy()
  for i, j in zip(*np.nonzero(mask[:, 1:] == 0), strict=True):  # column j + 1 is not scored
    changed_logits[i, j] = np.random.default_rng(j).normal(size=logits.shape[-1]) * 10
    changed_tokens[i, j + 1] = (tokens[i, j + 1] + 1) % logits.shape[-1]
  np.testing.assert_allclose(
    alg.masked_token_nll(changed_logits, changed_tokens, mask), loss, rtol=1e-6
  )
  assert float(alg.masked_token_nll(logits, tokens, np.zeros_like(mask))) == 0.0


def test_bradley_terry_loss_and_accuracy_match_numpy():
  rng = np.random.default_rng(1)
  chosen, rejected = rng.normal(size=6).astype(np.float32), rng.normal(size=6).astype(np.float32)
  chosen[4] = rejected[4]  # a tie counts as wrong
  valid = np.array([1, 1, 0, 1, 1, 1], np.float32)
  keep = valid > 0
  expected = np.mean(np.log1p(np.exp(-(chosen - rejected).astype(np.float64)))[keep])
  np.testing.assert_allclose(alg.bradley_terry_loss(chosen, rejected, valid), expected, rtol=1e-5)
  np.testing.assert_allclose(
    alg.preference_accuracy(chosen, rejected, valid), np.mean((chosen > rejected)[keep])
  )
  # Stable at huge margins: -log sigmoid(-1000) = 1000, not inf.
  big = alg.bradley_terry_loss(jnp.array([0.0, 1000.0]), jnp.array([1000.0, 0.0]), jnp.ones(2))
  np.testing.assert_allclose(big, 500.0, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The SFT loss on the model.


@pytest.fixture(scope="module")
def lm_params():
  return jax.jit(functools.partial(models.init_params, CONFIG, "lm"))(jax.random.key(0))


def _sft_batch(b=4, prompt=6, response=5, s=16, seed=0):
  rng = np.random.default_rng(seed)
  tokens = np.full((b, s), 258, np.int32)
  tokens[:, : prompt + response] = rng.integers(0, 256, (b, prompt + response))
  attention = np.zeros((b, s), np.int32)
  attention[:, : prompt + response] = 1
  loss_mask = np.zeros((b, s), np.float32)
  loss_mask[:, prompt : prompt + response] = 1
  return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask}


def test_sft_loss_is_the_response_nll_and_ignores_padding(lm_params):
  batch = _sft_batch()
  loss, metrics = sft.sft_loss(lm_params, batch, config=CONFIG)
  logits = np.asarray(models.forward_logits(CONFIG, lm_params, batch["tokens"]))
  nll, accuracy = _numpy_nll_and_accuracy(logits, batch["tokens"], batch["loss_mask"])
  np.testing.assert_allclose(loss, nll, rtol=1e-4)
  np.testing.assert_allclose(metrics["token_accuracy"], accuracy, atol=1e-6)
  padded = {**batch, "tokens": batch["tokens"].copy()}
  padded["tokens"][:, 12:] = 7  # pad columns: neither attended to nor scored
  np.testing.assert_allclose(sft.sft_loss(lm_params, padded, config=CONFIG)[0], loss, rtol=1e-6)


def test_sft_loss_scores_response_tokens_not_prompt_tokens(lm_params):
  batch = _sft_batch()
  loss = float(sft.sft_loss(lm_params, batch, config=CONFIG)[0])
  response = {**batch, "tokens": batch["tokens"].copy()}
  response["tokens"][:, 8] = (response["tokens"][:, 8] + 1) % 256
  assert abs(float(sft.sft_loss(lm_params, response, config=CONFIG)[0]) - loss) > 1e-4
  # Marking prompt tokens as targets changes the loss: the default mask really excludes them.
  with_prompt = {**batch, "loss_mask": batch["attention_mask"].astype(np.float32)}
  assert abs(float(sft.sft_loss(lm_params, with_prompt, config=CONFIG)[0]) - loss) > 1e-4


def test_preference_loss_scores_last_real_tokens_in_one_forward(lm_params):
  # A value model is the trunk plus a value head (no second initialisation to compile).
  params = {k: v for k, v in lm_params.items() if k != "lm_head"}
  params["value_head"] = jax.random.normal(jax.random.key(2), (CONFIG.hidden_size,))
  a, b = _sft_batch(seed=1), _sft_batch(seed=2)
  b["attention_mask"][:, 9:] = 0  # rejected sequences shorter
  batch = {
    "chosen_tokens": a["tokens"],
    "chosen_mask": a["attention_mask"],
    "rejected_tokens": b["tokens"],
    "rejected_mask": b["attention_mask"],
    "valid": np.array([1, 1, 1, 0], np.float32),
  }
  loss, metrics = reward_model.preference_loss(params, batch, config=CONFIG)
  values_a = models.forward_values(CONFIG, params, a["tokens"], a["attention_mask"])
  values_b = models.forward_values(CONFIG, params, b["tokens"], b["attention_mask"])
  chosen, rejected = np.asarray(values_a[:, 10]), np.asarray(values_b[:, 8])
  margin = (chosen - rejected)[:3]
  np.testing.assert_allclose(loss, np.mean(np.log1p(np.exp(-margin))), rtol=1e-4)
  np.testing.assert_allclose(metrics["accuracy"], np.mean(margin > 0))
  np.testing.assert_allclose(metrics["ties"], np.mean(margin == 0))


# ---------------------------------------------------------------------------------------------
# One SFT step on 1 device equals the step on 8 (fsdp=4 x tensor=2).


def _one_step(spec: RoleSpec, params, batch):
  runtime = RoleRuntime.create(Role.ACTOR, spec, CONFIG, "lm")
  tx = optax.sgd(0.5)  # params move by the gradient itself (Adam's first step is ~sign(g))
  loss_fn = functools.partial(sft.sft_loss, config=CONFIG)
  shardings = runtime.train_state_shardings(tx)
  state = jax.jit(init_train_state, static_argnums=1, out_shardings=shardings)(
    jax.device_put(params, runtime.param_shardings), tx
  )
  micro = steps.split_micro_batches(batch, 2)
  batch_shardings = runtime.batch_shardings(micro, leading=1)
  step = jax.jit(
    functools.partial(steps.accumulate_and_apply, loss_fn, tx),
    in_shardings=(shardings, batch_shardings),
    out_shardings=(shardings, runtime.replicated),
    donate_argnums=0,
  )
  new_state, metrics = step(state, jax.device_put(micro, batch_shardings))
  return runtime, new_state, metrics


def test_sft_step_on_one_device_equals_step_on_eight(lm_params):
  batch = _sft_batch(b=8)
  _, one, m1 = _one_step(RoleSpec.training([0]), lm_params, batch)
  runtime, eight, m8 = _one_step(RoleSpec.training(range(8), fsdp=4, tensor=2), lm_params, batch)
  np.testing.assert_allclose(m1["loss"], m8["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m8["grad_norm"], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
  kernel = eight.params["layers"]["mlp"]["up_proj"]["kernel"]
  assert kernel.sharding == runtime.param_shardings["layers"]["mlp"]["up_proj"]["kernel"]
  assert len({s.device for s in kernel.addressable_shards}) == 8
  assert {d.id for d in one.params["embedding"].sharding.device_set} == {0}
