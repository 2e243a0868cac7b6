"""Benchmarks `rlhfjax.mesh.transfer` between meshes against a NumPy copy of the same bytes.

Prints one JSON object per case. The headline is the steady state of a weight sync, a transfer
`into=` the previous result (`"into": true`); `"fresh"` holds the same numbers for a transfer
into new memory. `gbps` counts the global bytes of the tree over the transfer's time;
`numpy_gbps` counts the same bytes over the time NumPy takes to `np.copyto` every target shard
once into warm buffers (the bytes any move must write: replicas count), timed in the same loop.

Where the time goes: `passes` is the bytes the move writes (slicing pieces, copying them, joining
them, copying replicas; `rlhfjax.mesh.transfer.traffic`) per byte it delivers, and `faulted` the
bytes of fresh memory the kernel had to map in per move (minor page faults). On the CPU both cost
memory bandwidth, which is what NumPy's copy is limited by, so `ratio` stays below 1 / `passes`.

  python scripts/bench_transfer.py [--layers=6 --vocab=32768 --dtype=float32 --repeats=7]
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from rlhfjax.mesh.meshes import make_mesh  # noqa: E402
from rlhfjax.mesh.rules import named_shardings  # noqa: E402
from rlhfjax.mesh.transfer import (  # noqa: E402
  no_host_transfers,
  traffic,
  transfer,
  verify_transfer,
)
from rlhfjax.placement.spec import Layout, RoleSpec  # noqa: E402

_VOCAB = flags.DEFINE_integer("vocab", 32768, "Vocabulary size.")
_EMBED = flags.DEFINE_integer("embed", 768, "Model width.")
_LAYERS = flags.DEFINE_integer("layers", 6, "Transformer layers.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed runs per case (median reported).")

# A Llama-style tree with stacked layers (12 heads, 4 KV heads of 64, MLP 2048): ~88M params.
_ATTN, _KV = ("layers", "embed", "heads", "head_dim"), ("layers", "embed", "kv_heads", "head_dim")
_AXES = {
  "embed": ("vocab", "embed"), "q_proj": _ATTN, "k_proj": _KV, "v_proj": _KV,
  "o_proj": ("layers", "heads", "head_dim", "embed"), "gate_proj": ("layers", "embed", "mlp"),
  "up_proj": ("layers", "embed", "mlp"), "down_proj": ("layers", "mlp", "embed"),
  "attn_norm": ("layers", "norm"), "mlp_norm": ("layers", "norm"), "final_norm": ("norm",),
  "lm_head": ("embed", "vocab"),
}  # fmt: skip


def _role(devices, layout, **sizes):
  names = ("data", "fsdp", "tensor") if layout == Layout.TRAINING else ("data", "tensor")
  axes = tuple((a, sizes.get(a, 1)) for a in names)
  return RoleSpec(devices=tuple(devices), axes=axes, layout=layout)


_T, _G = Layout.TRAINING, Layout.GENERATION
_CASES = {
  "disaggregated fsdp4[0-3] -> data2xtensor2[4-7]":
    (_role(range(4), _T, fsdp=4), _role(range(4, 8), _G, data=2, tensor=2)),
  "colocated fsdp8[0-7] -> data4xtensor2[0-7]":
    (_role(range(8), _T, fsdp=8), _role(range(8), _G, data=4, tensor=2)),
  "interleaved fsdp8[0-7] -> tensor4[0-3]":
    (_role(range(8), _T, fsdp=8), _role(range(4), _G, tensor=4)),
  "same layout fsdp4[0-3] -> fsdp4[4-7]":
    (_role(range(4), _T, fsdp=4), _role(range(4, 8), _T, fsdp=4)),
}  # fmt: skip


def _bench(src, dst_shardings, into: bool, repeats: int) -> dict:
  """Median seconds of `transfer` and of NumPy writing the same target shards, interleaved."""
  with no_host_transfers():
    moved, nbytes = transfer(src, dst_shardings)  # warm-up: compiles the cut/join calls
    jax.block_until_ready(moved)
  verify_transfer(src, moved, dst_shardings)
  shard_sizes = [s.data.nbytes for leaf in jax.tree.leaves(moved) for s in leaf.addressable_shards]
  pairs = [(np.ones(n, np.uint8), np.empty(n, np.uint8)) for n in shard_sizes]
  seconds, numpy_seconds, faults = [], [], 0
  for _ in range(repeats):
    # Without `into`, drop the last result first so the move may reuse its memory.
    last, moved = (moved if into else None), None
    with no_host_transfers():
      faults -= resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      start = time.perf_counter()
      moved = jax.block_until_ready(transfer(src, dst_shardings, into=last)[0])
      seconds.append(time.perf_counter() - start)
      faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del last
    start = time.perf_counter()
    for s, d in pairs:
      np.copyto(d, s)
    numpy_seconds.append(time.perf_counter() - start)
  seconds, numpy_seconds = float(np.median(seconds)), float(np.median(numpy_seconds))
  gbps, numpy_gbps = nbytes / seconds / 1e9, nbytes / numpy_seconds / 1e9
  passes = traffic(src, dst_shardings, into=into).passes
  faulted = faults * resource.getpagesize() // repeats
  return {"bytes": nbytes, "bytes_written": sum(shard_sizes), "seconds": round(seconds, 5),
          "gbps": round(gbps, 3), "numpy_gbps": round(numpy_gbps, 3),
          "ratio": round(gbps / numpy_gbps, 3), "passes": round(passes, 2),
          "faulted": faulted}  # fmt: skip


def main(argv):
  del argv
  e = _EMBED.value
  dims = dict(vocab=_VOCAB.value, embed=e, norm=e, layers=_LAYERS.value, heads=12, kv_heads=4,
              head_dim=64, mlp=2048)  # fmt: skip
  shapes = {k: tuple(dims[a] for a in axes) for k, axes in _AXES.items()}
  rng = np.random.default_rng(0)
  host = {
    k: rng.standard_normal(s, np.float32).astype(jax.numpy.dtype(_DTYPE.value))
    for k, s in shapes.items()
  }
  for case, (src_role, dst_role) in _CASES.items():
    src_mesh, dst_mesh = make_mesh(src_role), make_mesh(dst_role)
    src = jax.device_put(host, named_shardings(_AXES, shapes, src_mesh, src_role.layout))
    dst_shardings = named_shardings(_AXES, shapes, dst_mesh, dst_role.layout)
    fresh = _bench(src, dst_shardings, False, _REPEATS.value)
    steady = _bench(src, dst_shardings, True, _REPEATS.value)
    fresh = {k: fresh[k] for k in ("seconds", "gbps", "numpy_gbps", "ratio", "passes", "faulted")}
    print(json.dumps({"case": case, "into": True, **steady, "fresh": fresh}), flush=True)


if __name__ == "__main__":
  app.run(main)
