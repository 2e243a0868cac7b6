"""Checkpoints of a run: saving on a schedule, resuming, and loading weights from other runs.

Orbax's `CheckpointManager` writes the steps (asynchronously, keeping the last N, coordinating
processes); this module decides what a step holds and how it is checked on the way back.

On-disk layout (`directory` is WORKDIR/checkpoints)::

  <step>/                           one complete checkpoint (orbax renames it into place)
    commit_success.txt              orbax's completion marker
    _CHECKPOINT_METADATA            orbax's step metadata (JSON)
    <name>_params/                  TrainState item `name`: its `params` (orbax PyTree, OCDBT)
    <name>_opt_state/               ... and {'step': state.step, 'opt_state': state.opt_state}
    <name>/                         any other item (a plain pytree of arrays), whole
    meta/metadata                   the caller's JSON meta (step, RNG, KL coefficient, ...)
    fingerprints/metadata           JSON {orbax item: {leaf: [h1, h2]}}, see `_fingerprint`,
                                    and {"meta": {"sha256": ...}} of the meta's canonical JSON
  <step>.orbax-checkpoint-tmp-<t>/  a save in progress, or one killed mid-way: never loaded

Why params and optimizer state are separate items: an SFT or reward-model run's weights are
then read without knowing (or building) the optimizer that produced them (`restore_params`).

Why fingerprints: orbax compresses arrays with zstd and checksums only OCDBT's index, so a
garbled byte inside array data restores silently as a different number. Two layout-independent
32-bit hashes per leaf, computed on device at save time and again after restore, catch that.

Why the meta is fingerprinted too: it holds loop state (the KL coefficient, the data
iterator's position) that a hand edit or a damaged byte would otherwise feed silently into the
next step.

Failed saves (a full or read-only disk, an error in orbax's background thread) raise
`CheckpointError` naming the step and the cause, from `save` or `wait`, and the partial
`<step>.orbax-checkpoint-tmp-*` directory is removed; earlier complete steps are untouched
(orbax deletes old steps only after a new one is complete).

Completeness: on a local filesystem orbax 0.12.8 writes into `<step>.orbax-checkpoint-tmp-<t>`,
adds `commit_success.txt`, then renames the directory to `<step>`. Orbax itself accepts any
directory named like a step; `complete_steps` also requires the marker, so a step directory
copied half-way or made by hand is never loaded either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from rlhfjax import errors
from rlhfjax.config import CheckpointSection
from rlhfjax.mesh import transfer

COMMIT_MARKER = "commit_success.txt"
_META, _FINGERPRINTS = "meta", "fingerprints"
_PARAMS, _OPT_STATE = "_params", "_opt_state"
_JSON_FILE = "metadata"  # the file orbax's JsonSave writes inside its item directory


class CheckpointError(ValueError):
  """A checkpoint is missing, partial, corrupt or does not match what is restored into it, or
  a save failed."""


def _meta_fingerprint(meta: Any) -> str:
  """sha256 of the meta's canonical JSON (sorted keys; floats round-trip exactly)."""
  return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def _absolute(path: epath.PathLike) -> epath.Path:
  """Orbax refuses relative paths (in a background thread, after training): resolve them here."""
  return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


# Layout of items: TrainStates split into params and optimizer state.


@runtime_checkable
class TrainState(Protocol):
  """What this module needs of `rlhfjax.training.state.TrainState` (a dataclass with these
  fields): the checkpoint layer sits below training and does not import it."""

  step: Any
  params: Any
  opt_state: Any


def _orbax_items(items: Mapping[str, Any]) -> dict[str, Any]:
  """The orbax items (directories) holding `items`; TrainStates become two of them."""
  out: dict[str, Any] = {}
  for name, tree in items.items():
    if not name.isidentifier() or name in (_META, _FINGERPRINTS):
      raise ValueError(f"item name {name!r} must be an identifier other than meta, fingerprints")
    if isinstance(tree, TrainState):
      parts = {
        name + _PARAMS: tree.params,
        name + _OPT_STATE: {"step": tree.step, "opt_state": tree.opt_state},
      }
    else:
      parts = {name: tree}
    for key, part in parts.items():
      if key in out:
        raise ValueError(f"two items are stored as {key!r}; rename one of them")
      out[key] = part
  return out


