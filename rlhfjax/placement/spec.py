"""Placement as data: which devices and which mesh each RLHF role gets.

A `PlacementSpec` maps every role to a `RoleSpec`: indices into `jax.devices()`, named mesh
axes with sizes, and the layout (training or generation) that decides how parameters are laid
out on that mesh. Co-location is simply two roles with the same devices.

A role is a name. `Role` lists the built-in five; a config's extra roles
(`model.extra_roles`: a second reward model, ...) are roles by their own names, placed,
checked and shown like the built-in ones (a `Role` is a `str`, so both key the same dicts).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping


class Role(enum.StrEnum):
  ACTOR = "actor"
  CRITIC = "critic"
  REFERENCE = "reference"
  REWARD = "reward"
  ROLLOUT = "rollout"


def ordered(roles: Iterable[str]) -> tuple[str, ...]:
  """`roles` in the order tables and logs show them: the built-in ones in `Role` order, then
  the extra ones as given."""
  roles = list(roles)
  return (*(role for role in Role if role in roles), *(r for r in roles if r not in tuple(Role)))


class Layout(enum.StrEnum):
  TRAINING = "training"
  """Pipeline stages over `stage`, FSDP over `fsdp` (and `data`), each row's tokens over
  `context`, tensor parallel over `tensor`."""
  GENERATION = "generation"
  """Tensor parallel over heads and MLP, replicated across `data` groups."""


LAYOUT_AXES: Mapping[Layout, tuple[str, ...]] = {
  Layout.TRAINING: ("stage", "data", "fsdp", "context", "tensor"),
  Layout.GENERATION: ("data", "tensor"),
}
"""The mesh axes of each layout, in mesh order (devices are listed row-major over them)."""
OPTIONAL_AXES = frozenset({"stage", "context"})
"""Axes a spec lists only when it uses them (size > 1): a training spec without a pipeline or
context parallelism keeps its three axes ('data', 'fsdp', 'tensor'), so specs and meshes from
before them are unchanged."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleSpec:
  """Where one role runs."""

  devices: tuple[int, ...]
  """Indices into `jax.devices()`, in mesh order (row-major over `axes`)."""
  axes: tuple[tuple[str, int], ...]
  """Named mesh axes and their sizes, e.g. (('data', 1), ('fsdp', 4), ('tensor', 1))."""
  layout: Layout

  @classmethod
  def training(
    cls,
    devices,
    *,
    stage: int = 1,
    data: int = 1,
    fsdp: int = 1,
    context: int = 1,
    tensor: int = 1,
  ) -> RoleSpec:
    """A training-layout spec: axes ('stage', 'data', 'fsdp', 'context', 'tensor') over
    `devices`, the pipeline's 'stage' outermost and only when `stage` > 1, 'context' only when
    `context` > 1."""
    axes = (("stage", stage),) if stage > 1 else ()
    axes += (("data", data), ("fsdp", fsdp))
    axes += (("context", context),) if context > 1 else ()
    axes += (("tensor", tensor),)
    return cls(devices=tuple(devices), axes=axes, layout=Layout.TRAINING)

  @classmethod
  def generation(cls, devices, *, data: int = 1, tensor: int = 1) -> RoleSpec:
    """A generation-layout spec: axes ('data', 'tensor') over `devices`."""
    axes = (("data", data), ("tensor", tensor))
    return cls(devices=tuple(devices), axes=axes, layout=Layout.GENERATION)

  @property
  def axis_names(self) -> tuple[str, ...]:
    return tuple(name for name, _ in self.axes)

  @property
  def axis_sizes(self) -> tuple[int, ...]:
    return tuple(size for _, size in self.axes)

  @property
  def mesh_size(self) -> int:
    return math.prod(self.axis_sizes)

  def axis_size(self, name: str) -> int:
    return dict(self.axes).get(name, 1)

  @property
  def context(self) -> int:
    """Context-parallel size: the size of the 'context' axis (1 without one)."""
    return self.axis_size("context")

  @property
  def stages(self) -> int:
    """Pipeline stages: the size of the 'stage' axis (1 without one)."""
    return self.axis_size("stage")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementSpec:
  """A `RoleSpec` for every role, plus the name of the strategy that built it."""

  strategy: str
  roles: Mapping[str, RoleSpec]
  """By role: a `Role`, or an extra role's name."""
  disjoint: tuple[tuple[str, str], ...] = ()
  """Pairs of roles meant to run at the same time, so they must not share any device."""
  pipeline_recompute: bool = False
  """Pipelined roles run each stage's forward again in its backward instead of keeping every
  micro-batch's residuals: `strategy=auto`'s choice where no placement fits otherwise (the
  config's `placement.pipeline_recompute` asks for it always)."""

  def __getitem__(self, role: str) -> RoleSpec:
    return self.roles[role]

  def colocated(self, a: Role | str, b: Role | str) -> bool:
    """True when two roles share any device (so they cannot run at the same time). Devices
    compare as sets: a critic whose stages run in the reverse order of the actor's
    (`rlhfjax.placement.strategies`) lists the actor's devices in another order."""
    return bool(set(self[a].devices) & set(self[b].devices))

  def only(self, roles) -> PlacementSpec:
    """The placement of just `roles` (the ones a flow uses): no mesh for the others, and no
    disjointness rule that names them."""
    keep = set(roles)
    return dataclasses.replace(
      self,
      roles={role: spec for role, spec in self.roles.items() if role in keep},
      disjoint=tuple((a, b) for a, b in self.disjoint if a in keep and b in keep),
    )

  def beside(self, role: Role, host: Role) -> PlacementSpec:
    """`role` placed exactly as `host` (its devices, mesh axes and layout), with no
    disjointness rule naming it: a role that runs on another's weights (the reference on the
    actor's base, `rlhfjax.cluster.Cluster.freeze`). Unchanged when `role` is not placed."""
    if role not in self.roles:
      return self
    return dataclasses.replace(
      self,
      roles={**self.roles, role: self.roles[host]},
      disjoint=tuple(pair for pair in self.disjoint if role not in pair),
    )

  @property
  def devices(self) -> tuple[int, ...]:
    """All device indices the job uses, sorted."""
    return tuple(sorted({d for spec in self.roles.values() for d in spec.devices}))
