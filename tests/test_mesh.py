"""Logical-to-mesh rules and meshes built from placement specs."""

import logging

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlhfjax.mesh import rules
from rlhfjax.mesh.meshes import make_mesh, role_meshes
from rlhfjax.placement.spec import Layout, PlacementSpec, Role, RoleSpec

pytestmark = pytest.mark.unit

# Tiny distinct dimensions, so that a transposed axis cannot pass.
V, E, H, K, D, F, L = 328, 56, 4, 2, 12, 152, 3


def _training(devices, data=1, fsdp=1, tensor=1):
  return RoleSpec.training(devices, data=data, fsdp=fsdp, tensor=tensor)


def _generation(devices, data=1, tensor=1):
  return RoleSpec.generation(devices, data=data, tensor=tensor)


def _spec(axes, spec, shape):
  return rules.partition_spec(axes, spec.layout, make_mesh(spec), shape)


@pytest.mark.parametrize(
  ("axes", "shape", "expected"),
  [
    (("vocab", "embed"), (V, E), P("tensor", "fsdp")),
    (("layers", "embed", "heads", "head_dim"), (L, E, H, D), P(None, "fsdp", "tensor", None)),
    (("layers", "embed", "kv_heads", "head_dim"), (L, E, K, D), P(None, "fsdp", "tensor", None)),
    (("layers", "heads", "head_dim", "embed"), (L, H, D, E), P(None, "tensor", None, "fsdp")),
    (("layers", "embed", "mlp"), (L, E, F), P(None, "fsdp", "tensor")),
    (("layers", "mlp", "embed"), (L, F, E), P(None, "tensor", "fsdp")),
    (("layers", "norm"), (L, E), P(None, None)),
    (("norm",), (E,), P(None)),
    (("embed", "vocab"), (E, V), P("fsdp", "tensor")),
    (("batch", "length", "vocab"), (8, 40, V), P("fsdp", None, "tensor")),
  ],
)
def test_training_rules_divisible(axes, shape, expected):
  spec, replicated = rules.resolve(
    axes, Layout.TRAINING, make_mesh(_training(range(8), fsdp=4, tensor=2)), shape
  )
  assert spec == expected
  assert replicated == ()


@pytest.mark.parametrize(
  ("axes", "shape", "expected"),
  [
    (("vocab", "embed"), (V, E), P("tensor", None)),
    (("layers", "embed", "heads", "head_dim"), (L, E, H, D), P(None, None, "tensor", None)),
    (("layers", "heads", "head_dim", "embed"), (L, H, D, E), P(None, "tensor", None, None)),
    (("layers", "embed", "mlp"), (L, E, F), P(None, None, "tensor")),
    (("layers", "mlp", "embed"), (L, F, E), P(None, "tensor", None)),
    (("embed", "vocab"), (E, V), P(None, "tensor")),
    (("layers", "norm"), (L, E), P(None, None)),
    (("batch", "length"), (6, 40), P("data", None)),
    (rules.KV_CACHE_AXES, (L, 6, 40, K, D), P(None, "data", None, "tensor", None)),
  ],
)
def test_generation_rules_divisible(axes, shape, expected):
  spec, replicated = rules.resolve(
    axes, Layout.GENERATION, make_mesh(_generation(range(4), data=2, tensor=2)), shape
  )
  assert spec == expected
  assert replicated == ()


def test_indivisible_dimension_is_replicated_and_reported():
  mesh = make_mesh(_generation(range(8), data=2, tensor=4))
  spec, replicated = rules.resolve(
    ("layers", "embed", "kv_heads", "head_dim"), Layout.GENERATION, mesh, (L, E, K, D)
  )
  assert spec == P(None, None, None, None)
  assert replicated == (
    rules.Replicated(
      dim=2, logical_axis="kv_heads", size=K, mesh_axes=("tensor",), reason="indivisible"
    ),
  )
  # Heads (4) still split over the same 4-way axis.
  assert _spec(
    ("layers", "embed", "heads", "head_dim"), _generation(range(8), data=2, tensor=4), (L, E, H, D)
  ) == P(None, None, "tensor", None)


def test_indivisible_dimension_in_training_layout():
  spec = _training(range(8), fsdp=8)
  # embed 56 = 7 * 8 splits 8 ways; 12 does not.
  assert _spec(("vocab", "embed"), spec, (V, E)) == P(None, "fsdp")
  assert _spec(("embed", "vocab"), spec, (12, V)) == P(None, None)
  heads8 = _training(range(8), tensor=8)
  assert _spec(("layers", "embed", "heads", "head_dim"), heads8, (L, E, H, D)) == P(
    None, None, None, None
  )
  assert _spec(("vocab", "embed"), heads8, (V, E)) == P("tensor", None)  # 328 = 41 * 8


def test_batch_over_data_and_fsdp_keeps_the_dividing_prefix():
  mesh = make_mesh(_training(range(8), data=2, fsdp=4))
  assert rules.resolve(("batch", "length"), Layout.TRAINING, mesh, (16, 40))[0] == P(
    ("data", "fsdp"), None
  )
  spec, replicated = rules.resolve(("batch", "length"), Layout.TRAINING, mesh, (6, 40))
  assert spec == P("data", None)
  assert [(r.mesh_axes, r.reason) for r in replicated] == [(("fsdp",), "indivisible")]
  assert rules.resolve(("batch", "length"), Layout.TRAINING, mesh, (3, 40))[0] == P(None, None)