def _join_items(abstract_items: Mapping[str, Any], restored: Mapping[str, Any]) -> dict[str, Any]:
  """Inverse of `_orbax_items`, shaped like `abstract_items`."""
  out = {}
  for name, tree in abstract_items.items():
    if isinstance(tree, TrainState):
      opt = restored[name + _OPT_STATE]
      out[name] = dataclasses.replace(
        tree, step=opt["step"], params=restored[name + _PARAMS], opt_state=opt["opt_state"]
      )
    else:
      out[name] = restored[name]
  return out


# Fingerprints: catching corruption orbax does not see.


def _words(x: jax.Array) -> jax.Array:
  """The bits of `x` as uint32 words (8-byte elements give a trailing dimension of 2)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = x.dtype.itemsize
  if size in (1, 2):
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)
  if size in (4, 8):
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  raise TypeError(f"cannot fingerprint arrays of dtype {x.dtype}")


def _fingerprint(x: jax.Array) -> jax.Array:
  """Two hashes of an array's bits, independent of its sharding.

    h1 = sum_i w_i * a_i,  h2 = sum_i (w_i ^ (w_i >> 15)) * b_i   (mod 2^32)

  over the uint32 words w_i in row-major position i, with odd weights a_i, b_i. Modular integer
  sums are exact in any order, so a resharded restore gives the same numbers; an odd weight
  makes any change to a single word change h1.
  """
  w = _words(x)
  i = jnp.zeros(w.shape, jnp.uint32)
  for d in range(w.ndim):  # row-major position without a reshape (which could relayout)
    i = i * jnp.uint32(w.shape[d]) + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d)
  a = i * jnp.uint32(0x9E3779B1) | jnp.uint32(1)
  b = (i + jnp.uint32(0x632BE5AB)) * jnp.uint32(0x85EBCA77) | jnp.uint32(1)
  h1 = jnp.sum(w * a, dtype=jnp.uint32)
  h2 = jnp.sum((w ^ (w >> 15)) * b, dtype=jnp.uint32)
  return jnp.stack([h1, h2])


_fingerprint_leaf = jax.jit(_fingerprint)
"""One program per leaf shape, dtype and sharding, not one per tree: a model's stacked layers
have a few distinct shapes, which every tree of the model shares (its parameters, its Adam
moments, another role's body). One jit over the whole tree compiled a new program for each
tree and grew with it: 0.59 s for the tiny model's parameters and moments (37 leaves, 10
distinct), against 0.47 s leaf by leaf and 0.03 s for those leaves again."""


def _leaf_name(path: tuple[Any, ...]) -> str:
  """A leaf's name as orbax writes it in its metadata: keys joined by dots."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      parts.append(key.name)
    else:
      parts.append(str(key))
  return ".".join(parts)


