"""Attention whose mask is ids per token, never a `[t, s]` array: the one entry point the
models, the scorers, the trainer and the rollout engine call (`attend`).

Letters as in `transformer`: b batch, t queries, s keys, h query heads, k kv heads, g query
heads per kv head, n head dim; q/c a block of queries/keys.

Which keys a query sees is a `Mask` of four `[b, t]` / `[b, s]` int arrays: query i sees key j
when both carry the same segment id, the key's id is positive, the key's position is not after
the query's, and (with a sliding window w) the query's position minus the key's is below w.
Packed rows (several sequences per row, positions restarting at each), left- or right-padded
rows (one segment, id 0 on padding) and the engine's cache slots are all such ids. A query that
sees no key (padding) gets a finite output that nothing reads (scores are finite: no NaN).

Kernels (`ModelConfig.attention`), equal within float tolerance (tests/test_attention.py):

* 'blockwise': flash attention in XLA, any backend: an online softmax over key blocks per
  query block, a custom gradient that recomputes each block's scores from the saved log-sum-exp
  (memory O(t x block), not O(t x s)), skipping there the blocks a causal row cannot see. The
  forward computes every block: a `lax.cond` there, differentiated inside the layer scan, has
  JAX keep every block's scores for the backward (measured: `[t, t]` of memory). What 'auto'
  runs on the CPU, and wherever the kernels below do not apply.
* 'pallas_gpu': JAX's Pallas (Triton) flash attention with segment ids
  (`jax.experimental.pallas.ops.gpu.attention.mha`), forward and backward, per shard.
* 'splash': JAX's TPU splash attention with `SegmentIds` and a causal (and local) mask.
* 'xla' (`jax.nn.dot_product_attention`) and 'einsum' (two einsums around a softmax): the
  reference paths. Both build the `[b, t, s]` mask inside the call, from the ids; 'auto' takes
  'xla' only for a few queries per row (decode steps).

Why these kernels: the two Pallas kernels ship with JAX itself (kept by the JAX team, run in
interpret mode on a CPU, which is how tests/test_attention.py checks them), and both take
segment ids. `jax.nn.dot_product_attention`'s cuDNN path takes no segment ids (JAX 0.10), and
`tokamax` (0.0.12) reaches per-row key ranges only through its private `_src` mask class.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rlhfjax.config.model import ModelConfig

MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
"""The score of a key a query may not see: finite, so a fully masked row stays NaN-free."""

DENSE_QUERIES = 16
"""'auto' takes the dense 'xla' path at most this many queries per row (decode steps)."""

BLOCK = 512
"""Queries and keys per block of the 'blockwise' kernel."""

PALLAS_BLOCK = 128
"""Queries and keys per block of the Pallas kernels (a row pads to a multiple of it)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mask:
  """Which keys each query sees, as ids per token (see the module docstring)."""

  q_segments_bt: jax.Array
  q_positions_bt: jax.Array
  k_segments_bs: jax.Array
  k_positions_bs: jax.Array
  window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  """A query sees keys at most `window - 1` positions back (sliding-window attention)."""
  self_attention: bool = dataclasses.field(default=False, metadata=dict(static=True))
  """The keys are the queries' own tokens, in order, and positions rise by one along each
  segment: a key after its query (by index) is never seen, so kernels may mask by index."""

  @classmethod
  def packed(cls, segments_bt, positions_bt, window: int | None = None) -> Mask:
    """Self-attention over rows of whole segments (`rlhfjax.data.packing`; a padded batch is
    one segment per row, id 0 on its padding)."""
    segments_bt = jnp.asarray(segments_bt, jnp.int32)
    positions_bt = jnp.asarray(positions_bt, jnp.int32)
    return cls(segments_bt, positions_bt, segments_bt, positions_bt, window, True)

  @classmethod
  def over_keys(
    cls, q_segments_bt, q_positions_bt, k_segments_bs, k_positions_bs, window: int | None = None
  ) -> Mask:
    """New queries over other keys (a KV cache's slots)."""
    ids = (q_segments_bt, q_positions_bt, k_segments_bs, k_positions_bs)
    return cls(*(jnp.asarray(x, jnp.int32) for x in ids), window, False)

  def allowed(self) -> jax.Array:
    """The whole `[b, t, s]` boolean mask (for the dense reference paths)."""
    return _allowed(
      self.q_segments_bt, self.q_positions_bt, self.k_segments_bs, self.k_positions_bs, self.window
    )


