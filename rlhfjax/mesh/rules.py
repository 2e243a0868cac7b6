"""Logical-to-mesh axis rules, one table per `Layout`.

Models name logical axes only ('embed', 'heads', ...). This module turns a tuple of logical
names plus a concrete shape and mesh into a `PartitionSpec`:

* each logical name maps to zero or more mesh axes through the layout's table;
* mesh axes the mesh does not have, or whose size is 1, are dropped (a spec that names them
  would shard nothing and only make specs differ between equivalent meshes);
* a mesh axis already used by an earlier dimension is dropped (a `PartitionSpec` may name a
  mesh axis once);
* mesh axes are kept, in order, only while their running product divides the dimension.
  A dimension that cannot be split evenly is **replicated** instead of raising, for example
  2 KV heads on a 4-way tensor axis. Every such decision is returned by `resolve` as a
  `Replicated` record and logged at INFO level by `partition_spec` and `named_shardings`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax.placement.spec import Layout

LogicalAxes = tuple[str | None, ...]
"""One logical axis name (or None for "never sharded") per array dimension."""
MeshAxes = tuple[str, ...]
"""Mesh axes one logical axis is sharded over, major to minor; empty means replicated."""

KV_CACHE_AXES: LogicalAxes = ("layers", "batch", "kv_length", "kv_heads", "head_dim")
"""Logical axes of a stacked KV cache (one per key/value tensor)."""

TRAINING_RULES: Mapping[str, MeshAxes] = types.MappingProxyType(
  {
    "vocab": ("tensor", "stage"),
    "embed": ("fsdp", "context"),
    "embed_lookup": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "layers": ("stage",),
    "norm": (),
    "batch": ("data", "fsdp", "stage"),
    "length": ("context",),
    "kv_length": (),
  }
)
"""FSDP over the model width, tensor parallel over vocab/heads/MLP, the scanned layer stack over
the pipeline's `stage` axis (contiguous blocks of layers per stage), the vocabulary of the
embedding and the head over the stages too (each stage keeps 1/P of them and of their optimizer
state; a pipelined step gathers them, `rlhfjax.training.pipeline`), and the batch over data x
fsdp x stage: a forward-only program (scoring) splits its rows over the stages too, while a
pipelined step places its micro-batches itself. With a `context` axis each row's tokens split
over it (context parallelism: `models.attention.context_attention` gathers the keys), and the
weights shard over it as over `fsdp` (its devices hold the same rows, so they share the
model's state as FSDP's do). Without `stage` and `context` axes (or with size 1) this is plain
FSDP x tensor parallel. 'embed_lookup' is the width of the embedding lookup on its way to
the residual stream's layout (`models.transformer.Transformer`)."""

GENERATION_RULES: Mapping[str, MeshAxes] = types.MappingProxyType(
  {
    **TRAINING_RULES,
    "embed": (),
    "embed_lookup": (),
    "layers": (),
    "batch": ("data",),
    "length": (),
  }
)
"""The training table without FSDP or pipeline stages: tensor parallel only; weights are
replicated across `data` groups (no gather per step)."""


