"""Pure PPO step functions: scoring of experience and actor / critic train steps.

Letters: b batch, p prompt length, t response length, s = p + t sequence length, v vocab,
m micro-batches. A sequence is its prompt, left-padded to `p`, followed by its response,
right-padded to `t`; `attention_mask_bs` marks real tokens and `response_mask_bt` real response
tokens. The logits at column `p - 1 + j` predict response token `j`, and the critic's value of
response token `j` is read at the same column (the state before the token is chosen).

Every function here is pure and compiled once by its caller with explicit shardings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rlhfjax import algorithms as alg
from rlhfjax import models
from rlhfjax.config.model import ModelConfig
from rlhfjax.models import lora
from rlhfjax.training.state import TrainState

Batch = dict[str, jax.Array]


def _response_slice(x_bs: jax.Array, prompt_len: int) -> jax.Array:
  """Columns `p - 1 .. s - 2`: the predictions (and values) for the response tokens."""
  return x_bs[:, prompt_len - 1 : -1]


def response_logprobs(
  config: ModelConfig,
  params: Any,
  tokens_bs: jax.Array,
  attention_mask_bs: jax.Array,
  prompt_len: int,
  temperature: float = 1.0,
) -> jax.Array:
  """`log pi(token_j | prefix)` for every response token `j`, `[b, t]`."""
  return models.token_stats(
    config, params, tokens_bs, attention_mask_bs, prompt_len, temperature
  ).logp_bt


def response_values(
  config: ModelConfig,
  params: Any,
  tokens_bs: jax.Array,
  attention_mask_bs: jax.Array,
  prompt_len: int,
) -> jax.Array:
  """The critic's value of each response token's state, `[b, t]`."""
  values_bs = models.forward_values(config, params, tokens_bs, attention_mask_bs)
  return _response_slice(values_bs, prompt_len)


def sequence_scores(
  config: ModelConfig, params: Any, tokens_bs: jax.Array, attention_mask_bs: jax.Array
) -> jax.Array:
  """The reward model's score of each whole sequence: its value at the last real token."""
  values_bs = models.forward_values(config, params, tokens_bs, attention_mask_bs)
  return models.sequence_reward(values_bs, attention_mask_bs)


# ---------------------------------------------------------------------------------------------
# Losses of one micro-batch.


