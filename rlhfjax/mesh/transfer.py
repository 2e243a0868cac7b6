"""Moving parameter trees between meshes and layouts, device to device.

`transfer` is the one way weights move between roles (for example the actor's training layout
to the rollout mesh's generation layout). It never stages data through host memory.

Why not a bare `jax.device_put(tree, shardings)`: on jax 0.10, unless the source is on one
device or the two device sets are equal but ordered differently, `device_put` copies shards
device to device only when every target shard is exactly a source shard; otherwise it fetches
the whole array into a NumPy value and uploads it again (`shard_sharded_device_array_slow_path`
-> `x._value`). That includes a relayout on the very same devices in the same order. As
`device_put` is an *explicit* transfer, `jax.transfer_guard("disallow")` lets that round trip
through; only `transfer_guard_host_to_device("disallow_explicit")` catches it (see
`no_host_transfers`). A jitted identity with `out_shardings` (same device set only) stays on
device but XLA's SPMD partitioner falls back to "involuntary full rematerialization" (gathering
every array whole on every device): about 3x slower than this module on 8 CPU devices.

So `transfer` plans the move shard by shard:

1. each distinct target shard (a box of the global array) is cut into pieces, one per source
   shard it overlaps; a piece that is only part of a source shard is sliced on the source
   device (one jitted call per source device for the whole tree);
2. pieces are copied device to device to the device that builds the box, the first target
   device holding it;
3. pieces are concatenated there (one jitted call per device for the whole tree), into the
   donated old shard when there is one;
4. the box is copied to the other target devices holding it, after their donated old shards
   (if any) are freed;
5. the global arrays are assembled with `jax.make_array_from_single_device_arrays`.

Leaves go through these steps in groups (see `_GROUP_BYTES`). Every step is asynchronous:
`transfer` does not block.

Arrays already laid out as asked are returned as they are.

Multi-process runs (arrays that span or live on other processes' devices):

- Same devices at both ends (a relayout of a mesh spanning processes, as a co-located weight
  sync): one jitted program per set of target shardings, in which each leaf is first gathered
  whole (replicated over the mesh) and then sliced to its target layout; XLA's collectives carry
  the shards. Left to choose, XLA's partitioner finds no efficient path from FSDP-sharded
  parameters to the rollout's data x tensor layout either, and does the same with a warning
  per leaf ("involuntary full rematerialization"); the pieces of `_move_across` would move
  fewer bytes but compile one exchange per plan, which cost more than the gathers (a two-step
  job of the five placements took 40 s longer).
- Different devices (a weight sync or experience moving between groups on different
  processes): the plan above, each process doing the steps on its own devices, and the pieces
  that cross processes sent by collective permutes in one program over the devices of both
  ends (`_exchange`), compiled once per plan. JAX 0.10's cross-host `jax.device_put` needs the
  same layout at both ends and, on CPU, its socket transfer library, whose batched copies
  delivered pieces to the wrong arrays when tried (two to one device in one call); the
  collectives work on every backend. Every process whose devices take part must call
  `transfer` for the same arrays in the same order (every process runs the same program).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

from rlhfjax import distributed

Box = tuple[tuple[int, int], ...]
"""A block of a global array: (start, stop) per dimension."""


def _box(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _intersect(a: Box, b: Box) -> Box | None:
  box = tuple((max(s0, t0), min(s1, t1)) for (s0, s1), (t0, t1) in zip(a, b, strict=True))
  # A dimension of size 0 overlaps itself; any other dimension needs a non-empty overlap.
  empty_dims = [s0 == s1 == t0 == t1 for (s0, s1), (t0, t1) in zip(a, b, strict=True)]
  return box if all(lo < hi or e for (lo, hi), e in zip(box, empty_dims, strict=True)) else None


def _relative(inner: Box, outer: Box) -> Box:
  return tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(inner, outer, strict=True))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Piece:
  """The part of one source shard that goes into one target box."""

  src_device: jax.Device
  cut: Box | None
  """Slice of the source shard to take, relative to it; None for the whole shard."""
  size: int
  """Elements in the piece."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Target:
  """One distinct target box: where it is built and where its replicas go."""

  devices: tuple[jax.Device, ...]
  """Target devices holding this box. It is built on the first and copied to the rest."""
  pieces: tuple[_Piece, ...]
  """Row-major over `grid`."""
  grid: tuple[int, ...]
  """Pieces per dimension."""


