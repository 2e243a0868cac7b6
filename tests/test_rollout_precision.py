"""Per-role precision: the rollout holds bf16 weights while the actor trains fp32 masters."""

import json
import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlhfjax.cluster.cluster import Cluster, WeightSource
from rlhfjax.config import ConfigError, ModelSection, RoleModelSection, from_config_dict
from rlhfjax.placement import strategies
from rlhfjax.placement.spec import Role
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
BF16 = {"rollout": {"param_dtype": "bfloat16"}}


def _config(variant: str, roles=BF16, total_steps: int = 2, **ppo):
  cd = runpy.run_path(str(_CONFIGS / "ppo_tiny.py"))["get_config"](variant)
  cd.ppo.update(ppo)
  cd.total_steps = total_steps
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.eval.num_prompts = 0
  cd.model.roles = roles
  return from_config_dict(cd)


def _check_rollout_weights(cluster: Cluster) -> None:
  """The engine's weights: bf16, on the rollout mesh's devices as its shardings say, equal to
  the actor's fp32 masters cast to bf16, bit for bit."""
  engine, rollout = cluster.engine, cluster.roles[Role.ROLLOUT]
  actor = jax.tree.map(np.asarray, cluster.weights(Role.ACTOR))
  rollout_devices = set(rollout.mesh.devices.flat)
  for got, sharding, want in zip(
    jax.tree.leaves(engine.params),
    jax.tree.leaves(engine.param_shardings),
    jax.tree.leaves(actor),
    strict=True,
  ):
    assert want.dtype == np.float32
    assert got.dtype == jnp.bfloat16
    assert {s.device for s in got.addressable_shards} == rollout_devices
    index_map = sharding.devices_indices_map(got.shape)
    for shard in got.addressable_shards:
      assert shard.data.dtype == jnp.bfloat16
      np.testing.assert_array_equal(
        np.asarray(shard.data).view(np.uint16),
        want.astype(jnp.bfloat16)[index_map[shard.device]].view(np.uint16),
      )


@pytest.mark.parametrize("variant", ["colocated", "disaggregated"])
def test_sync_casts_on_the_actor_mesh_and_moves_half_the_bytes(variant):
  cfg = _config(variant)
  cluster = Cluster(cfg, strategies.build_placement(cfg.placement, 8))
  tx = optax.sgd(1.0)
  source = WeightSource(source="", what="init.actor", rng=jax.random.key(3))
  cluster.train(Role.ACTOR, source, tx)
  cluster.rollout_from(Role.ACTOR, pad_id=0)
  cluster.materialize()
  _check_rollout_weights(cluster)
  actor_bytes = sum(x.nbytes for x in jax.tree.leaves(cluster.weights(Role.ACTOR)))
  for it in range(3):
    # A new actor state (fp32 values that bf16 cannot hold exactly), then the sync.
    state = cluster.states[Role.ACTOR]
    cluster.states[Role.ACTOR] = state.replace(
      params=jax.tree.map(lambda x, i=it: x * (1.0 + 1e-3 * (i + 1)) + 1e-4, state.params)
    )
    moved = cluster.sync(it)
    _check_rollout_weights(cluster)
    if variant == "disaggregated":
      assert moved == actor_bytes // 2  # bf16 travels
  # One cast program, traced once; decode runs on the bf16 weights without recompiling.
  assert cluster.traces.counts == {"rollout_cast": 1}
  out = cluster.engine.generate([[5, 6, 7], [9, 10]], seed=0)
  cluster.sync(3)
  out2 = cluster.engine.generate([[5, 6, 7], [9, 10]], seed=0)
  assert out.tokens.shape == out2.tokens.shape == (2, 8)
  assert np.isfinite(out.logprobs).all() and (out.logprobs[out.mask] < 0).all()
  assert set(cluster.engine.compilations.values()) == {1}, cluster.engine.compilations
  assert cluster.traces.counts == {"rollout_cast": 1}


def test_matching_dtypes_need_no_cast():
  cfg = _config("colocated", roles={})
  cluster = Cluster(cfg, strategies.build_placement(cfg.placement, 8))
  source = WeightSource(source="", what="init.actor", rng=jax.random.key(3))
  cluster.train(Role.ACTOR, source, optax.sgd(1.0))
  cluster.rollout_from(Role.ACTOR, pad_id=0)
  cluster.materialize()
  cluster.sync(0)
  assert "rollout_cast" not in cluster.traces.counts
  assert {x.dtype for x in jax.tree.leaves(cluster.engine.params)} == {np.dtype(np.float32)}


