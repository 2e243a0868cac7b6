"""A dense KV cache and a paged one on a long-tailed length mix, in the same KV memory.

Letters in names: n requests, g prompts (groups), p prompt length, r response length.

Reasoning-length RL has long-tailed answers: most are short, a few run to the token limit. A
dense cache gives every slot `max_prompt_len + max_new_tokens` tokens, so a memory budget of
`B` tokens holds `B / max_seq_len` sequences whatever their real lengths. A paged pool holds
the tokens sequences really have (in pages), so the same budget runs as many sequences as their
real lengths allow. Each engine here gets the same budget:

  dense                 `budget / max_seq_len` slots, each owning one page of `max_seq_len`
                        tokens: the dense cache, as the engine's pool of pages;
  paged                 a pool of `budget / page_size` pages (its reserved page included), more
                        slots than the dense engine, prompts admitted by free pages;
  paged_prefix_shared   the same, and the samples of a prompt prefill it once and share its
                        pages.

The workload: `groups` prompts of lengths uniform in [p/4, p], each asked `group_size` times
(GRPO), with response lengths drawn from a log-normal of mean `mean_new_tokens` capped at
`max_new_tokens` (a per-request token limit; stop tokens off, so every engine generates the
same lengths). Sampling at temperature 1 with the same seed, so the engines generate the same
tokens up to float rounding (`tokens_equal` reports the fraction that agree with the dense
cache's).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from rlhfjax import models
from rlhfjax.bench.rollout_bench import model_config
from rlhfjax.config.model import kv_cache_bytes_per_token
from rlhfjax.rollout.engine import Engine, EngineConfig
from rlhfjax.rollout.sampling import SamplingParams

ENGINES = ("dense", "paged", "paged_prefix_shared")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """A long-tailed GRPO-style request mix."""

  groups: int = 16
  group_size: int = 4
  max_prompt_len: int = 64
  max_new_tokens: int = 512
  mean_new_tokens: int = 64
  sigma: float = 1.0
  """Spread of the log-normal response lengths (log space)."""
  seed: int = 0

  def requests(self, vocab_size: int) -> tuple[list[np.ndarray], list[SamplingParams]]:
    """Prompts (each group's prompt `group_size` times, groups interleaved as a rollout batch
    lists them) and each request's sampling settings."""
    rng = np.random.default_rng(self.seed)
    low = max(1, self.max_prompt_len // 4)
    lengths_g = rng.integers(low, self.max_prompt_len + 1, self.groups)
    prompts_g = [rng.integers(1, vocab_size, n).astype(np.int32) for n in lengths_g]
    n = self.groups * self.group_size
    mu = math.log(self.mean_new_tokens) - self.sigma**2 / 2  # the log-normal's mean is `mean`
    new_n = np.clip(np.round(rng.lognormal(mu, self.sigma, n)), 1, self.max_new_tokens)
    prompts = [prompts_g[i // self.group_size] for i in range(n)]
    settings = [
      SamplingParams(temperature=1.0, max_new_tokens=int(r), stop_token_ids=()) for r in new_n
    ]
    return prompts, settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class Budget:
  """The KV memory every engine gets, and how the paged engines use it."""

  dense_slots: int = 8
  """The dense engine's slots; the budget is these slots at full length."""
  paged_slots: int = 32
  """Slots of the paged engines (their live sequences are bounded by pages, not slots)."""
  page_size: int = 16
  decode_chunk: int = 64


def engine_config(name: str, workload: Workload, budget: Budget) -> EngineConfig:
  """The engine `name` in the budget of `budget.dense_slots` full-length sequences."""
  if name not in ENGINES:
    raise ValueError(f"engine must be one of {ENGINES}, got {name!r}")
  common = dict(
    prompt_buckets=(workload.max_prompt_len,),
    max_new_tokens=workload.max_new_tokens,
    prefill_batch_sizes=None,
  )
  if name == "dense":  # one page per row: a page is a whole sequence
    return EngineConfig(
      num_slots=budget.dense_slots,
      page_size=workload.max_prompt_len + workload.max_new_tokens,
      share_prefixes=False,
      **common,
    )
  cache_tokens = budget.dense_slots * (workload.max_prompt_len + workload.max_new_tokens)
  return EngineConfig(
    num_slots=budget.paged_slots,
    page_size=budget.page_size,
    num_pages=cache_tokens // budget.page_size,
    share_prefixes=name == "paged_prefix_shared",
    decode_chunk=budget.decode_chunk,
    **common,
  )


def run(
  names: tuple[str, ...],
  workload: Workload,
  budget: Budget,
  *,
  size: str = "small",
  repeats: int = 2,
  model_overrides: dict | None = None,
) -> list[dict]:
  """One record per engine: the same requests, the same KV memory, the first device."""
  config = model_config(size, **(model_overrides or {}))
  device = jax.devices()[0]
  mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("data", "tensor"))
  prompts, settings = workload.requests(config.vocab_size)
  params = models.init_params(config, "lm", jax.random.key(workload.seed))
  kv_bytes = kv_cache_bytes_per_token(config)
  records, reference = [], None
  for name in names:
    engine_cfg = engine_config(name, workload, budget)
    engine = Engine(config, engine_cfg, mesh, params)
    out = engine.generate(prompts, sampling=settings, seed=workload.seed)  # compiles
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      out = engine.generate(prompts, sampling=settings, seed=workload.seed)
      times.append(time.perf_counter() - start)
    seconds = float(np.median(times))
    generated = int(out.lengths.sum())
    if reference is None:
      reference = out
    agree = [
      np.array_equal(a[:n], b[:n])
      for a, b, n in zip(out.tokens, reference.tokens, reference.lengths, strict=True)
    ]
    cache = jax.eval_shape(engine.init_decode_state).cache
    kv_cache = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    records.append(
      {
        "bench": "rollout_engines",
        "engine": name,
        "size": size,
        "device": device.device_kind,
        "requests": len(prompts),
        "group_size": workload.group_size,
        "max_new_tokens": workload.max_new_tokens,
        "mean_new_tokens": round(generated / len(prompts), 1),
        "num_slots": engine_cfg.num_slots,
        "kv_budget_tokens": budget.dense_slots
        * (workload.max_prompt_len + workload.max_new_tokens),
        "kv_cache_mib": round(kv_cache / 2**20, 3),
        "kv_bytes_per_token": kv_bytes,
        "max_live_sequences": int(out.max_live),
        "tokens_per_s": round(generated / seconds, 1),
        "seconds": round(seconds, 3),
        "generated_tokens": generated,
        "host_transfers": int(out.host_transfers),
        "host_transfers_per_token": round(out.host_transfers / generated, 5),
        "decode_calls": int(out.decode_calls),
        "prefill_rows": int(out.prefill_rows),
        "max_pages_in_use": int(out.max_pages_in_use),
        "preemptions": int(out.preemptions),
        "tokens_equal": round(float(np.mean(agree)), 4),
        "compilations": sum(engine.compilations.values()),
      }
    )
  return records
