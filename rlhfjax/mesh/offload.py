"""Idle-model offload to host memory (ChatLearn's efficient memory sharing).

Roles that share devices run one after another; between its stages a role's parameters (the
reference and reward models between scorings) or optimizer state (the actor's AdamW moments
outside the update) need not hold device memory. `to_host` moves them into the host memory
space of the *same* devices (`memory_kind='pinned_host'` shardings, the role's own
partitioning), `to_device` brings them back. Both are `jax.device_put` calls that XLA/PJRT
carry out shard by shard (no NumPy round trip); they dispatch asynchronously, so calling
`to_device` for the next stage before running the current one overlaps the copy with it
where the backend copies concurrently (GPU: a separate copy stream).

The compiled stages never see a host array: every array is back in device memory before the
stage runs, with the sharding it was compiled for, so offloading causes no recompilation.

On the CPU backend of jax 0.10 'device', 'pinned_host' and 'unpinned_host' are all ordinary
RAM, but the memory spaces are real to XLA: arrays report their kind and moves between kinds
are real copies, which is what the tests check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax

HOST = "pinned_host"
DEVICE = "device"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPolicy:
  """What of one role lives in host memory while the role is idle."""

  params: bool = False
  optimizer: bool = False


def _move(tree: Any, kind: str, donate: bool) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  stay = [leaf.sharding.memory_kind == kind for leaf in leaves]
  go = [leaf for leaf, s in zip(leaves, stay, strict=True) if not s]
  # One batched transfer for the whole tree. `device_put(donate=True)` across memory kinds is
  # not implemented in PJRT (jax 0.10), so the source is deleted explicitly: the runtime keeps
  # a buffer alive until the copies reading it are done.
  moved = iter(jax.device_put(go, [leaf.sharding.with_memory_kind(kind) for leaf in go]))
  if donate:
    for leaf in go:
      leaf.delete()
  out = [leaf if s else next(moved) for leaf, s in zip(leaves, stay, strict=True)]
  return jax.tree.unflatten(treedef, out)


def to_host(tree: Any, *, donate: bool = True) -> Any:
  """`tree`'s arrays in the pinned host memory of their own devices, same partitioning.

  With `donate` the source arrays are deleted (their device memory is released once the copies
  are done): nothing else may hold them.
  """
  return _move(tree, HOST, donate)


def to_device(tree: Any, *, donate: bool = True) -> Any:
  """`tree`'s arrays back in device memory (a no-op for arrays already there)."""
  return _move(tree, DEVICE, donate)


def device_copy(tree: Any) -> Any:
  """A copy of `tree` in device memory, same partitioning, wherever its arrays live: arrays a
  caller may keep while `tree`'s own go to host memory (and are deleted there)."""
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  shardings = [leaf.sharding.with_memory_kind(DEVICE) for leaf in leaves]
  return jax.tree.unflatten(treedef, jax.device_put(leaves, shardings, may_alias=False))


def memory_kinds(tree: Any) -> set[str]:
  """The memory kinds every shard of every array of `tree` really lives in."""
  return {
    shard.data.sharding.memory_kind
    for leaf in jax.tree.leaves(tree)
    for shard in leaf.addressable_shards
  }


def host_memory_supported(devices: Iterable[jax.Device]) -> bool:
  """Whether every device has a pinned host memory space to offload into."""
  return all(HOST in {m.kind for m in d.addressable_memories()} for d in devices)


def park(policy: OffloadPolicy, params: Any = None, opt_state: Any = None) -> tuple[Any, Any]:
  """The role's idle layout under `policy`: what it names goes to host memory."""
  return (
    to_host(params) if policy.params and params is not None else params,
    to_host(opt_state) if policy.optimizer and opt_state is not None else opt_state,
  )


def unpark(params: Any = None, opt_state: Any = None) -> tuple[Any, Any]:
  """Everything back in device memory before the role's stage."""
  return to_device(params), to_device(opt_state)
