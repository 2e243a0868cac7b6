"""Offload of an idle role's arrays to host memory, measured on one device (`rlhfjax.mesh.offload`).

For each part a co-located trainer parks, here of one model size on the first device (the
reference model's parameters in the size's parameter dtype; the actor's AdamW state), the
allocator's bytes in use (`Device.memory_stats()`) with the part resident, parked
(`offload.to_host`) and brought back (`offload.to_device`), the seconds and GB/s of each move
(the median of `repeats` round trips), and whether every leaf came back bit for bit (a wrapping
sum of its bits before and after).

On a GPU 'pinned_host' is page-locked host RAM and `bytes_in_use` counts device memory only, so
`freed_gb` is the device memory the part really gives back. The CPU backend reports no memory
statistics: its rows have None there and time copies within RAM.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax import models
from rlhfjax.config import OptimizerConfig
from rlhfjax.config.model import get_model_config
from rlhfjax.mesh import offload
from rlhfjax.training.optimizer import make_optimizer

GB = 1e9


def _bytes_in_use(device: jax.Device) -> int | None:
  stats = device.memory_stats()
  return stats.get("bytes_in_use") if stats else None


@jax.jit
def _fingerprint(tree: Any) -> list[jax.Array]:
  """Per leaf, the wrapping uint32 sum of its elements' bits (a changed bit changes it)."""

  def one(x):
    bits = x.astype(jnp.float32) if x.dtype.itemsize < 4 else x
    words = jax.lax.bitcast_convert_type(bits, jnp.uint32) if bits.dtype.itemsize == 4 else bits
    return jnp.sum(words.astype(jnp.uint32), dtype=jnp.uint32)

  return [one(x) for x in jax.tree.leaves(tree)]


def _timed_move(move, tree: Any) -> tuple[Any, float]:
  start = time.perf_counter()
  moved = jax.block_until_ready(move(tree))
  return moved, time.perf_counter() - start


def measure_part(name: str, tree: Any, device: jax.Device, repeats: int = 3) -> dict[str, Any]:
  """Park `tree` (resident on `device`) in host memory and bring it back `repeats` times."""
  nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
  before = [int(v) for v in _fingerprint(tree)]
  resident = _bytes_in_use(device)
  to_host_s, to_device_s, parked = [], [], None
  for _ in range(repeats):
    tree, seconds = _timed_move(offload.to_host, tree)
    to_host_s.append(seconds)
    parked = _bytes_in_use(device)
    kinds = offload.memory_kinds(tree)
    tree, seconds = _timed_move(offload.to_device, tree)
    to_device_s.append(seconds)
  back = _bytes_in_use(device)
  host_s, device_s = float(np.median(to_host_s)), float(np.median(to_device_s))
  return {
    "bench": "offload",
    "part": name,
    "device": device.device_kind,
    "part_bytes": nbytes,
    "part_gb": round(nbytes / GB, 3),
    "resident_in_use_gb": None if resident is None else round(resident / GB, 3),
    "parked_in_use_gb": None if parked is None else round(parked / GB, 3),
    "back_in_use_gb": None if back is None else round(back / GB, 3),
    "freed_gb": None if resident is None else round((resident - parked) / GB, 3),
    "parked_memory_kinds": sorted(kinds),
    "to_host_s": round(host_s, 4),
    "to_device_s": round(device_s, 4),
    "to_host_gb_per_s": round(nbytes / host_s / GB, 2),
    "to_device_gb_per_s": round(nbytes / device_s / GB, 2),
    "bit_identical": before == [int(v) for v in _fingerprint(tree)],
  }


def run(size: str = "1b", repeats: int = 3) -> list[dict[str, Any]]:
  """The reference parameters and the actor's optimizer state of `size`, one row each."""
  device = jax.devices()[0]
  if not offload.host_memory_supported([device]):
    return [{"bench": "offload", "device": device.device_kind, "error": "no pinned_host memory"}]
  config = get_model_config(size)
  tx = make_optimizer(OptimizerConfig(), 1000)
  params = jax.jit(lambda key: models.init_params(config, "lm", key))(jax.random.key(0))
  opt_state = jax.jit(tx.init)(params)
  rows = [
    measure_part("reference_params", params, device, repeats),
    measure_part("actor_opt_state", opt_state, device, repeats),
  ]
  return [{"size": size, "param_dtype": config.param_dtype, **row} for row in rows]