def actor_loss(
  params: Any,
  batch: Batch,
  *,
  config: ModelConfig,
  prompt_len: int,
  clip_eps: float,
  entropy_coef: float,
  temperature: float = 1.0,
  clip_eps_high: float | None = None,
  loss_agg: str = "token_mean",
  kl_loss_coef: float = 0.0,
  kl_estimator: str = "k3",
  policy_loss: str = "ppo",
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped policy loss (`policy_loss` of `alg.POLICY_LOSSES`) minus `entropy_coef` times the
  mean entropy of the response tokens, plus `kl_loss_coef` times the KL to the reference
  (`batch['ref_logprobs']`) when non-zero.

  The policy and KL terms reduce over tokens as `loss_agg` says (`alg.LOSS_AGGREGATIONS`).
  Log-probs and entropy are chunked over the sequence when `config.logprob_chunk_size` is set
  (no [b, t, v] logits).
  """
  token = models.token_stats(
    config, params, batch["tokens"], batch["attention_mask"], prompt_len, temperature
  )
  logp_bt = token.logp_bt
  mask_bt = batch["response_mask"]
  policy_loss, stats = alg.clipped_policy_loss(
    logp_bt,
    batch["old_logprobs"],
    batch["advantages"],
    mask_bt,
    clip_eps=clip_eps,
    weights_bt=batch.get("is_weights"),
    clip_eps_high=clip_eps_high,
    aggregation=loss_agg,
    loss=policy_loss,
  )
  entropy = alg.masked_mean(token.entropy_bt, mask_bt)
  metrics = {
    "loss/policy": policy_loss,
    "policy/entropy": entropy,
    "policy/clipfrac": stats["clipfrac"],
    "policy/approx_kl": stats["approx_kl"],
  }
  loss = policy_loss - entropy_coef * entropy
  if kl_loss_coef:
    kl_bt = alg.get_kl_estimator(kl_estimator)(logp_bt, batch["ref_logprobs"])
    kl = alg.LOSS_AGGREGATIONS[loss_agg](kl_bt, mask_bt)
    metrics["loss/kl"] = kl
    loss = loss + kl_loss_coef * kl
  return loss, metrics


def critic_loss(
  params: Any, batch: Batch, *, config: ModelConfig, prompt_len: int, clip_eps: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
  values_bt = response_values(config, params, batch["tokens"], batch["attention_mask"], prompt_len)
  loss, stats = alg.clipped_value_loss(
    values_bt, batch["old_values"], batch["returns"], batch["response_mask"], clip_eps=clip_eps
  )
  return loss, {"loss/value": loss, "value/clipfrac": stats["clipfrac"]}


# ---------------------------------------------------------------------------------------------
# Losses of one packed micro-batch (`rlhfjax.data.packing`).
#
# Leaves are `[r, w]` packed rows: 'tokens', 'positions', 'segments', and per slot (slot `c`
# predicts token `c + 1`) the response fields and two weights, 0 where the slot predicts no
# response token: 'weights', the loss aggregation's (`alg.aggregation_weights` over the whole
# mini-batch), and 'token_weights', 1 / the mini-batch's response tokens (the token means
# metrics report). Losses and metrics are weighted sums, so a mini-batch's are the sums of its
# micro-batches' whichever way its samples were packed.


def packed_sequence_mean(segments_rw: jax.Array, response_rw: jax.Array):
  """`sequence_mean` (`alg.PolicyLoss.terms`) of packed rows: each response slot gets the mean
  over its segment's response slots (a sample lies within one row; `segments` numbers a row's
  samples 1, 2, ... and 0 on empty slots)."""
  r, w = segments_rw.shape
  ids = (segments_rw + jnp.arange(r, dtype=segments_rw.dtype)[:, None] * (w + 1)).reshape(-1)
  response = response_rw.astype(jnp.float32).reshape(-1)
  count = jax.ops.segment_sum(response, ids, num_segments=r * (w + 1))

  def mean(x_rw):
    total = jax.ops.segment_sum(x_rw.reshape(-1) * response, ids, num_segments=r * (w + 1))
    return (total / jnp.maximum(count, 1.0))[ids].reshape(r, w)

  return mean


def packed_actor_loss(
  params: Any,
  batch: Batch,
  *,
  config: ModelConfig,
  clip_eps: float,
  entropy_coef: float,
  temperature: float = 1.0,
  clip_eps_high: float | None = None,
  kl_loss_coef: float = 0.0,
  kl_estimator: str = "k3",
  policy_loss: str = "ppo",
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`actor_loss` of a packed micro-batch, as its share of the mini-batch's loss."""
  token = models.packed_token_stats(
    config, params, batch["tokens"], batch["positions"], batch["segments"], temperature
  )
  w, tw = batch["weights"], batch["token_weights"]
  per_token, terms = alg.policy_token_terms(
    token.logp_bt,
    batch["old_logprobs"],
    batch["advantages"],
    clip_eps=clip_eps,
    weights_bt=batch.get("is_weights"),
    clip_eps_high=clip_eps_high,
    loss=policy_loss,
    sequence_mean=packed_sequence_mean(batch["segments"], tw > 0),
  )
  policy_loss = jnp.sum(w * per_token)
  entropy = jnp.sum(tw * token.entropy_bt)
  metrics = {
    "loss/policy": policy_loss,
    "policy/entropy": entropy,
    "policy/clipfrac": jnp.sum(tw * terms["clipped"]),
    "policy/approx_kl": jnp.sum(tw * terms["approx_kl"]),
  }
  loss = policy_loss - entropy_coef * entropy
  if kl_loss_coef:
    kl = jnp.sum(w * alg.get_kl_estimator(kl_estimator)(token.logp_bt, batch["ref_logprobs"]))
    metrics["loss/kl"] = kl
    loss = loss + kl_loss_coef * kl
  return loss, metrics


