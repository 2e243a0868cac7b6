"""One model on one role's mesh: its shardings, parameters and compiled functions."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax import models, programs
from rlhfjax.config.model import HeadKind, ModelConfig
from rlhfjax.mesh import meshes, rules, transfer
from rlhfjax.placement.spec import Role, RoleSpec
from rlhfjax.training import weights
from rlhfjax.training.state import TrainState, init_train_state, train_state_shardings


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleRuntime:
  """Where a role lives and how its parameters and batches are laid out there."""

  role: Role
  spec: RoleSpec
  mesh: Mesh
  model: ModelConfig
  head: HeadKind
  param_shardings: Any

  @classmethod
  def create(
    cls, role: Role, spec: RoleSpec, model: ModelConfig, head: HeadKind, mesh: Mesh | None = None
  ) -> RoleRuntime:
    mesh = meshes.make_mesh(spec) if mesh is None else mesh
    shardings = rules.named_shardings(
      models.logical_axes(model, head), models.abstract_params(model, head), mesh, spec.layout
    )
    return cls(role=role, spec=spec, mesh=mesh, model=model, head=head, param_shardings=shardings)

  @property
  def devices(self) -> tuple[int, ...]:
    return self.spec.devices

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def batch_sharding(self, shape: tuple[int, ...], leading: int = 0) -> NamedSharding:
    """Rows (dimension `leading`) split over the layout's batch axes, the rest replicated."""
    axes = (None,) * leading + ("batch",) + (None,) * (len(shape) - leading - 1)
    return NamedSharding(self.mesh, rules.partition_spec(axes, self.spec.layout, self.mesh, shape))

  def batch_shardings(self, tree: Any, leading: int = 0) -> Any:
    return jax.tree.map(lambda x: self.batch_sharding(np.shape(x), leading), tree)

  def put_batch(self, tree: Any, leading: int = 0) -> Any:
    """Sends a batch to this role's mesh, rows split over the batch axes.

    Device arrays move device to device through `rlhfjax.mesh.transfer` (a plain
    `jax.device_put` between meshes stages them through the host); host arrays are uploaded.
    """
    shardings = self.batch_shardings(tree, leading)
    leaves = jax.tree.leaves(tree)
    on_device = [isinstance(x, jax.Array) for x in leaves]
    if all(on_device):
      return transfer.transfer(tree, shardings)[0]
    if any(on_device):
      raise TypeError("put_batch takes a tree of host arrays or one of device arrays, not both")
    return jax.device_put(tree, shardings)

  def init_params(self, rng: jax.Array) -> Any:
    """Fresh parameters created directly in this role's shards."""
    return models.init_params(self.model, self.head, rng, shardings=self.param_shardings)

  def train_state_shardings(self, tx: optax.GradientTransformation) -> TrainState:
    """Shardings of this role's `TrainState` under optimizer `tx`."""
    return train_state_shardings(
      self.param_shardings, models.abstract_params(self.model, self.head), tx, self.replicated
    )

  def train_state(
    self, params: Any, tx: optax.GradientTransformation
  ) -> tuple[TrainState, TrainState]:
    """A `TrainState` of `params` (already in this role's shards; donated) with a fresh
    optimizer state created in its shards, and the state's shardings."""
    shardings = self.train_state_shardings(tx)
    create = programs.jit(
      functools.partial(init_train_state, tx=tx), out_shardings=shardings, donate_argnums=0
    )
    return create(params), shardings

  def abstract_train_state(self, tx: optax.GradientTransformation) -> TrainState:
    """Shapes, dtypes and shardings of this role's `TrainState`: what a checkpoint restores."""
    shapes = jax.eval_shape(
      lambda p: init_train_state(p, tx), models.abstract_params(self.model, self.head)
    )
    return weights.abstract_with_shardings(shapes, self.train_state_shardings(tx))
