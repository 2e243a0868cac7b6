"""The config's rollout section builds the engine the cluster runs, and prices its KV memory."""

import dataclasses

import jax
import numpy as np
import pytest

from rlhfjax.cluster.cluster import engine_config
from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.flows import registry
from rlhfjax.mesh import meshes
from rlhfjax.placement import Layout, PlacementError, Role, RoleSpec, estimate_memory, memory
from rlhfjax.planner import place
from rlhfjax.rollout import Engine

pytestmark = pytest.mark.unit


def _config(**rollout):
  return from_config_dict({"model": {"size": "tiny"}, "rollout": rollout})


@pytest.mark.parametrize(
  "fields, named",
  [
    ({"tail_threshold": 1.0}, "rollout.tail_threshold"),
    ({"paged": False}, "config field 'rollout.paged' was removed: the rollout engine always"),
    ({"kv_cache_tokens": 100, "max_prompt_len": 64, "max_new_tokens": 64}, "kv_cache_tokens"),
    ({"page_size": 0}, "rollout.page_size"),
    ({"decode_chunk": 0}, "rollout.decode_chunk"),
    ({"min_prompt_bucket": -1}, "rollout.min_prompt_bucket"),
    (
      {"max_prompt_len": 400, "max_new_tokens": 200},
      r"max_new_tokens' = 600 exceeds the actor's max_position_embeddings \(512, tiny\)",
    ),
  ],
)
def test_bad_paging_fields_fail_in_one_line(fields, named):
  with pytest.raises(ConfigError, match=named) as error:
    _config(**fields)
  assert "\n" not in str(error.value)


def test_the_tail_threshold_reaches_the_engine():
  assert engine_config(_config(tail_threshold=0.25).rollout, 0, 2).tail_threshold == 0.25


@pytest.mark.parametrize(
  "rollout, replicas",
  [
    ({"batch_size": 16, "max_prompt_len": 40, "max_new_tokens": 50}, 2),
    ({"batch_size": 8, "slots": 32, "kv_cache_tokens": 1000, "page_size": 8}, 4),
  ],
)
def test_the_page_pool_the_config_asks_for(rollout, replicas):
  section = _config(**rollout).rollout
  engine = engine_config(section, 0, replicas)
  assert engine.num_pages == section.kv_pages(replicas)
  assert engine.num_pages % replicas == 0
  per_replica = engine.num_pages // replicas - 1  # the reserved page excluded
  if section.kv_cache_tokens:
    assert per_replica * section.page_size >= section.kv_cache_tokens / replicas
    assert (per_replica - 1) * section.page_size < section.kv_cache_tokens / replicas
  else:  # a dense cache's memory: what `EngineConfig.num_pages=None` gives
    assert engine.num_pages == engine_config(section, 0, replicas).pages_total(replicas)
    default = engine.__class__(**{**engine.__dict__, "num_pages": None})
    assert default.pages_total(replicas) == engine.num_pages


@pytest.mark.parametrize("tokens", [300, 0])
def test_the_memory_estimate_is_the_engines_kv_cache(tokens):
  """The placement's KV estimate per device equals the bytes of the cache the engine allocates
  on each device of a data=2 x tensor=2 rollout mesh (XLA's own arrays, read by shard)."""
  config = from_config_dict(
    {
      "model": {"size": "tiny", "overrides": {"num_kv_heads": 2}},
      "rollout": {
        "batch_size": 8,
        "max_prompt_len": 24,
        "max_new_tokens": 40,
        "kv_cache_tokens": tokens,
      },
    }
  )
  spec = RoleSpec(devices=(0, 1, 2, 3), axes=(("data", 2), ("tensor", 2)), layout=Layout.GENERATION)
  model = config.model.for_role("actor")
  estimate = estimate_memory(Role.ROLLOUT, spec, model, config.rollout)
  engine = Engine(model, engine_config(config.rollout, 0, 2), meshes.make_mesh(spec))
  state = engine.init_decode_state()
  per_device = {}
  for leaf in jax.tree.leaves(state.cache):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  assert len(per_device) == 4
  assert set(per_device.values()) == {estimate.kv_cache}
  total = sum(x.nbytes for x in jax.tree.leaves(state.cache))
  assert total == 4 * estimate.kv_cache
  assert np.shape(state.cache["k"])[0] == 2  # a pool per replica


