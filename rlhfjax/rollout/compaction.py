"""Tail compaction: the last running requests move into a smaller decode batch on fewer replicas.

Response lengths are long-tailed, so most of a rollout's decode steps run a batch whose slots
are mostly finished. Each step still pays for every slot (attention over every cache row, the
sampling of every row), and on a mesh with several 'data' replicas every replica keeps stepping
for the one or two rows it still holds. Compaction gathers the active rows into a decode batch
of an allowed smaller size, moves it device to device onto the first replicas of the rollout
mesh (`rlhfjax.mesh.transfer`, the one mover), and decodes it there.

Allowed sizes halve: `num_slots / 2, num_slots / 4, ...` down to an odd size. A batch only ever
shrinks to the next size, possibly several times in a row, so each size has exactly one gather
program (from twice its size) and one decode program: compiled once per allowed size.

Replicas of a size keep the rows per replica of the full batch while they can: a batch of `m`
rows on a mesh with `d` 'data' replicas runs on the largest divisor `d'` of `d` that divides `m`
and is at most `d * m / num_slots` (at least 1). The sub-mesh is the first `d'` rows of the mesh
along 'data', with every other axis whole. Weights are replicated over 'data' in the generation
layout, so the sub-mesh's weights are views of the buffers the engine already holds: no copy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax.mesh import rules, transfer
from rlhfjax.placement.spec import Layout
from rlhfjax.rollout import decode
from rlhfjax.rollout.decode import DecodeState

if TYPE_CHECKING:
  from rlhfjax.rollout.engine import Engine


def allowed_sizes(num_slots: int) -> tuple[int, ...]:
  """Decode batch sizes a tail may shrink to, largest first (the full batch excluded)."""
  sizes, m = [], num_slots
  while m % 2 == 0:
    m //= 2
    sizes.append(m)
  return tuple(sizes)


def replicas_for(size: int, num_slots: int, data: int) -> int:
  """'data' replicas a decode batch of `size` rows runs on (see the module docstring)."""
  cap = max(1, data * size // num_slots)
  return max(k for k in range(1, data + 1) if data % k == 0 and size % k == 0 and k <= cap)


def sub_mesh(mesh: Mesh, replicas: int) -> Mesh:
  """The first `replicas` rows of `mesh` along 'data' (the mesh itself when it has them all)."""
  if "data" not in mesh.axis_names or mesh.shape["data"] == replicas:
    return mesh
  axis = mesh.axis_names.index("data")
  devices = np.take(mesh.devices, np.arange(replicas), axis=axis)
  return Mesh(devices, mesh.axis_names)


def take_rows(state: DecodeState, rows_c: jax.Array) -> DecodeState:
  """Rows `rows_c` of a decode batch as a smaller one; a row index of -1 gives a free slot."""
  row_c = jnp.maximum(rows_c, 0)
  small = jax.tree.map(lambda x: jnp.take(x, row_c, axis=0), dataclasses.replace(state, cache={}))
  cache = {name: jnp.take(c, row_c, axis=1) for name, c in state.cache.items()}
  return dataclasses.replace(small, cache=cache, done_b=small.done_b | (rows_c < 0))


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class TailBatch:
  """The programs of one compacted decode batch size."""

  size: int
  mesh: Mesh
  state_shardings: DecodeState
  param_shardings: Any
  gather: Callable
  """(state of twice this size, rows) -> state of this size, on the larger batch's mesh."""
  gathered_shardings: DecodeState
  """Where `gather` leaves its output: the larger batch's mesh."""
  generate_steps: Callable
  """(params, state, max_steps, until_free) -> (state, steps) on this size's mesh."""
  replicated: NamedSharding


