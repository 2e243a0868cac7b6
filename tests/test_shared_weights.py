"""A co-located rollout in the actor's layout and dtype reads the actor's arrays themselves: no
copy, no sync, the copy path's numbers exactly, and nothing recompiles."""

import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rlhfjax.cluster.cluster import Cluster
from rlhfjax.config import from_config_dict
from rlhfjax.mesh import sharing
from rlhfjax.placement.spec import Role
from rlhfjax.rollout.engine import Engine
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_ROOT = pathlib.Path(__file__).parent.parent
_EVERY = tuple(range(8))


def _mesh(shape, names):
  return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def test_same_layout_compares_shards_dtypes_shapes_and_structure():
  generation = _mesh((8, 1), ("data", "tensor"))
  training = _mesh((8, 1, 1), ("data", "fsdp", "tensor"))
  fsdp = _mesh((1, 8, 1), ("data", "fsdp", "tensor"))

  def leaf(shape, dtype, mesh, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  rep = {"w": leaf((7, 16), jnp.float32, generation, PartitionSpec())}
  # Another mesh object with other axis names, every shard in the same place: shareable.
  assert sharing.same_layout(rep, {"w": leaf((7, 16), jnp.float32, training, PartitionSpec())})
  assert not sharing.same_layout(
    rep, {"w": leaf((7, 16), jnp.float32, fsdp, PartitionSpec(None, "fsdp"))}
  )
  assert not sharing.same_layout(rep, {"w": leaf((7, 16), jnp.bfloat16, training, PartitionSpec())})
  assert not sharing.same_layout(rep, {"w": leaf((16, 7), jnp.float32, training, PartitionSpec())})
  assert not sharing.same_layout(rep, {"v": leaf((7, 16), jnp.float32, training, PartitionSpec())})
  # Arrays work as well as abstract leaves.
  x = jax.device_put(jnp.ones((7, 16)), NamedSharding(training, PartitionSpec()))
  assert sharing.same_layout(rep, {"w": x})


def _config(data_parallel: bool):
  cd = runpy.run_path(str(_ROOT / "configs" / "grpo_tiny.py"))["get_config"]("colocated")
  cd.total_steps = 2
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.eval.num_prompts = 0
  cd.reward.model_coef = 0.5
  if data_parallel:
    # Every role data parallel over all 8 devices: the actor's weights are replicated, as the
    # rollout's generation layout wants them.
    cd.placement.strategy = "explicit"
    for role in ("actor", "reference", "critic", "reward"):
      cd.placement.explicit[role] = {"devices": _EVERY, "axes": {"data": 8}, "layout": "training"}
    cd.placement.explicit.rollout = {
      "devices": _EVERY,
      "axes": {"data": 8},
      "layout": "generation",
    }
    cd.placement.explicit.colocate = (("actor", "reference", "rollout", "critic", "reward"),)
  return from_config_dict(cd)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = {}
  shared = Runner(_config(True), str(tmp_path_factory.mktemp("shared")), show_progress=False)
  # Nothing may copy weights into the engine once it reads the actor's.
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Engine, "update_params", lambda *a: pytest.fail("update_params ran"))
    out["shared"] = (shared, shared.run())
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Cluster, "rollout_reads_source", property(lambda self: False))
    copied = Runner(_config(True), str(tmp_path_factory.mktemp("copied")), show_progress=False)
    out["copied"] = (copied, copied.run())
    out["copied_shares"] = copied.cluster.rollout_reads_source
  return out


def test_rollout_reads_the_actors_buffers_after_every_update(runs):
  runner, result = runs["shared"]
  cluster = runner.cluster
  assert cluster.rollout_reads_source
  actor = jax.tree.leaves(cluster.states[Role.ACTOR].params)
  engine = jax.tree.leaves(cluster.engine.params)
  assert all(a is e for a, e in zip(actor, engine, strict=True))
  for a, e in zip(actor, engine, strict=True):
    assert not e.is_deleted()
    assert [s.data.unsafe_buffer_pointer() for s in a.addressable_shards] == [
      s.data.unsafe_buffer_pointer() for s in e.addressable_shards
    ]
  # The update donated the weights the first generation read; the engine holds none of them.
  assert [r["sync/bytes"] for r in result.metrics] == [0.0, 0.0]
  assert [r["time/sync"] for r in result.metrics] == [0.0, 0.0]
  assert not [r for r in runner.timeline.records if r.stage == "sync"]
  assert cluster.resync() == 0.0  # nothing to sync again either