# ---------------------------------------------------------------------------------------------
# The pool sized from memory (`rollout.kv_memory_fraction`).


_GIB = 16.0  # every role fits; the fraction decides the pool


def _fraction_config(fraction, strategy="colocated", gib=_GIB):
  return registry.configure(
    from_config_dict(
      {
        "model": {"size": "tiny"},
        "placement": {"strategy": strategy, "memory_per_device_gb": gib},
        "rollout": {
          "batch_size": 16,
          "max_prompt_len": 24,
          "max_new_tokens": 40,
          "kv_memory_fraction": fraction,
        },
      }
    )
  )


def _pool(fraction, strategy="colocated", gib=_GIB):
  config = _fraction_config(fraction, strategy, gib)
  spec = place.plan_placement(config, 8)
  sized, pool = place.sized(config, spec)
  return sized, pool, spec


def _fraction_for(pool, pages: float) -> float:
  """The fraction of `_GIB` that leaves `pool`'s rollout devices `pages` pages of 16 tokens."""
  return (pool.resident + pages * 16 * pool.token_bytes) / (_GIB * memory.GIB)


@pytest.mark.parametrize(
  "fields, named",
  [
    ({"kv_memory_fraction": 1.5}, "'rollout.kv_memory_fraction' must be in [0, 1], got 1.5"),
    ({"kv_memory_fraction": -0.1}, "'rollout.kv_memory_fraction' must be in [0, 1]"),
  ],
)
def test_bad_memory_fractions_fail_in_one_line(fields, named):
  with pytest.raises(ConfigError) as error:
    _config(**fields)
  assert named in str(error.value) and "\n" not in str(error.value)


def test_a_memory_fraction_fills_what_the_placement_leaves_on_the_rollouts_devices():
  # Plenty of memory: every slot at full length, the dense cache's pool, and no more.
  _, roomy, _ = _pool(0.9)
  replicas, page_bytes = roomy.replicas, 16 * roomy.token_bytes
  per_replica = _fraction_config(0.0).rollout.kv_pages(replicas) // replicas - 1
  assert roomy.capped and roomy.tokens == per_replica * 16 * replicas
  # Room for 5 pages and the reserved one, and half a page more.
  fraction = _fraction_for(roomy, 6.5)
  sized, pool, spec = _pool(fraction)
  assert not pool.capped and pool.tokens == replicas * 5 * 16
  assert sized.rollout.kv_cache_tokens == pool.tokens
  assert sized.rollout.kv_pages(replicas) == replicas * 6
  # The placement's own estimate of the sized config: each rollout device at the rollout's
  # stage (the idle state of every role on it, plus the rollout's stage bytes) fits the
  # fraction, and one more page would not.
  estimates = memory.estimate_placement_memory(spec, sized.model, sized.rollout)
  rollout = estimates[Role.ROLLOUT]
  need = max(
    rollout.transient + sum(e.persistent for r, e in estimates.items() if d in spec[r].devices)
    for d in spec[Role.ROLLOUT].devices
  )
  assert rollout.kv_cache == 6 * page_bytes
  assert need <= fraction * _GIB * memory.GIB < need + page_bytes
  assert f"rollout KV pool: {pool.tokens:,} tokens" in pool.describe()


