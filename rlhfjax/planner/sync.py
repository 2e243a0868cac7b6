"""The weight sync's work on a shared host, counted from the two layouts.

On XLA's virtual CPU devices (`Hardware.host_shared`) the sync's bytes are memory copies of a
few hundred kilobytes each; its time goes to the buffers themselves, every one allocated,
dispatched and waited for on the same shared cores. `buffers` counts them the way the mover
(`rlhfjax.mesh.transfer`) makes them: for every parameter array, its shard on each device the
sync touches (read on the actor's, written on the rollout's), every piece cut from a source
shard, and every device-to-device copy (pieces to the device building their box, boxes to their
replicas). `costs.sync_time` charges `Efficiency.transfer_s` for each.

On 8 CPU devices with `bench_config`'s model (12 arrays), `transfer.transfer(..., into=old)`
timed 40 times per move in alternation (a one-off measurement, not a shipped benchmark):
- 14 moves between training layouts (fsdp 2, 4, 8) and generation layouts (tensor 1, 2; 1 to 4
  replicas) on the same, disjoint and overlapping devices (72 to 396 buffers, 1.9 to 6.6 ms):
  0.85 ms plus 13.7 us per buffer is within 10% of every median;
- the same moves with the layer stacks split into one array per layer (36 arrays, 3.3x the
  buffers): 13.5 us per buffer, within 16%;
- with 2.7x the bytes: 15.9 us per buffer and a constant of 3.0 ms, within 22%. The bytes are
  cut and joined once whatever the layouts (a constant per model; the cost model's bytes over
  the device-pair bandwidth).
What the bench's placements differ in is buffers, not the bytes a rollout device receives (the
same 1.4 MB on every rollout device in each) nor the devices involved (8 for both the co-located
and the disaggregated placement, whose syncs took 14 and 10 ms in the same run): co-located
fsdp 8 -> 4 replicas x tensor 2 on the same 8 devices makes 396 buffers, interleaved_split
(the actor's 4 devices to the same 4) 180, disaggregated (4 devices to 4 others) 270; their
repeated syncs' medians in `localcheck.check` are in about those proportions (5.9, 3.5 and
4.3 ms in one run, with the same 1.7 ms fixed cost per stage).
"""

from __future__ import annotations

import dataclasses
import functools
import types

from rlhfjax.config.model import ModelConfig
from rlhfjax.placement.spec import RoleSpec


@dataclasses.dataclass(frozen=True)
class _Indexed:
  """A role's sharding of one array over device indices (the mover's view of a
  `NamedSharding`: each device's block of the global array)."""

  devices: tuple[int, ...]
  axes: tuple[tuple[str, int], ...]
  spec: tuple

  def devices_indices_map(self, shape: tuple[int, ...]) -> dict[int, tuple[slice, ...]]:
    sizes = dict(self.axes)
    out = {}
    for position, device in enumerate(self.devices):
      coords, rest = {}, position
      for name, size in reversed(self.axes):  # row-major: the last axis varies fastest
        coords[name], rest = rest % size, rest // size
      index = []
      for dim, entry in zip(shape, self.spec, strict=True):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        parts, k = 1, 0
        for name in axes:  # the first named axis is the major one
          parts, k = parts * sizes[name], k * sizes[name] + coords[name]
        step = dim // parts
        index.append(slice(k * step, (k + 1) * step))
      out[device] = tuple(index)
    return out


@functools.lru_cache(maxsize=64)
def _arrays(config: ModelConfig, head: str) -> tuple[tuple[tuple[int, ...], tuple], ...]:
  """(shape, logical axes) of every parameter array of the model."""
  import jax

  from rlhfjax import models

  shapes = jax.tree.leaves(models.abstract_params(config, head))
  axes = jax.tree.leaves(
    models.logical_axes(config, head),
    is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, str | None) for a in x),
  )
  return tuple((tuple(s.shape), tuple(a)) for s, a in zip(shapes, axes, strict=True))


def _sharding(role: RoleSpec, shape: tuple[int, ...], logical: tuple) -> _Indexed:
  from rlhfjax.mesh import rules

  mesh = types.SimpleNamespace(shape=dict(role.axes))  # all `rules.resolve` reads of a mesh
  spec, _ = rules.resolve(logical, role.layout, mesh, shape)
  return _Indexed(devices=role.devices, axes=role.axes, spec=tuple(spec))


def buffers(config: ModelConfig, source: RoleSpec, rollout: RoleSpec) -> int:
  """The buffers of one sync of `config`'s language model from `source`'s layout to
  `rollout`'s (see the module docstring): per array, one per device of the two roles together,
  plus the pieces cut and the copies made (`rlhfjax.mesh.transfer.buffers_made`, writing into
  the rollout's previous weights as the engine does)."""
  from rlhfjax.mesh import transfer

  devices = len(set(source.devices) | set(rollout.devices))
  total = 0
  for shape, logical in _arrays(config, "lm"):
    src, dst = _sharding(source, shape, logical), _sharding(rollout, shape, logical)
    if src.devices_indices_map(shape) == dst.devices_indices_map(shape):
      continue  # laid out alike: the mover leaves it in place
    total += devices + transfer.buffers_made(shape, src, dst, into=True)
  return total
