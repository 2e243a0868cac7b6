"""Every attention kernel against the einsum reference over packed rows, sliding windows and
grouped-query heads, forward and gradients (fp32); the Pallas kernels in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax.config.model import get_model_config
from rlhfjax.models import attention
from rlhfjax.models.attention import Mask

pytestmark = pytest.mark.unit

B, T, H, K, N = 3, 200, 4, 2, 16


def _ids():
  """Row 0: three packed segments and padding; row 1: left padded; row 2: one whole segment."""
  segments, positions = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
  start = 0
  for seg, length in enumerate((70, 45, 60), start=1):
    segments[0, start : start + length] = seg
    positions[0, start : start + length] = np.arange(length)
    start += length
  segments[1, 33:] = 1
  positions[1, 33:] = np.arange(T - 33)
  segments[2] = 1
  positions[2] = np.arange(T)
  return segments, positions


def _qkv(seed=0):
  rng = np.random.default_rng(seed)
  shapes = ((B, T, H, N), (B, T, K, N), (B, T, K, N))
  return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)


def _kernel(impl, block=64):
  if impl == "blockwise":
    return lambda q, k, v, mask: attention.blockwise_attention(q, k, v, mask, block, block)
  return lambda q, k, v, mask: attention.pallas_attention(impl, q, k, v, mask)


def _reference(q, k, v, mask):
  return attention.einsum_attention(q, k, v, mask, jnp.float32)


def _value_and_grads(fn, mask, seed=1):
  """Outputs and the gradients of a weighted sum of the real tokens' outputs."""
  q, k, v = _qkv()
  real = np.asarray(mask.q_segments_bt) > 0
  weights = jnp.asarray(np.random.default_rng(seed).normal(size=(B, T, H, N)), jnp.float32)
  weights = weights * real[:, :, None, None]
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, mask) * weights)
  return fn(q, k, v, mask), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _assert_close(got, want, what):
  scale = float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(
    np.asarray(got), np.asarray(want), atol=1e-5 * scale, rtol=0, err_msg=what
  )


@pytest.mark.parametrize(
  "impl,window",
  [("blockwise", None), ("blockwise", 7), ("pallas_gpu", None), ("splash", None), ("splash", 7)],
)
def test_kernels_equal_the_reference_forward_and_gradients(impl, window):
  segments, positions = _ids()
  mask = Mask.packed(segments, positions, window)
  out, grads = _value_and_grads(_kernel(impl), mask)
  ref, ref_grads = _value_and_grads(_reference, mask)
  real = segments > 0
  assert np.all(np.isfinite(np.asarray(out)))
  _assert_close(np.asarray(out)[real], np.asarray(ref)[real], "outputs")
  for got, want, name in zip(grads, ref_grads, "qkv", strict=True):
    _assert_close(got, want, f"d{name}")


def test_blockwise_over_cache_keys_with_uneven_blocks():
  """New queries over other keys (the engine's prefill into cache slots): no index causality,
  so no block is skipped; blocks of 48 queries and 80 keys leave partial blocks on both."""
  q, k, v = _qkv(2)
  rng = np.random.default_rng(3)
  lengths = rng.integers(1, T, size=B)
  slots = np.broadcast_to(np.arange(T), (B, T))
  query_slots = slots[:, :150]
  mask = Mask.over_keys(np.ones((B, 150)), query_slots, slots < lengths[:, None], slots, 9)
  q = q[:, :150]
  # Queries past a short prompt's window see no key: their outputs are read by nothing.
  sees_bt1 = np.asarray(jnp.any(mask.allowed(), axis=-1))[:, :, None, None]
  assert 0 < sees_bt1.mean() < 1
  fn = lambda q, k, v: attention.blockwise_attention(q, k, v, mask, 48, 80) * sees_bt1
  ref_fn = lambda q, k, v: attention.einsum_attention(q, k, v, mask, jnp.float32) * sees_bt1
  _assert_close(fn(q, k, v), ref_fn(q, k, v), "outputs")
  grads = jax.grad(lambda *x: jnp.sum(jnp.sin(fn(*x))), argnums=(0, 1, 2))(q, k, v)
  ref_grads = jax.grad(lambda *x: jnp.sum(jnp.sin(ref_fn(*x))), argnums=(0, 1, 2))(q, k, v)
  for got, want, name in zip(grads, ref_grads, "qkv", strict=True):
    _assert_close(got, want, f"d{name}")


