"""Single-device efficiency of the hot paths: train-step MFU, decode bandwidth, kernel checks.

* `train_step`: the PPO actor step (`rlhfjax.training.steps.accumulate_and_apply` of
  `actor_loss`: AdamW, fp32 master weights, bf16 compute, the size's remat, chunked log-probs)
  on one device.
  Model FLOPs per step = 6 x (non-embedding parameters + LM head) x tokens + causal attention
  (3 x 2 x b x layers x heads x head_dim x t^2: forward QK^T and PV over half the square, twice
  that backward); recomputation by remat is not counted (MFU, not hardware FLOPs utilisation).
* `paged_decode_step`: the rollout engine (`rlhfjax.rollout.paged_decode`) over a full batch of
  slots, each with a prompt of `cache_len - steps` tokens; the bytes a step must read are all
  weights plus the live KV (each row's tokens so far: the paged kernels stop at each row's
  length), so `bandwidth_fraction` is what a memory-bound decode reaches of the HBM peak.
* `attention_check`: logits and gradients of each attention kernel against the einsum path.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax import models
from rlhfjax.config import OptimizerConfig
from rlhfjax.config.model import (
  ModelConfig,
  get_model_config,
  kv_cache_bytes_per_token,
  param_count,
)
from rlhfjax.models import attention
from rlhfjax.rollout.engine import Engine, EngineConfig
from rlhfjax.rollout.sampling import SamplingParams
from rlhfjax.training import steps
from rlhfjax.training.optimizer import make_optimizer
from rlhfjax.training.state import init_train_state

H100_BF16_FLOPS = 989e12
"""Dense bf16 tensor-core peak of an H100 SXM."""
H100_HBM_BYTES_PER_S = 3.35e12

DATASHEET_PEAKS = {
  "NVIDIA H100": (H100_BF16_FLOPS, H100_HBM_BYTES_PER_S),
  "NVIDIA H200": (H100_BF16_FLOPS, 4.8e12),
}
"""(dense bf16 FLOP/s, HBM bytes/s) by the start of `device_kind`, from the SXM datasheets. The
H200 is an H100 with faster memory: the same matrix rate, 4.8 TB/s."""


def peaks(device: jax.Device | None = None) -> tuple[float, float]:
  """The datasheet peaks of `device` (the default device), or the H100's for a device not in
  `DATASHEET_PEAKS` (a CPU, say: its fractions then only compare runs)."""
  kind = (device or jax.devices()[0]).device_kind
  for prefix, rates in DATASHEET_PEAKS.items():
    if kind.startswith(prefix):
      return rates
  return H100_BF16_FLOPS, H100_HBM_BYTES_PER_S


def ceilings(copy_bytes: int = 4 << 30, matmul_n: int = 8192, repeats: int = 10) -> dict[str, Any]:
  """The default device's measured ceilings beside its datasheet peaks: an in-place pass over
  `copy_bytes` (bytes read plus written) and an `n x n x n` bf16 matmul on random data (zeros
  or constants can run faster than real data)."""
  from rlhfjax.bench.rollout_bench import copy_bandwidth

  keys = jax.random.split(jax.random.key(0))
  a, b = (jax.random.normal(k, (matmul_n, matmul_n), jnp.bfloat16) for k in keys)
  matmul = jax.jit(jnp.matmul)
  seconds = _timed(matmul, a, b, repeats=repeats)
  flops, hbm = peaks()
  return {
    "bench": "ceilings",
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "copy_gb_per_s": round(copy_bandwidth(copy_bytes, repeats) / 1e9, 1),
    "matmul_bf16_tflops": round(2 * matmul_n**3 / seconds / 1e12, 1),
    "datasheet_hbm_gb_per_s": round(hbm / 1e9, 1),
    "datasheet_bf16_tflops": round(flops / 1e12, 1),
  }


def _timed(fn, *args, repeats: int) -> float:
  """Median seconds of `fn(*args)` after one warm-up call (which also compiles)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def train_flops(config: ModelConfig, batch: int, seq_len: int) -> float:
  """Model FLOPs of one training step (forward + backward) over `batch` x `seq_len` tokens."""
  n_embed = config.vocab_size * config.hidden_size
  n_dense = param_count(config) - n_embed - (0 if config.tie_embeddings else n_embed)
  head = config.vocab_size * config.hidden_size
  tokens = batch * seq_len
  attention = 6 * batch * config.num_layers * config.num_heads * config.head_dim * seq_len**2
  return 6 * (n_dense + head) * tokens + attention


