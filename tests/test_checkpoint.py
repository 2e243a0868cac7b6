"""Checkpoints: round trips, restoring onto another placement, partial and corrupt steps."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax.checkpoint import (
  Checkpointer,
  CheckpointError,
  CheckpointSection,
  complete_steps,
  restore_params,
)
from rlhfjax.training.state import TrainState, train_state_shardings

pytestmark = pytest.mark.unit

TX = optax.adamw(1e-3)


def _fsdp_mesh():
  return Mesh(np.array(jax.devices()[:4]), ("fsdp",))


def _other_mesh():
  return Mesh(np.array(jax.devices()[4:]).reshape(2, 2), ("data", "tensor"))


def _params(seed: int = 0):
  rng = np.random.default_rng(seed)
  # Distinct dimensions (divisible by the mesh axes they are split over). "embed" is too big for
  # orbax to inline its data into OCDBT's (checksummed) index nodes.
  return {
    "embed": rng.normal(size=(48, 40)).astype(np.float32),
    "layer": {"w": rng.normal(size=(4, 6)).astype(jnp.bfloat16), "b": np.arange(6, dtype=np.int32)},
  }


def _param_shardings(mesh, spec):
  return {
    "embed": NamedSharding(mesh, spec),
    "layer": {"w": NamedSharding(mesh, spec), "b": NamedSharding(mesh, PartitionSpec())},
  }


def _state(mesh, spec, seed: int = 0):
  """A TrainState with nonzero optimizer moments, laid out over `mesh`, and its shardings."""
  params = jax.tree.map(jnp.asarray, _params(seed))
  opt_state = jax.tree.map(lambda x: x + 1, TX.init(params))
  state = TrainState(step=jnp.int32(7), params=params, opt_state=opt_state)
  replicated = NamedSharding(mesh, PartitionSpec())
  abstract_params = jax.eval_shape(lambda: params)
  shardings = train_state_shardings(_param_shardings(mesh, spec), abstract_params, TX, replicated)
  return jax.device_put(state, shardings), shardings


def _abstract(shardings, like):
  return jax.tree.map(
    lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shardings, like
  )


def _assert_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _box(index, shape):
  return tuple(i.indices(n)[:2] for i, n in zip(index, shape, strict=True))


def _assert_placed(tree, shardings):
  """Every shard on the device and covering the block that `shardings` asks for."""
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
    want = s.devices_indices_map(x.shape)
    assert {shard.device for shard in x.addressable_shards} == set(want)
    for shard in x.addressable_shards:
      assert shard.data.devices() == {shard.device}
      assert _box(shard.index, x.shape) == _box(want[shard.device], x.shape)


def _sync(tmp_path, **kw):
  return Checkpointer(tmp_path / "checkpoints", CheckpointSection(async_save=False, **kw))


def test_round_trip_and_meta(tmp_path):
  state, shardings = _state(_fsdp_mesh(), PartitionSpec("fsdp"))
  meta = {"step": 5, "rng": [0, 42], "kl_coef": 0.05, "data": {"epoch": 1, "index": 7}}
  with _sync(tmp_path, every_steps=5) as ckpt:
    assert ckpt.latest_step() is None
    assert not ckpt.save(4, {"actor": state}, meta)
    assert ckpt.save(5, {"actor": state}, meta)
    assert not ckpt.save(5, {"actor": state}, meta, force=True)  # already there
    assert ckpt.latest_step() == 5
    items, got_meta = ckpt.restore(5, {"actor": _abstract(shardings, state)})
  assert isinstance(items["actor"], TrainState)
  _assert_equal(items["actor"], state)
  _assert_placed(items["actor"], shardings)
  assert got_meta == meta
  names = sorted(p.name for p in (tmp_path / "checkpoints" / "5").iterdir() if p.is_dir())
  assert names == ["actor_opt_state", "actor_params", "fingerprints", "meta"]


def test_restore_onto_another_placement(tmp_path):
  state, _ = _state(_fsdp_mesh(), PartitionSpec("fsdp"))
  assert {d.id for d in state.params["embed"].sharding.device_set} == {0, 1, 2, 3}
  _, target = _state(_other_mesh(), PartitionSpec("tensor", "data"))
  with _sync(tmp_path) as ckpt:
    ckpt.save(10, {"actor": state}, {}, force=True)
    items, _ = ckpt.restore(10, {"actor": _abstract(target, state)})
  _assert_equal(items["actor"], state)
  _assert_placed(items["actor"], target)
  embed = items["actor"].params["embed"]
  assert {s.device.id for s in embed.addressable_shards} == {4, 5, 6, 7}
  assert {s.index[0].indices(48)[:2] for s in embed.addressable_shards} == {(0, 24), (24, 48)}


def test_keeps_last_n(tmp_path):
  params = jax.device_put(_params(), _param_shardings(_fsdp_mesh(), PartitionSpec("fsdp")))
  with _sync(tmp_path, every_steps=1, keep=2) as ckpt:
    for step in range(1, 5):
      assert ckpt.save(step, {"reward": params}, {"step": step})
  assert complete_steps(tmp_path / "checkpoints") == [3, 4]


def test_async_save_then_wait(tmp_path):
  state, shardings = _state(_fsdp_mesh(), PartitionSpec("fsdp"))
  expected = jax.device_get(state)
  abstract = _abstract(shardings, state)
  config = CheckpointSection(every_steps=2, async_save=True)
  with Checkpointer(tmp_path / "checkpoints", config) as ckpt:
    assert ckpt.save(2, {"actor": state}, {"step": 2})
    jax.tree.map(lambda x: x.delete(), state)  # as a donating train step would
    ckpt.wait()
    assert ckpt.latest_step() == 2
    items, meta = ckpt.restore(2, {"actor": abstract})
  _assert_equal(items["actor"], expected)
  assert meta == {"step": 2}


@pytest.fixture
def saved(tmp_path):
  """A run directory with complete steps 3 and 6, and the state saved at step 6."""
  state, shardings = _state(_fsdp_mesh(), PartitionSpec("fsdp"))
  with _sync(tmp_path, every_steps=3) as ckpt:
    ckpt.save(3, {"actor": state}, {"step": 3})
    ckpt.save(6, {"actor": state}, {"step": 6})
  return tmp_path / "checkpoints", state, _abstract(shardings, state)


def test_partial_checkpoints_are_skipped(saved, tmp_path):
  directory, state, abstract = saved
  tmp = directory / "9.orbax-checkpoint-tmp-1234567"  # a save killed mid-way
  (tmp / "actor_params").mkdir(parents=True)
  unmarked = directory / "12"  # a step directory without orbax's completion marker
  os.system(f"cp -r {directory / '6'} {unmarked}")
  (unmarked / "commit_success.txt").unlink()
  ckpt = _sync(tmp_path, every_steps=3)
  assert ckpt.latest_step() == 6
  with pytest.raises(CheckpointError, match="no complete checkpoint for step 12"):
    ckpt.restore(12, {"actor": abstract})
  ckpt.close()
  with pytest.raises(CheckpointError, match=f"partial checkpoint .*{unmarked}"):
    restore_params(unmarked, abstract.params)
  params = restore_params(directory, abstract.params)  # skips 12, reads 6
  _assert_equal(params, state.params)


def _largest_file(directory):
  files = [p for p in directory.rglob("*") if p.is_file()]
  return max(files, key=lambda p: p.stat().st_size)


def _truncate(path):
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x55
  path.write_bytes(bytes(data))


@pytest.mark.parametrize(
  "pick, damage, named",
  [
    (lambda d: d / "actor_params" / "_METADATA", _truncate, "file"),
    (lambda d: d / "actor_params" / "manifest.ocdbt", _flip, "file"),
    (lambda d: _largest_file(d / "actor_params" / "d"), _truncate, "file"),
    # Array data is compressed but not checksummed by orbax: the fingerprint catches it.
    (lambda d: _largest_file(d / "actor_params" / "ocdbt.process_0" / "d"), _flip, "item"),
    (lambda d: d / "meta" / "metadata", _truncate, "file"),
  ],
  ids=["metadata", "manifest", "index", "array-data", "meta"],
)
def test_corrupt_file_is_named(saved, tmp_path, pick, damage, named):
  directory, _, abstract = saved
  path = pick(directory / "6")
  damage(path)
  ckpt = _sync(tmp_path)
  with pytest.raises(CheckpointError, match="corrupt checkpoint") as error:
    ckpt.restore(6, {"actor": abstract})
  ckpt.close()
  message = str(error.value)
  assert "\n" not in message
  assert str(path if named == "file" else directory / "6" / "actor_params") in message


def test_shape_mismatch_names_the_leaf(saved):
  directory, _, abstract = saved
  wrong = dict(abstract.params)
  embed = abstract.params["embed"]
  wrong["embed"] = jax.ShapeDtypeStruct((48, 8), embed.dtype, sharding=embed.sharding)
  with pytest.raises(CheckpointError, match=r"leaf 'embed' .* is \(48, 40\) .*expected \(48, 8\)"):
    restore_params(directory, wrong)
  layer = dict(wrong["layer"], w=jax.ShapeDtypeStruct((4, 6), jnp.float32, sharding=embed.sharding))
  with pytest.raises(CheckpointError, match=r"leaf 'layer.w' .* bfloat16, expected .* float32"):
    restore_params(directory, dict(abstract.params, layer=layer))
  with pytest.raises(CheckpointError, match="no item 'critic'"):
    restore_params(directory, abstract.params, item="critic")


def test_restore_params_from_run_or_step_dir(saved, tmp_path):
  directory, state, abstract = saved
  _, target = _state(_other_mesh(), PartitionSpec(None, "tensor"))
  from_run = restore_params(directory, _abstract(target.params, state.params))
  from_step = restore_params(directory / "3", abstract.params)
  _assert_equal(from_run, state.params)
  _assert_equal(from_step, state.params)
  _assert_placed(from_run, target.params)
  with pytest.raises(CheckpointError, match="no complete checkpoint in"):
    restore_params(tmp_path, abstract.params)
  with pytest.raises(CheckpointError, match="does not exist"):
    restore_params(tmp_path / "nowhere", abstract.params)


def test_section_validation():
  with pytest.raises(ValueError, match="every_steps"):
    CheckpointSection(every_steps=-1)
  with pytest.raises(ValueError, match="keep"):
    CheckpointSection(keep=0)