def test_blockwise_memory_is_linear_in_the_sequence():
  """XLA's own memory analysis of the gradient of two layers of attention at 8192 tokens, in a
  scan like the model's layer stack (where JAX's partial evaluation once kept every block's
  scores): the live temporaries stay a small fraction of one head's `[t, t]` scores."""
  t = 8192
  q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, t), jnp.int32)

  def loss(q, segments, positions):
    mask = Mask.packed(segments, positions)

    def layer(x, _):
      keys = x[:, :, :1] * 0.5
      return x + attention.blockwise_attention(x, keys, keys, mask, 512, 512), None

    out, _ = jax.lax.scan(layer, q, None, length=2)
    return jnp.sum(out)

  compiled = jax.jit(jax.grad(loss)).lower(q, ids, ids).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  one_head_scores = t * t * 4
  assert temp < one_head_scores / 8, (temp, one_head_scores)


def test_pallas_kernel_runs_per_shard_under_a_mesh():
  """Under a mesh in context the kernel runs per shard: rows over 'data', heads over 'tensor';
  the result equals the unsharded one and stays sharded where its inputs were."""
  segments, positions = _ids()
  segments, positions = np.concatenate([segments] * 2)[:4], np.concatenate([positions] * 2)[:4]
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.normal(size=(4, T, h, N)), jnp.float32) for h in (H, K, K))
  mask = Mask.packed(segments, positions)
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
  spec = NamedSharding(mesh, PartitionSpec("data", None, "tensor"))
  q, k, v = (jax.device_put(x, spec) for x in (q, k, v))

  def fn(q, k, v, mask):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return attention.pallas_attention("pallas_gpu", q, k, v, mask)

  out = jax.jit(fn)(q, k, v, mask)
  ref = attention.einsum_attention(q, k, v, mask, jnp.float32)
  real = segments > 0
  _assert_close(np.asarray(out)[real], np.asarray(ref)[real], "outputs")
  assert out.sharding.is_equivalent_to(spec, out.ndim)
  for shard in out.addressable_shards:
    assert shard.data.shape == (2, T, H // 2, N)


def test_auto_picks_per_backend_and_kernels_refuse_what_they_cannot_do(monkeypatch):
  config = get_model_config("tiny")
  segments, positions = _ids()
  packed = Mask.packed(segments, positions)
  windowed = Mask.packed(segments, positions, 8)
  cache = Mask.over_keys(np.ones((B, 1)), positions[:, :1], segments, positions)
  bf16 = jnp.zeros((B, T, H, 64), jnp.bfloat16)
  f32 = jnp.zeros((B, T, H, 64), jnp.float32)
  pick = lambda q, mask: attention.implementation(config, q, mask)
  assert pick(bf16[:, :1], cache) == "xla"  # a decode step
  assert pick(bf16, packed) == "blockwise"  # the CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert pick(bf16, packed) == "pallas_gpu"
  assert pick(bf16, windowed) == "blockwise"  # Triton's kernel has no window
  assert pick(f32, packed) == "blockwise"
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert pick(jnp.zeros((B, T, H, 128), jnp.bfloat16), windowed) == "splash"
  assert pick(bf16, packed) == "blockwise"  # head dim 64: not a multiple of 128
  assert attention.implementation(config.replace(attention="einsum"), bf16, packed) == "einsum"
  monkeypatch.undo()
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="'pallas_gpu' kernel has no sliding window"):
    attention.pallas_attention("pallas_gpu", q, k, v, windowed)
  with pytest.raises(ValueError, match="self-attention of whole rows only"):
    cross = Mask.over_keys(segments, positions, segments, positions)
    attention.pallas_attention("splash", q, k, v, cross)