@functools.lru_cache(maxsize=4096)
def _plan(shape: tuple[int, ...], src: Sharding, dst: Sharding) -> tuple[_Target, ...]:
  """How to build every target box of an array of `shape` from its source shards."""
  holders: dict[Box, list[jax.Device]] = {}
  for device, index in src.devices_indices_map(shape).items():
    holders.setdefault(_box(index, shape), []).append(device)
  wanted: dict[Box, list[jax.Device]] = {}
  for device, index in dst.devices_indices_map(shape).items():
    wanted.setdefault(_box(index, shape), []).append(device)
  targets = []
  for n, (box, devices) in enumerate(wanted.items()):
    pieces, cuts_per_dim = [], [set() for _ in shape]
    for src_box, src_devices in sorted(holders.items()):
      part = _intersect(box, src_box)
      if part is None:
        continue
      # Read on the target device itself when it holds this source box (no copy); otherwise
      # spread the reads of a replicated source over its replicas.
      src_device = devices[0] if devices[0] in src_devices else src_devices[n % len(src_devices)]
      cut = None if part == src_box else _relative(part, src_box)
      size = math.prod(hi - lo for lo, hi in part)
      pieces.append((part, _Piece(src_device=src_device, cut=cut, size=size)))
      for dim, extent in enumerate(part):
        cuts_per_dim[dim].add(extent)
    pieces.sort(key=lambda p: p[0])  # row-major over the grid of sub-boxes
    grid = tuple(len(c) for c in cuts_per_dim)
    if math.prod(grid) != len(pieces):
      raise AssertionError(f"source shards of {src} do not tile target box {box}")
    targets.append(_Target(devices=tuple(devices), pieces=tuple(p for _, p in pieces), grid=grid))
  return tuple(targets)


def _concatenate(pieces: Sequence[jax.Array], grid: tuple[int, ...], axis: int = 0) -> jax.Array:
  """Joins pieces laid out row-major over `grid` into one array."""
  if axis == len(grid):
    return pieces[0]
  step = math.prod(grid[axis + 1 :])
  parts = [
    _concatenate(pieces[i * step : (i + 1) * step], grid, axis + 1) for i in range(grid[axis])
  ]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


@functools.partial(jax.jit, static_argnums=1)
def _cut_all(shards: Sequence[jax.Array], cuts: tuple[Box, ...]) -> list[jax.Array]:
  return [
    jax.lax.slice(x, [lo for lo, _ in cut], [hi for _, hi in cut])
    for x, cut in zip(shards, cuts, strict=True)
  ]


@functools.partial(jax.jit, static_argnums=1)
def _join_all(pieces: Sequence[Sequence[jax.Array]], grids: tuple[tuple[int, ...], ...]):
  return [_concatenate(p, g) for p, g in zip(pieces, grids, strict=True)]


# `keep_unused`: jit drops arguments the function does not read, and a dropped argument is not
# donated (silently: no "donated buffers were not usable" warning). The results have the shapes
# and dtypes of the donated `olds`, so XLA writes each result into an old buffer.
@functools.partial(jax.jit, static_argnums=2, donate_argnums=0, keep_unused=True)
def _write_all(
  olds: Sequence[jax.Array],
  pieces: Sequence[Sequence[jax.Array]],
  grids: tuple[tuple[int, ...], ...],
):
  del olds
  return [_concatenate(p, g) for p, g in zip(pieces, grids, strict=True)]


def _per_device(requests: list[tuple[jax.Device, Any, Any]], run) -> list[Any]:
  """Calls `run(items, keys)` once per device (async); returns results in request order."""
  groups: dict[jax.Device, list[int]] = {}
  for i, (device, _, _) in enumerate(requests):
    groups.setdefault(device, []).append(i)
  results: list[Any] = [None] * len(requests)
  for idx in groups.values():
    outs = run([requests[i][1] for i in idx], tuple(requests[i][2] for i in idx))
    for i, out in zip(idx, outs, strict=True):
      results[i] = out
  return results


def _copy_all(arrays: list[jax.Array], devices: list[jax.Device]) -> list[jax.Array]:
  """Device-to-device copies, one call for all of them (PJRT runs them asynchronously)."""
  return jax.device_put(arrays, devices, may_alias=False) if arrays else []


def _lone_whole(target: _Target) -> bool:
  return len(target.pieces) == 1 and target.pieces[0].cut is None


def _writes_into(plan: tuple[_Target, ...], donated: bool) -> bool:
  """Whether boxes are joined into donated buffers: given some, and some box needs a join."""
  return donated and not all(map(_lone_whole, plan))


def _copied(piece: _Piece, target: _Target, written: bool) -> bool:
  """Whether a piece is copied to the device building its box.

  A box that is one whole source shard is copied even onto its own device, so that a result
  never aliases its source; except where `written` (the box is written into a donated buffer,
  which copies it anyway).
  """
  return piece.src_device != target.devices[0] or (_lone_whole(target) and not written)


def buffers_made(shape: tuple[int, ...], src: Sharding, dst: Sharding, *, into: bool) -> int:
  """The new buffers `transfer` makes to move one array of `shape` from `src` to `dst` (with
  `into`: a donated old array to write into): the pieces it cuts from source shards plus its
  device-to-device copies (pieces to the device building their box, boxes to their replicas).
  Only `devices_indices_map` of the shardings is used, so the planner counts a move between
  device indices without the devices (`rlhfjax.planner.sync`)."""
  plan = _plan(shape, src, dst)
  written = _writes_into(plan, into)
  cut = sum(p.cut is not None for t in plan for p in t.pieces)
  gathered = sum(_copied(p, t, written) for t in plan for p in t.pieces)
  replicas = sum(len(t.devices) - 1 for t in plan)
  return cut + gathered + replicas


