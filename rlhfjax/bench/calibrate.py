"""Calibration of the `local` hardware: measured rates, then efficiency factors fitted to a run.

`measure_hardware` times, on the devices at hand: a matmul sharded over all of them (per dtype),
a sharded elementwise copy (memory bandwidth), a `device_put` between every pair of devices and,
on XLA's virtual CPU devices (`host_shared`), `DeviceCost`: one small train step (FSDP-like
weight gathers and gradient reductions) with its batch split over 1, 2, 4, 8 devices, and a
decode step (a known run's own rollout engine, `EngineCost`; else a token of a few rows through
a stand-in stack). Each virtual device runs its own copy of every op on
the host's shared cores, so the same step takes longer on more devices; the times relative to
one device are `Hardware.device_cost` and `Hardware.step_cost`, which scale the fixed
per-device overheads of the cost model (passes over a batch, and decode steps).

`rlhfjax.bench.localcheck.fit` then solves, stage by stage, for the factor each stage depends
on, so that the planner's prediction of ONE measured placement equals its measurement; every
other placement's prediction is then a test of the model.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax.costmodel.efficiency import Efficiency
from rlhfjax.costmodel.hardware import Hardware

_MIN_TIMED_S = 0.003
"""`DeviceCost` times enough calls together to last this long on one device."""


def _timed(fn, *args, repeats: int = 5, calls: int = 1, warm_up: bool = True) -> float:
  """Median seconds of one call over `repeats` timings of `calls` calls each (short programs
  are timed over enough work to rise above the timer and the scheduler), after one call that
  compiles and warms up (`warm_up`). Each call is waited for: several programs with
  collectives in flight at once can stall XLA's CPU rendezvous."""
  if warm_up:
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


