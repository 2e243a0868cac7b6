"""Packed scoring and updates of the PPO family (`ppo.packing`) against the padded ones.

Function level: the packed scorers' log-probs, values and sequence scores, unpacked, and the
packed actor and critic losses, metrics and gradients, summed over micro-batches, equal the
padded ones (one micro-batch: the whole mini-batch) within 1e-5 in float32, for every loss
aggregation; two packings of the same samples give the same gradients. Flow level (every
PPO-family flow's metrics over two iterations against the padded run's): test_packing_runs.py.

Tolerances: the tiny model's sums run over 56 hidden units, 152 MLP units and at most 16 keys in
float32 (unit roundoff 6e-8); packed and padded differ only in the order of those sums (a
sample's keys sit between other segments' masked zeros), so each result moves by a few ulps of
its size: log-probs near -ln(328) ~ -5.8 by ~1e-6, losses of size ~1 by ~1e-6. 1e-5 is the
issue's bound and holds with a margin of 10.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax import models
from rlhfjax.config.model import get_model_config
from rlhfjax.flows import experience, packed
from rlhfjax.training import steps

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny")
P, T = 6, 10
W = P + T
B = 8


def _seqs(seed: int = 0, conversations: bool = False) -> experience.Sequences:
  """B samples of very different prompt and response lengths (1 to the capacity);
  `conversations`: some responses hold observations (out of the response mask)."""
  rng = np.random.default_rng(seed)
  prompt_n = np.array([1, P, 3, 2, P, 4, 1, 5])
  response_n = np.array([T, 1, 4, T, 2, 7, 1, 3])
  prompts = [rng.integers(3, CONFIG.vocab_size, n) for n in prompt_n]
  responses = rng.integers(3, CONFIG.vocab_size, (B, T)).astype(np.int32)
  observed = np.zeros((B, T), bool)
  if conversations:  # observations mid-response, at the start and at the end of a sample
    observed[0, 3:6], observed[3, 1:4], observed[3, 7:9], observed[5, 2] = True, True, True, True
  return experience.assemble(
    prompts,
    responses,
    response_n,
    np.zeros((B, T), np.float32),
    prompt_len=P,
    response_len=T,
    pad_id=0,
    observed=observed if conversations else None,
  )


def _params(head="lm", seed=0):
  return models.init_params(CONFIG, head, jax.random.key(seed))


_response_logprobs = jax.jit(functools.partial(steps.response_logprobs, CONFIG, prompt_len=P))
_response_values = jax.jit(functools.partial(steps.response_values, CONFIG, prompt_len=P))
_sequence_scores = jax.jit(functools.partial(steps.sequence_scores, CONFIG))
_packed_logp = jax.jit(lambda p, *rows: models.packed_token_stats(CONFIG, p, *rows).logp_bt)
_packed_values = jax.jit(lambda p, *rows: models.forward_packed(CONFIG, p, *rows, head="value"))


def _padded_fields(params, seqs, seed=1):
  """The padded actor/critic batch: tokens, masks and random update fields."""
  rng = np.random.default_rng(seed)
  tokens, attention = jnp.asarray(seqs.tokens_bs), jnp.asarray(seqs.attention_mask_bs)
  mask = jnp.asarray(seqs.response_mask_bt)
  logp = _response_logprobs(params, tokens, attention)
  noise = lambda scale: jnp.asarray(rng.normal(0, scale, (B, T)).astype(np.float32))
  return {
    "tokens": tokens,
    "attention_mask": attention,
    "response_mask": mask,
    "old_logprobs": logp + noise(0.5),  # ratios far from 1: clipping is exercised
    # The rollout correction's weights (`alg.rollout_correction`): 'tis' of these ratios.
    "is_weights": jnp.minimum(jnp.exp(noise(0.3)), 1.2) * mask,
    "ref_logprobs": logp + noise(0.2),
    "advantages": noise(1.0) * mask,
    "returns": noise(1.0) * mask,
    "old_values": noise(0.5) * mask,
  }


def _packed_micro_batches(fields, seqs, aggregation, max_rows):
  parts = packed.layouts(seqs, np.arange(B), W, max_rows, 1)
  index = packed.micro_batch_index(parts, np.arange(B), seqs.response_mask_bt, aggregation)
  per_token = {k: v for k, v in fields.items() if k not in ("attention_mask", "response_mask")}
  return [packed.gather_micro_batch(per_token, jax.tree.map(jnp.asarray, i)) for i in index]


def _summed(loss_fn, params, micros):
  """Loss, metrics and gradients summed over packed micro-batches (one compiled gradient per
  micro-batch shape: op by op, each of the model's operations would compile on its own)."""
  grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  total = None
  for micro in micros:
    (loss, metrics), grads = grad(params, micro)
    out = (loss, metrics, grads)
    total = out if total is None else jax.tree.map(jnp.add, total, out)
  return total


def _assert_trees_close(a, b, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


def _grad_atol(grads):
  """1e-5 of the largest gradient entry: the bound on a float32 sum's reordering."""
  return 1e-5 * max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))


