"""Packed micro-batches on the devices: per-sequence sums and scores, and gradient accumulation.

A packed micro-batch (`rlhfjax.data.packed_batches.micro_batch_arrays`) is `[r, w]` rows of
several sequences end to end, `slot_seq` naming the batch row each slot's prediction belongs
to, `slot_weight` its weight, and `[B]` `last_slot` indices. Its loss is a *contribution* to the
batch's loss, already weighted as the batch's aggregation asks (a token-mean's `1 / N` tokens
of the whole batch, a pair-mean's `1 / N` pairs), so the batch's loss and gradients are the
plain sums over micro-batches however the samples fell into them. Micro-batches differ in row
count (a few buckets), so they run as separate calls of one compiled program per bucket
(`accumulate`) and the optimizer applies the sum once (`apply`).

Letters: r rows, w width, B sequences of the batch, g pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rlhfjax import models
from rlhfjax.config.model import ModelConfig
from rlhfjax.training import steps
from rlhfjax.training.state import TrainState

Batch = dict[str, jax.Array]


def sequence_logprobs(config: ModelConfig, params: Any, micro: Batch) -> jax.Array:
  """`sum_j weight_j log p(x_j | x_<j)` of every batch row in the micro-batch, `[B]` (0 for
  rows not in it): the padded `alg.sequence_logprobs` summed by segment."""
  stats = models.packed_token_stats(
    config, params, micro["tokens"], micro["positions"], micro["segments"]
  )
  b = micro["last_slot"].shape[0]
  sums = jax.ops.segment_sum(
    (stats.logp_bt * micro["slot_weight"]).reshape(-1),
    micro["slot_seq"].reshape(-1),
    num_segments=b + 1,  # the last collects the slots that predict nothing (weight 0)
  )
  return sums[:b]


def last_token_values(config: ModelConfig, params: Any, micro: Batch) -> jax.Array:
  """The value head's output at each batch row's last real token, `[B]` (meaningless for rows
  not in the micro-batch): the padded `models.sequence_reward`."""
  values_rw = models.forward_packed(
    config, params, micro["tokens"], micro["positions"], micro["segments"], head="value"
  )
  return values_rw.astype(jnp.float32).reshape(-1)[micro["last_slot"]]


def pair_scale(micro: Batch) -> tuple[jax.Array, jax.Array]:
  """`(member_g, scale)` of a micro-batch's pairs, `pair_weight` being `1 / N` valid pairs of
  the batch on the valid pairs of this micro-batch: a mean over the members times `scale`
  (their share of the batch's valid pairs) is the micro-batch's contribution to the batch's
  pair mean."""
  weight_g = micro["pair_weight"]
  return (weight_g > 0).astype(jnp.float32), jnp.sum(weight_g)


LossFn = Callable[[Any, Batch], tuple[jax.Array, dict[str, jax.Array]]]


def zeros(loss_fn: LossFn, params: Any, micro: Batch) -> dict[str, Any]:
  """An empty accumulator for `loss_fn`: float32 gradients and its metrics, all zero."""
  _, metrics = jax.eval_shape(loss_fn, params, micro)
  return {
    "grads": steps.zero_gradients(params),
    "metrics": jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), metrics),
  }


def accumulate(loss_fn: LossFn, params: Any, acc: dict[str, Any], micro: Batch) -> dict[str, Any]:
  """`acc` plus one micro-batch's gradients and metrics (contributions, summed;
  `steps.add_gradients`): a non-finite loss poisons the gradients, so the update is skipped."""
  grads, metrics = steps.add_gradients(loss_fn, params, (acc["grads"], acc["metrics"]), micro)
  return {"grads": grads, "metrics": metrics}


def apply(
  tx: optax.GradientTransformation, state: TrainState, acc: dict[str, Any]
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update with the accumulated gradients (`steps.apply_gradients`: the padded
  step's finite check, skipped update and metrics)."""
  return steps.apply_gradients(tx, state, acc["grads"], acc["metrics"])