Slots = list[list[list[jax.Array]]]
"""Per leaf, per target box, per piece: the array holding that piece."""


def _cut(plans: list[tuple[_Target, ...]], leaves: list[jax.Array]) -> Slots:
  """Step 1: every piece, sliced on its source device where it is part of a shard."""
  shards = [{s.device: s.data for s in x.addressable_shards} for x in leaves]
  pieces = [[[shards[i][p.src_device] for p in t.pieces] for t in plan]
            for i, plan in enumerate(plans)]  # fmt: skip
  requests, slots = [], []
  for i, plan in enumerate(plans):
    for j, target in enumerate(plan):
      for k, piece in enumerate(target.pieces):
        if piece.cut is not None:
          requests.append((piece.src_device, pieces[i][j][k], piece.cut))
          slots.append((i, j, k))
  for (i, j, k), out in zip(slots, _per_device(requests, _cut_all), strict=True):
    pieces[i][j][k] = out
  return pieces


def _gather(
  plans: list[tuple[_Target, ...]], pieces: Slots, written: list[bool]
) -> dict[tuple[int, int, jax.Device], list[jax.Array]]:
  """Step 2: the pieces of every box, copied to the device that builds it (its first one)."""
  local, copies, devices, slots = {}, [], [], []
  for i, plan in enumerate(plans):
    for j, target in enumerate(plan):
      device = target.devices[0]
      local[i, j, device] = list(pieces[i][j])
      for k, piece in enumerate(pieces[i][j]):
        if _copied(target.pieces[k], target, written[i]):
          copies.append(piece)
          devices.append(device)
          slots.append((i, j, device, k))
  for (i, j, device, k), out in zip(slots, _copy_all(copies, devices), strict=True):
    local[i, j, device][k] = out
  return local


def _build(
  plans: list[tuple[_Target, ...]],
  local: dict[tuple[int, int, jax.Device], list[jax.Array]],
  old_shards: list[dict[jax.Device, jax.Array]],
  reuse: list[bool],
) -> list[dict[jax.Device, jax.Array]]:
  """Step 3: every box joined from its pieces, into the donated old shard where `reuse`."""
  built: list[dict[jax.Device, jax.Array]] = [{} for _ in plans]
  joins, writes, join_slots, write_slots = [], [], [], []
  for (i, j, device), pieces in local.items():
    if reuse[i]:
      writes.append((device, (old_shards[i][device], pieces), plans[i][j].grid))
      write_slots.append((i, device))
    elif len(pieces) > 1:
      joins.append((device, pieces, plans[i][j].grid))
      join_slots.append((i, device))
    else:
      built[i][device] = pieces[0]
  for (i, device), out in zip(join_slots, _per_device(joins, _join_all), strict=True):
    built[i][device] = out
  write = lambda items, grids: _write_all(*zip(*items, strict=True), grids)
  for (i, device), out in zip(write_slots, _per_device(writes, write), strict=True):
    built[i][device] = out
  return built


def _replicate(plans: list[tuple[_Target, ...]], built: list[dict[jax.Device, jax.Array]]):
  """Step 4: boxes built on one device copied to the other target devices holding them."""
  copies, devices, slots = [], [], []
  for i, plan in enumerate(plans):
    for target in plan:
      for device in target.devices:
        if device not in built[i]:
          copies.append(built[i][target.devices[0]])
          devices.append(device)
          slots.append((i, device))
  for (i, device), out in zip(slots, _copy_all(copies, devices), strict=True):
    built[i][device] = out


def _move(
  leaves: list[jax.Array], shardings: list[Sharding], olds: list[jax.Array | None]
) -> list[jax.Array]:
  """Moves arrays to new shardings; see the module docstring.

  Every target box is built once, on its first device, and copied to its replicas. Where
  `olds[i]` is given and leaf i needs slicing or joining anyway, the box is joined straight into
  the donated old shard on that device, and the old shards on its replicas are freed before the
  copies are made: no more memory than `olds[i]` on the target devices, beyond pieces in flight.
  (Joining on every replica instead would write into every old shard, but each replica would
  then receive all the pieces and join them: more passes over memory for the same copied bytes.)
  """
  plans = [_plan(x.shape, x.sharding, s) for x, s in zip(leaves, shardings, strict=True)]
  reuse = [_writes_into(plan, old is not None) for old, plan in zip(olds, plans, strict=True)]
  old_shards = [{s.device: s.data for s in old.addressable_shards} if r else {}
                for old, r in zip(olds, reuse, strict=True)]  # fmt: skip
  built = _build(plans, _gather(plans, _cut(plans, leaves), reuse), old_shards, reuse)
  for i, shards in enumerate(old_shards):
    for device, shard in shards.items():
      if device not in built[i]:
        shard.delete()  # a replica's old shard: freed before the copy that replaces it
  _replicate(plans, built)
  for old, reused in zip(olds, reuse, strict=True):
    if old is not None and not reused:
      old.delete()  # donated, but a plain copy was cheaper than writing into it
  return [
    jax.make_array_from_single_device_arrays(
      x.shape, s, [built[i][d] for d in s.addressable_devices_indices_map(x.shape)]
    )
    for i, (x, s) in enumerate(zip(leaves, shardings, strict=True))
  ]