def packed_critic_loss(
  params: Any, batch: Batch, *, config: ModelConfig, clip_eps: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`critic_loss` of a packed micro-batch, as its share of the mini-batch's loss."""
  values = models.forward_packed(
    config, params, batch["tokens"], batch["positions"], batch["segments"], head="value"
  )
  err, clipped = alg.value_token_terms(
    values, batch["old_values"], batch["returns"], clip_eps=clip_eps
  )
  tw = batch["token_weights"]
  loss = 0.5 * jnp.sum(tw * err)
  return loss, {"loss/value": loss, "value/clipfrac": jnp.sum(tw * clipped)}


# ---------------------------------------------------------------------------------------------
# Train steps with gradient accumulation.


LossFn = Callable[[Any, Batch], tuple[jax.Array, dict[str, jax.Array]]]


def accumulate_and_apply(
  loss_fn: LossFn, tx: optax.GradientTransformation, state: TrainState, batch: Batch
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update from a mini-batch split into micro-batches.

  An update whose loss or gradients are not finite is skipped by the optimizer (parameters and
  moments unchanged) and reported as `skipped` = 1.

  `batch` leaves have a leading micro-batch axis `[m, ...]`; gradients are averaged over the
  `m` micro-batches by a `lax.scan`, so only one micro-batch of activations is live at a time.
  """
  trained, frozen = lora.split(state.params)
  grad_fn = jax.value_and_grad(lambda t, b: loss_fn(lora.join(t, frozen), b), has_aux=True)

  def micro_step(grads_acc, micro_batch):
    (loss, metrics), grads = grad_fn(trained, micro_batch)
    # A non-finite loss poisons the gradients, so the optimizer's finite check (see
    # `make_optimizer`) skips the update even when the gradients happen to be finite.
    poison = jnp.where(jnp.isfinite(loss), 0.0, jnp.nan)
    grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype) + poison, grads_acc, grads)
    return grads_acc, metrics

  grads_sum, metrics_m = jax.lax.scan(micro_step, zero_gradients(state.params), batch)
  num_micro = jax.tree.leaves(batch)[0].shape[0]
  grads = jax.tree.map(lambda g: g / num_micro, grads_sum)
  return apply_gradients(tx, state, grads, jax.tree.map(jnp.mean, metrics_m))


def zero_gradients(params: Any) -> Any:
  """The float32 gradient accumulator of `params`' trained leaves (`models.lora.split`: all of
  them without adapters), zeroed; None for frozen ones."""
  return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), lora.split(params)[0])


def add_gradients(
  loss_fn: LossFn, params: Any, acc: tuple[Any, dict[str, jax.Array]], micro_batch: Batch
) -> tuple[Any, dict[str, jax.Array]]:
  """`acc` (float32 gradient and metric sums; metrics `{}` at first) plus one micro-batch's.

  For losses that are a micro-batch's share of the mini-batch's (the packed ones): summed, not
  averaged. A non-finite loss poisons the sum, as in `accumulate_and_apply`."""
  grads_acc, metrics_acc = acc
  trained, frozen = lora.split(params)
  (loss, metrics), grads = jax.value_and_grad(
    lambda t: loss_fn(lora.join(t, frozen), micro_batch), has_aux=True
  )(trained)
  poison = jnp.where(jnp.isfinite(loss), 0.0, jnp.nan)
  grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype) + poison, grads_acc, grads)
  if metrics_acc:
    metrics = jax.tree.map(jnp.add, metrics_acc, metrics)
  return grads_acc, metrics


def apply_gradients(
  tx: optax.GradientTransformation, state: TrainState, grads: Any, metrics: dict[str, jax.Array]
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update from float32 gradients; an update whose gradients are not finite is
  skipped by the optimizer (see `make_optimizer`) and reported as `skipped` = 1."""
  trained, frozen = lora.split(state.params)  # only the trained leaves have moments
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trained)
  updates, opt_state = tx.update(grads, state.opt_state, trained)
  params = lora.join(optax.apply_updates(trained, updates), frozen)
  metrics = dict(metrics)
  metrics["grad_norm"] = optax.tree.norm(grads)
  finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
  metrics["grad_finite"] = finite
  metrics["skipped"] = (~finite).astype(jnp.float32)
  new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, metrics


def split_micro_batches(batch: dict[str, Any], micro_batches: int) -> dict[str, Any]:
  """`[b, ...]` arrays to `[m, b / m, ...]`, the layout `accumulate_and_apply` scans."""
  return {k: v.reshape(micro_batches, -1, *v.shape[1:]) for k, v in batch.items()}