def test_the_roles_sharing_the_rollouts_devices_leave_it_less():
  # Co-located, the rollout's devices hold the actor's and critic's weights and moments and
  # the reference's and reward's weights; disaggregated, only its own.
  for strategy, shared in (("colocated", True), ("disaggregated", False)):
    config, pool, spec = _pool(0.9, strategy)
    estimates = memory.estimate_placement_memory(spec, config.model, config.rollout)
    own = estimates.pop(Role.ROLLOUT)
    others = {
      d: sum(e.persistent for r, e in estimates.items() if d in spec[r].devices)
      for d in spec[Role.ROLLOUT].devices
    }
    assert (min(others.values()) > 0) == shared, strategy
    assert pool.resident == own.total - own.kv_cache + max(others.values()), strategy


def test_a_fraction_too_small_for_one_sequence_says_which_fits():
  _, roomy, _ = _pool(0.9)
  # One sequence is 64 tokens: 4 pages and the reserved one; room for 3.
  with pytest.raises(PlacementError) as error:
    _pool(_fraction_for(roomy, 3.5))
  message = str(error.value)
  assert "\n" not in message and "max_prompt_len + max_new_tokens = 64 tokens" in message
  fits = float(message.split("a fraction of at least ")[1].split(" fits one")[0])
  assert fits >= _fraction_for(roomy, 5)
  _, pool, _ = _pool(fits)  # the fraction it names does
  assert pool.tokens >= pool.replicas * 64
  # Less memory than the rollout's own weights: no fraction fits.
  with pytest.raises(PlacementError, match="no fraction does"):
    _pool(1.0, gib=roomy.resident / 2 / memory.GIB)


def test_devices_that_report_no_memory_need_the_budget():
  config = _fraction_config(0.9)
  config = dataclasses.replace(
    config, placement=dataclasses.replace(config.placement, memory_per_device_gb=None)
  )
  with pytest.raises(PlacementError, match="the cpu devices report none: set "
                     "'placement.memory_per_device_gb' too"):  # fmt: skip
    place.plan_placement(config, 8)


def test_the_engine_allocates_the_pool_the_fraction_gives():
  _, roomy, _ = _pool(0.9, "disaggregated")
  page_bytes = 16 * roomy.token_bytes
  fraction = _fraction_for(roomy, 5.5)  # 4 pages (one sequence) and the reserved one
  sized, pool, spec = _pool(fraction, "disaggregated")
  rollout = spec[Role.ROLLOUT]
  engine = Engine(
    sized.model.for_role("actor"),
    engine_config(sized.rollout, 0, pool.replicas),
    meshes.make_mesh(rollout),
  )
  cache = engine.init_decode_state().cache
  per_device = {}
  for leaf in jax.tree.leaves(cache):
    for shard in leaf.addressable_shards:
      per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
  ids = [d.id for d in jax.devices()]
  assert set(per_device) == {ids[i] for i in rollout.devices}
  assert set(per_device.values()) == {5 * page_bytes}
  assert pool.resident + 5 * page_bytes <= fraction * _GIB * memory.GIB


def test_a_released_rollouts_weights_count_only_while_it_generates():
  # `rollout.release`: the rollout's weights leave its devices between generations, so a
  # co-located device's peak (every role's idle state plus the largest stage) drops by them.
  kept = _fraction_config(0.0)
  freed = dataclasses.replace(kept, rollout=dataclasses.replace(kept.rollout, release=True))
  spec = place.plan_placement(kept, 8)
  totals, estimates = {}, {}
  for name, config in (("kept", kept), ("freed", freed)):
    estimates[name] = memory.estimate_placement_memory(spec, config.model, config.rollout)
    totals[name] = memory.device_totals(spec, estimates[name])
  rollout = estimates["freed"][Role.ROLLOUT]
  assert rollout.parked == rollout.params > 0 and rollout.persistent == 0
  assert rollout.total == estimates["kept"][Role.ROLLOUT].total  # the same while generating
  # The training's stage is the largest here, so each device's peak is lower by the weights.
  for device in spec[Role.ROLLOUT].devices:
    assert totals["freed"][device] == totals["kept"][device] - rollout.params