_GROUP_BYTES = 1 << 27
"""Leaves whose target boxes are replicated and cut from several source shards are moved in
groups of about this many bytes, each group with its own cut, copy and join calls: the copies
of one group overlap the work on the one before, and fewer staging buffers (one per piece and
replica) are alive at once. On 8 CPU devices this made such moves 1.15-1.3x faster; other
leaves were as fast or slower in groups, so they move in one."""


def _groups(
  indices: list[int], leaves: list[jax.Array], shardings: list[Sharding]
) -> Iterator[list[int]]:
  """Splits `indices` into groups: leaves whose target boxes are not replicated (or are each one
  whole source shard) together, the rest in runs of about `_GROUP_BYTES` bytes."""
  plans = {i: _plan(leaves[i].shape, leaves[i].sharding, shardings[i]) for i in indices}
  # Only replicated boxes gain: each replica gets its own copy of every piece.
  whole = [i for i in indices if all(len(t.devices) == 1 or _lone_whole(t) for t in plans[i])]
  if whole:
    yield whole
  group, size = [], 0
  for i in (i for i in indices if i not in whole):
    group.append(i)
    size += leaves[i].nbytes
    if size >= _GROUP_BYTES:
      yield group
      group, size = [], 0
  if group:
    yield group


def _buffers(x: jax.Array) -> set[int]:
  return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def _disown_aliases(
  olds: list[jax.Array | None], leaves: list[jax.Array]
) -> list[jax.Array | None]:
  """`olds` without the leaves that share a buffer with `leaves` or with an earlier old leaf.

  Those buffers are not the caller's to give: they still back a leaf of `tree` (for example an
  array a previous transfer left in place) or another `into` leaf. They are neither written
  into nor freed.
  """
  if all(old is None for old in olds):
    return olds
  owned = set().union(*map(_buffers, leaves))
  kept: list[jax.Array | None] = []
  for old in olds:
    buffers = set() if old is None else _buffers(old)
    kept.append(None if old is None or buffers & owned else old)
    owned |= buffers
  return kept


def transfer(
  tree: Any,
  target_shardings: Any,
  *,
  donate: bool = False,
  into: Any = None,
) -> tuple[Any, int]:
  """Moves a pytree of arrays to new shardings (other devices, mesh or layout).

  Every byte goes device to device; nothing is staged in host memory. Leaves already laid out
  as asked are returned unchanged and not counted.

  Args:
    tree: Pytree of `jax.Array`s (global ones too, see the module docstring).
    target_shardings: Pytree of `jax.sharding.Sharding` with the structure of `tree` (or a
      prefix of it).
    donate: Delete the source arrays once the move is enqueued, freeing their memory early.
      The caller must not use `tree` afterwards. Leaves returned unchanged are not deleted.
    into: Optional tree already laid out as `target_shardings`, with the shapes and dtypes of
      `tree` (for example the rollout's weights from the last sync). It is donated: a shard
      that has to be joined anyway is joined into its buffer on the device that builds it, and
      its other buffers are freed before their replacements are copied in, so the move needs
      no more memory on the target devices than `into` held. The caller must not use `into`
      afterwards. A leaf of `into` that shares a buffer with `tree` (say an array
      an earlier transfer left in place) or with another `into` leaf is left alone.

  Returns:
    The moved tree and the number of bytes moved (sum of `nbytes` of the global arrays that
    changed placement; replicas are not counted twice).

  Raises:
    TypeError: If a leaf is not a `jax.Array`.
    ValueError: If a global leaf would change devices, or `into` does not match.
  """
  leaves, treedef = jax.tree.flatten(tree)
  shardings = treedef.flatten_up_to(
    jax.tree.broadcast(target_shardings, tree, is_leaf=lambda s: isinstance(s, Sharding))
  )
  olds = [None] * len(leaves) if into is None else treedef.flatten_up_to(into)
  moving = []
  for i, (x, s, old) in enumerate(zip(leaves, shardings, olds, strict=True)):
    if not isinstance(x, jax.Array):
      raise TypeError(f"transfer moves jax.Arrays already on devices, got {type(x).__name__}")
    if old is not None and (
      old.shape != x.shape or old.dtype != x.dtype or not old.sharding.is_equivalent_to(s, x.ndim)
    ):
      raise ValueError(
        f"`into` leaf {old.shape} {old.dtype} on {old.sharding} does not match "
        f"{x.shape} {x.dtype} on {s}"
      )
    if not x.sharding.is_equivalent_to(s, x.ndim):
      moving.append(i)
  kinds = {i: _kind(leaves[i], shardings[i]) for i in moving}
  elsewhere = [i for i in moving if kinds[i] == "elsewhere"]
  global_moves = [i for i in moving if kinds[i] == "global"]
  across = [i for i in moving if kinds[i] == "across"]
  moving = [i for i in moving if kinds[i] == "local"]
  olds = _disown_aliases(olds, leaves)
  out = list(leaves)
  for i in elsewhere:  # other processes move it: nothing of it lives here
    out[i] = jax.make_array_from_single_device_arrays(
      leaves[i].shape, shardings[i], [], dtype=leaves[i].dtype
    )
  if global_moves:
    owners = {d.process_index for i in global_moves for d in shardings[i].device_set}
    distributed.wait_for(owners, "reshard")
    moved = _reshard(tuple(shardings[i] for i in global_moves))(*(leaves[i] for i in global_moves))
    for i, y in zip(global_moves, moved, strict=True):
      out[i] = y  # fresh buffers: the `into` leaves are freed below
  if across:
    moved = _move_across([leaves[i] for i in across], [shardings[i] for i in across])
    for i, y in zip(across, moved, strict=True):
      out[i] = y  # fresh buffers: the `into` leaves are freed below
  global_moves += across + elsewhere
  for group in _groups(moving, leaves, shardings):
    moved = _move([leaves[i] for i in group], [shardings[i] for i in group],
                  [olds[i] for i in group])  # fmt: skip
    for i, y in zip(group, moved, strict=True):
      out[i] = y
  for i in set(range(len(leaves))) - set(moving):
    if olds[i] is not None:
      olds[i].delete()
  moving += global_moves
  if donate:
    for i in moving:
      leaves[i].delete()
  return treedef.unflatten(out), sum(leaves[i].nbytes for i in moving)


