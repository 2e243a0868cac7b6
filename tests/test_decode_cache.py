"""A decode step updates the KV cache in place: no copy of the whole cache per step."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from rlhfjax import models
from rlhfjax.config.model import get_model_config
from rlhfjax.rollout import decode

pytestmark = pytest.mark.unit

L, B, S = 5, 4, 512
# XLA's default CPU code generation, which users' runs get; the two-worker suite compiles with
# faster settings (tests/conftest.py) whose loop emitters leave an in-place update of the cache
# unfused, so the op names checked below are those of this code generation.
_DEFAULT_CPU_CODEGEN = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def test_decode_step_writes_the_cache_in_place():
  cfg = get_model_config("tiny", num_layers=L, attention="xla")
  params = models.abstract_params(cfg, "lm")
  state = jax.eval_shape(functools.partial(decode.empty_state, cfg, B, S, 16, 4))
  step = jax.jit(functools.partial(decode.generate_steps, cfg), donate_argnums=1)
  lowered = step.lower(params, state, jnp.int32(1), jnp.int32(B))
  compiled = lowered.compile(compiler_options=_DEFAULT_CPU_CODEGEN)
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.cache))
  # XLA's own analysis: the cache is donated and aliased to the output, and the step's
  # temporaries stay below half of it (carried through the layer scan as xs/ys, each step
  # built a new stacked cache and copied it back: temporaries larger than the cache itself).
  stats = compiled.memory_analysis()
  assert stats.alias_size_in_bytes >= cache_bytes
  assert stats.temp_size_in_bytes < cache_bytes / 2, (stats.temp_size_in_bytes, cache_bytes)
  # No instruction copies or rebuilds a whole [l, b, s, k, n] cache.
  whole = f"f32[{L},{B},{S},{cfg.num_kv_heads},{cfg.head_dim}]"
  ops = re.findall(rf"= {re.escape(whole)}\{{[0-9,]*\}} ([a-z\-]+)\(", compiled.as_text())
  assert ops, "the cache's shape was not found in the HLO"
  assert not {"copy", "dynamic-update-slice", "broadcast"} & set(ops), ops