def _allowed(q_seg_bt, q_pos_bt, k_seg_bs, k_pos_bs, window) -> jax.Array:
  seg_q, seg_k = q_seg_bt[:, :, None], k_seg_bs[:, None, :]
  pos_q, pos_k = q_pos_bt[:, :, None], k_pos_bs[:, None, :]
  allowed = (seg_q == seg_k) & (seg_k > 0) & (pos_k <= pos_q)
  if window is not None:
    allowed &= pos_q - pos_k < window
  return allowed


# ---------------------------------------------------------------------------------------------
# Reference paths.


def einsum_attention(q_bthn, keys_bskn, values_bskn, mask: Mask, dtype) -> jax.Array:
  """Softmax attention as two einsums over an fp32 `[b, k, g, t, s]` score tensor."""
  b, t, h, n = q_bthn.shape
  k = keys_bskn.shape[2]
  q_btkgn = q_bthn.reshape(b, t, k, h // k, n)  # query head j uses kv head j // g
  scores_bkgts = jnp.einsum("btkgn,bskn->bkgts", q_btkgn, keys_bskn.astype(q_btkgn.dtype))
  scores_bkgts = scores_bkgts.astype(jnp.float32) * (n**-0.5)
  scores_bkgts = jnp.where(mask.allowed()[:, None, None], scores_bkgts, MASKED)
  probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(dtype)
  out_btkgn = jnp.einsum("bkgts,bskn->btkgn", probs_bkgts, values_bskn.astype(dtype))
  return out_btkgn.reshape(b, t, h, n)


# ---------------------------------------------------------------------------------------------
# 'blockwise': flash attention in XLA.


def _pad_to(x, axis: int, size: int):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _blocks(x, axis: int, block: int):
  """`x` split along `axis` into `[m, ..., block, ...]` (leading block index)."""
  shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1 :]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x, axis: int):
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])


def _live(mask: Mask, qi, kj, block_q: int, block_k: int):
  """Whether block (qi, kj) may hold a visible key (in the backward): always, unless the mask is
  causal by index (then not for a key block after the query block, nor one wholly before a
  window)."""
  if not mask.self_attention:
    return True
  live = kj * block_k <= qi * block_q + block_q - 1
  if mask.window is not None:
    live &= kj * block_k + block_k - 1 > qi * block_q - mask.window
  return live


def _block_scores(q_bkgqn, k_bckn, ids, window, scale):
  """Masked fp32 scores `[b, k, g, q, c]` of a query block over a key block, and the mask."""
  q_seg, q_pos, k_seg, k_pos = ids
  s = jnp.einsum("bkgqn,bckn->bkgqc", q_bkgqn, k_bckn, preferred_element_type=jnp.float32)
  allowed_bqc = _allowed(q_seg, q_pos, k_seg, k_pos, window)[:, None, None]
  return jnp.where(allowed_bqc, s * scale, MASKED), allowed_bqc