class Matmul:
  """A matmul sharded over `devices` by rows, `size` rows and columns per device, compiled once
  (timed again between measurements on a shared machine)."""

  def __init__(self, devices, dtype=jnp.float32, size: int = 256):
    mesh = Mesh(np.array(devices), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x", None))
    self._a = jax.device_put(jnp.ones((size * len(devices), size), dtype), rows)
    self._b = jax.device_put(jnp.ones((size, size), dtype), NamedSharding(mesh, PartitionSpec()))
    self._fn = jax.jit(lambda a, b: a @ b, out_shardings=rows)
    self._flops = 2 * size * size * size * len(devices)

  def rate(self, repeats: int = 5) -> float:
    """FLOP/s of all the devices together (median of `repeats` calls after a warm-up)."""
    return self._flops / _timed(self._fn, self._a, self._b, repeats=repeats)


def _matmul_rate(devices, dtype, size: int) -> float:
  return Matmul(devices, dtype, size).rate() / len(devices)


class DeviceCost:
  """`Hardware.device_cost`'s program, compiled once per group size (1, 2, 4, ... devices).

  One train step of a residual stack of `layers` MLP blocks (`width` -> `mlp` -> `width`, the
  benchmark model's sizes) on `rows` rows, SGD update included: the same step at every size,
  its batch split over the group and its weights sharded over it on the MLP dimension (XLA
  gathers or reduces them every pass, FSDP-like). On accelerators each device would do
  1/size of the work at once; on virtual CPU devices every device runs its own copy of every op
  and every collective on the host's shared cores, so the step takes longer with more devices:
  how much longer, relative to one device, is what every fixed per-device cost of the cost
  model is multiplied by.
  """

  def __init__(
    self,
    devices=None,
    *,
    layers: int = 4,
    width: int = 128,
    mlp: int = 352,
    rows: int = 256,
    train: bool = True,
  ):
    """`train=False`: the forward alone, as `DeviceCost.decode` (one token of a few rows)."""
    devices = list(devices or jax.devices())
    self.sizes = [2**i for i in range(len(devices).bit_length()) if 2**i <= len(devices)]
    self._runs = []
    self._calls = None

    def loss(weights, x_bd):
      w_in_ldf, w_out_lfd = weights
      h_bd = x_bd
      for layer in range(layers):
        h_bd = h_bd + jnp.tanh(h_bd @ w_in_ldf[layer]) @ w_out_lfd[layer]
      return jnp.mean(h_bd * h_bd)

    def step(w_in_ldf, w_out_lfd, x_bd):
      if not train:
        return loss((w_in_ldf, w_out_lfd), x_bd)
      g_in, g_out = jax.grad(loss)((w_in_ldf, w_out_lfd), x_bd)
      return w_in_ldf - 0.01 * g_in, w_out_lfd - 0.01 * g_out

    for size in self.sizes:
      mesh = Mesh(np.array(devices[:size]), ("x",))
      sharded = NamedSharding(mesh, PartitionSpec(None, "x", None))
      w_in = jax.device_put(jnp.full((layers, width, mlp), 0.01, jnp.float32), sharded)
      w_out = jax.device_put(jnp.full((layers, mlp, width), 0.01, jnp.float32), sharded)
      x = jax.device_put(
        jnp.ones((rows, width), jnp.float32), NamedSharding(mesh, PartitionSpec("x", None))
      )
      fn = jax.jit(step, out_shardings=(sharded, sharded) if train else None)
      self._runs.append((fn, (w_in, w_out, x)))

  @classmethod
  def decode(cls, devices=None, **sizes) -> DeviceCost:
    """`Hardware.step_cost`'s program: one token of a few rows (32 unless `rows` says)
    through the same layers, forward only."""
    return cls(devices, **{"rows": 32, **sizes}, train=False)

  def seconds(self, repeats: int = 5) -> list[float]:
    """Median seconds of the step per group size (after a warm-up call), each timing over
    enough calls to last about `_MIN_TIMED_S` on one device."""
    if self._calls is None:
      one = _timed(*self._runs[0][:1], *self._runs[0][1], repeats=3)
      self._calls = max(1, min(200, math.ceil(_MIN_TIMED_S / max(one, 1e-6))))
    return [_timed(fn, *args, repeats=repeats, calls=self._calls) for fn, args in self._runs]

  @staticmethod
  def relative(seconds: list[float]) -> tuple[float, ...]:
    """Times relative to one device (`Hardware.device_cost`)."""
    return tuple(t / seconds[0] for t in seconds)


class EngineCost:
  """`Hardware.step_cost`'s program for a known run: its rollout engine (paged or dense, as
  `rollout` says) generating one batch of the run's shape, answers at full length, on groups
  of 1, 2, 4, ... devices, `tensor` wide (the whole group when smaller) with 'data' replicas
  over the rest, as the rollout's mesh is laid out.

  A stand-in decode step (`DeviceCost.decode`) is almost nothing but the per-device copies of
  its ops, so it grows about as fast as the group. The engine's decode loop has work besides
  (page-table gathers, sampling, slot refills, shared out over the group), so it grows more
  slowly: on `localcheck`'s benchmark with the paged engine, 1.29, 1.39 and 1.62x one device's
  time on 2, 4 and 8 devices. Scaled by the stand-in's factor instead, the fitted decode cost
  predicted generation on 4 of the 8 devices at 0.67-0.78 of the measured time (four runs);
  by the engine's, 0.80-1.02 (four runs, 0.80 at a 75% spread).
  """

  def __init__(self, devices, model, rollout, tensor: int = 1, *, seed: int = 0):
    from rlhfjax import models
    from rlhfjax.cluster.cluster import engine_config
    from rlhfjax.rollout.engine import Engine
    from rlhfjax.rollout.sampling import SamplingParams

    devices = list(devices or jax.devices())
    self.sizes = [2**i for i in range(len(devices).bit_length()) if 2**i <= len(devices)]
    rng = np.random.default_rng(seed)
    low = max(1, rollout.max_prompt_len // 2)
    self._prompts = [
      rng.integers(1, model.vocab_size, size=int(rng.integers(low, rollout.max_prompt_len + 1)))
      for _ in range(rollout.batch_size)
    ]
    self._sampling = SamplingParams(temperature=1.0, stop_token_ids=())
    params = models.init_params(model, "lm", jax.random.key(seed))
    self._engines = []
    for size in self.sizes:
      width = math.gcd(size, tensor)
      replicas = math.gcd(size // width, rollout.num_slots)
      grid = np.array(devices[: replicas * width]).reshape(replicas, width)
      mesh = Mesh(grid, ("data", "tensor"))
      engine = Engine(model, engine_config(rollout, 0, replicas), mesh)
      engine.update_params(params)
      self._engines.append(engine)
      self._generate(engine)  # compiles what one batch uses

  @property
  def meshes(self) -> list[Mesh]:
    """The engines' meshes, one per group size."""
    return [engine.mesh for engine in self._engines]

  def _generate(self, engine):
    return engine.generate(self._prompts, sampling=self._sampling)  # on the host: waited for

  def seconds(self, repeats: int = 1) -> list[float]:
    """Median seconds of one batch per group size (compiled and warmed up when built)."""
    return [
      _timed(self._generate, engine, repeats=repeats, warm_up=False) for engine in self._engines
    ]


class AtMoments:
  """The calibration of a shared host timed again at chosen moments of a measured run (right
  before each of its iterations), so that the rates the prediction uses are medians over the
  same moments as the stage times it is compared with: the matmul rate (`Matmul`) and the group
  scalings (`DeviceCost`: `device_cost`; `step_cost` from `step`, an `EngineCost` for a known
  run, or `DeviceCost.decode`). On an accelerator nothing is timed again: its full-size
  measurement in `base` stands (a small matmul there reads its launch cost)."""

  def __init__(self, base: Hardware, devices, step: DeviceCost | EngineCost | None = None):
    self._base = base
    shared = base.host_shared
    self._matmul = Matmul(devices) if shared else None
    self._programs = (
      {"device_cost": DeviceCost(devices), "step_cost": step or DeviceCost.decode(devices)}
      if shared
      else {}
    )
    self._rates: list[float] = []
    self.samples: dict[str, list[tuple[float, ...]]] = {name: [] for name in self._programs}
    """Each scaling as measured at every moment (`DeviceCost.relative`)."""

  def sample(self) -> None:
    """Times the calibration programs now."""
    for name, program in self._programs.items():
      self.samples[name].append(DeviceCost.relative(program.seconds()))
    if self._matmul is not None:
      self._rates.append(self._matmul.rate())

  def hardware(self) -> Hardware:
    """`base` with the medians of the moments' measurements."""
    if not self._rates:
      return self._base
    rate = statistics.median(self._rates)
    return dataclasses.replace(
      self._base,
      float_flops=rate,
      half_flops=self._base.half_flops if self._base.native_half else rate,
      **{
        name: tuple(statistics.median(x) for x in zip(*rows, strict=True))
        for name, rows in self.samples.items()
      },
    )


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
  step: DeviceCost | EngineCost | None = None,
) -> Hardware:
  """The current devices as a `Hardware` named 'local'.

  On XLA's virtual CPU devices (one host's cores) the rates are the host's: a group of any size
  gets them all, groups take turns, and fixed per-device costs grow with the group
  (`host_shared`, `device_cost`). Sizes default by platform: a 512-wide matmul and 64 MiB copy
  on the host; 8192 and 2 GiB on an accelerator, where smaller ones measure the launch rather
  than the rate (a 512-wide bf16 matmul on an H100 reads 2.7 TFLOP/s). `step` times the
  decode step's scaling (`step_cost`): a known run's own engine (`EngineCost`); by default a
  stand-in step (`DeviceCost.decode`).
  """
  devices = list(devices or jax.devices())
  host_shared = devices[0].platform == "cpu"
  matmul_size = matmul_size or (512 if host_shared else 8192)
  copy_bytes = copy_bytes or ((64 << 20) if host_shared else (2 << 30))
  device_cost = DeviceCost.relative(DeviceCost(devices).seconds()) if host_shared else ()
  step = step or (DeviceCost.decode(devices) if host_shared else None)
  step_cost = DeviceCost.relative(step.seconds()) if host_shared else ()
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
    device_cost=device_cost,
    step_cost=step_cost,
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
"""Every fraction of peak 1 and every fixed cost 0: where `localcheck.fit` starts."""