def test_packed_scores_unpack_to_the_padded_ones():
  seqs = _seqs()
  lm, value = _params(), _params("value", 1)
  tokens, attention = jnp.asarray(seqs.tokens_bs), jnp.asarray(seqs.attention_mask_bs)
  mask = seqs.response_mask_bt > 0
  want = {
    "logp": np.asarray(_response_logprobs(lm, tokens, attention)),
    "values": np.asarray(_response_values(value, tokens, attention)),
    "scores": np.asarray(_sequence_scores(value, tokens, attention)),
  }
  _, response_n = packed.lengths(seqs)
  # Two rows per call: the samples spread over several calls, as a long batch's do.
  parts = packed.layouts(seqs, np.arange(B), W, 2, 1)
  assert len(parts) > 1
  got = {"logp": jnp.zeros((B, T)), "values": jnp.zeros((B, T)), "scores": jnp.zeros(B)}
  for idx, lay in parts:
    rows = [jnp.asarray(x) for x in (lay.take(seqs.tokens_bs), lay.positions, lay.segments)]
    base_b, last_b = np.full(B, -1, np.int32), np.full(B, -1, np.int32)
    base_b[idx], last_b[idx] = lay.response_slot[:, 0], lay.last_slot
    logp = _packed_logp(lm, *rows)
    values = _packed_values(value, *rows)
    got["logp"] = packed.unpack_response(got["logp"], logp, base_b, response_n)
    got["values"] = packed.unpack_response(got["values"], values, base_b, response_n)
    got["scores"] = packed.unpack_last(got["scores"], values, last_b)
  for name in ("logp", "values"):
    np.testing.assert_allclose(np.asarray(got[name])[mask], want[name][mask], atol=1e-5)
    assert not np.asarray(got[name])[~mask].any()  # nothing outside the responses
  np.testing.assert_allclose(np.asarray(got["scores"]), want["scores"], atol=1e-5)


@pytest.mark.parametrize(
  ("aggregation", "policy_loss", "conversations"),
  [
    ("token_mean", "ppo", False),
    ("seq_mean_token_mean", "ppo", False),
    ("seq_mean_token_sum_norm", "ppo", False),
    # GSPO reads each sequence's mean log-ratio: over packed segments as over padded rows.
    ("seq_mean_token_mean", "gspo", False),
    ("token_mean", "cispo", False),
    # Observations are out of the loss, packed as padded (weights 0 where the mask is).
    ("token_mean", "ppo", True),
    ("seq_mean_token_mean", "gspo", True),
  ],
)
def test_packed_actor_loss_and_gradients_equal_the_padded_ones(
  aggregation, policy_loss, conversations
):
  seqs, params = _seqs(conversations=conversations), _params()
  fields = _padded_fields(params, seqs)
  options = dict(
    clip_eps=0.2,
    entropy_coef=0.01,
    clip_eps_high=0.28,
    kl_loss_coef=0.05,
    kl_estimator="k3",
    policy_loss=policy_loss,
  )
  padded_loss = functools.partial(
    steps.actor_loss, config=CONFIG, prompt_len=P, loss_agg=aggregation, **options
  )
  (loss, metrics), grads = jax.jit(jax.value_and_grad(padded_loss, has_aux=True))(params, fields)
  micros = _packed_micro_batches(fields, seqs, aggregation, max_rows=2)
  assert len(micros) > 1
  packed_loss = functools.partial(steps.packed_actor_loss, config=CONFIG, **options)
  p_loss, p_metrics, p_grads = _summed(packed_loss, params, micros)
  np.testing.assert_allclose(p_loss, loss, atol=1e-5)
  assert set(p_metrics) == set(metrics)
  for key in metrics:
    np.testing.assert_allclose(p_metrics[key], metrics[key], atol=1e-5, err_msg=key)
  assert float(metrics["policy/clipfrac"]) > 0  # the clip is exercised
  _assert_trees_close(p_grads, grads, _grad_atol(grads))


