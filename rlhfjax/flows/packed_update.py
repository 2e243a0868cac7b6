"""Packed updates and scoring of one role on the cluster: what DPO, online DPO, SFT and the
reward model share when they pack (`dpo.packing`, `online_dpo.packing`, `supervised.packing`).

The host plans a batch into packed micro-batches (`rlhfjax.data.packed_batches`), uploads each
(rows split over the role's batch axes, per-sequence arrays replicated) and `PackedStep` sums
their gradients with one compiled program per row bucket, then applies one optimizer update
(`rlhfjax.training.packed`). Row counts are multiples of the role's batch shards, so packed rows
split evenly over its devices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax.cluster.cluster import Cluster
from rlhfjax.config import ConfigError
from rlhfjax.mesh import rules
from rlhfjax.placement.spec import Role
from rlhfjax.training import packed
from rlhfjax.training.state import TrainState


def rows_multiple(cluster: Cluster, role: Role) -> int:
  """The product of the mesh axes `role`'s batch rows are split over."""
  rt = cluster.roles[role]
  sizes = dict(rt.mesh.shape)
  return math.prod(sizes.get(a, 1) for a in rules.rules_table(rt.spec.layout)["batch"])


def max_rows(budget: int, width: int, default_rows: int) -> int:
  """Rows of `width` tokens in a token budget (0: `default_rows`, the padded micro-batch's)."""
  return budget // width if budget else default_rows


def upload(cluster: Cluster, role: Role, micros: Sequence[dict[str, np.ndarray]], name: str):
  """Host micro-batches onto `role`'s mesh: `[r, w]` rows split over its batch axes, `[B]`
  per-sequence arrays replicated (one named host transfer)."""
  rows = [{k: v for k, v in m.items() if v.ndim == 2} for m in micros]
  seqs = [{k: v for k, v in m.items() if v.ndim != 2} for m in micros]
  with cluster.host(name):
    rows = cluster.roles[role].put_batch(rows)
    seqs = jax.device_put(seqs, cluster.roles[role].replicated)
  return [{**r, **s} for r, s in zip(rows, seqs, strict=True)]


class PackedStep:
  """`step(state, micros) -> (state, metrics)`: one optimizer update of trained `role` from
  packed micro-batches on its mesh (`loss_fn(params, micro)` gives each one's contribution),
  for `Cluster.update_stage`. Programs are traced per row bucket, counted under `name`_*.

  On a mesh with pipeline stages (`pipelines`: the PPO family's updates) the micro-batches of
  an update run through the stages as one schedule (`Cluster.train_step`): each is padded with
  empty rows to the largest one's row count and their number with empty micro-batches to a
  power of two (one program per pair, a handful), and each contribution is scaled by that
  number, since a pipelined step averages what the packed losses mean to be summed."""

  def __init__(
    self,
    cluster: Cluster,
    role: Role,
    name: str,
    loss_fn: packed.LossFn,
    *,
    field: str,
    pipelines: bool = False,
  ):
    rt, shardings = cluster.roles[role], cluster.state_shardings[role]
    self.stages = rt.spec.stages
    if self.stages > 1:
      if not pipelines:
        # Packed micro-batches differ in rows and run as separate programs; this flow's
        # updates do not stack them into one schedule.
        raise ConfigError(
          f"packed updates of this flow do not run through pipeline stages: set '{field}=False' "
          f"with 'placement.pipeline_stages'={self.stages}"
        )
      self._stacker = Stacker(cluster, role, name)
      self._pipelined = cluster.train_step(f"{name}_pipelined", role, summed(loss_fn))
      return
    acc = {"grads": rt.param_shardings, "metrics": rt.replicated}
    self._zeros = cluster.compile(
      f"{name}_zeros", functools.partial(packed.zeros, loss_fn), out_shardings=acc, role=role
    )
    self._grad = cluster.compile(
      f"{name}_grad",
      functools.partial(packed.accumulate, loss_fn),
      out_shardings=acc,
      donate_argnums=1,
      role=role,
    )
    self._apply = cluster.compile(
      f"{name}_apply",
      functools.partial(packed.apply, cluster.tx[role]),
      in_shardings=(shardings, acc),
      out_shardings=(shardings, rt.replicated),
      donate_argnums=0,
      role=role,
    )

  def __call__(self, state: TrainState, micros: Sequence[dict[str, jax.Array]]):
    if self.stages > 1:
      return self._pipelined(state, self._stacker.stacked(micros))
    acc = self._zeros(state.params, micros[0])
    for micro in micros:
      acc = self._grad(state.params, acc, micro)
    return self._apply(state, acc)


class Stacker:
  """`stacked(micros)`: packed micro-batches on `role`'s mesh as one pipelined mini-batch
  (`stack_micro_batches`), their count rounded up to a power of two; compiled per count."""

  def __init__(self, cluster: Cluster, role: Role, name: str):
    self._compile = functools.partial(cluster.compile, f"{name}_stack", role=role)
    self._programs: dict[int, Callable] = {}

  def stacked(self, micros: Sequence[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    count = 1 << (len(micros) - 1).bit_length()
    if count not in self._programs:
      self._programs[count] = self._compile(functools.partial(stack_micro_batches, count=count))
    return self._programs[count](tuple(micros))


def summed(loss_fn: packed.LossFn) -> packed.LossFn:
  """`loss_fn` with its loss and metrics scaled by the micro-batch's `sum_scale` (the number
  of micro-batches): a pipelined step's average of the scaled contributions is their sum."""

  def scaled(params: Any, micro: dict[str, jax.Array]):
    micro = dict(micro)
    scale = micro.pop("sum_scale")
    loss, metrics = loss_fn(params, micro)
    return loss * scale, jax.tree.map(lambda x: x * scale.astype(x.dtype), metrics)

  return scaled


def stack_micro_batches(
  micros: tuple[dict[str, jax.Array], ...], *, count: int
) -> dict[str, jax.Array]:
  """`[count, ...]` leaves of packed micro-batches: rows (`[r, w]` leaves) padded with empty
  ones to the largest `r`, per-sequence leaves as they are, then empty micro-batches (all
  zeros: no segment, weight 0, contributing nothing) up to `count`; `sum_scale` `[count]` is
  `count` in each."""
  rows = max(m["tokens"].shape[0] for m in micros)

  def pad(x: jax.Array) -> jax.Array:
    if x.ndim != 2:
      return x
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))

  padded = [jax.tree.map(pad, m) for m in micros]
  empty = jax.tree.map(jnp.zeros_like, padded[0])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *padded, *[empty] * (count - len(padded)))
  stacked["sum_scale"] = jnp.full((count,), count, jnp.float32)
  return stacked


def sequence_scorer(
  cluster: Cluster, role: Role, name: str, fn: Callable[[Any, Any], jax.Array]
) -> Callable[[Sequence[dict[str, jax.Array]], int], jax.Array]:
  """`score(micros, b) -> [b]`: `fn(params, micro) -> [b]` (a per-sequence sum or score, 0 on
  rows not in the micro-batch) of `role`'s weights, summed over packed micro-batches on its mesh."""
  rt = cluster.roles[role]
  add = cluster.compile(
    name,
    lambda params, acc_b, micro: acc_b + fn(params, micro) * micro["member"],
    out_shardings=rt.replicated,
    donate_argnums=1,
    role=role,
  )

  def score(micros, b):
    acc_b = jax.device_put(np.zeros(b, np.float32), rt.replicated)
    for micro in micros:
      acc_b = add(cluster.weights(role), acc_b, micro)
    return acc_b

  return score