def train_step(
  config: ModelConfig, batch: int, seq_len: int, prompt_len: int, repeats: int = 5
) -> dict[str, Any]:
  """Time the actor step on the default device; MFU against its datasheet bf16 peak (`peaks`)."""
  tx = make_optimizer(OptimizerConfig(), 1000)
  params = models.init_params(config, "lm", jax.random.key(0))
  state = jax.jit(init_train_state, static_argnums=1)(params, tx)
  rng = np.random.default_rng(0)
  t = seq_len - prompt_len
  data = {
    "tokens": rng.integers(0, config.vocab_size, (1, batch, seq_len)).astype(np.int32),
    "attention_mask": np.ones((1, batch, seq_len), np.int32),
    "response_mask": np.ones((1, batch, t), np.float32),
    "old_logprobs": np.full((1, batch, t), -3.0, np.float32),
    "advantages": rng.normal(size=(1, batch, t)).astype(np.float32),
  }
  data = jax.device_put(data)
  loss = functools.partial(
    steps.actor_loss, config=config, prompt_len=prompt_len, clip_eps=0.2, entropy_coef=0.01
  )
  step = jax.jit(functools.partial(steps.accumulate_and_apply, loss, tx), donate_argnums=0)
  step = step.lower(state, data).compile()  # compiled once, its memory read from XLA
  memory = step.memory_analysis()
  holder = [state]

  def run(batch_):
    holder[0], metrics = step(holder[0], batch_)
    return metrics["grad_norm"]

  seconds = _timed(run, data, repeats=repeats)
  flops = train_flops(config, batch, seq_len)
  return {
    "bench": "train_step",
    "attention": attention.implementation(
      config,
      jnp.zeros((1, seq_len, config.num_heads, config.head_dim), jnp.dtype(config.dtype)),
      models.Mask.packed(jnp.ones((1, seq_len)), jnp.arange(seq_len)[None], config.sliding_window),
    ),
    "remat": config.remat,
    "logprob_chunk_size": config.logprob_chunk_size,
    "batch": batch,
    "seq_len": seq_len,
    "step_s": round(seconds, 4),
    "tokens_per_s": round(batch * seq_len / seconds, 1),
    "model_tflops_per_step": round(flops / 1e12, 2),
    "mfu": round(flops / seconds / peaks()[0], 4),
    **_memory_gb(memory),
  }


def _memory_gb(analysis: Any) -> dict[str, float]:
  """A compiled program's memory in GB by XLA's own analysis: its arguments (the train state
  and the batch), its temporaries (activations and workspace), and the peak both make (less
  what the outputs reuse of the donated arguments); empty where the backend gives none."""
  if analysis is None:
    return {}
  args, temp = analysis.argument_size_in_bytes, analysis.temp_size_in_bytes
  peak = args + temp + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
  return {
    "xla_args_gb": round(args / 1e9, 3),
    "xla_temp_gb": round(temp / 1e9, 3),
    "xla_peak_gb": round(peak / 1e9, 3),
  }