class Compactor:
  """Builds and holds the compaction programs of one engine, one set per allowed size."""

  def __init__(self, engine: Engine):
    self._engine = engine
    self._batches: dict[int, TailBatch] = {}
    self._params_of: Any = None
    self._params: dict[int, Any] = {}

  @property
  def sizes(self) -> tuple[int, ...]:
    return allowed_sizes(self._engine.config.num_slots)

  def batch(self, size: int) -> TailBatch:
    """The programs of decode batch `size` (built on first use; jitted lazily, once)."""
    if size not in self._batches:
      if size not in self.sizes:
        raise ValueError(f"{size} is not an allowed tail size {self.sizes}")
      self._batches[size] = self._build(size)
    return self._batches[size]

  def mesh_of(self, size: int) -> Mesh:
    return self._engine.mesh if size == self._engine.config.num_slots else self.batch(size).mesh

  def _build(self, size: int) -> TailBatch:
    engine = self._engine
    full = engine.config.num_slots
    data = dict(engine.mesh.shape).get("data", 1)
    # Decided alike on every process: a mesh spanning processes keeps its replicas.
    one_process = len({d.process_index for d in engine.mesh.devices.flat}) == 1
    replicas = replicas_for(size, full, data) if one_process else data
    mesh = sub_mesh(engine.mesh, replicas)
    source_mesh = self.mesh_of(size * 2)
    source_shardings = (
      engine.state_shardings if size * 2 == full else self.batch(size * 2).state_shardings
    )
    gathered = engine.state_shardings_for(size, source_mesh)
    replicated_src = NamedSharding(source_mesh, PartitionSpec())
    replicated = NamedSharding(mesh, PartitionSpec())
    param_shardings = rules.named_shardings(
      engine.param_logical_axes, engine.abstract_params, mesh, Layout.GENERATION
    )
    state_shardings = engine.state_shardings_for(size, mesh)
    traces = engine.traces
    return TailBatch(
      size=size,
      mesh=mesh,
      state_shardings=state_shardings,
      param_shardings=param_shardings,
      gather=traces.jit(
        f"compact[{size}]",
        take_rows,
        in_shardings=(source_shardings, replicated_src),
        out_shardings=gathered,
      ),
      gathered_shardings=gathered,
      generate_steps=traces.jit(
        f"generate_steps[{size}]",
        functools.partial(decode.generate_steps, engine.model_config),
        in_shardings=(param_shardings, state_shardings, replicated, replicated),
        out_shardings=(state_shardings, replicated),
        donate_argnums=1,
      ),
      replicated=replicated,
    )

  def params(self, size: int) -> Any:
    """The engine's weights on the mesh of `size`: views of its buffers where it holds them."""
    current = self._engine.params
    if self._params_of is not current:
      self._params_of, self._params = current, {}
    if size not in self._params:
      shardings = self.batch(size).param_shardings
      views = jax.tree.map(_view, current, shardings)
      if any(v is None for v in jax.tree.leaves(views, is_leaf=lambda v: v is None)):
        views, _ = transfer.transfer(current, shardings)
      self._params[size] = views
    return self._params[size]

  def shrink(self, state: DecodeState, size: int, rows: list[int]) -> DecodeState:
    """Moves rows `rows` of `state` (a batch of `2 * size`) into a batch of `size` rows.

    The gather runs where `state` lives; the result moves device to device to the smaller
    mesh. `state` is consumed.
    """
    batch = self.batch(size)
    if len(rows) > size:
      raise ValueError(f"{len(rows)} active rows do not fit a tail batch of {size}")
    rows_c = np.full(size, -1, np.int32)
    rows_c[: len(rows)] = rows
    replicated_src = NamedSharding(self.mesh_of(size * 2), PartitionSpec())
    small = batch.gather(state, jax.device_put(rows_c, replicated_src))
    for leaf in jax.tree.leaves(state):
      leaf.delete()
    small, _ = transfer.transfer(small, batch.state_shardings, donate=True)
    return small

  def generate_steps(
    self, size: int, state: DecodeState, max_steps: int, until_free: int
  ) -> tuple[DecodeState, jax.Array]:
    """Decodes the tail batch of `size` rows on its own mesh. Donates `state`."""
    batch = self.batch(size)
    limits = jax.device_put((np.int32(max_steps), np.int32(until_free)), batch.replicated)
    return batch.generate_steps(self.params(size), state, *limits)