def rules_table(layout: Layout | str) -> Mapping[str, MeshAxes]:
  """The logical-to-mesh table of `layout`."""
  return {Layout.TRAINING: TRAINING_RULES, Layout.GENERATION: GENERATION_RULES}[Layout(layout)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replicated:
  """Mesh axes the rules asked for on one dimension but that could not be used."""

  dim: int
  """Index of the array dimension."""
  logical_axis: str
  size: int
  """Size of the dimension."""
  mesh_axes: MeshAxes
  """The mesh axes left out; the dimension is not sharded over them."""
  reason: str
  """'indivisible' (size not a multiple of the axes' product) or 'axis already used'."""


def resolve(
  logical_axes: Sequence[str | None],
  layout: Layout | str,
  mesh: Mesh,
  shape: Sequence[int],
) -> tuple[PartitionSpec, tuple[Replicated, ...]]:
  """Maps logical axes to a `PartitionSpec` for an array of `shape` on `mesh`.

  Args:
    logical_axes: One logical name (or None) per dimension of the array.
    layout: Which rules table to use.
    mesh: The mesh the array will live on.
    shape: The global shape of the array.

  Returns:
    The spec (one entry per dimension) and the dimensions that were replicated over some of
    the mesh axes the rules named for them, with the reason.

  Raises:
    ValueError: If the ranks differ or a logical name is not in the table.
  """
  if len(logical_axes) != len(shape):
    raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
  table = rules_table(layout)
  sizes = dict(mesh.shape)
  used: set[str] = set()
  entries: list[str | tuple[str, ...] | None] = []
  replicated: list[Replicated] = []
  for dim, (name, size) in enumerate(zip(logical_axes, shape, strict=True)):
    if name is None:
      entries.append(None)
      continue
    if name not in table:
      raise ValueError(
        f"logical axis {name!r} has no rule for layout {Layout(layout).value}; "
        f"known: {sorted(table)}"
      )
    wanted = [a for a in table[name] if sizes.get(a, 1) > 1]
    taken = tuple(a for a in wanted if a in used)
    if taken:
      replicated.append(
        Replicated(
          dim=dim, logical_axis=name, size=size, mesh_axes=taken, reason="axis already used"
        )
      )
    kept: list[str] = []
    for axis in (a for a in wanted if a not in used):
      if size % (math.prod(sizes[a] for a in kept) * sizes[axis]) == 0:
        kept.append(axis)
      else:
        # Once one axis is skipped the rest are too: keeping a minor axis without the major one
        # in front of it would give an ordering the rules did not ask for.
        rest = tuple(a for a in wanted if a not in used and a not in kept)
        replicated.append(
          Replicated(dim=dim, logical_axis=name, size=size, mesh_axes=rest, reason="indivisible")
        )
        break
    used.update(kept)
    entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*entries), tuple(replicated)


def _log(replicated: Sequence[Replicated], where: str) -> None:
  for r in replicated:
    logging.info(
      "%s: dim %d (%s, size %d) replicated over %s: %s",
      where,
      r.dim,
      r.logical_axis,
      r.size,
      r.mesh_axes,
      r.reason,
    )


def partition_spec(
  logical_axes: Sequence[str | None],
  layout: Layout | str,
  mesh: Mesh,
  shape: Sequence[int],
) -> PartitionSpec:
  """The `PartitionSpec` of `resolve`; replicated dimensions are logged at INFO level."""
  spec, replicated = resolve(logical_axes, layout, mesh, shape)
  _log(replicated, str(tuple(logical_axes)))
  return spec


def _is_axes_leaf(x: Any) -> bool:
  return isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)


def _shape_of(x: Any) -> tuple[int, ...]:
  return tuple(x.shape) if hasattr(x, "shape") else tuple(x)


def named_shardings(
  logical_axes_tree: Any,
  shapes_tree: Any,
  mesh: Mesh,
  layout: Layout | str,
) -> Any:
  """A `NamedSharding` for every leaf of a parameter (or activation) tree.

  Args:
    logical_axes_tree: Pytree whose leaves are tuples of logical axis names.
    shapes_tree: Pytree of the same structure whose leaves are shapes (tuples of ints) or
      anything with a `.shape` (arrays, `jax.ShapeDtypeStruct`).
    mesh: The target mesh.
    layout: Which rules table to use.

  Returns:
    A pytree of `NamedSharding` with the structure of `logical_axes_tree`.
  """

  def one(path, axes, shape):
    spec, replicated = resolve(axes, layout, mesh, _shape_of(shape))
    _log(replicated, jax.tree_util.keystr(path))
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(
    one, logical_axes_tree, shapes_tree, is_leaf=_is_axes_leaf
  )


def flax_rules(layout: Layout | str, mesh: Mesh) -> tuple[tuple[str, MeshAxes | None], ...]:
  """The layout's table as `flax.linen.logical_axis_rules` (mesh axes `mesh` lacks dropped),
  for the activation constraints the model places (`models.transformer.ACTIVATION_AXES`)."""
  sizes = dict(mesh.shape)
  return tuple(
    (name, tuple(a for a in axes if sizes.get(a, 1) > 1) or None)
    for name, axes in rules_table(layout).items()
  )


def constrained(fn: Any, layout: Layout | str, mesh: Mesh) -> Any:
  """`fn`, traced under `mesh` (as the abstract mesh) and the layout's `flax_rules`, so that
  the activation constraints the model places apply inside the `jax.jit` that compiles it.

  Without them XLA's sharding propagation may follow the FSDP-sharded weights and gather the
  activations of the whole batch on every device. The context is entered at trace time, inside
  the jit, so the compiled program and its cache key are the same on every call.
  """
  flax_axis_rules = flax_rules(layout, mesh)

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(flax_axis_rules):
      return fn(*args, **kwargs)

  return traced
