"""The config's rollout section builds the engine the cluster runs, and prices its KV memory."""

import jax
import numpy as np
import pytest

from rlhfjax.cluster.cluster import engine_config
from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.mesh import meshes
from rlhfjax.placement import Layout, Role, RoleSpec, estimate_memory
from rlhfjax.rollout import Engine

pytestmark = pytest.mark.unit


def _config(**rollout):
  return from_config_dict({"model": {"size": "tiny"}, "rollout": rollout})


@pytest.mark.parametrize(
  "fields, named",
  [
    ({"tail_threshold": 0.25}, "rollout.tail_threshold"),
    ({"kv_cache_tokens": 100, "max_prompt_len": 64, "max_new_tokens": 64}, "kv_cache_tokens"),
    ({"page_size": 0}, "rollout.page_size"),
    ({"decode_chunk": 0}, "rollout.decode_chunk"),
  ],
)
def test_bad_paging_fields_fail_in_one_line(fields, named):
  with pytest.raises(ConfigError, match=named) as error:
    _config(**fields)
  assert "\n" not in str(error.value)


def test_tail_compaction_runs_on_the_dense_engine():
  config = _config(tail_threshold=0.25, paged=False)
  assert not engine_config(config.rollout, 0, 2).paged


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
  assert engine.paged and engine.num_pages == section.kv_pages(replicas)
  assert engine.num_pages % replicas == 0
  per_replica = engine.num_pages // replicas - 1  # the reserved page excluded
  if section.kv_cache_tokens:
    assert per_replica * section.page_size >= section.kv_cache_tokens / replicas
    assert (per_replica - 1) * section.page_size < section.kv_cache_tokens / replicas
  else:  # the dense cache's memory: what `EngineConfig.num_pages=None` gives
    assert engine.num_pages == engine_config(section, 0, replicas).pages_total(replicas)
    default = engine.__class__(**{**engine.__dict__, "num_pages": None})
    assert default.pages_total(replicas) == engine.num_pages


@pytest.mark.parametrize("paged", [True, False])
def test_the_memory_estimate_is_the_engines_kv_cache(paged):
  """The placement's KV estimate per device equals the bytes of the cache the engine allocates
  on each device of a data=2 x tensor=2 rollout mesh (XLA's own arrays, read by shard)."""
  config = from_config_dict(
    {
      "model": {"size": "tiny", "overrides": {"num_kv_heads": 2}},
      "rollout": {
        "batch_size": 8,
        "max_prompt_len": 24,
        "max_new_tokens": 40,
        "paged": paged,
        "kv_cache_tokens": 300 if paged else 0,
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
  if paged:
    assert np.shape(state.cache["k"])[0] == 2  # a pool per replica
