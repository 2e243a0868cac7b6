"""Which hosts a role's tensor-parallel groups span.

Tensor parallelism all-reduces the activations twice per layer, so it belongs inside a node
(NVLink, a TPU host's ICI neighbours): a tensor group whose devices sit on different hosts runs
those all-reduces at the network's rate. Hosts are given as data, one entry per device index
(`nodes_of` for the nodes of a hardware description; in a live job, the host of each device's
process), so this module needs no JAX.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from rlhfjax.placement.report import format_devices
from rlhfjax.placement.spec import PlacementSpec, RoleSpec, ordered


def nodes_of(num_devices: int, devices_per_node: int) -> tuple[int, ...]:
  """The node of each of `num_devices` device indices, `devices_per_node` to a node in order
  (as `jax.devices()` lists them: one process's, one host's, devices after another's)."""
  if devices_per_node < 1:
    raise ValueError(f"devices_per_node must be >= 1, got {devices_per_node}")
  return tuple(i // devices_per_node for i in range(num_devices))


def tensor_groups(role_spec: RoleSpec) -> tuple[tuple[int, ...], ...]:
  """The device indices of each tensor-parallel group of `role_spec`: the devices that differ
  only in their `tensor` coordinate. The mesh is row-major over `axes`
  (`rlhfjax.mesh.meshes.make_mesh`), so a group's devices lie `stride` apart in
  `role_spec.devices`, where `stride` is the product of the sizes of the axes after `tensor`
  (1 in both layouts, whose last axis it is)."""
  devices, names, sizes = role_spec.devices, role_spec.axis_names, role_spec.axis_sizes
  if "tensor" not in names:
    return tuple((d,) for d in devices)
  axis = names.index("tensor")
  size, stride = sizes[axis], math.prod(sizes[axis + 1 :])
  block = size * stride
  return tuple(
    tuple(devices[start + offset + j * stride] for j in range(size))
    for start in range(0, len(devices), block)
    for offset in range(stride)
  )


def tensor_spans_hosts(role_spec: RoleSpec, hosts: Sequence[Hashable]) -> tuple[Hashable, ...]:
  """The hosts that `role_spec`'s tensor groups spanning more than one host touch, in device
  order; () when every tensor group sits on one host. `hosts[i]`: the host of device index i."""
  spanned: dict[Hashable, None] = {}
  for group in tensor_groups(role_spec):
    on = {hosts[d] for d in group}
    if len(on) > 1:
      spanned.update((hosts[d], None) for d in group)
  return tuple(spanned)


def tensor_across_hosts(
  spec: PlacementSpec, hosts: Sequence[Hashable], *, unit: str = "host"
) -> list[str]:
  """One warning line per role whose `tensor` axis spans hosts (`hosts[i]`: the host of device
  index i; `unit`: what a host is called in the message, 'host' or 'node')."""
  warnings = []
  for role in ordered(spec.roles):
    role_spec = spec[role]
    spanned = tensor_spans_hosts(role_spec, hosts)
    if not spanned:
      continue
    crossing = next(g for g in tensor_groups(role_spec) if len({hosts[d] for d in g}) > 1)
    warnings.append(
      f"{role}: tensor={role_spec.axis_size('tensor')} spans {unit}s "
      f"{', '.join(map(str, spanned))} (e.g. devices {format_devices(crossing)}); tensor "
      f"parallel belongs inside a {unit}: all-reduces twice a layer at the network's rate"
    )
  return warnings