def _prepare(q_bthn, k_bskn, v_bskn, mask: Mask, block_q: int, block_k: int):
  """Inputs padded to whole blocks and split into them: queries `[m, b, k, g, q, n]`, keys and
  values `[w, b, c, k, n]`, ids `[m, b, q]` and `[w, b, c]`. Padded queries and keys carry
  segment 0: they see nothing and are never seen."""
  b, t, h, n = q_bthn.shape
  s, k = k_bskn.shape[1], k_bskn.shape[2]
  tp, sp = -(-t // block_q) * block_q, -(-s // block_k) * block_k
  q = _pad_to(q_bthn, 1, tp).reshape(b, tp, k, h // k, n).transpose(0, 2, 3, 1, 4)
  q_blocks = _blocks(q, 3, block_q)
  k_blocks, v_blocks = (_blocks(_pad_to(x, 1, sp), 1, block_k) for x in (k_bskn, v_bskn))
  # The ids plus a zero computed from the queries: differentiated in a scan over layers, JAX
  # hoists what depends on loop-invariant values alone (every block's mask from the ids) out
  # of the scan and keeps all of it, `[t, s]`; made per-layer values, it stays in the loop.
  zero = jnp.where(jnp.isnan(q_bthn[0, 0, 0, 0]), 0, 0)
  q_ids = (mask.q_segments_bt + zero, mask.q_positions_bt + zero)
  k_ids = (mask.k_segments_bs + zero, mask.k_positions_bs + zero)
  q_ids = tuple(_blocks(_pad_to(x, 1, tp), 1, block_q) for x in q_ids)
  k_ids = tuple(_blocks(_pad_to(x, 1, sp), 1, block_k) for x in k_ids)
  return q_blocks, k_blocks, v_blocks, q_ids, k_ids


def _flash_forward(q_bthn, k_bskn, v_bskn, mask: Mask, block_q: int, block_k: int):
  """`(out [b, t, h, n], lse [m, b, k, g, q])`: each query block's online softmax over the key
  blocks it may see."""
  b, t, h, n = q_bthn.shape
  scale = n**-0.5
  q_blocks, k_blocks, v_blocks, q_ids, k_ids = _prepare(
    q_bthn, k_bskn, v_bskn, mask, block_q, block_k
  )

  def query_block(args):
    q_bkgqn, q_seg, q_pos = args

    def key_block(carry, x):
      k_bckn, v_bckn, k_seg, k_pos = x

      def update(carry):
        m_bkgq, l_bkgq, acc_bkgqn = carry
        s, _ = _block_scores(q_bkgqn, k_bckn, (q_seg, q_pos, k_seg, k_pos), mask.window, scale)
        m_new = jnp.maximum(m_bkgq, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m_bkgq - m_new)
        l_new = l_bkgq * correction + jnp.sum(p, axis=-1)
        pv = jnp.einsum(
          "bkgqc,bckn->bkgqn", p.astype(v_bckn.dtype), v_bckn, preferred_element_type=jnp.float32
        )
        return m_new, l_new, acc_bkgqn * correction[..., None] + pv

      return update(carry), None

    shape = q_bkgqn.shape[:-1]
    init = (
      jnp.full(shape, MASKED, jnp.float32),
      jnp.zeros(shape, jnp.float32),
      jnp.zeros(q_bkgqn.shape, jnp.float32),
    )
    (m, total, acc), _ = jax.lax.scan(key_block, init, (k_blocks, v_blocks, *k_ids))
    return acc / total[..., None], m + jnp.log(total)

  out_mbkgqn, lse_mbkgq = jax.lax.map(query_block, (q_blocks, *q_ids))
  out = _unblocks(out_mbkgqn, 3).transpose(0, 3, 1, 2, 4).reshape(b, -1, h, n)[:, :t]
  return out.astype(q_bthn.dtype), lse_mbkgq


def blockwise_attention(q_bthn, k_bskn, v_bskn, mask: Mask, block_q: int, block_k: int):
  """Flash attention in XLA (see the module docstring), `[b, t, h, n]`.

  Queries and keys that fit one block each are that one block's dense attention (the same
  memory; no loop to compile)."""
  if q_bthn.shape[1] <= block_q and k_bskn.shape[1] <= block_k:
    return einsum_attention(q_bthn, k_bskn, v_bskn, mask, q_bthn.dtype)
  return _blockwise(q_bthn, k_bskn, v_bskn, mask, block_q, block_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blockwise(q_bthn, k_bskn, v_bskn, mask: Mask, block_q: int, block_k: int):
  return _flash_forward(q_bthn, k_bskn, v_bskn, mask, block_q, block_k)[0]


def _blockwise_fwd(q_bthn, k_bskn, v_bskn, mask, block_q, block_k):
  out, lse = _flash_forward(q_bthn, k_bskn, v_bskn, mask, block_q, block_k)
  return out, (q_bthn, k_bskn, v_bskn, mask, out, lse)


def _blockwise_bwd(block_q, block_k, residuals, d_out_bthn):
  """FlashAttention-2's backward: per query block, the key blocks' scores recomputed from the
  saved log-sum-exp; dq summed over key blocks, dk and dv over query blocks."""
  q_bthn, k_bskn, v_bskn, mask, out_bthn, lse_mbkgq = residuals
  b, t, h, n = q_bthn.shape
  s, k = k_bskn.shape[1], k_bskn.shape[2]
  scale = n**-0.5
  q_blocks, k_blocks, v_blocks, q_ids, k_ids = _prepare(
    q_bthn, k_bskn, v_bskn, mask, block_q, block_k
  )
  # d_out and out in the queries' block layout; D = rowsum(d_out * out).
  tp = q_blocks.shape[0] * block_q

  def query_layout(x):
    x = _pad_to(x.astype(jnp.float32), 1, tp).reshape(b, tp, k, h // k, n).transpose(0, 2, 3, 1, 4)
    return _blocks(x, 3, block_q)

  do_blocks = query_layout(d_out_bthn)
  delta_blocks = jnp.sum(do_blocks * query_layout(out_bthn), axis=-1)

  def query_block(carry, args):
    dk_wbckn, dv_wbckn = carry
    qi, q_bkgqn, do_bkgqn, lse_bkgq, delta_bkgq, q_seg, q_pos = args

    def key_block(dq_bkgqn, x):
      kj, k_bckn, v_bckn, k_seg, k_pos = x

      def grads(dq_bkgqn):
        s, allowed = _block_scores(
          q_bkgqn, k_bckn, (q_seg, q_pos, k_seg, k_pos), mask.window, scale
        )
        p = jnp.exp(s - lse_bkgq[..., None])
        dv = jnp.einsum("bkgqc,bkgqn->bckn", p, do_bkgqn)
        dp = jnp.einsum("bkgqn,bckn->bkgqc", do_bkgqn, v_bckn.astype(jnp.float32))
        ds = jnp.where(allowed, p * (dp - delta_bkgq[..., None]), 0.0) * scale
        dq = dq_bkgqn + jnp.einsum("bkgqc,bckn->bkgqn", ds, k_bckn.astype(jnp.float32))
        dk = jnp.einsum("bkgqc,bkgqn->bckn", ds, q_bkgqn.astype(jnp.float32))
        return dq, (dk, dv)

      live = _live(mask, qi, kj, block_q, block_k)
      if live is True:
        return grads(dq_bkgqn)
      zeros = jnp.zeros(k_bckn.shape, jnp.float32)
      return jax.lax.cond(live, grads, lambda dq: (dq, (zeros, zeros)), dq_bkgqn)

    dq, (dk, dv) = jax.lax.scan(
      key_block,
      jnp.zeros(q_bkgqn.shape, jnp.float32),
      (jnp.arange(k_blocks.shape[0]), k_blocks, v_blocks, *k_ids),
    )
    return (dk_wbckn + dk, dv_wbckn + dv), dq

  zeros = jnp.zeros(k_blocks.shape, jnp.float32)
  (dk_w, dv_w), dq_m = jax.lax.scan(
    query_block,
    (zeros, zeros),
    (jnp.arange(q_blocks.shape[0]), q_blocks, do_blocks, lse_mbkgq, delta_blocks, *q_ids),
  )
  dq = _unblocks(dq_m, 3).transpose(0, 3, 1, 2, 4).reshape(b, -1, h, n)[:, :t]
  dk, dv = (_unblocks(x, 1)[:, :s] for x in (dk_w, dv_w))
  return dq.astype(q_bthn.dtype), dk.astype(k_bskn.dtype), dv.astype(v_bskn.dtype), None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


# ---------------------------------------------------------------------------------------------
# Pallas kernels: self-attention of whole rows, per shard.


def _pallas_gpu(q_bthn, k_bthn, v_bthn, segments_bt, block: int) -> jax.Array:
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention

  sizes = gpu_attention.BlockSizes(
    block_q=block,
    block_k=block,
    block_q_dkv=min(block, 32),
    block_kv_dkv=min(block, 32),
    block_q_dq=min(block, 32),
    block_kv_dq=min(block, 32),
  )
  return gpu_attention.mha(
    q_bthn,
    k_bthn,
    v_bthn,
    segments_bt,
    sm_scale=q_bthn.shape[-1] ** -0.5,
    causal=True,
    block_sizes=sizes,
    interpret=jax.default_backend() != "gpu",
  )


def _splash(q_bthn, k_bthn, v_bthn, segments_bt, block: int, window: int | None) -> jax.Array:
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
  )
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as splash_mask,
  )

  _, t, h, n = q_bthn.shape
  if window is None:
    head_mask = splash_mask.CausalMask((t, t))
  else:
    head_mask = splash_mask.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
  sizes = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  kernel = splash.make_splash_mha(
    splash_mask.MultiHeadMask([head_mask] * h),
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=1,
    interpret=jax.default_backend() != "tpu",
  )

  def one_row(q_thn, k_thn, v_thn, seg_t):
    q_htn = (q_thn.astype(jnp.float32) * n**-0.5).astype(q_thn.dtype).swapaxes(0, 1)
    ids = splash.SegmentIds(seg_t, seg_t)
    return kernel(q_htn, k_thn.swapaxes(0, 1), v_thn.swapaxes(0, 1), segment_ids=ids).swapaxes(0, 1)

  return jax.vmap(one_row)(q_bthn, k_bthn, v_bthn, segments_bt)


def pallas_attention(kernel: str, q_bthn, k_bskn, v_bskn, mask: Mask) -> jax.Array:
  """Self-attention of whole rows through a Pallas kernel ('pallas_gpu' or 'splash'),
  `[b, t, h, n]`.

  Rows pad to whole blocks (padding is segment 0, and so is a row's own padding: such tokens
  see only each other, their outputs unused). Keys and values repeat over their query heads
  (the kernels take as many kv heads as query heads). Under a mesh in context the kernel runs
  per shard (`jax.shard_map`): rows over the batch's mesh axes, heads over 'tensor'."""
  if not mask.self_attention:
    raise ValueError(f"the {kernel!r} kernel runs self-attention of whole rows only")
  if kernel == "pallas_gpu" and mask.window is not None:
    raise ValueError("the 'pallas_gpu' kernel has no sliding window: use 'blockwise'")
  b, t, h, n = q_bthn.shape
  k = k_bskn.shape[2]
  block = PALLAS_BLOCK
  tp = -(-t // block) * block
  q, keys, values = (_pad_to(x, 1, tp) for x in (q_bthn, k_bskn, v_bskn))
  keys, values = (jnp.repeat(x, h // k, axis=2) for x in (keys, values))
  segments = _pad_to(mask.q_segments_bt, 1, tp)
  if kernel == "pallas_gpu":
    fn = functools.partial(_pallas_gpu, block=block)
  else:
    fn = functools.partial(_splash, block=block, window=mask.window)

  mesh = jax.sharding.get_abstract_mesh()
  sizes = {} if mesh.empty else {a: s for a, s in mesh.shape.items() if s > 1}
  if sizes:
    P = jax.sharding.PartitionSpec
    heads = "tensor" if h % sizes.get("tensor", 1) == 0 and "tensor" in sizes else None
    rows_spec = _row_axes(mesh, b)
    fn = jax.shard_map(
      fn,
      mesh=mesh,
      in_specs=(P(rows_spec, None, heads),) * 3 + (P(rows_spec),),
      out_specs=P(rows_spec, None, heads),
      check_vma=False,
    )
  return fn(q, keys, values, segments)[:, :t]


# ---------------------------------------------------------------------------------------------
# Context parallelism: a row's tokens split over the mesh's 'context' axis.


def context_shards(length: int) -> int:
  """How many pieces the mesh in context splits a row of `length` tokens into: the size of its
  'context' axis when that divides `length` (as `rlhfjax.mesh.rules` then shards the 'length'
  logical axis over it), else 1."""
  mesh = jax.sharding.get_abstract_mesh()
  size = 1 if mesh.empty else dict(mesh.shape).get("context", 1)
  return size if size > 1 and length % size == 0 else 1


def _row_axes(mesh, rows: int) -> tuple[str, ...] | None:
  """The batch's mesh axes (data, fsdp, stage, in that order) whose product divides `rows`."""
  sizes = {a: s for a, s in mesh.shape.items() if s > 1}
  axes, product = [], 1
  for axis in ("data", "fsdp", "stage"):
    if axis in sizes and rows % (product * sizes[axis]) == 0:
      axes.append(axis)
      product *= sizes[axis]
  return tuple(axes) or None


def context_attention(impl: str, q_bthn, k_bskn, v_bskn, mask: Mask) -> jax.Array:
  """Self-attention of rows whose tokens are split over the mesh's 'context' axis (Llama 3's
  context parallelism), `[b, t, h, n]`.

  Per shard (`jax.shard_map`: rows over the batch's axes, tokens over 'context', heads over
  'tensor' when it divides the KV heads), the keys and values of the whole row and their ids
  are all-gathered over 'context' (their gradient is the matching reduce-scatter), and the
  shard's queries attend to them under the ids' mask: 'blockwise' (the fused kernels take
  whole rows only), or 'einsum' for the reference paths. Causality comes from the positions,
  so any split of a row is exact; the forward computes every block, so the shards do equal
  work whatever their place in the row. A sliding window works the same way (the gathered
  keys hold every position)."""
  mesh = jax.sharding.get_abstract_mesh()
  b = q_bthn.shape[0]
  k = k_bskn.shape[2]
  tensor = dict(mesh.shape).get("tensor", 1)
  heads = "tensor" if tensor > 1 and k % tensor == 0 else None
  rows = _row_axes(mesh, b)
  P = jax.sharding.PartitionSpec
  window = mask.window

  def per_shard(q_bthn, k_bskn, v_bskn, q_seg, q_pos, k_seg, k_pos):
    gather = functools.partial(jax.lax.all_gather, axis_name="context", axis=1, tiled=True)
    keys, values, k_seg, k_pos = (gather(x) for x in (k_bskn, v_bskn, k_seg, k_pos))
    local = Mask.over_keys(q_seg, q_pos, k_seg, k_pos, window)
    if impl in ("einsum", "xla"):
      return einsum_attention(q_bthn, keys, values, local, q_bthn.dtype)
    tl, s = q_bthn.shape[1], keys.shape[1]
    return blockwise_attention(q_bthn, keys, values, local, min(BLOCK, tl), min(BLOCK, s))

  tokens = P(rows, "context", heads)
  ids = P(rows, "context")
  fn = jax.shard_map(
    per_shard,
    mesh=mesh,
    in_specs=(tokens,) * 3 + (ids,) * 4,
    out_specs=tokens,
    check_vma=False,
  )
  return fn(
    q_bthn,
    k_bskn,
    v_bskn,
    mask.q_segments_bt,
    mask.q_positions_bt,
    mask.k_segments_bs,
    mask.k_positions_bs,
  )


# ---------------------------------------------------------------------------------------------
# The entry point.


def implementation(config: ModelConfig, q_bthn: jax.Array, mask: Mask) -> str:
  """The kernel `config.attention` resolves to for these queries on the default backend.

  'auto': 'xla' for at most `DENSE_QUERIES` queries a row (a decode step's `[b, t, s]` mask is
  small); for self-attention of whole rows the Pallas kernel of the backend where it applies
  (a GPU: 'pallas_gpu' without a sliding window, for half precision and a head dim of at most
  128; a TPU: 'splash', for head dims that are multiples of 128); 'blockwise' elsewhere."""
  if config.attention != "auto":
    return config.attention
  t, n = q_bthn.shape[1], q_bthn.shape[-1]
  if t <= DENSE_QUERIES:
    return "xla"
  backend = jax.default_backend()
  half = q_bthn.dtype in (jnp.bfloat16, jnp.float16)
  if mask.self_attention and backend == "gpu" and half and mask.window is None and n <= 128:
    return "pallas_gpu"
  if mask.self_attention and backend == "tpu" and n % 128 == 0:
    return "splash"
  return "blockwise"


def attend(config: ModelConfig, q_bthn, keys_bskn, values_bskn, mask: Mask) -> jax.Array:
  """Grouped-query attention of `q` over keys/values under `mask`, `[b, t, h, n]`."""
  impl = implementation(config, q_bthn, mask)
  dtype = jnp.dtype(config.dtype)
  if mask.self_attention and context_shards(q_bthn.shape[1]) > 1:
    q_bthn, keys_bskn, values_bskn = (x.astype(dtype) for x in (q_bthn, keys_bskn, values_bskn))
    return context_attention(impl, q_bthn, keys_bskn, values_bskn, mask)
  if impl == "einsum":
    return einsum_attention(q_bthn, keys_bskn, values_bskn, mask, dtype)
  q_bthn, keys_bskn, values_bskn = (x.astype(dtype) for x in (q_bthn, keys_bskn, values_bskn))
  if impl == "blockwise":
    t, s = q_bthn.shape[1], keys_bskn.shape[1]
    return blockwise_attention(q_bthn, keys_bskn, values_bskn, mask, min(BLOCK, t), min(BLOCK, s))
  if impl in ("pallas_gpu", "splash"):
    return pallas_attention(impl, q_bthn, keys_bskn, values_bskn, mask)
  return jax.nn.dot_product_attention(
    q_bthn, keys_bskn, values_bskn, mask=mask.allowed()[:, None], implementation="xla"
  )