@pytest.mark.parametrize("conversations", [False, True])
def test_packed_critic_loss_and_gradients_equal_the_padded_ones(conversations):
  seqs, params = _seqs(conversations=conversations), _params("value", 2)
  fields = _padded_fields(_params(), seqs)
  padded_loss = functools.partial(steps.critic_loss, config=CONFIG, prompt_len=P, clip_eps=0.2)
  (loss, metrics), grads = jax.jit(jax.value_and_grad(padded_loss, has_aux=True))(params, fields)
  micros = _packed_micro_batches(fields, seqs, "token_mean", max_rows=3)
  packed_loss = functools.partial(steps.packed_critic_loss, config=CONFIG, clip_eps=0.2)
  p_loss, p_metrics, p_grads = _summed(packed_loss, params, micros)
  np.testing.assert_allclose(p_loss, loss, atol=1e-5)
  # A token whose value moved by within 1e-5 (the bound on packed against padded values) of
  # the clip range may be clipped in one and not the other: each such token may flip.
  values = _response_values(params, fields["tokens"], fields["attention_mask"])
  mask = np.asarray(fields["response_mask"]) > 0
  moved = np.abs(np.asarray(values) - np.asarray(fields["old_values"]))[mask]
  ambiguous = np.sum(np.abs(moved - 0.2) <= 1e-5)
  assert abs(float(p_metrics["value/clipfrac"]) - float(metrics["value/clipfrac"])) <= (
    ambiguous / mask.sum() + 1e-6
  )
  assert 0 < float(metrics["value/clipfrac"]) < 1  # the clip is exercised
  _assert_trees_close(p_grads, grads, _grad_atol(grads))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_two_packings_give_the_same_gradients(aggregation):
  """One sample per row-ish (1-row micro-batches) against everything in one micro-batch: the
  samples fall into micro-batches differently, the weighted sums do not care."""
  seqs, params = _seqs(3), _params()
  fields = _padded_fields(params, seqs, seed=4)
  loss = functools.partial(steps.packed_actor_loss, config=CONFIG, clip_eps=0.2, entropy_coef=0.0)
  one = _packed_micro_batches(fields, seqs, aggregation, max_rows=1)
  whole = _packed_micro_batches(fields, seqs, aggregation, max_rows=B)
  assert len(one) > len(whole) == 1
  l1, _, g1 = _summed(loss, params, one)
  l2, _, g2 = _summed(loss, params, whole)
  np.testing.assert_allclose(l1, l2, atol=1e-6)
  _assert_trees_close(g1, g2, _grad_atol(g2))


def test_aggregation_weights_reproduce_each_aggregation():
  """NumPy reference: the weighted token sum is each aggregation of the padded batch."""
  from rlhfjax import algorithms as alg

  rng = np.random.default_rng(0)
  lengths = np.array([1, 5, 10, 3])
  mask = (np.arange(10)[None] < lengths[:, None]).astype(np.float32)
  x = rng.normal(size=(4, 10)).astype(np.float32)
  for name, fn in alg.LOSS_AGGREGATIONS.items():
    w = alg.aggregation_weights(name, lengths, 10)
    np.testing.assert_allclose(np.sum(w[:, None] * x * mask), fn(x, mask), rtol=1e-6)
