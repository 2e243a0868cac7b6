"""A role's first weights from Hugging Face or rlhfjax checkpoints, with trunk transfer between
heads, read straight into the role's shards."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from rlhfjax import checkpoint as ckpt
from rlhfjax import models
from rlhfjax.cluster.role import RoleRuntime
from rlhfjax.config import CheckpointSection
from rlhfjax.config import model as model_config
from rlhfjax.placement.spec import Role, RoleSpec
from rlhfjax.training import weights

pytestmark = pytest.mark.unit

MODEL = model_config.get_model_config("tiny")


def _runtime(head: str, devices=(4, 5, 6, 7)) -> RoleRuntime:
  role = Role.ACTOR if head == "lm" else Role.CRITIC
  spec = RoleSpec.training(devices, fsdp=2, tensor=2)
  return RoleRuntime.create(role, spec, MODEL, head)


def _load(source: str, rt: RoleRuntime, model=MODEL, items=("policy", "actor")):
  return weights.load_params(
    source,
    model=model,
    head=rt.head,
    mesh=rt.mesh,
    layout=rt.spec.layout,
    shardings=rt.param_shardings,
    rng=jax.random.key(1),
    items=items,
    what="init.test",
  )


def _assert_in_shards(params, rt: RoleRuntime, expected) -> None:
  devices = {jax.devices()[i] for i in rt.devices}
  for leaf, sharding, want in zip(
    jax.tree.leaves(params),
    jax.tree.leaves(rt.param_shardings),
    jax.tree.leaves(expected),
    strict=True,
  ):
    assert leaf.sharding == sharding
    assert {s.device for s in leaf.addressable_shards} == devices
    for shard in leaf.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])


@pytest.fixture(scope="module")
def policy():
  return jax.device_get(models.init_params(MODEL, "lm", jax.random.key(0)))


@pytest.fixture(scope="module")
def hf_policy(policy, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("hf_policy"))
  models.save_hf_checkpoint(MODEL, policy, path)
  return path


def test_hf_policy_lands_in_the_roles_shards(policy, hf_policy):
  rt = _runtime("lm")
  _assert_in_shards(_load(hf_policy, rt), rt, policy)


def test_a_value_role_takes_the_policys_trunk_and_a_zero_head(policy, hf_policy):
  rt = _runtime("value", devices=(0, 1, 2, 3))
  params = _load(hf_policy, rt)
  trunk = {k: v for k, v in policy.items() if k != "lm_head"}
  expected = {**trunk, "value_head": np.zeros((MODEL.hidden_size,), np.float32)}
  _assert_in_shards(params, rt, expected)


def test_an_rlhfjax_checkpoint_item_is_found_by_name(policy, tmp_path):
  source = _runtime("lm", devices=(0, 1, 2, 3))
  placed = jax.device_put(policy, source.param_shardings)
  with ckpt.Checkpointer(tmp_path, CheckpointSection(every_steps=0)) as saver:
    saver.save(3, {"policy": placed}, {"step": 3}, force=True)
    saver.wait()
  rt = _runtime("value")
  params = _load(str(tmp_path), rt, items=("reward", "critic", "policy"))
  np.testing.assert_array_equal(np.asarray(params["embedding"]), policy["embedding"])
  assert not np.any(np.asarray(params["value_head"]))
  with pytest.raises(weights.WeightsError, match="none of the items reward"):
    _load(str(tmp_path), rt, items=("reward",))


def test_a_policy_cannot_start_from_a_value_head(tmp_path):
  value = jax.device_get(models.init_params(MODEL, "value", jax.random.key(0)))
  models.save_hf_checkpoint(MODEL, value, str(tmp_path))
  with pytest.raises(weights.WeightsError, match="value head"):
    _load(str(tmp_path), _runtime("lm"))


def test_another_model_is_an_error_naming_the_fields(hf_policy):
  other = dataclasses.replace(MODEL, num_layers=MODEL.num_layers + 1)
  rt = RoleRuntime.create(Role.ACTOR, RoleSpec.training((0, 1), fsdp=2), other, "lm")
  with pytest.raises(weights.WeightsError, match=r"config.json has num_layers=3, the config has 4"):
    _load(hf_policy, rt, model=other)


def test_same_shapes_another_architecture_is_an_error_naming_every_field(policy, tmp_path):
  """The issue's reproduction: rope_theta and rms_norm_eps change no shape, so a shape check
  let these weights run as another model, silently."""
  llama3 = MODEL.replace(rope_theta=500_000.0, rms_norm_eps=1e-6)
  models.save_hf_checkpoint(llama3, policy, str(tmp_path))
  config = str(tmp_path / "config.json")
  expected = (
    f"init.test: {config} has rope_theta=500000.0, the config has 10000.0; "
    "rms_norm_eps=1e-06, the config has 1e-05"
  )
  with pytest.raises(weights.WeightsError) as error:
    _load(str(tmp_path), _runtime("lm"))
  assert str(error.value) == expected


def test_numerics_a_user_chooses_are_not_a_mismatch(policy, hf_policy):
  numerics = MODEL.replace(dtype="bfloat16", remat="full", attention="einsum", logprob_chunk_size=7)
  rt = RoleRuntime.create(Role.ACTOR, RoleSpec.training((0, 1), fsdp=2), numerics, "lm")
  params = _load(hf_policy, rt, model=numerics)
  np.testing.assert_array_equal(np.asarray(params["embedding"]), policy["embedding"])