def test_shared_weights_give_the_copy_paths_numbers_exactly_and_compile_once(runs):
  (shared, a), (copied, b) = runs["shared"], runs["copied"]
  assert not runs["copied_shares"]
  assert [r["sync/bytes"] for r in b.metrics] == [0.0, 0.0]  # same layout: nothing to move
  assert copied.timeline.for_iteration(0) and any(
    r.stage == "sync" for r in copied.timeline.records
  )
  skip = ("time/", "throughput/")
  for x, y in zip(a.metrics, b.metrics, strict=True):
    assert {k: v for k, v in x.items() if not k.startswith(skip)} == {
      k: v for k, v in y.items() if not k.startswith(skip)
    }
  assert a.metrics[0]["loss/policy"] != a.metrics[1]["loss/policy"]
  assert set(a.compilations.values()) == {1}, a.compilations
  engine = shared.cluster.engine
  counts = engine.compilations
  # Prefill and insert: a program per prefill batch size and bucket (with shared prefixes the
  # batch's prompts may prefill in calls of several sizes); every other
  # program once.
  shapes = len(engine.config.prefill_batch_sizes) * len(engine.config.prompt_buckets)
  assert counts["prefill"] <= shapes and counts["insert"] <= shapes, counts
  assert {n for k, n in counts.items() if k not in ("prefill", "insert")} == {1}, counts
  # The paged decode loop: one jitted program per live-batch size x width, each traced for
  # one set of argument shardings at most (the actor's own arrays hit the compiled program).
  programs = shared.cluster.engine.paged._generate_steps.values()
  assert {p._cache_size() for p in programs} <= {0, 1}
  assert sum(p._cache_size() for p in programs) >= 1


def test_other_layouts_and_dtypes_still_copy(tmp_path):
  runner = Runner(_config(False), str(tmp_path), show_progress=False)
  cluster = runner.cluster
  assert not cluster.rollout_reads_source  # FSDP actor, tensor-parallel rollout
  assert cluster.sync(0) > 0
  actor = jax.tree.leaves(cluster.states[Role.ACTOR].params)
  engine = jax.tree.leaves(cluster.engine.params)
  assert not any(a is e for a, e in zip(actor, engine, strict=True))
  # The sync run again (as the local check samples it): timed, the same weights in the same
  # shards, and no second timeline entry.
  records = len(cluster.timeline.records)
  before = [np.asarray(e) for e in engine]
  assert cluster.resync() > 0
  assert len(cluster.timeline.records) == records
  again = jax.tree.leaves(cluster.engine.params)
  shardings = jax.tree.leaves(cluster.roles[Role.ROLLOUT].param_shardings)
  for a, e, b, s in zip(actor, again, before, shardings, strict=True):
    np.testing.assert_array_equal(np.asarray(e), np.asarray(a))
    np.testing.assert_array_equal(np.asarray(e), b)
    assert e.sharding.is_equivalent_to(s, e.ndim)
    assert {x.device for x in e.addressable_shards} == set(s.device_set)
  # The same layout in another dtype (a bf16 rollout beside fp32 masters) is no share either.
  abstract = cluster.abstract_rollout()
  cast = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding), abstract
  )
  assert sharing.same_layout(abstract, abstract)
  assert not sharing.same_layout(abstract, cast)
  # An engine cannot be told to read arrays laid out elsewhere.
  rollout, actor = cluster.roles[Role.ROLLOUT], cluster.roles[Role.ACTOR]
  with pytest.raises(ValueError, match="param_shardings must place every shard"):
    Engine(
      rollout.model, cluster.engine.config, rollout.mesh, param_shardings=actor.param_shardings
    )


def test_the_tunix_benchmarks_rlhfjax_side_has_the_issues_sizes_and_shares_weights():
  from rlhfjax.planner.place import plan_placement

  bench = runpy.run_path(str(_ROOT / "scripts" / "bench_tunix.py"), run_name="bench_tunix")
  cfg = bench["rlhfjax_config"]("colocated", 3)
  actor = cfg.model.for_role("actor")
  sizes = (actor.num_layers, actor.hidden_size, actor.num_heads, actor.head_dim)
  assert sizes == (2, 128, 4, 32)
  assert (actor.num_kv_heads, actor.intermediate_size, actor.vocab_size) == (2, 512, 1024)
  assert (cfg.rollout.batch_size, cfg.ppo.group_size, cfg.rollout.max_new_tokens) == (32, 4, 32)
  assert (cfg.ppo.ppo_epochs, cfg.ppo.mini_batches, cfg.total_steps) == (1, 1, 3)
  spec = plan_placement(cfg, 8)
  assert spec[Role.ACTOR].devices == spec[Role.ROLLOUT].devices == _EVERY
  disaggregated = bench["rlhfjax_config"]("disaggregated", 3)
  assert disaggregated.ppo.async_rollout and not cfg.ppo.async_rollout  # one step off
  split = plan_placement(disaggregated, 8)
  assert split[Role.ACTOR].devices == (0, 1, 2, 3)
  assert split[Role.ROLLOUT].devices == (4, 5, 6, 7)
