"""Sample-level fusion on a long-tailed workload, against batch-at-a-time generation and scoring.

One iteration here is what fusion changes in an RLHF iteration: generate responses to a batch of
prompts on the rollout mesh, then score them (reference log-probs of every response token, the
`fused.logprob_scorer`) on the scorer mesh. Two ways:

* unfused (batch at a time): the streaming loop without compaction; scoring starts when the last
  sample is out, on the whole batch. (`generate_call_iteration_s` also times the plain
  `Engine.generate`, one device call for the whole batch, then the same scoring.)
* fused: the streaming loop with tail compaction (`tail_threshold`), scoring micro-batches as
  they finish (`fused.score_stream`), while the rest still decode.

Per-request stop lengths come from a log-normal whose `1 - tail_fraction` quantile is
`tail_ratio` times its median (so about `tail_fraction` of the samples are at least
`tail_ratio` times longer than the median), scaled to the mean `mean_len` and clipped to
`[1, max_len]`; every response runs exactly to its length (greedy, no stop ids).

Placements over the devices: 'disaggregated' (rollout on the first half, scorer on the second,
'data'-parallel each) and 'co-located' (both on all devices). The configurations run alternately,
`repeats` times after one warm-up each; medians are reported.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from rlhfjax import models
from rlhfjax.mesh import meshes
from rlhfjax.placement.spec import RoleSpec
from rlhfjax.rollout import fused
from rlhfjax.rollout.benchmark import model_config
from rlhfjax.rollout.engine import Engine, EngineConfig
from rlhfjax.rollout.sampling import SamplingParams
from rlhfjax.rollout.streaming import Finished, RolloutStream

PLACEMENTS = ("disaggregated", "co-located")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusionBench:
  """One benchmark configuration."""

  size: str = "small"
  model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  batch: int = 32
  prompt_len: int = 16
  mean_len: float = 48.0
  """Mean of the response-length distribution before clipping."""
  max_len: int = 384
  tail_fraction: float = 0.1
  tail_ratio: float = 8.0
  micro_batch: int = 8
  """Samples per fused scoring call."""
  tail_threshold: float = 0.25
  repeats: int = 3
  seed: int = 0
  placements: tuple[str, ...] = PLACEMENTS
  num_devices: int | None = None
  """Devices used (the first ones); None: all."""

  def __post_init__(self):
    if bad := [p for p in self.placements if p not in PLACEMENTS]:
      raise ValueError(f"unknown placements {bad}; choose from {PLACEMENTS}")
    if not 0 < self.tail_fraction < 0.5 or self.tail_ratio <= 1:
      raise ValueError("tail_fraction must be in (0, 0.5) and tail_ratio > 1")
    if self.mean_len < 1 or self.max_len < 1 or self.batch < 1 or self.micro_batch < 1:
      raise ValueError("mean_len, max_len, batch and micro_batch must be >= 1")


def tail_lengths(bench: FusionBench) -> np.ndarray:
  """Seeded per-request response lengths (see the module docstring)."""
  sigma = math.log(bench.tail_ratio) / statistics.NormalDist().inv_cdf(1 - bench.tail_fraction)
  median = bench.mean_len / math.exp(sigma**2 / 2)
  draws = np.random.default_rng(bench.seed).lognormal(math.log(median), sigma, bench.batch)
  return np.clip(np.rint(draws), 1, bench.max_len).astype(np.int32)


def length_stats(lengths: np.ndarray, tail_ratio: float) -> dict[str, float]:
  median = float(np.median(lengths))
  return {
    "median": median,
    "mean": float(lengths.mean()),
    "p90": float(np.percentile(lengths, 90)),
    "max": int(lengths.max()),
    "fraction_at_least_ratio_x_median": float((lengths >= tail_ratio * median).mean()),
  }


def _role_specs(placement: str, n: int) -> tuple[RoleSpec, RoleSpec]:
  if placement == "co-located":
    both = RoleSpec.generation(list(range(n)), data=n)
    return both, both
  if n < 2 or n % 2:
    raise ValueError(f"the disaggregated placement needs an even device count, got {n}")
  half = n // 2
  return (
    RoleSpec.generation(list(range(half)), data=half),
    RoleSpec.generation(list(range(half, n)), data=half),
  )


def _timed_stream(stream: RolloutStream, times: list[float]) -> Iterator[Finished]:
  for done in stream:
    times.append(time.perf_counter())
    yield done


def _whole(groups: list[Finished]) -> fused.MicroBatch:
  order = np.argsort(np.concatenate([g.indices for g in groups]), kind="stable")
  cat = {f: np.concatenate([getattr(g, f) for g in groups])[order] for f in fused.FIELDS}
  return fused.MicroBatch(**cat, num_real=len(order))


def _call_time(fn, repeats: int = 3) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


class _Case:
  """One placement: its engine, scorer and the standalone cost of a scoring call."""

  def __init__(self, bench: FusionBench, placement: str, config, params, ref_params, prompts):
    n = min(bench.num_devices or jax.device_count(), jax.device_count())
    rollout_spec, scorer_spec = _role_specs(placement, n)
    self.placement = placement
    self.shared = rollout_spec.devices == scorer_spec.devices
    self.bench = bench
    self.prompts = prompts
    lengths = tail_lengths(bench)
    self.settings = [
      SamplingParams(temperature=0.0, max_new_tokens=int(m), stop_token_ids=()) for m in lengths
    ]
    engine_config = EngineConfig(
      num_slots=bench.batch,
      prompt_buckets=(bench.prompt_len,),
      max_new_tokens=bench.max_len,
      prefill_batch_sizes=(1, bench.batch),
      tail_threshold=bench.tail_threshold,
    )
    self.engine = Engine.for_role(config, engine_config, rollout_spec, params)
    self.scorer = fused.logprob_scorer(
      config, ref_params, meshes.make_mesh(scorer_spec), prompts, bench.max_len
    )
    out = self.engine.generate(prompts, sampling=self.settings)
    whole = fused.MicroBatch(
      indices=np.arange(bench.batch),
      tokens=out.tokens,
      logprobs=out.logprobs,
      lengths=out.lengths,
      stopped=out.stopped,
      num_real=bench.batch,
    )
    micro = dataclasses.replace(
      whole, **{f: getattr(whole, f)[: bench.micro_batch] for f in fused.FIELDS}
    )
    self.score_s = {
      bench.batch: _call_time(lambda: self.scorer(whole)),
      bench.micro_batch: _call_time(lambda: self.scorer(micro)),
    }

  def iteration(self, fused_on: bool) -> dict[str, Any]:
    bench, times, calls = self.bench, [], []
    start = time.perf_counter()
    stream = RolloutStream(
      self.engine,
      self.prompts,
      sampling=self.settings,
      tail_threshold=bench.tail_threshold if fused_on else 0.0,
    )
    if fused_on:
      scores = fused.score_stream(
        _timed_stream(stream, times),
        self.scorer,
        num_samples=bench.batch,
        micro_batch=bench.micro_batch,
        on_score=calls.append,
      )
    else:
      scores = self.scorer(_whole(list(_timed_stream(stream, times))))
      calls.append(None)
    jax.block_until_ready(scores)
    iteration_s = time.perf_counter() - start
    generate_s = times[-1] - start
    rows = bench.micro_batch if fused_on else bench.batch
    score_busy = len(calls) * self.score_s[rows]
    if self.shared:
      idle = {"rollout+scorer": max(0.0, 1 - (generate_s + score_busy) / iteration_s)}
    else:
      idle = {
        "rollout": max(0.0, 1 - generate_s / iteration_s),
        "scorer": max(0.0, 1 - score_busy / iteration_s),
      }
    return {
      "iteration_s": iteration_s,
      "generate_s": generate_s,
      "tail_s": times[-1] - times[0],
      "idle_fraction": idle,
      "decode_steps_by_batch": {
        str(k): v for k, v in sorted(stream.stats.decode_steps_by_batch.items(), reverse=True)
      },
      "score_calls": len(calls),
    }

  def generate_call_iteration(self) -> float:
    """The plain `Engine.generate` (one device call), then scoring the whole batch."""
    start = time.perf_counter()
    out = self.engine.generate(self.prompts, sampling=self.settings)
    whole = fused.MicroBatch(
      indices=np.arange(self.bench.batch),
      tokens=out.tokens,
      logprobs=out.logprobs,
      lengths=out.lengths,
      stopped=out.stopped,
      num_real=self.bench.batch,
    )
    jax.block_until_ready(self.scorer(whole))
    return time.perf_counter() - start


def _median_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
  record = dict(runs[-1])
  for key in ("iteration_s", "generate_s", "tail_s"):
    record[key] = statistics.median(r[key] for r in runs)
  record["idle_fraction"] = {
    g: statistics.median(r["idle_fraction"][g] for r in runs) for g in runs[-1]["idle_fraction"]
  }
  return record


def run(bench: FusionBench) -> list[dict[str, Any]]:
  """Every (placement, fused) record, then one summary per placement with the speed-ups."""
  config = model_config(bench.size, **bench.model_overrides)
  params = models.init_params(config, "lm", jax.random.key(bench.seed))
  ref_params = models.init_params(config, "lm", jax.random.key(bench.seed + 1))
  rng = np.random.default_rng(bench.seed + 2)
  prompts = [rng.integers(0, config.vocab_size, bench.prompt_len) for _ in range(bench.batch)]
  cases = [_Case(bench, p, config, params, ref_params, prompts) for p in bench.placements]
  runs = {(c.placement, f): [] for c in cases for f in (False, True)}
  plain = {c.placement: [] for c in cases}
  for case in cases:  # warm-up: every program compiled before timing
    case.iteration(False), case.iteration(True), case.generate_call_iteration()
  for _ in range(bench.repeats):
    for case in cases:
      for fused_on in (False, True):
        runs[case.placement, fused_on].append(case.iteration(fused_on))
      plain[case.placement].append(case.generate_call_iteration())
  records = []
  lengths = length_stats(tail_lengths(bench), bench.tail_ratio)
  for case in cases:
    off = _median_record(runs[case.placement, False])
    on = _median_record(runs[case.placement, True])
    off["generate_call_iteration_s"] = statistics.median(plain[case.placement])
    for fused_on, record in ((False, off), (True, on)):
      records.append({"placement": case.placement, "fused": fused_on, **record})
    records.append(
      {
        "placement": case.placement,
        "speedup": off["iteration_s"] / on["iteration_s"],
        "speedup_vs_generate_call": off["generate_call_iteration_s"] / on["iteration_s"],
        "score_call_s": {str(k): v for k, v in case.score_s.items()},
        "lengths": lengths,
        "batch": bench.batch,
        "devices": min(bench.num_devices or jax.device_count(), jax.device_count()),
        "backend": jax.default_backend(),
      }
    )
  return records
