"""Fused scoring: score finished samples in micro-batches while the rest are still generating.

`score_stream` takes a stream of finished requests (`rlhfjax.rollout.streaming.RolloutStream`)
and calls a scorer on each full micro-batch as soon as it is complete. A scorer that dispatches
a jitted program on its own mesh returns at once, so its work runs:

* at the same time as the next decode chunk when the scorer's devices are not the rollout's
  (disaggregated or interleaved placements);
* between decode chunks when they share devices (co-located): JAX runs programs on a device in
  the order they were dispatched.

The scores are put back in the input order on device at the end (one gather), so they equal
scoring the whole batch after generation row for row. Advantages, which need the whole batch (or
group), start from that result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax import algorithms, models
from rlhfjax.config.model import ModelConfig
from rlhfjax.rollout.streaming import Finished


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatch:
  """`size` finished samples to score (host arrays); rows past `num_real` repeat real rows."""

  indices: np.ndarray
  """[size] int: each row's position in the input prompts."""
  tokens: np.ndarray
  """[size, r] int32 response tokens, padded past each length."""
  logprobs: np.ndarray
  """[size, r] float32 rollout log-probs."""
  lengths: np.ndarray
  """[size] int32 response lengths."""
  stopped: np.ndarray
  """[size] bool."""
  num_real: int


FIELDS = ("indices", "tokens", "logprobs", "lengths", "stopped")


@jax.jit
def in_order(parts: tuple[Any, ...], rows_n: jax.Array) -> Any:
  """Concatenates the micro-batches' results and picks row `rows_n[i]` for sample `i`."""
  return jax.tree.map(lambda *xs: jnp.take(jnp.concatenate(xs), rows_n, axis=0), *parts)


def score_stream(
  finished: Iterable[Finished],
  scorer: Callable[[MicroBatch], Any],
  *,
  num_samples: int,
  micro_batch: int,
  on_score: Callable[[MicroBatch], None] | None = None,
) -> Any:
  """Runs `scorer` on micro-batches of samples as they finish; returns scores in input order.

  Args:
    finished: The stream (each sample `0 .. num_samples - 1` exactly once).
    scorer: Maps a `MicroBatch` of `micro_batch` rows to a pytree of arrays with `micro_batch`
      leading rows. Called with one shape only, so a jitted scorer compiles once.
    num_samples: Samples the stream hands out.
    micro_batch: Rows per scorer call; the last call is padded with repeated rows.
    on_score: Called with each micro-batch right after its scorer call was dispatched (for
      timelines and tests).

  Returns:
    The scorer's pytree with `num_samples` rows, row `i` for sample `i`, where the scorer put it.

  Raises:
    ValueError: If the stream hands out a sample twice, one outside the range, or misses one.
  """
  if micro_batch < 1 or num_samples < 1:
    raise ValueError(f"micro_batch and num_samples must be >= 1, got {micro_batch}, {num_samples}")
  seen = np.zeros(num_samples, bool)
  rows_n = np.zeros(num_samples, np.int32)
  buffered: list[Finished] = []
  parts = []

  def flush(take: int):
    joined = {f: np.concatenate([getattr(b, f) for b in buffered]) for f in FIELDS}
    rest = {f: v[take:] for f, v in joined.items()}
    pick = np.minimum(np.arange(micro_batch), take - 1)  # pad by repeating the last real row
    batch = MicroBatch(**{f: v[pick] for f, v in joined.items()}, num_real=take)
    rows_n[batch.indices[:take]] = len(parts) * micro_batch + np.arange(take)
    parts.append(scorer(batch))
    if on_score is not None:
      on_score(batch)
    buffered.clear()
    if len(rest["indices"]):
      buffered.append(Finished(**rest))

  for done in finished:
    idx = np.asarray(done.indices)
    if idx.min(initial=0) < 0 or idx.max(initial=0) >= num_samples or seen[idx].any():
      raise ValueError(f"the stream handed out samples {idx.tolist()} twice or out of range")
    if len(set(idx.tolist())) != len(idx):
      raise ValueError(f"the stream handed out samples {idx.tolist()} twice")
    seen[idx] = True
    buffered.append(done)
    while sum(len(b.indices) for b in buffered) >= micro_batch:
      flush(micro_batch)
  if buffered:
    flush(sum(len(b.indices) for b in buffered))
  if not seen.all():
    raise ValueError(f"the stream never handed out samples {np.flatnonzero(~seen).tolist()}")
  return in_order(tuple(parts), rows_n)


def logprob_scorer(
  model_config: ModelConfig,
  params: Any,
  mesh: Mesh,
  prompts: list[np.ndarray],
  width: int,
) -> Callable[[MicroBatch], jax.Array]:
  """A scorer of the log-prob of every response token under `params` (say the reference's).

  Sequences are `[prompt left padded to the longest prompt | response right padded]`, the
  response part as wide as the smallest power of two (at least 8, at most `width`) that holds
  the batch's longest response: a micro-batch of short early finishers costs a short forward.
  Rows go over `mesh`'s 'data' axis when they divide it, else are replicated. The result is
  `[rows, width]` float32 on `mesh`, 0 past each response. One compiled program per (row count,
  response bucket).
  """
  p = max(len(q) for q in prompts)
  data = dict(mesh.shape).get("data", 1)
  params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))

  @jax.jit
  def logprobs(params, tokens_bs, mask_bs):
    logits_btv = models.forward_logits(model_config, params, tokens_bs, mask_bs)[:, p - 1 : -1]
    logp_bt = algorithms.token_logprobs(logits_btv, tokens_bs[:, p:]) * mask_bs[:, p:]
    return jnp.pad(logp_bt, ((0, 0), (0, width - logp_bt.shape[1])))

  def score(batch: MicroBatch) -> jax.Array:
    rows, longest = len(batch.indices), int(np.max(batch.lengths))
    bucket = min(width, max(8, 1 << max(0, longest - 1).bit_length()))
    tokens = np.zeros((rows, p + bucket), np.int32)
    mask = np.zeros_like(tokens)
    for row, (i, n) in enumerate(zip(batch.indices, batch.lengths, strict=True)):
      q = prompts[i]
      tokens[row, p - len(q) : p], mask[row, p - len(q) : p + n] = q, 1
      tokens[row, p : p + n] = batch.tokens[row, :n]
    spec = PartitionSpec("data") if rows % data == 0 else PartitionSpec()
    return logprobs(params, *jax.device_put((tokens, mask), NamedSharding(mesh, spec)))

  return score
