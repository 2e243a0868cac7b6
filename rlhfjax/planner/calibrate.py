"""Calibration of the `local` hardware: measured rates, then efficiency factors fitted to a run.

`measure_hardware` times, on the devices at hand: a matmul sharded over all of them (per dtype),
a sharded elementwise copy (memory bandwidth), and a `device_put` between every pair of devices.
`fit_efficiency` then takes the measured stage times of one short PPO run and solves, stage by
stage, for the factor that stage depends on (with every other factor ideal):

- `stage_s` from the advantages stage (one small jitted call and its wait);
- `forward_mfu` from the scoring stages, `train_mfu` from the updates (their FLOPs over the
  measured time, less their dispatch overheads);
- `decode_step_s` from generation (what each decode step costs beyond reading and computing);
- `transfer_bw` from the weight sync.

The fit uses one placement; every other placement's prediction is then a test of the model.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax.planner.efficiency import Efficiency
from rlhfjax.planner.hardware import Hardware


def _timed(fn, *args, repeats: int = 5) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _matmul_rate(devices, dtype, size: int) -> float:
  mesh = Mesh(np.array(devices), ("x",))
  rows = NamedSharding(mesh, PartitionSpec("x", None))
  a = jax.device_put(jnp.ones((size * len(devices), size), dtype), rows)
  b = jax.device_put(jnp.ones((size, size), dtype), NamedSharding(mesh, PartitionSpec()))
  seconds = _timed(jax.jit(lambda a, b: a @ b, out_shardings=rows), a, b)
  return 2 * size * size * size * len(devices) / seconds / len(devices)


class Probe:
  """A fixed sharded matmul, compiled once, timed between measurements: on a shared machine
  its time follows the load, so stage times divided by its slowdown since calibration are
  comparable across moments (`rlhfjax.planner.localcheck`)."""

  def __init__(self, devices=None, size: int = 256):
    devices = list(devices or jax.devices())
    mesh = Mesh(np.array(devices), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x", None))
    self._a = jax.device_put(jnp.ones((size * len(devices), size), jnp.float32), rows)
    self._b = jax.device_put(
      jnp.ones((size, size), jnp.float32), NamedSharding(mesh, PartitionSpec())
    )
    self._fn = jax.jit(lambda a, b: a @ b, out_shardings=rows)

  def seconds(self, repeats: int = 3) -> float:
    """Median seconds of one matmul (after a warm-up call)."""
    return _timed(self._fn, self._a, self._b, repeats=repeats)


def _copy_rate(devices, num_bytes: int) -> float:
  mesh = Mesh(np.array(devices), ("x",))
  x = jax.device_put(
    jnp.ones((num_bytes // 4,), jnp.float32), NamedSharding(mesh, PartitionSpec("x"))
  )
  seconds = _timed(jax.jit(lambda x: x * 1.0001), x)
  return 2 * num_bytes / seconds / len(devices)  # read and write, per device


def _pair_rates(devices, num_bytes: int) -> list[list[float]]:
  rates = [[0.0] * len(devices) for _ in devices]
  for i, src in enumerate(devices):
    x = jax.device_put(jnp.ones((num_bytes // 4,), jnp.float32), src)
    for j, dst in enumerate(devices):
      if i != j:
        rates[i][j] = num_bytes / _timed(lambda x, d=dst: jax.device_put(x, d), x, repeats=3)
  return rates


def measure_hardware(
  devices=None,
  *,
  matmul_size: int | None = None,
  copy_bytes: int | None = None,
  pair_bytes: int = 8 << 20,
) -> Hardware:
  """The current devices as a `Hardware` named 'local'.

  On XLA's virtual CPU devices (one host's cores) the rates are the host's: a group of any size
  gets them all, and groups take turns (`host_shared`). Sizes default by platform: a 512-wide
  matmul and 64 MiB copy on the host; 8192 and 2 GiB on an accelerator, where smaller ones
  measure the launch rather than the rate (a 512-wide bf16 matmul on an H100 reads 2.7 TFLOP/s).
  """
  devices = list(devices or jax.devices())
  host_shared = devices[0].platform == "cpu"
  matmul_size = matmul_size or (512 if host_shared else 8192)
  copy_bytes = copy_bytes or ((64 << 20) if host_shared else (2 << 30))
  f32 = _matmul_rate(devices, jnp.float32, matmul_size)
  bf16 = _matmul_rate(devices, jnp.bfloat16, matmul_size)
  copy = _copy_rate(devices, copy_bytes)
  pairs = _pair_rates(devices, pair_bytes)
  scale = len(devices) if host_shared else 1  # per device -> the host's whole rate
  off_diagonal = [r for i, row in enumerate(pairs) for j, r in enumerate(row) if i != j]
  link = statistics.median(off_diagonal) if off_diagonal else copy
  memory = getattr(devices[0], "memory_stats", lambda: None)() or {}
  limit = memory.get("bytes_limit", 0)
  return Hardware(
    name="local",
    half_flops=bf16 * scale,
    float_flops=f32 * scale,
    memory_gib=(limit / 2**30) if limit else 16.0,
    memory_bw=copy * scale,
    intra_node_bw=link,
    inter_node_bw=link,
    devices_per_node=len(devices),
    native_half=not host_shared,
    pair_bw=tuple(tuple(row) for row in pairs),
    host_shared=host_shared,
  )


IDEAL = Efficiency(
  train_mfu=1.0,
  forward_mfu=1.0,
  decode_bw=1.0,
  decode_mfu=1.0,
  collective_bw=1.0,
  transfer_bw=1.0,
  optimizer_bw=1.0,
  decode_step_s=0.0,
  layer_s=0.0,
  stage_s=0.0,
  generation_engine="local (calibrated)",
)


def fit_efficiency(
  ideal: Mapping[str, float],
  measured: Mapping[str, float],
  *,
  counts: Mapping[str, int],
  replicated_activations: bool = False,
) -> Efficiency:
  """Factors that make the ideal stage times of one run match its measured ones.

  Args:
    ideal: seconds per stage (generate_prefill, generate_decode, score, update, sync) predicted
      with `IDEAL` factors.
    measured: seconds per stage (generate, score, advantages, update, sync) of the same run.
    counts: stage dispatches (score_stages, update_calls, decode_steps) that pay `stage_s` or
      `decode_step_s`.
  """
  stage_s = max(measured.get("advantages", 0.0), 0.0)

  def fraction(ideal_s: float, measured_s: float) -> float:
    if ideal_s <= 0:
      return 1.0
    return float(np.clip(ideal_s / max(measured_s, 1e-9), 1e-4, 1.0))

  score = measured["score"] - counts["score_stages"] * stage_s
  update = measured["update"] - counts["update_calls"] * stage_s
  forward_mfu = fraction(ideal["score"], score)
  train_mfu = fraction(ideal["update"], update)
  prefill = ideal["generate_prefill"] / forward_mfu + stage_s
  decode = measured["generate"] - prefill - ideal["generate_decode"]
  decode_step_s = max(decode / max(counts["decode_steps"], 1), 0.0)
  transfer_bw = fraction(ideal["sync"], measured["sync"] - stage_s)
  return dataclasses.replace(
    IDEAL,
    train_mfu=train_mfu,
    forward_mfu=forward_mfu,
    decode_step_s=decode_step_s,
    transfer_bw=transfer_bw,
    stage_s=stage_s,
    replicated_activations=replicated_activations,
  )