def cast(tree: Any, dtypes: Any) -> Any:
  """`tree`'s arrays as `dtypes` (a tree of dtypes, or of anything with a `.dtype`).

  Jitted with the source's shardings in and out, this is how the weight sync of a rollout that
  holds narrower weights than its source (bf16 from fp32 masters) casts on the source's mesh
  before `transfer`: half the bytes then travel, and the source stays as it is.
  """
  return jax.tree.map(lambda x, d: x.astype(getattr(d, "dtype", d)), tree, dtypes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Traffic:
  """The bytes one `transfer` writes into device memory, step by step.

  On a host whose "devices" share one memory (the CPU backend), each step is a pass over
  memory, so `passes` bounds how close a move can come to one plain copy of what it delivers.
  """

  cut: int
  """Pieces sliced out of source shards."""
  copied: int
  """Device-to-device copies: pieces to the device building a box, boxes to their replicas."""
  joined: int
  """Boxes concatenated from pieces (or written into donated buffers)."""
  delivered: int
  """Every target shard once: what any schedule has to write."""

  @property
  def written(self) -> int:
    return self.cut + self.copied + self.joined

  @property
  def passes(self) -> float:
    """Bytes written per byte delivered (1.0 for a move that only copies whole shards)."""
    return self.written / self.delivered if self.delivered else 0.0


def traffic(tree: Any, target_shardings: Any, *, into: bool = False) -> Traffic:
  """What `transfer(tree, target_shardings, into=...)` writes, by step, without moving anything.

  Counts the moves this process plans shard by shard (multi-process moves go through XLA's
  collectives and are not counted). `into` says whether a tree of donated buffers is given.
  """
  leaves, treedef = jax.tree.flatten(tree)
  shardings = treedef.flatten_up_to(
    jax.tree.broadcast(target_shardings, tree, is_leaf=lambda s: isinstance(s, Sharding))
  )
  cut = copied = joined = delivered = 0
  for x, s in zip(leaves, shardings, strict=True):
    if x.sharding.is_equivalent_to(s, x.ndim) or not _addressable(x, s):
      continue
    plan, size = _plan(x.shape, x.sharding, s), x.dtype.itemsize
    written = _writes_into(plan, into)
    for target in plan:
      box = sum(p.size for p in target.pieces) * size
      for piece in target.pieces:
        cut += piece.size * size if piece.cut is not None else 0
        copied += piece.size * size if _copied(piece, target, written) else 0
      joined += box if len(target.pieces) > 1 or written else 0
      copied += box * (len(target.devices) - 1)
      delivered += box * len(target.devices)
  return Traffic(cut=cut, copied=copied, joined=joined, delivered=delivered)


def _addressable(x: jax.Array, target: Sharding) -> bool:
  """Whether this process holds every shard of the move, so `_move` can plan it."""
  return x.is_fully_addressable and target.is_fully_addressable


def _kind(x: jax.Array, target: Sharding) -> str:
  """How `transfer` moves `x`, decided alike on every process: 'local' (every device at both
  ends is this process's: `_move`), 'elsewhere' (none is: nothing to do here), 'global' (the
  same devices at both ends, on several processes: `_reshard`) or 'across' (different devices
  on several processes: `_move_across`)."""
  owners = {d.process_index for d in x.sharding.device_set | target.device_set}
  if jax.process_index() not in owners:
    return "elsewhere"
  if len(owners) == 1:
    return "local"
  return "global" if x.sharding.device_set == target.device_set else "across"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Part:
  """One piece on its way across processes: leaf `leaf`'s target box `box`, piece `piece`."""

  leaf: int
  box: int
  piece: int
  shape: tuple[int, ...]


def _piece_shape(piece: _Piece, shape: tuple[int, ...], src: Sharding) -> tuple[int, ...]:
  if piece.cut is not None:
    return tuple(hi - lo for lo, hi in piece.cut)
  return tuple(src.shard_shape(shape))


def _rounds(sizes: dict[tuple[jax.Device, jax.Device, str], int]) -> list[list[tuple]]:
  """The messages (source device, target device, dtype) grouped into rounds, each a partial
  permutation of one dtype (a device sends at most one message and receives at most one):
  largest first, so a round's messages have similar sizes (each is padded to the largest)."""
  rounds: list[list[tuple]] = []
  for key in sorted(sizes, key=lambda k: (k[2], -sizes[k])):
    src, dst, dtype = key
    for r in rounds:
      if r[0][2] == dtype and all(src != k[0] and dst != k[1] for k in r):
        r.append(key)
        break
    else:
      rounds.append([key])
  return rounds


@functools.lru_cache(maxsize=256)
def _exchange_program(devices: tuple[jax.Device, ...], perms: tuple[tuple[tuple[int, int], ...]]):
  """One program over `devices` (axis 'x', one row per device) sending round r's rows along
  `perms[r]` with a collective permute."""
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  spec = jax.sharding.PartitionSpec("x")

  def body(*rows):
    return tuple(jax.lax.ppermute(x, "x", perm) for x, perm in zip(rows, perms, strict=True))

  specs = (spec,) * len(perms)
  program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))
  return program, jax.sharding.NamedSharding(mesh, spec)


