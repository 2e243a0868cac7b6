"""Context parallelism: each row's tokens split over the mesh's 'context' axis. Attention
against the einsum reference per shard, and a 4-way context-parallel actor update against the
same update without it (fp32); the placement, memory model and planner that carry the axis.
PPO with `placement.context=2` against the co-located run is tests/test_ppo.py's
'disaggregated' variant."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax import models
from rlhfjax.config import ConfigError, PlacementSection
from rlhfjax.config.model import get_model_config
from rlhfjax.costmodel import costs, efficiency, hardware, memory
from rlhfjax.mesh import meshes, rules
from rlhfjax.models import attention, logprobs
from rlhfjax.models.attention import Mask
from rlhfjax.placement import strategies
from rlhfjax.placement.spec import Layout, RoleSpec
from rlhfjax.placement.validate import PlacementError

pytestmark = pytest.mark.unit

B, T, H, K, N = 4, 96, 4, 2, 8


def _packed_ids(rng, rows: int, width: int):
  """Rows of three packed segments each (cut at random) and a padded tail."""
  segments, positions = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
  for r in range(rows):
    cuts = sorted(rng.choice(np.arange(2, width - 8), 2, replace=False)) + [width - 5]
    start = 0
    for seg, end in enumerate(cuts, start=1):
      segments[r, start:end] = seg
      positions[r, start:end] = np.arange(end - start)
      start = end
  return segments, positions


def _assert_close(got, want, what):
  scale = float(np.max(np.abs(want)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * scale, err_msg=what)


@pytest.mark.parametrize("impl,window", [("blockwise", None), ("blockwise", 11), ("einsum", 5)])
def test_attention_over_a_context_axis_equals_the_reference(impl, window, attention_block):
  """data=2 x context=2 x tensor=2: each shard holds a quarter of its rows' tokens, gathers the
  keys of the whole rows, and the outputs and the gradients of q, k and v equal attention on
  one device; blocks of 16 make the blockwise kernel loop over a shard's 48 queries."""
  attention_block(16)
  rng = np.random.default_rng(0)
  segments, positions = _packed_ids(rng, B, T)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, heads, N)), jnp.float32) for heads in (H, K, K))
  weights = jnp.asarray(rng.normal(size=(B, T, H, N)) * (segments > 0)[:, :, None, None])
  mask = Mask.packed(segments, positions, window)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "context", "tensor"))
  tokens = NamedSharding(mesh, PartitionSpec("data", "context", "tensor"))
  config = get_model_config("tiny", attention=impl)

  def sharded(q, k, v):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      assert attention.context_shards(T) == 2
      return attention.attend(config, q, k, v, mask)

  reference = lambda q, k, v: attention.einsum_attention(q, k, v, mask, jnp.float32)
  loss = lambda fn: lambda *x: jnp.sum(fn(*x) * weights)
  placed = [jax.device_put(x, tokens) for x in (q, k, v)]
  out = jax.jit(sharded)(*placed)
  grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(*placed)
  real = segments > 0
  _assert_close(np.asarray(out)[real], np.asarray(reference(q, k, v))[real], "outputs")
  want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for got, ref, name in zip(grads, want, "qkv", strict=True):
    _assert_close(got, ref, f"d{name}")
  for shard in out.addressable_shards:
    assert shard.data.shape == (B // 2, T // 2, H // 2, N)


def _update_fn(config, tx):
  """One actor step: the packed rows' log-probs and entropies (chunked), a loss over the real
  tokens, its gradients, and the optimizer's update."""

  def step(params, opt_state, tokens, positions, segments):
    def loss(params):
      stats = logprobs.packed_token_stats(config, params, tokens, positions, segments)
      real = (segments > 0).astype(jnp.float32)
      return jnp.sum((stats.logp_bt + 0.1 * stats.entropy_bt) * real) / jnp.sum(real), stats

    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), value, stats.logp_bt

  return step


