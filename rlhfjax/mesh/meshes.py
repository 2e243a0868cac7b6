"""Meshes built from placement specs: one `jax.sharding.Mesh` per role."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rlhfjax.placement.spec import PlacementSpec, Role, RoleSpec


def make_mesh(role_spec: RoleSpec, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The mesh of one role: its devices, reshaped row-major to its axis sizes.

  Args:
    role_spec: Device indices and named axes of the role.
    devices: The devices the indices refer to; defaults to `jax.devices()`.

  Returns:
    A mesh whose `devices` array holds exactly `role_spec.devices`, in order.

  Raises:
    ValueError: If an index is out of range or repeated, or the device count does not equal
      the product of the axis sizes.
  """
  devices = list(jax.devices() if devices is None else devices)
  indices = role_spec.devices
  if len(set(indices)) != len(indices):
    raise ValueError(f"device indices repeat: {indices}")
  if bad := [i for i in indices if not 0 <= i < len(devices)]:
    raise ValueError(f"device indices {bad} out of range: {len(devices)} devices exist")
  if len(indices) != role_spec.mesh_size:
    raise ValueError(
      f"{len(indices)} devices do not fill mesh axes {role_spec.axes} "
      f"({role_spec.mesh_size} devices)"
    )
  grid = np.empty(len(indices), dtype=object)
  grid[:] = [devices[i] for i in indices]
  return Mesh(grid.reshape(role_spec.axis_sizes), role_spec.axis_names)


def role_meshes(placement_spec: PlacementSpec) -> dict[Role, Mesh]:
  """One mesh per role; roles with the same devices and axes share one `Mesh` object."""
  shared: dict[tuple, Mesh] = {}
  meshes = {}
  for role, spec in placement_spec.roles.items():
    key = (spec.devices, spec.axes)
    if key not in shared:
      shared[key] = make_mesh(spec)
    meshes[Role(role)] = shared[key]
  return meshes