@functools.lru_cache(maxsize=1024)
def _packer(device: jax.Device):
  """Per device: its outgoing pieces of each round, flattened, joined and padded to the
  round's row (zeros where it sends nothing), placed on `device` even when it sends nothing."""

  def pack(pieces, layout):
    rows = []
    for parts, (width, dtype) in zip(pieces, layout, strict=True):
      flat = [x.reshape(-1) for x in parts] or [jnp.zeros((0,), dtype)]
      row = jnp.concatenate(flat) if len(flat) > 1 else flat[0]
      rows.append(jnp.pad(row, (0, width - row.shape[0]))[None])
    return rows

  return jax.jit(pack, static_argnums=1, out_shardings=jax.sharding.SingleDeviceSharding(device))


@functools.partial(jax.jit, static_argnums=1)
def _unpack(rows: Sequence[jax.Array], shapes: tuple[tuple[tuple[int, ...], ...], ...]):
  """Per device: the pieces of each round's row it received (`shapes[r]`, in order)."""
  out = []
  for row, parts in zip(rows, shapes, strict=True):
    start = 0
    for shape in parts:
      size = math.prod(shape)
      out.append(row[0, start : start + size].reshape(shape))
      start += size
  return out


def _move_across(leaves: list[jax.Array], shardings: list[Sharding]) -> list[jax.Array]:
  """Moves arrays to shardings on other devices, across processes; see the module docstring.

  Every target device builds its own box (no copies between replicas across processes). Each
  process cuts the pieces on its own source devices and joins the boxes on its own target
  devices; pieces whose two devices share a process are copied device to device, the others go
  through `_exchange`. A process owning none of the devices gets arrays without local shards.
  """
  me = jax.process_index()
  local = lambda d: d.process_index == me
  plans = [_plan(x.shape, x.sharding, s) for x, s in zip(leaves, shardings, strict=True)]
  # Step 1: pieces cut on this process's source devices (each piece once, for every replica).
  shards = [{s.device: s.data for s in x.addressable_shards} for x in leaves]
  cut_requests, cut_slots, have = [], [], {}
  for i, plan in enumerate(plans):
    for j, target in enumerate(plan):
      for k, piece in enumerate(target.pieces):
        if not local(piece.src_device):
          continue
        if piece.cut is None:
          have[i, j, k] = shards[i][piece.src_device]
        else:
          cut_requests.append((piece.src_device, shards[i][piece.src_device], piece.cut))
          cut_slots.append((i, j, k))
  for slot, out in zip(cut_slots, _per_device(cut_requests, _cut_all), strict=True):
    have[slot] = out
  # Step 2: every piece to every target device holding its box.
  got: dict[tuple[int, int, jax.Device], list[Any]] = {}
  copies, copy_slots = [], []
  messages: dict[tuple[jax.Device, jax.Device, str], list[_Part]] = {}
  for i, (plan, x) in enumerate(zip(plans, leaves, strict=True)):
    for j, target in enumerate(plan):
      for device in target.devices:
        got[i, j, device] = [None] * len(target.pieces)
        for k, piece in enumerate(target.pieces):
          if piece.src_device.process_index == device.process_index:
            if local(device):
              copies.append(have[i, j, k])
              copy_slots.append((i, j, device, k))
          else:
            part = _Part(leaf=i, box=j, piece=k, shape=_piece_shape(piece, x.shape, x.sharding))
            messages.setdefault((piece.src_device, device, str(x.dtype)), []).append(part)
  for (i, j, device, k), out in zip(copy_slots, _copy_all(copies, [s[2] for s in copy_slots]),
                                    strict=True):  # fmt: skip
    got[i, j, device][k] = out
  if messages:
    _exchange(messages, have, got)
  # Step 3: boxes joined on this process's target devices, arrays assembled.
  joins, join_slots = [], []
  for (i, j, device), pieces in got.items():
    if local(device) and len(pieces) > 1:
      joins.append((device, pieces, plans[i][j].grid))
      join_slots.append((i, j, device))
  for (i, j, device), out in zip(join_slots, _per_device(joins, _join_all), strict=True):
    got[i, j, device] = [out]
  out = []
  for i, (x, s) in enumerate(zip(leaves, shardings, strict=True)):
    box_of = {d: j for j, t in enumerate(plans[i]) for d in t.devices}
    mine = [got[i, box_of[d], d][0] for d in s.addressable_devices_indices_map(x.shape)]
    out.append(jax.make_array_from_single_device_arrays(x.shape, s, mine, dtype=x.dtype))
  return out