def test_a_context_parallel_actor_update_equals_the_update_without_it(attention_block):
  """The tiny actor (3 layers, full remat, log-probs in chunks of 4, blocks of 8) updated once
  on packed rows of 64 tokens: fsdp=2 x context=4 against fsdp=8. The new parameters, the loss
  and the log-probs agree at 1e-5 of their scale (fp32: only the order of sums differs); the
  log-probs come out split over 'context' (each device a quarter of each row)."""
  attention_block(8)
  config = get_model_config("tiny", remat="full", logprob_chunk_size=4)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, config.vocab_size, (B, 64)).astype(np.int32)
  segments, positions = _packed_ids(rng, B, 64)
  params = models.init_params(config, "lm", jax.random.key(2))
  # Plain SGD: the update is linear in the gradients, so it inherits their 1e-5. (Adam divides
  # each gradient by its own magnitude: a gradient at rounding level would pick its sign.)
  tx = optax.sgd(0.5)
  results = {}
  for name, spec in {
    "flat": RoleSpec.training(range(8), fsdp=8),
    "context": RoleSpec.training(range(8), fsdp=2, context=4),
  }.items():
    mesh = meshes.make_mesh(spec)
    shardings = rules.named_shardings(
      models.logical_axes(config, "lm"), models.abstract_params(config, "lm"), mesh, spec.layout
    )
    placed = jax.device_put(params, shardings)
    step = jax.jit(
      rules.constrained(_update_fn(config, tx), spec.layout, mesh),
      out_shardings=(shardings, None, None),
    )
    args = (placed, tx.init(placed), tokens, positions, segments)
    results[name] = step(*args)
  new, loss, logp = results["context"]
  want_new, want_loss, want_logp = results["flat"]
  assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
  real = segments > 0
  _assert_close(np.asarray(logp)[real], np.asarray(want_logp)[real], "log-probs")
  # The new parameters: the updates agree at 1e-5 of their scale, and adding one to a weight
  # rounds to the weight's float32 spacing (one ulp each side).
  eps = np.finfo(np.float32).eps
  for (path, got), want, old in zip(
    jax.tree_util.tree_leaves_with_path(new),
    jax.tree.leaves(want_new),
    jax.tree.leaves(params),
    strict=True,
  ):
    got, want, old = np.asarray(got), np.asarray(want), np.asarray(old)
    update = np.max(np.abs(want - old))
    assert update > 0, jax.tree_util.keystr(path)
    atol = 1e-5 * update + 2 * eps * np.max(np.abs(old))
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
  assert {shard.data.shape for shard in logp.addressable_shards} == {(B // 2, 64 // 4)}
  # The weights shard over 'context' as over 'fsdp': the embedding's width over 8 devices.
  embedding = new["embedding"]
  assert {s.data.shape for s in embedding.addressable_shards} == {(config.vocab_size, 7)}


def test_placement_splits_fsdp_into_context_and_refuses_what_cannot_split():
  spec = strategies.build_placement(
    PlacementSection(strategy="disaggregated", context=2, tensor=1), 8
  )
  actor = spec["actor"]
  assert actor.axes == (("data", 1), ("fsdp", 2), ("context", 2), ("tensor", 1))
  assert actor.devices == (0, 1, 2, 3)
  assert spec["rollout"].layout == Layout.GENERATION and spec["rollout"].context == 1
  with pytest.raises(PlacementError, match=r"placement.context=3 does not divide .* 1, 2 or 4$"):
    strategies.build_placement(PlacementSection(strategy="disaggregated", context=3), 8)
  with pytest.raises(ConfigError, match="context parallelism does not run inside pipeline"):
    PlacementSection(context=2, pipeline_stages=2)
  with pytest.raises(ConfigError, match="'context' axis in placement.explicit"):
    PlacementSection(strategy="explicit", context=2)
  mesh = meshes.make_mesh(actor)
  spec_of = lambda axes, shape: rules.partition_spec(axes, Layout.TRAINING, mesh, shape)
  assert spec_of(("batch", "length", None), (4, 64, 8)) == PartitionSpec("fsdp", "context", None)
  assert spec_of(("embed", "mlp"), (56, 152)) == PartitionSpec(("fsdp", "context"), None)


def test_memory_and_time_models_price_the_context_axis():
  """The same tokens per device as 8 rows of 8k on fsdp=8 and 2 rows of 32k on fsdp=2 x
  context=4: the same activations and logits, plus attention's gathered keys and values of
  whole rows (their gradients too); the all-gather is priced per layer and pass on the links."""
  config = get_model_config("1b")
  options = memory.Options(remat="full", fused_attention=True, logits_chunk=1024)
  flat = memory.Sharding(param_shards=8, batch_shards=8)
  split = memory.Sharding(param_shards=8, batch_shards=2, context=4)
  one = memory.train_memory(config, "lm", flat, micro_batch=1, seq_len=8192, options=options)
  cp = memory.train_memory(config, "lm", split, micro_batch=1, seq_len=32768, options=options)
  assert (cp.params, cp.optimizer, cp.logits) == (one.params, one.optimizer, one.logits)
  c = memory.activation_bytes(config, options.native_half)
  gathered = 2 * 32768 * 2 * config.num_kv_heads * config.head_dim * c
  assert cp.activations - one.activations == pytest.approx(gathered, abs=16)
  hw, eff = hardware.load_hardware("h100"), efficiency.Efficiency()
  group = lambda context: costs.Group(devices=8, context=context)
  kw = dict(sequences=8, seq_len=32768, epochs=1, optimizer_steps=1, micro_steps=4, remat="full")
  t1 = costs.train_time(hw, eff, config, "lm", group(1), **kw)
  t4 = costs.train_time(hw, eff, config, "lm", group(4), **kw)
  rows = 8 // 2  # 2 groups of 4 context devices, each group 4 whole rows
  kv = (
    rows
    * 32768
    * 2
    * config.num_kv_heads
    * config.head_dim
    * {"float32": 4, "bfloat16": 2}[config.dtype]
  )
  ring = kv * 3 / 4 / (hw.intra_node_bw * eff.collective_bw)
  passes = 4  # with full remat: as the model prices every per-layer collective of a step
  assert t4 - t1 == pytest.approx(passes * config.num_layers * ring, rel=1e-6)


def test_the_planner_splits_rows_over_context_only_where_a_sequence_does_not_fit():
  """A 7b actor and reference on 8 H100s at 256k tokens a sequence: with tensor=1 the rows do
  not fit one device's share, and the search keeps the placement with each row over 4 devices
  (the smallest split that fits); at 8k tokens no plan splits rows."""
  from rlhfjax.costmodel.workload import Workload, resolve_model
  from rlhfjax.flows import registry
  from rlhfjax.planner import search
  from rlhfjax.planner.evaluate import evaluate

  seven = resolve_model("7b")
  hw, eff = hardware.load_hardware("h100"), efficiency.load_efficiency(None)

  def workload(seq_len):
    return Workload(
      actor=seven,
      reference=seven,
      pricing=registry.pricing_by_name("ppo"),
      prompts=8,
      prompt_len=1024,
      response_len_mean=seq_len - 1024,
      response_len_max=seq_len - 1024,
      remat="full",
      logits_chunk=1024,
    )

  long = workload(262144)
  plans = search.search(long, hw, eff, 8)
  split = [p for p in plans if "cp=" in p.label]
  assert split and all(p.fits for p in split)
  plan = split[0]
  assert plan.label.endswith("cp=4")
  actor = plan.spec["actor"]
  assert actor.context == 4 and actor.axis_size("fsdp") * 4 * actor.axis_size("tensor") == 8
  flat = dict(plan.spec.roles)
  for role, spec in flat.items():
    if spec.layout == Layout.TRAINING:
      flat[role] = RoleSpec.training(spec.devices, fsdp=spec.axis_size("fsdp") * spec.context)
  unsplit = evaluate(
    dataclasses.replace(plan.spec, roles=flat), long, hw, eff, micro_batch=1, label="flat"
  )
  assert not unsplit.fits and unsplit.peak_memory_gib > plan.peak_memory_gib
  assert not any("cp=" in p.label for p in search.search(workload(8192), hw, eff, 8))


def test_a_context_size_that_does_not_split_the_rows_is_one_line_at_config_time():
  import pathlib
  import runpy

  from rlhfjax.config import from_config_dict
  from rlhfjax.flows import registry

  configs = pathlib.Path(__file__).parent.parent / "configs"
  cd = runpy.run_path(str(configs / "ppo_tiny.py"))["get_config"]("disaggregated")
  cd.placement.context = 3
  cfg = from_config_dict(cd)  # 48 + 16 tokens a row
  with pytest.raises(ConfigError, match=r"'placement.context'=3 does not divide the rows' 64 "):
    registry.configure(cfg)
  cd.placement.context = 2
  assert registry.configure(from_config_dict(cd)).placement.context == 2
