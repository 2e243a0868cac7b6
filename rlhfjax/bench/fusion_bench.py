"""Sample-level fusion on a long-tailed workload, against batch-at-a-time generation and scoring.

One iteration here is what fusion changes in an RLHF iteration: generate responses to a batch of
prompts on the rollout mesh, then score them (reference log-probs of every response token, the
`fused.logprob_scorer`) on the scorer mesh. Two ways:

* unfused (batch at a time): the streaming loop without compaction, handing samples out as
  they finish (so `tail_s` is seen); scoring starts when the last one is out, on the whole
  batch. `generate_call_iteration_s` times the other unfused way, `Engine.generate` without
  compaction (one decode call for the whole batch, fewer host round trips), then the same
  scoring.
* fused: the streaming loop with tail compaction (`tail_threshold`), returning to the host
  each time a micro-batch more has finished, and scoring micro-batches as they finish
  (`fused.score_stream`) while the rest still decode.

The summary's `speedup` divides the faster of the two unfused iterations by the fused one.
The scorer pads responses to a power-of-two bucket of the longest in its batch: a micro-batch
of early finishers is short, the whole batch is as long as its longest sample.

Per-request stop lengths come from a log-normal whose `1 - tail_fraction` quantile is
`tail_ratio` times its median (so `tail_fraction` of the samples are at least `tail_ratio`
times longer than the median; drawn stratified, see `tail_lengths`), scaled to the mean
`mean_len` and clipped to `[1, max_len]`; every response runs exactly to its length (greedy,
no stop ids).

Placements over the devices: 'disaggregated' (rollout on the first half, scorer on the second,
'data'-parallel each) and 'co-located' (both on all devices). The configurations run alternately,
`repeats` times after one warm-up each; medians are reported.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from rlhfjax import models
from rlhfjax.bench.rollout_bench import model_config
from rlhfjax.mesh import meshes
from rlhfjax.placement.spec import RoleSpec
from rlhfjax.rollout import fused
from rlhfjax.rollout import lengths as length_dist
from rlhfjax.rollout.engine import Engine, EngineConfig
from rlhfjax.rollout.sampling import SamplingParams
from rlhfjax.rollout.streaming import Finished, RolloutStream

PLACEMENTS = ("disaggregated", "co-located")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusionBench:
  """One benchmark configuration."""

  size: str = "small"
  model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  batch: int = 40
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
  """Seeded per-request response lengths (`rlhfjax.rollout.lengths.tail_lengths`)."""
  return length_dist.tail_lengths(
    bench.batch,
    mean=bench.mean_len,
    max_len=bench.max_len,
    tail_fraction=bench.tail_fraction,
    tail_ratio=bench.tail_ratio,
    seed=bench.seed,
  )


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


def _busy_time(scorer, batches: list[fused.MicroBatch]) -> float:
  """Seconds the scorer's devices spend on `batches`, one blocked call after another."""
  jax.block_until_ready([scorer(b) for b in batches])  # compiled already; warm the caches
  start = time.perf_counter()
  for batch in batches:
    jax.block_until_ready(scorer(batch))
  return time.perf_counter() - start


class _Case:
  """One placement: its engine and scorer, and how long its scoring calls keep devices busy."""

  def __init__(self, bench: FusionBench, placement: str, config, params, ref_params, prompts):
    n = min(bench.num_devices or jax.device_count(), jax.device_count())
    rollout_spec, scorer_spec = _role_specs(placement, n)
    self.placement = placement
    self.shared = rollout_spec.devices == scorer_spec.devices
    self.bench = bench
    self.prompts = prompts
    self.settings = [
      SamplingParams(temperature=0.0, max_new_tokens=int(m), stop_token_ids=())
      for m in tail_lengths(bench)
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
    self.score_busy_s: dict[bool, float] = {}

  def _stream(self, fused_on: bool, one_call: bool = False) -> RolloutStream:
    bench = self.bench
    return RolloutStream(
      self.engine,
      self.prompts,
      sampling=self.settings,
      min_yield=bench.batch if one_call else bench.micro_batch if fused_on else 1,
      tail_threshold=bench.tail_threshold if fused_on else 0.0,
    )

  def warm_up(self) -> None:
    """Compiles every program, then measures the scorer's busy time of each mode."""
    for fused_on in (False, True):
      _, batches = self._iteration(fused_on)
      self.score_busy_s[fused_on] = _busy_time(self.scorer, batches)
    self.generate_call_iteration()

  def _iteration(self, fused_on: bool) -> tuple[dict[str, Any], list[fused.MicroBatch]]:
    bench, times, calls = self.bench, [], []
    start = time.perf_counter()
    stream = self._stream(fused_on)
    if fused_on:
      scores = fused.score_stream(
        _timed_stream(stream, times),
        self.scorer,
        num_samples=bench.batch,
        micro_batch=bench.micro_batch,
        on_score=calls.append,
      )
    else:
      calls.append(_whole(list(_timed_stream(stream, times))))
      scores = self.scorer(calls[0])
    jax.block_until_ready(scores)
    iteration_s = time.perf_counter() - start
    generate_s = times[-1] - start
    return {
      "iteration_s": iteration_s,
      "generate_s": generate_s,
      "tail_s": times[-1] - times[0],
      "decode_steps_by_batch": {
        str(k): v for k, v in sorted(stream.stats.decode_steps_by_batch.items(), reverse=True)
      },
      "decode_calls": stream.stats.decode_calls,
      "tail_moves": list(stream.stats.compactions),
      "score_calls": len(calls),
    }, calls

  def iteration(self, fused_on: bool) -> dict[str, Any]:
    """One timed iteration; `idle_fraction` per device group over it (see `_idle`)."""
    record, _ = self._iteration(fused_on)
    record["idle_fraction"] = self._idle(record, self.score_busy_s[fused_on])
    return record

  def _idle(self, record: dict[str, Any], score_busy: float) -> dict[str, float]:
    """Share of the iteration each device group had nothing to do.

    The rollout group is busy from the start until the last sample is out; the scorer group
    for the time its calls take one after another (measured in `warm_up`). Co-located, both
    are one group, busy for the sum.
    """
    total, gen = record["iteration_s"], record["generate_s"]
    if self.shared:
      return {"rollout+scorer": max(0.0, 1 - (gen + score_busy) / total)}
    return {"rollout": max(0.0, 1 - gen / total), "scorer": max(0.0, 1 - score_busy / total)}

  def generate_call_iteration(self) -> float:
    """`Engine.generate` without compaction (one decode call), then scoring the whole batch."""
    start = time.perf_counter()
    batch = _whole(list(self._stream(False, one_call=True)))
    jax.block_until_ready(self.scorer(batch))
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
  for case in cases:
    case.warm_up()
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
    baseline = min(off["iteration_s"], off["generate_call_iteration_s"])
    records.append(
      {
        "placement": case.placement,
        "speedup": baseline / on["iteration_s"],
        "speedup_vs_streamed_unfused": off["iteration_s"] / on["iteration_s"],
        "speedup_vs_generate_call": off["generate_call_iteration_s"] / on["iteration_s"],
        "score_busy_s": {"unfused": case.score_busy_s[False], "fused": case.score_busy_s[True]},
        "lengths": lengths,
        "batch": bench.batch,
        "devices": min(bench.num_devices or jax.device_count(), jax.device_count()),
        "backend": jax.default_backend(),
      }
    )
  return records