def _exchange(
  messages: dict[tuple[jax.Device, jax.Device, str], list[_Part]],
  have: dict[tuple[int, int, int], jax.Array],
  got: dict[tuple[int, int, jax.Device], list[Any]],
) -> None:
  """Sends each message (the pieces one device sends another, of one dtype) with collective
  permutes, in one program over the devices that send or receive; fills `got` on this
  process's receiving devices. Every process computes the same rounds from the same plan."""
  sizes = {key: sum(math.prod(p.shape) for p in parts) for key, parts in messages.items()}
  rounds = _rounds(sizes)
  devices = tuple(sorted({d for key in messages for d in key[:2]}, key=lambda d: d.id))
  me = jax.process_index()
  mine = [d for d in devices if d.process_index == me]
  if not mine:
    return
  position = {d: n for n, d in enumerate(devices)}
  perms = tuple(tuple((position[k[0]], position[k[1]]) for k in r) for r in rounds)
  layout = tuple((max(sizes[k] for k in r), r[0][2]) for r in rounds)
  program, sharding = _exchange_program(devices, perms)
  rows_by_device = {}
  for device in mine:
    pieces = []
    for r in rounds:
      sent = next((k for k in r if k[0] == device), None)
      parts = messages[sent] if sent else []
      pieces.append([have[p.leaf, p.box, p.piece] for p in parts])
    rows_by_device[device] = _packer(device)(pieces, layout)
  rows = [
    jax.make_array_from_single_device_arrays(
      (len(devices), width), sharding, [rows_by_device[d][r] for d in mine]
    )
    for r, (width, _) in enumerate(layout)
  ]
  distributed.wait_for({d.process_index for d in devices}, "exchange")
  received = [{s.device: s.data for s in x.addressable_shards} for x in program(*rows)]
  for device in mine:
    keys = [next((k for k in r if k[1] == device), None) for r in rounds]
    taken = [(r, k) for r, k in enumerate(keys) if k is not None]
    if not taken:
      continue
    shapes = tuple(tuple(p.shape for p in messages[k]) for _, k in taken)
    pieces = iter(_unpack([received[r][device] for r, _ in taken], shapes))
    for _, k in taken:
      for p in messages[k]:
        got[p.leaf, p.box, device][p.piece] = next(pieces)