def _fingerprints(tree: Any) -> dict[str, list[int]]:
  """{leaf name: [h1, h2]} of a pytree of arrays (all on one set of devices)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  paths, leaves = [p for p, _ in flat], [x for _, x in flat]
  # Read on every process, also where the tree lives on other processes' devices.
  hashes = transfer.to_host([_fingerprint_leaf(x) for x in leaves])
  return {_leaf_name(p): [int(v) for v in h] for p, h in zip(paths, hashes, strict=True)}


def _spanning_sharding(x: Any) -> jax.sharding.Sharding:
  """Where a checkpoint holds leaf `x` (an array or abstract array) while it is written or read.

  Its own sharding, unless the job has several processes and `x` lives on the devices of only
  some of them: orbax writes and reads arrays that span every process (each writes its own
  shards), so such a leaf is spread over every device of the job, split along its first
  dimension that divides evenly (replicated if none does). A checkpoint is then read onto any
  placement and any process layout, and moved from there to the roles' meshes.
  """
  sharding = x.sharding
  if jax.process_count() == 1:
    return sharding
  if {d.process_index for d in sharding.device_set} == set(range(jax.process_count())):
    return sharding
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("checkpoint",))
  dims = [None] * len(x.shape)
  for d, n in enumerate(x.shape):
    if n % len(devices) == 0:
      dims[d] = "checkpoint"
      break
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*dims))


def _spanning(tree: Any) -> Any:
  """`tree` with every leaf on `_spanning_sharding` (moved device to device where needed)."""
  return transfer.transfer(tree, jax.tree.map(_spanning_sharding, tree))[0]


# Finding checkpoints.


def complete_steps(directory: epath.PathLike) -> list[int]:
  """Steps in `directory` whose checkpoint is complete (renamed into place, marker written)."""
  directory = _absolute(directory)
  if not directory.is_dir():
    return []
  return sorted(
    int(p.name)
    for p in directory.iterdir()
    if p.name.isdigit() and p.is_dir() and (p / COMMIT_MARKER).exists()
  )


def find_step_dir(path: epath.PathLike) -> epath.Path:
  """`path` if it is a complete step directory, else the latest complete step inside it."""
  path = _absolute(path)
  if not path.exists():
    raise CheckpointError(f"no checkpoint: {path} does not exist")
  if (path / COMMIT_MARKER).exists():
    return path
  if ocp.path.atomicity.TMP_DIR_SUFFIX in path.name or (path / "_CHECKPOINT_METADATA").exists():
    raise CheckpointError(f"partial checkpoint (no {COMMIT_MARKER}): {path}")
  steps = complete_steps(path)
  if not steps:
    raise CheckpointError(f"no complete checkpoint in {path}")
  return path / str(steps[-1])


def saved_items(step_dir: epath.PathLike) -> set[str]:
  """Names of the items a step directory holds (a TrainState's two parts count as one)."""
  names = set()
  for p in epath.Path(step_dir).iterdir():
    if not p.is_dir() or p.name in (_META, _FINGERPRINTS):
      continue
    for suffix in (_PARAMS, _OPT_STATE):
      if p.name.endswith(suffix):
        names.add(p.name[: -len(suffix)])
        break
    else:
      names.add(p.name)
  return names


# Reading with clear errors.


def _read_json(path: epath.Path) -> Any:
  if not path.exists():
    raise CheckpointError(f"corrupt checkpoint: missing file {path}")
  try:
    return json.loads(path.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise CheckpointError(f"corrupt checkpoint: unreadable JSON in {path}: {e}") from None


def _check_json_files(item_dir: epath.Path) -> None:
  """Parses orbax's JSON metadata files of an item: a clear error beats orbax's bare one."""
  _read_json(item_dir / "_METADATA")
  if (item_dir / "_sharding").exists():
    _read_json(item_dir / "_sharding")
  if (item_dir / "array_metadatas").is_dir():
    for path in (item_dir / "array_metadatas").iterdir():
      _read_json(path)


_TMP_STEP = re.compile(r"/(\d+)\.orbax-checkpoint-tmp")
_FILE_IN_ERROR = re.compile(r'local file "([^"]+)"(?:: )?')
_OCDBT_READ = re.compile(
  r'Error reading "([^"/]+)/([^"]*)" in OCDBT database at local file "([^"]+)"'
)


def _corrupt(error: Exception, item_dir: epath.Path) -> CheckpointError:
  """A one-line error naming the file TensorStore failed on (else the item directory), from
  whichever exception in the chain says it (orbax wraps TensorStore's in its own)."""
  texts = []
  for e in errors.chain(error):
    lines = str(e).split(" [tensorstore_spec")[0].strip().splitlines()
    texts.append(lines[0] if lines else type(e).__name__)
  text = next((t for t in texts if _FILE_IN_ERROR.search(t)), texts[0])
  ocdbt = _OCDBT_READ.search(text)
  if ocdbt:
    # Arrays live in one OCDBT database per item (its files under d/ and ocdbt.process_*/d/);
    # TensorStore names the database and the leaf, not the data file.
    leaf, chunk, where = ocdbt.groups()
    reason = text[ocdbt.end() :].lstrip(": ")
    return CheckpointError(
      f"corrupt checkpoint file in {where.rstrip('/')}: the data of leaf {leaf!r} (chunk "
      f"{chunk}) cannot be read: {reason[:300]}"
    )
  files = list(_FILE_IN_ERROR.finditer(text))
  if files:
    where, reason = files[-1].group(1), text[files[-1].end() :]
  else:
    where, reason = str(item_dir), text
  return CheckpointError(f"corrupt checkpoint file {where}: {reason[:300]}")


def _check_compatible(item_dir: epath.Path, abstract: Any) -> None:
  """Same leaves, shapes and dtypes on disk as in `abstract` (orbax would cast dtypes)."""
  try:
    saved = ocp.StandardCheckpointHandler().metadata(item_dir).tree
  except Exception as e:  # TensorStore and orbax raise many types
    raise _corrupt(e, item_dir) from None
  on_disk = {
    m.name: m
    for m in jax.tree.leaves(saved, is_leaf=lambda m: isinstance(m, ocp.metadata.ArrayMetadata))
  }
  wanted = {_leaf_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  for name, x in wanted.items():
    if getattr(x, "sharding", None) is None:
      raise ValueError(f"restore target leaf {name!r} of {item_dir.name} has no sharding")
    if name not in on_disk:
      raise CheckpointError(f"incompatible checkpoint: leaf {name!r} missing in {item_dir}")
    m = on_disk[name]
    if tuple(m.shape) != tuple(x.shape) or np.dtype(m.dtype) != np.dtype(x.dtype):
      raise CheckpointError(
        f"incompatible checkpoint: leaf {name!r} in {item_dir} is {tuple(m.shape)} "
        f"{np.dtype(m.dtype)}, expected {tuple(x.shape)} {np.dtype(x.dtype)}"
      )
  extra = sorted(set(on_disk) - set(wanted))
  if extra:
    raise CheckpointError(f"incompatible checkpoint: {item_dir} has unexpected leaves {extra}")


def _restore_item(item_dir: epath.Path, abstract: Any, fingerprints: Mapping[str, Any]) -> Any:
  """One orbax item read straight into the shardings of `abstract`, checked bit for bit."""
  if not item_dir.is_dir():
    raise CheckpointError(f"incompatible checkpoint: no item directory {item_dir}")
  _check_json_files(item_dir)
  _check_compatible(item_dir, abstract)
  read_as = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_spanning_sharding(x)), abstract
  )
  try:
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
      tree = checkpointer.restore(item_dir, args=ocp.args.StandardRestore(read_as))
  except Exception as e:
    raise _corrupt(e, item_dir) from None
  tree, _ = transfer.transfer(tree, jax.tree.map(lambda x: x.sharding, abstract), donate=True)
  for name, hashes in _fingerprints(tree).items():
    if fingerprints.get(name) != hashes:
      raise CheckpointError(
        f"corrupt checkpoint: data of leaf {name!r} in {item_dir} does not match its fingerprint"
      )
  return tree


def _restore_step(
  step_dir: epath.Path, abstract_items: Mapping[str, Any], fingerprints: Mapping[str, Any]
) -> dict[str, Any]:
  return {
    name: _restore_item(step_dir / name, abstract, fingerprints.get(name, {}))
    for name, abstract in _orbax_items(abstract_items).items()
  }


class Checkpointer:
  """Saves and restores the steps of one run in `directory` (WORKDIR/checkpoints).

  Every process calls every method (orbax coordinates the writes; JSON is written by the
  primary process only). Usable as a context manager: leaving waits for writes in flight.
  """

  def __init__(self, directory: epath.PathLike, config: CheckpointSection | None = None):
    self.directory = _absolute(directory)
    self.config = CheckpointSection() if config is None else config
    options = ocp.CheckpointManagerOptions(
      max_to_keep=self.config.keep,
      enable_async_checkpointing=self.config.async_save,
      cleanup_tmp_directories=True,  # leftovers of killed saves
      create=True,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(
    self, step: int, items: Mapping[str, Any], meta: Mapping[str, Any], *, force: bool = False
  ) -> bool:
    """Saves `items` (name -> pytree of `jax.Array`; TrainStates allowed) and `meta` (JSON).

    Saves when `step` is a multiple of `every_steps` or `force`, and the step is not saved
    already (say a run resumed at this step and is preempted before the next). With
    `async_save` it returns once the arrays are copied to host; the caller may then donate
    them. Returns whether a save was started.
    """
    if not self.due(step, force=force):
      return False
    json.dumps(meta)  # fail here, not in a background thread
    orbax_items = {name: _spanning(tree) for name, tree in _orbax_items(items).items()}
    args = {name: ocp.args.StandardSave(tree) for name, tree in orbax_items.items()}
    fingerprints = {name: _fingerprints(tree) for name, tree in orbax_items.items()}
    fingerprints[_META] = {"sha256": _meta_fingerprint(dict(meta))}
    args[_META] = ocp.args.JsonSave(dict(meta))
    args[_FINGERPRINTS] = ocp.args.JsonSave(fingerprints)
    with self._failures(f"checkpoint of step {step}"):
      return self._manager.save(step, args=ocp.args.Composite(**args), force=True)

  def due(self, step: int, *, force: bool = False) -> bool:
    """Whether `save(step, ..., force=force)` would save: on the schedule or forced, and not
    saved already."""
    every = self.config.every_steps
    scheduled = force or (every > 0 and step % every == 0)
    return scheduled and step not in self._manager.all_steps()

  @contextlib.contextmanager
  def _failures(self, what: str):
    """Turns any failure of orbax (its background thread's too) into one `CheckpointError`
    naming the cause, after removing partial step directories."""
    try:
      yield
    except CheckpointError:
      raise
    except Exception as error:  # orbax, TensorStore and the OS raise many types
      self._remove_partial_saves()
      line, _ = errors.describe(error)
      # An asynchronous save's failure surfaces at the next call: name the step that failed.
      failed = _TMP_STEP.search(line)
      if failed:
        what = f"checkpoint of step {failed.group(1)}"
      raise CheckpointError(f"{what} in {self.directory} failed: {line}") from error

  def _remove_partial_saves(self) -> None:
    if jax.process_index() != 0 or not self.directory.is_dir():
      return
    for p in self.directory.iterdir():
      if ocp.path.atomicity.TMP_DIR_SUFFIX in p.name:
        shutil.rmtree(os.fspath(p), ignore_errors=True)

  def latest_step(self) -> int | None:
    """The latest complete checkpoint's step; a save still in flight does not count."""
    steps = complete_steps(self.directory)
    return steps[-1] if steps else None

  def restore(
    self,
    step: int,
    abstract_items: Mapping[str, Any],
    check_meta: Callable[[dict[str, Any], str], None] | None = None,
  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads a complete step into the shardings of `abstract_items`.

    `abstract_items` has the structure of the saved items with `jax.ShapeDtypeStruct` leaves
    carrying a `sharding`; the arrays are read straight into those shards, which may be on
    other devices and another mesh than at save time (restoring onto another placement).

    `check_meta(meta, step_dir)`, if given, sees the meta before any array is read (a caller
    refusing a checkpoint of another kind of run raises there).

    Returns:
      The items and the meta saved with them.

    Raises:
      CheckpointError: If the step is missing or partial, a file is corrupt, or an item, leaf,
        shape or dtype differs from `abstract_items`.
    """
    step_dir = self.directory / str(step)
    if step not in complete_steps(self.directory):
      raise CheckpointError(f"no complete checkpoint for step {step}: {step_dir}")
    meta = read_meta(step_dir)
    fingerprints = _read_json(step_dir / _FINGERPRINTS / _JSON_FILE)
    if check_meta is not None:
      check_meta(meta, str(step_dir))
    restored = _restore_step(step_dir, abstract_items, fingerprints)
    return _join_items(abstract_items, restored), meta

  def wait(self) -> None:
    """Blocks until every save in flight is complete.

    Raises:
      CheckpointError: A save in flight failed (the cause named on one line).
    """
    with self._failures("a checkpoint save"):
      self._manager.wait_until_finished()

  def close(self) -> None:
    with self._failures("a checkpoint save"):
      self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def restore_params(path: epath.PathLike, abstract_params: Any, item: str = "actor") -> Any:
  """Parameters of item `item` from another run, e.g. to start PPO from SFT or a reward model.

  Args:
    path: A run's checkpoints directory (its latest complete step is read) or one step
      directory in it.
    abstract_params: `jax.ShapeDtypeStruct` tree with shardings to read the parameters into.
    item: The saved item: a TrainState's params (`<item>_params/`) or a plain item (`<item>/`).

  Raises:
    CheckpointError: If `path` holds no complete checkpoint or the item is missing, corrupt
      or does not match `abstract_params`.
  """
  step_dir = find_step_dir(path)
  item_dir = item_directory(step_dir, item)
  fingerprints = _read_json(step_dir / _FINGERPRINTS / _JSON_FILE)
  return _restore_item(item_dir, abstract_params, fingerprints.get(item_dir.name, {}))


def item_directory(step_dir: epath.PathLike, item: str) -> epath.Path:
  """Where a step keeps the parameters of `item`: a TrainState's `<item>_params/` or a plain
  item's `<item>/`."""
  step_dir = epath.Path(step_dir)
  for name in (item + _PARAMS, item):
    if (step_dir / name).exists():
      return step_dir / name
  found = sorted(p.name for p in step_dir.iterdir() if p.is_dir())
  raise CheckpointError(f"no item {item!r} in {step_dir}; found {found}")


def read_meta(step_dir: epath.PathLike) -> dict[str, Any]:
  """The meta a complete step was saved with, checked against its fingerprint."""
  step_dir = epath.Path(step_dir)
  meta_file = step_dir / _META / _JSON_FILE
  meta = _read_json(meta_file)
  fingerprints = _read_json(step_dir / _FINGERPRINTS / _JSON_FILE)
  if fingerprints.get(_META, {}).get("sha256") != _meta_fingerprint(meta):
    raise CheckpointError(f"corrupt checkpoint: {meta_file} does not match its fingerprint")
  return meta