def test_size_one_and_missing_mesh_axes_are_dropped():
  # Training rules on a mesh with a size-1 tensor axis: vocab stays unsharded, no report.
  spec, replicated = rules.resolve(
    ("vocab", "embed"), Layout.TRAINING, make_mesh(_training(range(4), fsdp=4)), (V, E)
  )
  assert spec == P(None, "fsdp")
  assert replicated == ()
  # A generation mesh has no fsdp axis at all.
  spec, replicated = rules.resolve(
    ("batch", "length"),
    Layout.TRAINING,
    make_mesh(_generation(range(4), data=2, tensor=2)),
    (8, 40),
  )
  assert spec == P("data", None)
  assert replicated == ()


def test_mesh_axis_is_used_once():
  mesh = make_mesh(_training(range(8), fsdp=4, tensor=2))
  spec, replicated = rules.resolve(("heads", "mlp"), Layout.TRAINING, mesh, (H, F))
  assert spec == P("tensor", None)
  assert replicated == (
    rules.Replicated(
      dim=1, logical_axis="mlp", size=F, mesh_axes=("tensor",), reason="axis already used"
    ),
  )


def test_bad_logical_axes_raise():
  mesh = make_mesh(_training(range(4), fsdp=4))
  with pytest.raises(ValueError, match="no rule"):
    rules.resolve(("embedding",), Layout.TRAINING, mesh, (E,))
  with pytest.raises(ValueError, match="do not match shape"):
    rules.resolve(("vocab", "embed"), Layout.TRAINING, mesh, (V,))


def test_named_shardings_tree_and_logging(caplog):
  axes = {
    "embed": {"embedding": ("vocab", "embed")},
    "layers": {"k_proj": {"kernel": ("layers", "embed", "kv_heads", "head_dim")}},
    "final_norm": {"scale": ("norm",)},
  }
  shapes = {
    "embed": {"embedding": (V, E)},
    "layers": {"k_proj": {"kernel": jax.ShapeDtypeStruct((L, E, K, D), np.float32)}},
    "final_norm": {"scale": (E,)},
  }
  spec = _generation(range(4), tensor=4)
  mesh = make_mesh(spec)
  with caplog.at_level(logging.INFO):
    shardings = rules.named_shardings(axes, shapes, mesh, spec.layout)
  assert jax.tree.structure(shardings) == jax.tree.structure(
    axes, is_leaf=lambda x: isinstance(x, tuple)
  )
  assert all(isinstance(s, NamedSharding) and s.mesh is mesh for s in jax.tree.leaves(shardings))
  assert shardings["embed"]["embedding"].spec == P("tensor", None)
  assert shardings["layers"]["k_proj"]["kernel"].spec == P(None, None, None, None)
  assert shardings["final_norm"]["scale"].spec == P(None)
  assert "['layers']['k_proj']['kernel']" in caplog.text
  assert "kv_heads" in caplog.text and "indivisible" in caplog.text


def _ids(mesh):
  return np.vectorize(lambda d: d.id)(mesh.devices)


def test_make_mesh_is_row_major_over_the_spec_devices():
  mesh = make_mesh(_generation((4, 5, 6, 7), data=2, tensor=2))
  assert mesh.axis_names == ("data", "tensor")
  np.testing.assert_array_equal(_ids(mesh), [[4, 5], [6, 7]])
  assert mesh.devices[1, 0] is jax.devices()[6]

  mesh = make_mesh(_training((6, 1, 3, 0, 7, 2), data=1, fsdp=3, tensor=2))
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert mesh.devices.shape == (1, 3, 2)
  np.testing.assert_array_equal(_ids(mesh), [[[6, 1], [3, 0], [7, 2]]])


def test_make_mesh_with_explicit_devices():
  devices = jax.devices()[::-1]
  mesh = make_mesh(_training((0, 1), fsdp=2), devices=devices)
  np.testing.assert_array_equal(_ids(mesh), [[[7], [6]]])


@pytest.mark.parametrize(
  ("spec", "match"),
  [
    (_training((0, 1, 2), fsdp=4), "do not fill"),
    (_training((0, 1, 2, 8), fsdp=4), "out of range"),
    (_training((0, 1, 1, 2), fsdp=4), "repeat"),
  ],
)
def test_make_mesh_errors(spec, match):
  with pytest.raises(ValueError, match=match):
    make_mesh(spec)


def test_role_meshes_share_identical_meshes():
  train = _training(range(4), fsdp=4)
  placement = PlacementSpec(
    strategy="test",
    roles={
      Role.ACTOR: train,
      Role.CRITIC: _training(range(4), fsdp=4),
      Role.REFERENCE: _training(range(4), fsdp=2, tensor=2),
      Role.REWARD: _training(range(4, 8), fsdp=4),
      Role.ROLLOUT: _generation(range(4, 8), data=2, tensor=2),
    },
  )
  meshes = role_meshes(placement)
  assert set(meshes) == set(Role)
  assert meshes[Role.ACTOR] is meshes[Role.CRITIC]
  assert meshes[Role.REFERENCE] is not meshes[Role.ACTOR]
  assert meshes[Role.REWARD] is not meshes[Role.ROLLOUT]
  np.testing.assert_array_equal(_ids(meshes[Role.ROLLOUT]), [[4, 5], [6, 7]])
  np.testing.assert_array_equal(_ids(meshes[Role.REFERENCE]), [[[0, 1], [2, 3]]])