def to_host(tree: Any) -> Any:
  """NumPy copies of a pytree of arrays, wherever they live.

  An array this process holds only part of, or none of (it lives on other processes' devices),
  is read on every process: a collective, so every process must call this for the same arrays
  in the same order. Arrays on devices of every process are gathered with
  `multihost_utils.process_allgather`; the others move first (`transfer`) to one device of
  each process. Fully addressable arrays are read locally.
  """
  leaves, treedef = jax.tree.flatten(tree)
  gathered = list(leaves)
  foreign = []
  for i, x in enumerate(leaves):
    if not isinstance(x, jax.Array) or jax.process_count() == 1:
      continue
    # Decided alike on every process (a collective follows): by the processes x lives on.
    owners = {d.process_index for d in x.sharding.device_set}
    if len(owners) < jax.process_count():
      foreign.append(i)
    elif not x.is_fully_replicated:
      distributed.wait_for(owners, "to_host")
      gathered[i] = multihost_utils.process_allgather(x, tiled=True)
  if foreign:
    readable = _one_device_per_process()
    moved = _move_across([leaves[i] for i in foreign], [readable] * len(foreign))
    for i, y in zip(foreign, moved, strict=True):
      gathered[i] = y.addressable_shards[0].data
  return treedef.unflatten(jax.device_get(gathered))


@functools.cache
def _one_device_per_process() -> Sharding:
  """Replicated on the first device of every process: every process can read it."""
  first = {}
  for device in jax.devices():
    first.setdefault(device.process_index, device)
  mesh = jax.sharding.Mesh(np.array([first[p] for p in sorted(first)]), ("process",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@functools.lru_cache(maxsize=64)
def _reshard(shardings: tuple[Sharding, ...]):
  """A jitted identity laying its arguments out as `shardings` on their own devices, each
  gathered whole first (see the module docstring): one all-gather, then a local slice."""
  whole = tuple(
    jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
    if isinstance(s, jax.sharding.NamedSharding) else None
    for s in shardings
  )  # fmt: skip

  def relayout(*xs):
    return tuple(
      x if w is None else jax.lax.with_sharding_constraint(x, w)
      for x, w in zip(xs, whole, strict=True)
    )

  return jax.jit(relayout, out_shardings=shardings)


@contextlib.contextmanager
def no_host_transfers() -> Iterator[None]:
  """Fails any host<->device transfer inside the block, explicit ones included.

  `jax.transfer_guard("disallow")` alone is not enough to prove a move stays on devices: it
  only rejects *implicit* transfers, and the host fallback inside `jax.device_put` counts as
  explicit. Device-to-device copies stay allowed. On the CPU backend a device-to-host read is
  zero-copy and never reaches the guard; the upload that must follow it does.
  """
  with (
    jax.transfer_guard("disallow"),
    jax.transfer_guard_host_to_device("disallow_explicit"),
    jax.transfer_guard_device_to_host("disallow_explicit"),
  ):
    yield


@contextlib.contextmanager
def host_transfers_allowed() -> Iterator[None]:
  """Lets every host<->device transfer through inside the block, also inside
  `no_host_transfers` (a deliberate crossing: `Cluster.host`)."""
  with (
    jax.transfer_guard("allow"),
    jax.transfer_guard_host_to_device("allow"),
    jax.transfer_guard_device_to_host("allow"),
  ):
    yield


def verify_transfer(src_tree: Any, dst_tree: Any, target_shardings: Any) -> None:
  """Checks a moved tree against its source: values, shardings and where every shard lives.

  Reads both trees to host memory, so call it outside `no_host_transfers`.

  Raises:
    AssertionError: If any leaf's values differ, its sharding is not equivalent to the target,
      or a shard sits on an unexpected device, covers an unexpected block, or holds data that
      is not the source's data for that block.
  """
  src_leaves, treedef = jax.tree_util.tree_flatten_with_path(src_tree)
  dst_leaves = treedef.flatten_up_to(dst_tree)
  shardings = treedef.flatten_up_to(
    jax.tree.broadcast(target_shardings, src_tree, is_leaf=lambda s: isinstance(s, Sharding))
  )
  for (path, src), dst, sharding in zip(src_leaves, dst_leaves, shardings, strict=True):
    where = f"{jax.tree_util.keystr(path)} {dst.shape} {dst.dtype}"
    expected = np.asarray(jax.device_get(src))
    np.testing.assert_array_equal(np.asarray(jax.device_get(dst)), expected, err_msg=where)
    assert dst.dtype == src.dtype, f"{where}: dtype {dst.dtype} != {src.dtype}"
    assert dst.sharding.is_equivalent_to(sharding, dst.ndim), (
      f"{where}: sharding {dst.sharding} is not {sharding}"
    )
    index_map = sharding.devices_indices_map(dst.shape)
    shards = dst.addressable_shards
    assert {s.device for s in shards} == set(index_map), (
      f"{where}: shards on {sorted(d.id for d in {s.device for s in shards})}, "
      f"expected {sorted(d.id for d in index_map)}"
    )
    for shard in shards:
      want = _box(index_map[shard.device], dst.shape)
      assert _box(shard.index, dst.shape) == want, (
        f"{where}: shard on {shard.device} covers {shard.index}, expected {want}"
      )
      assert shard.data.devices() == {shard.device}, f"{where}: buffer not on {shard.device}"
      np.testing.assert_array_equal(
        np.asarray(shard.data), expected[shard.index], err_msg=f"{where}: shard on {shard.device}"
      )
