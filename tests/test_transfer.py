"""Weight transfer between meshes: values, placement, byte counts, and no host round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax.mesh import transfer as transfer_lib
from rlhfjax.mesh.meshes import make_mesh
from rlhfjax.mesh.rules import named_shardings
from rlhfjax.mesh.transfer import no_host_transfers, transfer, verify_transfer
from rlhfjax.placement.spec import RoleSpec

pytestmark = pytest.mark.unit

# Tiny distinct dimensions, so that a transposed axis cannot pass.
V, E, H, K, D, F, L = 328, 56, 4, 2, 12, 152, 3

AXES = {
  "embed": {"embedding": ("vocab", "embed")},
  "layers": {
    "attn": {
      "q_proj": {
        "kernel": ("layers", "embed", "heads", "head_dim"),
        "bias": ("layers", "heads", "head_dim"),
      },
      "k_proj": {"kernel": ("layers", "embed", "kv_heads", "head_dim")},
      "v_proj": {"kernel": ("layers", "embed", "kv_heads", "head_dim")},
      "o_proj": {"kernel": ("layers", "heads", "head_dim", "embed")},
    },
    "mlp": {
      "gate_proj": {"kernel": ("layers", "embed", "mlp")},
      "up_proj": {"kernel": ("layers", "embed", "mlp")},
      "down_proj": {"kernel": ("layers", "mlp", "embed")},
    },
    "attn_norm": {"scale": ("layers", "norm")},
    "mlp_norm": {"scale": ("layers", "norm")},
  },
  "final_norm": {"scale": ("norm",)},
  "lm_head": {"kernel": ("embed", "vocab")},
}
_DIMS = {
  "vocab": V,
  "embed": E,
  "heads": H,
  "kv_heads": K,
  "head_dim": D,
  "mlp": F,
  "layers": L,
  "norm": E,
}
_is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
SHAPES = jax.tree.map(lambda axes: tuple(_DIMS[a] for a in axes), AXES, is_leaf=_is_axes)


def _training(devices, data=1, fsdp=1, tensor=1):
  return RoleSpec.training(devices, data=data, fsdp=fsdp, tensor=tensor)


def _generation(devices, data=1, tensor=1):
  return RoleSpec.generation(devices, data=data, tensor=tensor)


def _shardings(spec):
  return named_shardings(AXES, SHAPES, make_mesh(spec), spec.layout)


def _host_tree(dtype, seed=0):
  """Distinct values in every leaf (and across leaves), so a misplaced block cannot pass."""
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=_is_axes)
  out, offset = [], 0
  for shape in leaves:
    n = int(np.prod(shape))
    if dtype == jnp.bfloat16:  # too few bfloat16 values for a permutation; random is enough
      values = rng.standard_normal(n).astype(jnp.bfloat16)
    else:
      values = (offset + rng.permutation(n)).astype(dtype)
    out.append(values.reshape(shape))
    offset += n
  return jax.tree.unflatten(treedef, out)


def _nbytes(tree, keep=lambda path: True):
  return sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(tree) if keep(path))


def _assert_equal_to_host(tree, host):
  for got, want in zip(jax.tree.leaves(jax.device_get(tree)), jax.tree.leaves(host), strict=True):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def _is_norm(path):
  return "norm" in jax.tree_util.keystr(path)


# (source, target, which leaves move). Norm scales are replicated in both layouts, so they stay
# in place when the device set is the same.
CASES = {
  "disaggregated": (_training(range(4), fsdp=4), _generation(range(4, 8), data=2, tensor=2), None),
  "colocated": (_training(range(8), fsdp=8), _generation(range(8), data=4, tensor=2), _is_norm),
  "interleaved": (_training(range(8), fsdp=8), _generation(range(4), tensor=4), None),
  "fsdp_tensor_to_other_devices": (
    _training(range(4), fsdp=2, tensor=2),
    _generation(range(4, 8), data=2, tensor=2),
    None,
  ),
  "same_layout_other_devices": (_training(range(4), fsdp=4), _training(range(4, 8), fsdp=4), None),
  "same_devices_other_order": (_training((3, 2, 1, 0), fsdp=4), _training(range(4), fsdp=4), None),
  "one_to_four": (_training((5,)), _generation(range(4), tensor=4), None),
  "four_to_one": (_generation(range(4), tensor=4), _generation((5,)), None),
  "non_contiguous": (
    _training((7, 1, 4, 2), fsdp=2, tensor=2),
    _generation((0, 6), tensor=2),
    None,
  ),
}


@pytest.mark.parametrize(
  ("case", "dtype"),
  [(case, jnp.float32) for case in CASES]
  + [(case, jnp.bfloat16) for case in ("disaggregated", "colocated", "interleaved")],
)
def test_transfer(case, dtype):
  src_spec, dst_spec, stays = CASES[case]
  host = _host_tree(dtype)
  dst_shardings = _shardings(dst_spec)
  src = jax.block_until_ready(jax.device_put(host, _shardings(src_spec)))
  with no_host_transfers():
    moved, nbytes = transfer(src, dst_shardings)
    jax.block_until_ready(moved)
  _assert_equal_to_host(moved, host)
  verify_transfer(src, moved, dst_shardings)
  expected_devices = {jax.devices()[i] for i in dst_spec.devices}
  for leaf in jax.tree.leaves(moved):
    assert {s.device for s in leaf.addressable_shards} == expected_devices
  assert nbytes == _nbytes(host, lambda path: stays is None or not stays(path))
  _assert_equal_to_host(src, host)  # the source is untouched


def test_transfer_one_device_to_four_and_back():
  host = _host_tree(jnp.float32)
  one, four = _shardings(_training((2,))), _shardings(_generation((4, 5, 6, 7), data=2, tensor=2))
  src = jax.device_put(host, one)
  with no_host_transfers():
    there, _ = transfer(src, four)
    back, nbytes = transfer(there, one)
    jax.block_until_ready(back)
  verify_transfer(src, there, four)
  verify_transfer(there, back, one)
  _assert_equal_to_host(back, host)
  assert nbytes == _nbytes(host)


@pytest.mark.parametrize("case", ["disaggregated", "colocated", "interleaved", "one_to_four"])
def test_transfer_into_donated_buffers(case):
  src_spec, dst_spec, _ = CASES[case]
  dst_shardings = _shardings(dst_spec)
  old_host, new_host = _host_tree(jnp.float32, seed=0), _host_tree(jnp.float32, seed=1)
  old = jax.device_put(old_host, _shardings(src_spec))
  new = jax.device_put(new_host, _shardings(src_spec))
  with no_host_transfers():
    first, _ = transfer(old, dst_shardings)
    jax.block_until_ready(first)
  pointers = jax.tree.map(
    lambda x: [s.data.unsafe_buffer_pointer() for s in x.addressable_shards], first
  )
  with no_host_transfers():
    second, _ = transfer(new, dst_shardings, into=first)
    jax.block_until_ready(second)
  verify_transfer(new, second, dst_shardings)
  _assert_equal_to_host(second, new_host)
  assert all(x.is_deleted() for x in jax.tree.leaves(first))
  # Blocks that had to be cut or joined were joined in place, into the donated buffer on the
  # device that builds them (the first holding each block); replicas are copies of it.
  for name, leaf in (("embed", "embedding"), ("lm_head", "kernel")):
    x, old = second[name][leaf], pointers[name][leaf]
    builders = {}
    for k, shard in enumerate(x.addressable_shards):
      builders.setdefault(transfer_lib._box(shard.index, x.shape), (k, shard))
    for k, shard in builders.values():
      assert shard.data.unsafe_buffer_pointer() == old[k], (name, shard.device)


def test_transfer_donate_deletes_the_source():
  src_spec, dst_spec, _ = CASES["disaggregated"]
  host = _host_tree(jnp.float32)
  dst_shardings = _shardings(dst_spec)
  src = jax.device_put(host, _shardings(src_spec))
  with no_host_transfers():
    moved, _ = transfer(src, dst_shardings, donate=True)
    jax.block_until_ready(moved)
  assert all(x.is_deleted() for x in jax.tree.leaves(src))
  _assert_equal_to_host(moved, host)


def test_transfer_in_place_is_a_no_op():
  spec = _training(range(4), fsdp=4)
  src = jax.device_put(_host_tree(jnp.float32), _shardings(spec))
  moved, nbytes = transfer(src, _shardings(spec))
  assert nbytes == 0
  assert all(a is b for a, b in zip(jax.tree.leaves(src), jax.tree.leaves(moved), strict=True))


def test_transfer_accepts_a_sharding_prefix():
  src = {
    "a": jax.device_put(np.arange(24.0).reshape(4, 6), jax.devices()[0]),
    "b": jax.device_put(np.arange(8.0), jax.devices()[1]),
  }
  mesh = make_mesh(_training((4, 5), fsdp=2))
  target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  with no_host_transfers():
    moved, nbytes = transfer(src, target)
  verify_transfer(src, moved, {"a": target, "b": target})
  assert nbytes == 24 * 4 + 8 * 4


def test_transfer_rejects_host_arrays_and_mismatched_into():
  spec = _training(range(4), fsdp=4)
  with pytest.raises(TypeError, match="jax.Array"):
    transfer({"x": np.zeros(4)}, {"x": jax.sharding.SingleDeviceSharding(jax.devices()[0])})
  src = jax.device_put(_host_tree(jnp.float32), _shardings(spec))
  wrong = jax.device_put(_host_tree(jnp.float32), _shardings(_training(range(4, 8), fsdp=4)))
  with pytest.raises(ValueError, match="does not match"):
    transfer(src, _shardings(_generation(range(4, 8), tensor=4)), into=wrong)


def test_verify_transfer_catches_swapped_shards():
  spec = _training(range(4), fsdp=4)
  host = _host_tree(jnp.float32)["embed"]["embedding"]
  sharding = _shardings(spec)["embed"]["embedding"]
  src = jax.device_put(host, sharding)
  shards = [s.data for s in src.addressable_shards]
  # Same devices and sharding, but the data of devices 0 and 1 swapped.
  swapped_data = [
    jax.device_put(shards[1], shards[0].devices().pop()),
    jax.device_put(shards[0], shards[1].devices().pop()),
    *shards[2:],
  ]
  swapped = jax.make_array_from_single_device_arrays(host.shape, sharding, swapped_data)
  with pytest.raises(AssertionError):
    verify_transfer(src, swapped, sharding)


def test_plain_device_put_round_trips_through_host():
  """Documents the jax 0.10 behaviour `transfer` works around (see its module docstring).

  If this starts failing, `jax.device_put` has learnt to relayout device to device, and
  `transfer` may be able to use it directly.
  """
  src_spec, dst_spec, _ = CASES["disaggregated"]
  src = jax.device_put(_host_tree(jnp.float32), _shardings(src_spec))
  dst_shardings = _shardings(dst_spec)
  with jax.transfer_guard("disallow"):  # explicit transfers pass this guard, host ones included
    jax.block_until_ready(jax.device_put(src, dst_shardings))
  with pytest.raises(Exception, match="Disallowed host-to-device transfer"), no_host_transfers():
    jax.block_until_ready(jax.device_put(src, dst_shardings))


def test_repeated_transfer_does_not_recompile():
  src_spec, dst_spec, _ = CASES["disaggregated"]
  dst_shardings = _shardings(dst_spec)
  src = jax.device_put(_host_tree(jnp.float32), _shardings(src_spec))
  jitted = (transfer_lib._cut_all, transfer_lib._join_all, transfer_lib._write_all)
  moved = transfer(src, dst_shardings)[0]
  moved = transfer(src, dst_shardings, into=moved)[0]
  sizes = [f._cache_size() for f in jitted]
  for _ in range(2):
    moved = transfer(src, dst_shardings)[0]
    moved = transfer(src, dst_shardings, into=moved)[0]
  assert [f._cache_size() for f in jitted] == sizes


@pytest.mark.parametrize("alias", ["same_object", "same_buffers", "into_twice"])
def test_transfer_into_never_frees_buffers_the_caller_still_holds(alias):
  """An `into` leaf that still backs a leaf of `tree` (or another `into` leaf) is not donated."""
  src_sharding = _shardings(_training(range(4), fsdp=4))["lm_head"]["kernel"]
  dst_sharding = _shardings(_generation((4, 5), tensor=2))["lm_head"]["kernel"]
  x_host, y_host = (_host_tree(jnp.float32, seed)["lm_head"]["kernel"] for seed in (0, 1))
  x = jax.device_put(x_host, src_sharding)  # moves: cut and joined, so `into` would be written
  y = jax.device_put(y_host, dst_sharding)  # already in place: returned as it is
  shards = [s.data for s in y.addressable_shards]
  y_again = jax.make_array_from_single_device_arrays(y.shape, dst_sharding, shards)
  tree, into = (
    {"x": x, "y": y},
    {
      "same_object": {"x": y, "y": y},
      "same_buffers": {"x": y_again, "y": y},
      "into_twice": {"x": y, "y": y},
    }[alias],
  )
  if alias == "into_twice":
    tree = {"x": x, "y": jax.device_put(x_host, src_sharding)}
  with no_host_transfers():
    moved, _ = transfer(tree, dst_sharding, into=into)
    jax.block_until_ready(moved)
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(tree))
  np.testing.assert_array_equal(jax.device_get(moved["x"]), x_host)
  want_y = x_host if alias == "into_twice" else y_host
  np.testing.assert_array_equal(jax.device_get(moved["y"]), want_y)
  verify_transfer(tree, moved, dst_sharding)


@pytest.mark.parametrize("into", [False, True])
def test_traffic_counts_each_step(into):
  """8x16 float32 by columns on 4 devices -> by rows on a 2x2 (data x tensor) mesh elsewhere."""
  devices = jax.devices()
  src_sharding = jax.sharding.NamedSharding(
    jax.sharding.Mesh(np.array(devices[:4]), ("fsdp",)), jax.sharding.PartitionSpec(None, "fsdp")
  )
  dst_sharding = jax.sharding.NamedSharding(
    jax.sharding.Mesh(np.array(devices[4:]).reshape(2, 2), ("data", "tensor")),
    jax.sharding.PartitionSpec("tensor", None),
  )
  x = jax.device_put(np.arange(128, dtype=np.float32).reshape(8, 16), src_sharding)
  t = transfer_lib.traffic({"x": x}, dst_sharding, into=into)
  # Two 4x16 boxes (256 bytes), each of four 4x4 pieces cut from the column shards and copied to
  # the box's first device, joined there and copied once more to its replica.
  assert (t.cut, t.copied, t.joined, t.delivered) == (512, 512 + 512, 512, 1024)
  assert t.passes == 2.0
  moved, nbytes = transfer({"x": x}, dst_sharding)
  assert t.delivered == sum(s.data.nbytes for s in moved["x"].addressable_shards)
  assert nbytes == 512


def test_traffic_of_whole_shards_is_one_pass():
  src_spec, dst_spec = _training(range(4), fsdp=4), _training(range(4, 8), fsdp=4)
  src = jax.device_put(_host_tree(jnp.float32), _shardings(src_spec))
  t = transfer_lib.traffic(src, _shardings(dst_spec))
  moved, _ = transfer(src, _shardings(dst_spec))
  shard_bytes = sum(s.data.nbytes for x in jax.tree.leaves(moved) for s in x.addressable_shards)
  assert (t.cut, t.joined) == (0, 0)
  assert t.copied == t.delivered == shard_bytes  # the norms' replicas too
  assert t.passes == 1.0
  # Nothing to move: nothing written.
  assert transfer_lib.traffic(src, _shardings(src_spec)).written == 0


def test_exchange_rounds_are_partial_permutations_of_one_dtype():
  # Messages (source, target, dtype) between the devices of two "processes": every device
  # sends at most one message and receives at most one per round, a round has one dtype, and
  # every message is sent exactly once, the largest first.
  rng = np.random.default_rng(0)
  sizes = {}
  for _ in range(40):
    src, dst = int(rng.integers(0, 4)), int(rng.integers(4, 8))
    sizes[src, dst, str(rng.choice(["float32", "bfloat16"]))] = int(rng.integers(1, 1000))
  rounds = transfer_lib._rounds(sizes)
  assert sorted(k for r in rounds for k in r) == sorted(sizes)
  for r in rounds:
    assert len({k[0] for k in r}) == len(r) and len({k[1] for k in r}) == len(r)
    assert len({k[2] for k in r}) == 1
  firsts = [max(sizes[k] for k in r) for r in rounds if r[0][2] == "float32"]
  assert firsts == sorted(firsts, reverse=True)
