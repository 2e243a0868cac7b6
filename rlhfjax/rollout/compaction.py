"""Tail compaction: the last running requests move onto fewer 'data' replicas.

Response lengths are long-tailed, so most of a rollout's decode steps run for a few requests.
The engine's live batch shrinks with them (`rlhfjax.rollout.paging.live_batch_sizes`), but on a
mesh of several 'data' replicas every replica keeps stepping for the rows it still holds, and
the batch stops halving at an odd count of rows per replica. With `EngineConfig.tail_threshold`,
once no prompt waits and at most that fraction of the slots still run, the running requests
move onto a tail engine: `rows` slots on the first replicas of the mesh (`replicas_for`: as
many rows per replica as the full batch has, at least one replica). There each is prefilled
again with its prompt and the tokens it has, as a preempted request is (the same keys, so the
same tokens follow), and decodes to its end. The other replicas' devices are free from then on,
as RLHFuse migrates the tail of generation to dedicated instances.

A tail engine is the engine (`Engine`) on the sub-mesh, with its own page pool (every slot at
full length) and programs, built and compiled on first use and kept: one per tail size. The
weights are replicated over 'data' in the generation layout, so its weights are views of the
buffers the engine holds (read when each of its programs runs): no copy. On a mesh spanning
processes the tail stays where it is.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rlhfjax.mesh import transfer

if TYPE_CHECKING:
  from rlhfjax.rollout.engine import Engine


def replicas_for(rows: int, num_slots: int, data: int) -> int:
  """'data' replicas a tail of `rows` slots runs on: the largest divisor of `data` that divides
  `rows` and is at most `data * rows / num_slots` (at least 1)."""
  cap = max(1, data * rows // num_slots)
  return max(k for k in range(1, data + 1) if data % k == 0 and rows % k == 0 and k <= cap)


def sub_mesh(mesh: Mesh, replicas: int) -> Mesh:
  """The first `replicas` rows of `mesh` along 'data' (the mesh itself when it has them all)."""
  if "data" not in mesh.axis_names or mesh.shape["data"] == replicas:
    return mesh
  axis = mesh.axis_names.index("data")
  devices = np.take(mesh.devices, np.arange(replicas), axis=axis)
  return Mesh(devices, mesh.axis_names)


def _view(x: jax.Array, sharding: NamedSharding) -> jax.Array | None:
  """`x` on `sharding`'s devices from the shards it already has there, or None if it lacks one."""
  shards = {s.device: s for s in x.addressable_shards}
  pieces = []
  for device, index in sharding.addressable_devices_indices_map(x.shape).items():
    shard = shards.get(device)
    if shard is None or _bounds(shard.index, x.shape) != _bounds(index, x.shape):
      return None
    pieces.append(shard.data)
  return jax.make_array_from_single_device_arrays(x.shape, sharding, pieces, dtype=x.dtype)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


class Compactor:
  """The tail engines of one engine, one per tail size, built on first use."""

  def __init__(self, engine: Engine):
    self._engine = engine
    self.engines: dict[int, Engine] = {}
    """The tail engines built so far, by their slots."""
    self._views: tuple[Any, dict[int, Any]] = (None, {})

  def rows(self, threshold: float) -> int | None:
    """Slots of the tail engine at `threshold` (a fraction of the engine's slots), or None
    when the tail stays where it is: threshold 0, a mesh spanning processes, or a tail on as
    many replicas as the mesh has."""
    engine = self._engine
    full = engine.config.num_slots
    if threshold <= 0 or len({d.process_index for d in engine.mesh.devices.flat}) > 1:
      return None
    data = dict(engine.mesh.shape).get("data", 1)
    rows = max(1, int(threshold * full))
    if replicas_for(rows, full, data) == data:
      return None
    return rows

  def engine(self, rows: int) -> Engine:
    """The tail engine of `rows` slots (built on first use)."""
    if rows not in self.engines:
      main = self._engine
      data = dict(main.mesh.shape).get("data", 1)
      mesh = sub_mesh(main.mesh, replicas_for(rows, main.config.num_slots, data))
      config = dataclasses.replace(
        main.config,
        num_slots=rows,
        prefill_batch_sizes=None,
        tail_threshold=0.0,
        num_pages=None,
        share_prefixes=False,
      )
      tail = type(main)(main.model_config, config, mesh)  # (no import of the engine's module)
      tail.read_params_from(lambda: self._params(rows))
      self.engines[rows] = tail
    return self.engines[rows]

  def _params(self, rows: int) -> Any:
    """The engine's weights on the tail engine's mesh: views of its buffers where it holds
    them (else moved there by `rlhfjax.mesh.transfer`), remade when its weights change."""
    current = self._engine.params
    if self._views[0] is not current:
      self._views = (current, {})
    views = self._views[1]
    if rows not in views:
      shardings = self.engines[rows].param_shardings
      tree = jax.tree.map(_view, current, shardings)
      if any(v is None for v in jax.tree.leaves(tree, is_leaf=lambda v: v is None)):
        tree, _ = transfer.transfer(current, shardings)
      views[rows] = tree
    return views[rows]