def test_a_rollout_wider_than_the_actor_is_refused():
  with pytest.raises(ConfigError, match="rollout's param_dtype float32 is wider than the actor"):
    ModelSection(size="7b", roles={"actor": RoleModelSection(param_dtype="bfloat16")})
  roles = {"rollout": RoleModelSection(param_dtype="bfloat16")}
  assert ModelSection(size="7b", roles=roles).for_role("rollout").param_dtype == "bfloat16"


@pytest.mark.slow
def test_ppo_runs_with_a_bf16_rollout_and_fp32_actor(tmp_path):
  # The engine samples with bf16 weights, the trainer recomputes in fp32: the mismatch shows,
  # and the truncated correction (a cap of 1.0005, inside the mismatch) weighs the tokens it
  # caps.
  config = _config("disaggregated", rollout_correction="tis", rollout_correction_cap=1.0005)
  runner = Runner(config, str(tmp_path), show_progress=False)
  result = runner.run()
  assert len(result.metrics) == 2
  assert all(np.isfinite(row["loss/policy"]) for row in result.metrics)
  for row in result.metrics:
    # bf16 weights are off by up to 2^-9 relative: the tiny model's log-probs by 4e-4 on
    # average and 1e-3 at most (measured), k3 by 1e-7; fp32 alone stays 10x and 100x below
    # (`runs_testing.assert_engine_agrees_with_the_trainer`).
    assert row["logprob_mismatch/k3"] > 1e-8, row
    assert row["logprob_mismatch/max"] > 1e-4, row
    assert 0.0 < row["rollout_correction/corrected_frac"] < 1.0
  assert set(result.compilations.values()) == {1}, result.compilations
  assert result.compilations["rollout_cast"] == 1
  cluster = runner.cluster
  assert {x.dtype for x in jax.tree.leaves(cluster.weights(Role.ACTOR))} == {np.dtype(np.float32)}
  _check_rollout_weights(cluster)


def test_one_update_at_lr_1e6_moves_fp32_masters_and_rounds_away_in_pure_bf16(tmp_path):
  """A bf16 checkpoint's actor keeps fp32 masters (`model.fp32_masters`): one AdamW step at the
  learning rates RL uses changes nearly every weight; in pure bf16 an Adam step of about 1e-6
  is below half the bf16 spacing of all but the smallest weights (|w| < about 2.6e-4) and of
  every norm scale (1.0), so almost nothing changes."""
  from hf_dirs import TINY_QWEN2

  from rlhfjax import models
  from rlhfjax.config import OptimizerConfig
  from rlhfjax.config.hf import config_to_hf
  from rlhfjax.training.optimizer import make_optimizer

  (tmp_path / "config.json").write_text(
    json.dumps({**config_to_hf(TINY_QWEN2, "lm"), "torch_dtype": "bfloat16"})
  )
  tx = make_optimizer(OptimizerConfig(learning_rate=1e-6, decay="constant"), 1)
  step = jax.jit(lambda p, g: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]))
  # The checkpoint's bf16 weights, and a gradient of ones and minus ones scaled at random.
  saved = models.init_params(TINY_QWEN2, "lm", jax.random.key(0))
  saved = jax.tree.map(lambda x: x.astype(jnp.bfloat16), saved)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(saved))))
  grads = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), saved)
  changed = {}
  for masters in (True, False):
    model = ModelSection(hf=str(tmp_path), fp32_masters=masters).for_role("actor")
    params = jax.tree.map(lambda x, m=model: x.astype(m.param_dtype), saved)
    g = jax.tree.map(lambda x, p: x.astype(p.dtype), grads, params)
    new = step(params, g)
    assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(model.param_dtype)}
    changed[masters] = jax.tree.map(
      lambda a, b: float(np.mean(np.asarray(a, np.float32) != np.asarray(b, np.float32))),
      params,
      new,
    )
  for path, fraction in jax.tree_util.tree_leaves_with_path(changed[True]):
    assert fraction > 0.99, (jax.tree_util.keystr(path), fraction)
  for path, fraction in jax.tree_util.tree_leaves_with_path(changed[False]):
    if jax.tree_util.keystr(path).endswith(("['kernel']", "['scale']", "['embedding']")):
      assert fraction < 0.05, (jax.tree_util.keystr(path), fraction)
    # (Biases start at 0, where bf16 holds 1e-6.)
