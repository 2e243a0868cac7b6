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
  for `Cluster.update_stage`. Programs are traced per row bucket, counted under `name`_*."""

  def __init__(
    self, cluster: Cluster, role: Role, name: str, loss_fn: packed.LossFn, *, field: str
  ):
    rt, shardings = cluster.roles[role], cluster.state_shardings[role]
    if (stages := rt.spec.stages) > 1:
      # Packed micro-batches differ in rows and run as separate programs; a pipeline runs all
      # of a mini-batch's micro-batches, of one shape, in one program.
      raise ConfigError(
        f"packed updates do not run through pipeline stages: set '{field}=False' with "
        f"'placement.pipeline_stages'={stages}"
      )
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
    acc = self._zeros(state.params, micros[0])
    for micro in micros:
      acc = self._grad(state.params, acc, micro)
    return self._apply(state, acc)


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