def paged_decode_step(
  config: ModelConfig,
  batch: int,
  cache_len: int,
  steps_per_call: int = 64,
  repeats: int = 5,
  page_size: int = 16,
  kernel: str = "auto",
) -> dict[str, Any]:
  """Time decode steps of the paged engine with every slot busy (see the module docstring)."""
  prompt_len = cache_len - steps_per_call * (repeats + 2)
  if prompt_len < 2:
    raise ValueError(f"cache_len={cache_len} leaves no prompt for {repeats + 2} timed calls")
  device = jax.devices()[0]
  mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("data", "tensor"))
  engine_cfg = EngineConfig(
    num_slots=batch,
    prompt_buckets=(prompt_len,),
    max_new_tokens=cache_len - prompt_len,
    prefill_batch_sizes=(1, batch),
    page_size=page_size,
    paged_attention=kernel,
  )
  params = models.init_params(config, "lm", jax.random.key(0))
  engine = Engine(config, engine_cfg, mesh, params)
  prompts = np.random.default_rng(0).integers(1, config.vocab_size, (batch, prompt_len))
  sampling = SamplingParams(temperature=1.0, stop_token_ids=())
  state = engine.insert(
    engine.prefill(list(prompts), sampling), engine.init_decode_state(), range(batch)
  )
  times = []
  for call in range(repeats + 1):  # the first call compiles
    jax.block_until_ready(state)
    start = time.perf_counter()
    state, steps = engine.generate_steps(state, max_steps=steps_per_call)
    jax.block_until_ready(state)
    if call:
      times.append((time.perf_counter() - start) / int(steps))
  seconds = float(np.median(times))
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  context = prompt_len + steps_per_call * (repeats / 2 + 1)  # tokens per row, mid-measurement
  read = weight_bytes + kv_cache_bytes_per_token(config) * batch * context
  return {
    "bench": "paged_decode_step",
    "batch": batch,
    "cache_len": cache_len,
    "page_size": page_size,
    "kernel": engine.paged.kernel,
    "step_ms": round(seconds * 1e3, 3),
    "tokens_per_s": round(batch / seconds, 1),
    "gb_read_per_step": round(read / 1e9, 3),
    "bandwidth_fraction": round(read / seconds / peaks()[1], 4),
  }


def attention_check(dtype: str = "bfloat16") -> list[dict[str, Any]]:
  """Each available kernel against the einsum path on a padded, windowed batch: the largest
  logits and gradient differences relative to the largest magnitude."""
  base = get_model_config(
    "tiny",
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    hidden_size=256,
    dtype=dtype,
    attention="einsum",
  )
  params = models.init_params(base, "lm", jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, base.vocab_size, (4, 128)), jnp.int32)
  mask = np.ones((4, 128), np.int32)
  mask[1, :37] = 0
  mask[3, :90] = 0
  mask = jnp.asarray(mask)
  real = np.asarray(mask).astype(bool)

  def loss(config, p):
    return jnp.sum(models.forward_logits(config, p, tokens, mask) * mask[..., None])

  rows = []
  for window in (None, 24):
    ref_cfg = base.replace(sliding_window=window)
    ref = np.asarray(models.forward_logits(ref_cfg, params, tokens, mask))
    ref_grad = jax.grad(loss, argnums=1)(ref_cfg, params)
    for impl in ("xla", "blockwise", "pallas_gpu"):
      cfg = ref_cfg.replace(attention=impl)
      try:
        out = np.asarray(models.forward_logits(cfg, params, tokens, mask))
        grad = jax.grad(loss, argnums=1)(cfg, params)
      except Exception as e:  # noqa: BLE001 - reported, e.g. a kernel without a sliding window
        rows.append({"bench": "attention_check", "impl": impl, "error": str(e)[:200]})
        continue
      g_err = max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        / float(jnp.max(jnp.abs(a.astype(jnp.float32))))
        for a, b in zip(jax.tree.leaves(ref_grad), jax.tree.leaves(grad), strict=True)
      )
      rows.append(
        {
          "bench": "attention_check",
          "impl": impl,
          "dtype": dtype,
          "sliding_window": window,
          "finite": bool(np.all(np.isfinite(out))),
          "logits_rel_err": float(np.max(np.abs(out[real] - ref[real])) / np.max(np.abs(ref))),
          "grad_rel_err": g_err,
        }
      )
  return rows
