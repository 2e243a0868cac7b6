"""Rollout throughput: the engine against a no-cache generator and against the machine's roofline.

Letters in names: b batch, p prompt length, t sequence length (prompt + new tokens), r new
tokens, v vocab.

Everything is measured in the same process, on the same device: the engine's end-to-end
`generate` rate, a naive generator that recomputes the full forward for every new token, and
the two machine rates the decode roofline needs (a large on-device copy for memory bandwidth,
a square matmul for FLOP/s). A decode step must at least read the weights and the live KV
cache, and do `2 * matmul params * batch` plus attention FLOPs; its roofline time is the larger
of bytes / bandwidth and FLOPs / matmul rate, and `roofline_fraction` is that over the measured
decode step time.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax import models
from rlhfjax.config.model import (
  ModelConfig,
  get_model_config,
  kv_cache_bytes_per_token,
  param_count,
)
from rlhfjax.rollout.engine import Engine, EngineConfig
from rlhfjax.rollout.sampling import SamplingParams

BENCH_SIZES = {
  "small": ModelConfig(
    vocab_size=8192,
    hidden_size=384,
    intermediate_size=1024,
    num_layers=6,
    num_heads=6,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
  ),
}
"""Sizes for benchmarks only, on top of the registered ones (`rlhfjax.config.model`): `small` has
16M parameters, big enough that matmuls, not dispatch, dominate on a CPU, small enough for a
2-core machine."""


def model_config(size: str, **overrides) -> ModelConfig:
  """A registered model size or a `BENCH_SIZES` one, with optional field overrides."""
  if size in BENCH_SIZES:
    config = BENCH_SIZES[size]
    return config.replace(**overrides) if overrides else config
  return get_model_config(size, **overrides)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
  """One benchmark configuration."""

  size: str
  batch: int
  prompt_len: int
  new_tokens: int
  repeats: int = 3
  """Timed runs of each generator after a warm-up run; the median is reported."""
  no_cache: bool = True
  """Also time the no-cache generator (slow by design: it is the baseline)."""
  temperature: float = 0.0
  """The engine's sampling temperature: 0 decodes greedily (and compares its tokens with the
  no-cache generator's), above 0 draws every token as a run does."""


