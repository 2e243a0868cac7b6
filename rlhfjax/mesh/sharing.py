"""Whether one role can read another role's arrays as they are: no copy, no sync.

Two co-located roles whose parameter trees have the same structure, shapes, dtypes and
shardings (the same shard of every array on every device, in the same memory) need nothing
moved between them: the reader can take the writer's arrays themselves, as Tunix's co-located
rollout shares the actor's model. A rollout in bf16 beside fp32 masters, or in another layout
(say tensor parallel beside FSDP), must still copy or cast (`rlhfjax.mesh.transfer`).
"""

from __future__ import annotations

from typing import Any

import jax


def _same_places(sa: Any, sb: Any, ndim: int) -> bool:
  return (
    sa is not None
    and sb is not None
    and sa.memory_kind == sb.memory_kind
    and sa.is_equivalent_to(sb, ndim)
  )


def _leaf_equal(a: Any, b: Any) -> bool:
  return (
    tuple(a.shape) == tuple(b.shape)
    and a.dtype == b.dtype
    and _same_places(a.sharding, b.sharding, len(a.shape))
  )


def same_layout(a: Any, b: Any) -> bool:
  """Whether trees `a` and `b` (of `jax.Array`s or `jax.ShapeDtypeStruct`s with shardings) lay
  out every leaf alike: same tree structure, shapes, dtypes, memory kinds and shards per device.

  Mesh objects and axis names may differ (an FSDP mesh of size 1 beside a generation mesh);
  only where each shard lives counts.
  """
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  if tree_a != tree_b:
    return False
  return all(_leaf_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))


def same_shardings(a: Any, b: Any, shapes: Any) -> bool:
  """Whether sharding trees `a` and `b` put every shard of arrays of `shapes` (a tree of
  anything with `.shape`) on the same device and memory."""
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  dims = [len(x.shape) for x in jax.tree.leaves(shapes)]
  if tree_a != tree_b or len(dims) != len(leaves_a):
    return False
  return all(_same_places(x, y, n) for x, y, n in zip(leaves_a, leaves_b, dims, strict=True))


def on_mesh(sharding: jax.sharding.NamedSharding, mesh: jax.sharding.Mesh) -> Any:
  """`sharding`'s spec on `mesh` (another mesh of the same devices, in another order)."""
  return jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def view_on(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """The same device buffers, labelled with the same specs on `mesh`: no byte moves.

  `mesh` holds the arrays' devices in another order, so the view is another array: each device
  keeps its shard, which now stands at that device's place in `mesh`. A pipelined critic is
  laid out on the actor's devices with its `stage` axis reversed (its stage j on the actor's
  stage p - 1 - j); viewed on the actor's mesh, its layer stack reads in reversed blocks, which
  is what a fused schedule running the critic in the reverse device order needs on every
  device (`rlhfjax.training.pipeline`). Viewing the result on the critic's mesh undoes it.
  """

  def one(x: jax.Array) -> jax.Array:
    target = on_mesh(x.sharding, mesh)
    if set(target.device_set) != set(x.sharding.device_set):
      raise ValueError("a view needs the same devices in another order")
    return jax.make_array_from_single_device_arrays(
      x.shape, target, [shard.data for shard in x.addressable_shards]
    )

  return jax.tree.map(one, tree)