def _timed(fn: Callable[[], object], repeats: int, pick=statistics.median) -> float:
  """Median (or `pick`) wall time of `fn()` (run once first to compile), waiting for its
  results."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return pick(times)


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
  """Bytes per second read plus written (the STREAM convention) by an in-place pass, the
  fastest of `repeats` (like `matmul_rate`).

  The buffer is donated so every pass writes memory that is already mapped: a fresh output
  each time would measure page faults on the CPU, not bandwidth.
  """
  add = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  x = add(jnp.zeros((nbytes // 4,), jnp.float32)).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    x = add(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * x.nbytes / min(times)


def matmul_rate(n: int, dtype, repeats: int = 10) -> float:
  """FLOP/s of an `n x n` by `n x n` matmul in `dtype`, its fastest run: on a shared machine
  the median of a few runs moved by half between runs (296 to 507 GFLOP/s on 2 cores), and a
  slower probe would make the decode step look closer to its roofline than it is."""
  a = jnp.ones((n, n), dtype)
  mm = jax.jit(lambda a: a @ a)
  return 2 * n**3 / _timed(lambda: mm(a), repeats, min)


@functools.partial(jax.jit, static_argnums=(0, 3))
def no_cache_generate(
  config: ModelConfig, params, prompts_bp: jax.Array, new_tokens: int
) -> jax.Array:
  """Greedy decoding that recomputes the whole forward for every token (no KV cache).

  The sequence buffer has a fixed length (prompt + new tokens), so it compiles once; tokens
  not generated yet are masked out. Returns the new tokens `[b, r]`.
  """
  b, p = prompts_bp.shape
  t = p + new_tokens
  tokens_bt = jnp.zeros((b, t), jnp.int32).at[:, :p].set(prompts_bp)

  def step(i, tokens_bt):
    mask_bt = (jnp.arange(t) < p + i)[None, :].repeat(b, axis=0)
    logits_btv = models.forward_logits(config, params, tokens_bt, mask_bt)
    next_b = jnp.argmax(logits_btv[:, p + i - 1], axis=-1).astype(jnp.int32)
    return tokens_bt.at[:, p + i].set(next_b)

  return jax.lax.fori_loop(0, new_tokens, step, tokens_bt)[:, p:]


def decode_step_cost(config: ModelConfig, batch: int, context: float) -> tuple[float, float]:
  """(bytes, FLOPs) a decode step needs at least, with `context` cached tokens per row."""
  param_bytes = param_count(config) * config.param_bytes_per_element
  kv_bytes = kv_cache_bytes_per_token(config) * batch * context
  embedding = config.vocab_size * config.hidden_size
  matmul_params = param_count(config) - (0 if config.tie_embeddings else embedding)
  attention = 4 * config.num_layers * config.num_heads * config.head_dim * context
  return param_bytes + kv_bytes, batch * (2 * matmul_params + attention)


def run(
  bench: BenchConfig, *, copy_bytes: int, matmul_n: int, model_overrides=None, seed: int = 0
) -> dict:
  """Measures one configuration on the first device; returns the JSON-able record."""
  config = model_config(bench.size, **(model_overrides or {}))
  b, p, r = bench.batch, bench.prompt_len, bench.new_tokens
  device = jax.devices()[0]
  mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("data", "tensor"))
  engine = Engine(
    config,
    EngineConfig(num_slots=b, prompt_buckets=(p,), max_new_tokens=r, prefill_batch_sizes=(1, b)),
    mesh,
  )
  init = jax.jit(
    functools.partial(models.init_params, config, "lm"), out_shardings=engine.param_shardings
  )
  engine.update_params(init(jax.random.key(seed)))
  prompts_bp = np.random.default_rng(seed).integers(0, config.vocab_size, (b, p), np.int32)
  prompts = list(prompts_bp)

  sampling = SamplingParams(temperature=bench.temperature)  # 0: greedy
  engine_s = _timed(lambda: engine.generate(prompts, sampling=sampling).tokens, bench.repeats)
  out = engine.generate(prompts, sampling=sampling)

  def decode_only():
    state = engine.insert(engine.prefill(prompts, sampling), engine.init_decode_state(), range(b))
    jax.block_until_ready(state)
    start = time.perf_counter()
    state, steps = engine.generate_steps(state)
    jax.block_until_ready(state)
    return time.perf_counter() - start, int(steps)

  decode_only()
  decode_s, steps = min(decode_only() for _ in range(bench.repeats))
  step_s = decode_s / steps

  record = {
    "size": bench.size,
    "params": param_count(config),
    "dtype": config.dtype,
    "batch": b,
    "prompt_len": p,
    "new_tokens": r,
    "temperature": bench.temperature,
    "device": device.device_kind,
    "engine_tokens_per_s": b * r / engine_s,
  }
  if bench.no_cache:
    params, prompts_dev = engine.params, jax.device_put(prompts_bp, device)
    no_cache_s = _timed(lambda: no_cache_generate(config, params, prompts_dev, r), bench.repeats)
    naive = np.asarray(no_cache_generate(config, params, prompts_dev, r))
    record["no_cache_tokens_per_s"] = b * r / no_cache_s
    record["speedup"] = no_cache_s / engine_s
    if not bench.temperature:
      record["greedy_tokens_equal"] = float(np.mean(naive == out.tokens))

  bandwidth = copy_bandwidth(copy_bytes)
  flop_rate = matmul_rate(matmul_n, jnp.dtype(config.dtype))
  context = p + (steps + 1) / 2  # cached tokens per row, averaged over the decode steps
  step_bytes, step_flops = decode_step_cost(config, b, context)
  memory_s, compute_s = step_bytes / bandwidth, step_flops / flop_rate
  record.update(
    {
      "decode_tokens_per_s": b / step_s,
      "decode_ms_per_step": 1e3 * step_s,
      "roofline_fraction": max(memory_s, compute_s) / step_s,
      "roofline_bound": "memory" if memory_s >= compute_s else "compute",
      "bandwidth_fraction": memory_s / step_s,
      "copy_GBps": bandwidth / 1e9,
      "matmul_GFLOPps": flop_rate / 1e9,
      "bytes_per_step": step_bytes,
      "flops_per_step": step_flops,
      "compilations": sum(engine.compilations.values()),
    }
  )
  return record
