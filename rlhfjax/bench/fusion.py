"""Sample-level fusion (RLHFuse) predicted at scale: generation and scoring of one iteration
under a long-tailed response-length distribution.

The placement planner (`evaluate`) prices generation from the mean and the longest response.
Here each sample gets a length from `rlhfjax.rollout.lengths.tail_lengths` (log-normal, mean
and max set, `tail_fraction` of the samples at least `tail_ratio` times the median) and the
rollout is replayed decode step by decode step (jumping from one finish to the next) in three
ways:

* `static`: batch at a time (DeepSpeed-Chat's hybrid engine): waves of `slots` samples, each
  wave as long as its longest sample; scoring starts when the batch is out, on whole batches
  padded to the longest response.
* `continuous`: rlhfjax's engine unfused: finished slots refill from the queue; the decode
  batch stays at `slots` rows to the end (finished rows still cost their KV reads; the engine's
  live batch does halve where every replica's rows fit, which this way leaves out); scoring
  starts when the last sample is out.
* `fused`: continuous, plus tail compaction (once the queue is empty and at most
  `tail_threshold` of the slots run, the batch halves each time its rows fit: the engine moves
  the tail onto a tail engine on fewer replicas, whose live batch halves) and fused scoring:
  every `micro_batch` finished samples are scored on each scorer's group as they come.
  A group disjoint from the rollout's works meanwhile; one sharing its devices runs between
  decode chunks, so generation waits for it. Advantages start when every score is in.

A decode step costs `costs.decode_step_time` at the batch of the moment per data replica (the
engine's slots span the rollout's replicas and advance together; a compacted batch smaller
than the replica count runs on that many), at the context `prompt + mean / 2` while the batch
is full and `prompt + max / 2` once compacted (the tail is the long samples). A scoring call
costs `costs.forward_time` over its rows at the full width (`prompt + max`, what the training
loop's fused scorers compile), or with `bucketed` widths at the prompt plus the smallest power
of two holding its longest response (what `scripts/bench_fusion.py`'s scorer does). On a
`host_shared` machine (CPU devices on one host's cores) every group takes turns.

The rest of the iteration (advantages, update, sync) is the placement plan's; `predict` swaps
the plan's generate and score for each way and reports the iteration times and gains.
Not modelled: moving the compacted tail onto fewer data replicas across devices (a batch
smaller than the replica count just runs on fewer), and prefill of refills (prefill is priced
once for the whole batch, as the plan does).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from rlhfjax.config.model import ModelConfig
from rlhfjax.costmodel import costs
from rlhfjax.costmodel.efficiency import Efficiency
from rlhfjax.costmodel.hardware import Hardware
from rlhfjax.costmodel.workload import Workload
from rlhfjax.placement.spec import Role
from rlhfjax.planner.evaluate import HEADS, Plan, model_for, present_roles
from rlhfjax.rollout.lengths import tail_lengths

WAYS = ("static", "continuous", "fused")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusionSettings:
  """The length distribution's tail and the fused rollout's settings."""

  tail_fraction: float = 0.1
  tail_ratio: float = 8.0
  seed: int = 0
  micro_batch: int = 0
  """Samples per fused scoring call; 0: a quarter of the slots."""
  tail_threshold: float = 0.25
  bucketed: bool = False
  """Scoring widths: the smallest power of two holding the call's longest response (else the
  full response width)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scorer:
  """One scoring role: its model, head and device group."""

  role: str
  model: ModelConfig
  head: str
  devices: tuple[int, ...]
  group: costs.Group


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phase:
  """Generation and scoring of one iteration, predicted (seconds from its start)."""

  generate_s: float
  """The last sample is out."""
  scored_s: float
  """Every score is in: advantages may start."""
  decode_steps_by_batch: dict[int, int]
  score_calls: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rollout:
  """What the replay of generation needs: prices of a decode step and of the prefill."""

  slots: int
  """Decode slots over all data replicas."""
  replicas: int
  prefill_s: float
  step_s: Callable[[int, float], float]
  """`step_s(batch, context)`: one decode step of `batch` slots over the replicas at a mean
  context of `context` tokens."""
  devices: tuple[int, ...]
  prompt_len: int
  mean: float
  max_len: int


def _decode(
  lengths: np.ndarray, rollout: Rollout, *, refill: bool, threshold: float
) -> tuple[np.ndarray, dict[int, int], float]:
  """Finish time of each sample (from the end of prefill), steps by batch size, end time."""
  slots, num = rollout.slots, len(lengths)
  done = np.zeros(num)
  steps: dict[int, int] = {}
  now = 0.0
  if not refill:  # waves, each as long as its longest sample, handed out at its end
    for start in range(0, num, slots):
      wave = lengths[start : start + slots]
      n = int(wave.max())
      now += n * rollout.step_s(slots, rollout.prompt_len + n / 2)
      steps[slots] = steps.get(slots, 0) + n
      done[start : start + slots] = now
    return done, steps, now
  queue = list(range(slots, num))
  active = {i: int(lengths[i]) for i in range(min(slots, num))}
  size, compacted = slots, False
  while active:
    if not queue and threshold > 0:
      # Sizes halve down to an odd one (the live batches of `rollout.paging`).
      fits = lambda size: size % 2 == 0 and len(active) <= size // 2  # noqa: E731
      while fits(size) and (compacted or len(active) <= threshold * slots):
        size, compacted = size // 2, True
    n = min(active.values())
    context = rollout.prompt_len + (rollout.max_len if compacted else rollout.mean) / 2
    now += n * rollout.step_s(size, context)
    steps[size] = steps.get(size, 0) + n
    for i in list(active):
      active[i] -= n
      if active[i] == 0:
        del active[i]
        done[i] = now
        if queue:
          j = queue.pop(0)
          active[j] = int(lengths[j])
  return done, steps, now


def lengths_with_mean(num: int, *, mean: float, max_len: int, **tail) -> np.ndarray:
  """`tail_lengths` whose mean after clipping at `max_len` is `mean` (published figures give
  the mean of what was generated): the log-normal's own mean found by bisection."""
  low, high = mean, 64.0 * mean
  for _ in range(40):
    mid = (low + high) / 2
    if tail_lengths(num, mean=mid, max_len=max_len, **tail).mean() < mean:
      low = mid
    else:
      high = mid
  return tail_lengths(num, mean=high, max_len=max_len, **tail)


def replay_phase(
  lengths: np.ndarray,
  rollout: Rollout,
  scorers: Sequence[Scorer],
  score_s: Callable[[Scorer, int, int], float],
  way: str,
  *,
  micro_batch: int,
  threshold: float,
  serial: bool = False,
) -> Phase:
  """Generation and scoring of `lengths` one of the `WAYS` (see the module docstring).

  Args:
    score_s: `score_s(scorer, rows, longest)`: one scoring call of `rows` samples whose longest
      response is `longest`.
    serial: Every group shares the rollout's devices (one host's cores).
  """
  if way not in WAYS:
    raise ValueError(f"way must be one of {', '.join(WAYS)}, got {way!r}")
  fused = way == "fused"
  done, steps, end = _decode(
    lengths, rollout, refill=way != "static", threshold=threshold if fused else 0.0
  )
  done, end = done + rollout.prefill_s, end + rollout.prefill_s
  order = np.argsort(done, kind="stable")
  calls = (
    [order[k : k + micro_batch] for k in range(0, len(order), micro_batch)] if fused else [order]
  )
  groups: dict[tuple[int, ...], list[Scorer]] = {}
  for s in scorers:
    groups.setdefault(s.devices, []).append(s)
  shared = {g: serial or bool(set(g) & set(rollout.devices)) for g in groups}
  free = dict.fromkeys(groups, 0.0)
  delay = 0.0  # generation waits for the scoring dispatched on its devices before its end
  for rows in calls:
    ready = float(done[rows].max())
    arrival = (ready if fused else end) + delay
    longest = int(lengths[rows].max())
    for g, members in groups.items():
      seconds = sum(score_s(s, len(rows), longest) for s in members)
      free[g] = max(arrival, free[g]) + seconds
      if shared[g] and fused and ready < end:
        delay += seconds
  generate_end = end + delay
  return Phase(
    generate_s=generate_end,
    scored_s=max([generate_end, *free.values()]),
    decode_steps_by_batch=dict(sorted(steps.items(), reverse=True)),
    score_calls=len(calls),
  )


def bucket(longest: int, width: int) -> int:
  """The scorer's response width for a call whose longest response is `longest`."""
  return min(width, max(8, 1 << max(0, longest - 1).bit_length()))


def make_score_s(
  hw: Hardware, eff: Efficiency, *, prompt_len: int, width: int, micro_batch: int, bucketed: bool
) -> Callable[[Scorer, int, int], float]:
  """`score_s(scorer, rows, longest)` from `costs.forward_time` (`micro_batch` sequences per
  device per forward)."""

  def score_s(s: Scorer, rows: int, longest: int) -> float:
    w = bucket(longest, width) if bucketed else width
    return costs.forward_time(
      hw,
      eff,
      s.model,
      s.head,
      s.group,
      sequences=rows,
      seq_len=prompt_len + w,
      micro_steps=max(1, math.ceil(rows / (max(micro_batch, 1) * s.group.replicas))),
    )

  return score_s


def make_rollout(
  hw: Hardware,
  eff: Efficiency,
  model: ModelConfig,
  group: costs.Group,
  devices: tuple[int, ...],
  *,
  slots: int,
  sequences: int,
  prompt_len: int,
  mean: float,
  max_len: int,
) -> Rollout:
  """The rollout's prices: `slots` per data replica (engine slots: `slots x replicas`)."""
  replicas = group.replicas
  prefill, _ = costs.generate_time(
    hw,
    eff,
    model,
    group,
    sequences=sequences,
    prompt_len=prompt_len,
    response_mean=mean,
    response_max=max_len,
    slots=slots,
    static_batching=False,
  )

  def step_s(batch: int, context: float) -> float:
    used = min(replicas, batch)
    if hw.host_shared:  # the replicas take turns on the host's cores
      used = 1
    per = math.ceil(batch / used)
    return costs.decode_step_time(hw, eff, model, group, batch=per, context=context)

  return Rollout(
    slots=slots * replicas,
    replicas=replicas,
    prefill_s=prefill,
    step_s=step_s,
    devices=devices,
    prompt_len=prompt_len,
    mean=mean,
    max_len=max_len,
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
  """One plan's iteration the three ways."""

  label: str
  phases: dict[str, Phase]
  iteration_s: dict[str, float]
  lengths: dict[str, float]

  @property
  def gain(self) -> dict[str, float]:
    """Iteration speed-up of fused + compacted over each other way."""
    fused = self.iteration_s["fused"]
    return {way: self.iteration_s[way] / fused for way in WAYS if way != "fused"}

  def to_json(self) -> dict:
    return {
      "label": self.label,
      "iteration_s": {k: round(v, 3) for k, v in self.iteration_s.items()},
      "generate_s": {k: round(p.generate_s, 3) for k, p in self.phases.items()},
      "scored_s": {k: round(p.scored_s, 3) for k, p in self.phases.items()},
      "decode_steps_by_batch": {
        k: {str(b): n for b, n in p.decode_steps_by_batch.items()} for k, p in self.phases.items()
      },
      "gain": {k: round(v, 3) for k, v in self.gain.items()},
      "lengths": self.lengths,
    }


def predict(
  plan: Plan, workload: Workload, hw: Hardware, eff: Efficiency, settings: FusionSettings
) -> Prediction:
  """`plan`'s iteration with its generate and score replayed the three ways (sync rollout:
  the iteration is generate, score, then the plan's advantages, update and sync)."""
  w = workload
  lengths = lengths_with_mean(
    w.sequences,
    mean=w.response_len_mean,
    max_len=w.response_len_max,
    tail_fraction=settings.tail_fraction,
    tail_ratio=settings.tail_ratio,
    seed=settings.seed,
  )
  spec = plan.spec
  group = lambda role: costs.Group(  # noqa: E731
    devices=len(spec[role].devices), tensor=spec[role].axis_size("tensor")
  )
  rollout = make_rollout(
    hw,
    eff,
    w.actor,
    group(Role.ROLLOUT),
    spec[Role.ROLLOUT].devices,
    slots=plan.slots or math.ceil(w.sequences / group(Role.ROLLOUT).replicas),
    sequences=w.sequences,
    prompt_len=w.prompt_len,
    mean=w.response_len_mean,
    max_len=w.response_len_max,
  )
  scorers = [
    Scorer(
      role=role.value,
      model=model_for(w, role),
      head=HEADS[role],
      devices=spec[role].devices,
      group=group(role),
    )
    for role in (Role.ACTOR, Role.REFERENCE, Role.CRITIC, Role.REWARD)
    if role in present_roles(w)
  ]
  micro = settings.micro_batch or max(1, rollout.slots // 4)
  score_s = make_score_s(
    hw,
    eff,
    prompt_len=w.prompt_len,
    width=w.response_len_max,
    micro_batch=plan.micro_batch,
    bucketed=settings.bucketed,
  )
  rest = plan.iteration_s - plan.stages["generate"] - plan.stages["score"]
  phases, iteration = {}, {}
  for way in WAYS:
    phases[way] = replay_phase(
      lengths,
      rollout,
      scorers,
      score_s,
      way,
      micro_batch=micro,
      threshold=settings.tail_threshold,
      serial=hw.host_shared,
    )
    iteration[way] = rest + phases[way].scored_s
  return Prediction(
    label=plan.label,
    phases=phases,
    iteration_s=iteration,
    lengths={
      "mean": float(lengths.mean()),
      "median": float(np.median(lengths)),
      "p90": float(np.percentile(lengths, 90)),
      "max": int(lengths.max()),
    },
  )


def format_predictions(predictions: Sequence[Prediction]) -> str:
  """A table: iteration seconds the three ways and the fused gains, one row per plan."""
  head = f"{'plan':40s} {'static':>9s} {'continuous':>11s} {'fused':>9s} {'gain/static':>12s} "
  head += f"{'gain/continuous':>16s}"
  rows = [head]
  for p in predictions:
    t, g = p.iteration_s, p.gain
    rows.append(
      f"{p.label[:40]:40s} {t['static']:9.2f} {t['continuous']:11.2f} {t['fused']:9.2f} "
      f"{g['static']:11.2f}x {g['continuous']:15.2f}x"
    )
  return "\n".join(rows)


def report_from_flags(f, plans: Sequence[Plan]) -> tuple[list[Prediction], str]:
  """`plan_placement.py --fusion`: the best fitting plan of each strategy, the three ways."""
  from rlhfjax.costmodel import efficiency, hardware
  from rlhfjax.planner import cli

  work = cli.workload_from_flags(f)
  hw = hardware.load_hardware(f.hardware, f.efficiency)
  eff = efficiency.load_efficiency(f.efficiency)
  settings = FusionSettings(
    tail_fraction=f.tail_fraction,
    tail_ratio=f.tail_ratio,
    micro_batch=f.fusion_micro_batch,
    tail_threshold=f.tail_threshold,
  )
  best = {}
  for plan in plans:
    if plan.fits and plan.spec.strategy not in best:
      best[plan.spec.strategy] = plan
  predictions = [predict(p, work, hw, eff, settings) for p in best.values()]
  if not predictions:
    return [], "fusion: no placement fits memory"
  lengths = predictions[0].lengths
  title = (
    f"fused scoring + tail compaction: response lengths log-normal, mean "
    f"{lengths['mean']:.0f} (median {lengths['median']:.0f}, p90 {lengths['p90']:.0f}, max "
    f"{lengths['max']}); predicted seconds per iteration"
  )
  return predictions, title + "\n" + format_predictions(predictions)


def predict_benchmark(
  bench, lengths: np.ndarray, hw: Hardware, eff: Efficiency, model: ModelConfig
) -> list[dict]:
  """What `scripts/bench_fusion.py` should measure (`bench`: its `FusionBench`, `lengths` its
  responses' lengths): per placement, generation and bucketed reference scoring 'continuous'
  (its unfused iteration) and 'fused', and the speed-up."""
  n = bench.num_devices or 8
  out = []
  for placement in bench.placements:
    half = tuple(range(n // 2))
    rollout_devices = tuple(range(n)) if placement == "co-located" else half
    scorer_devices = tuple(range(n)) if placement == "co-located" else tuple(range(n // 2, n))
    rollout_group = costs.Group(devices=len(rollout_devices))
    rollout = make_rollout(
      hw,
      eff,
      model,
      rollout_group,
      rollout_devices,
      slots=math.ceil(bench.batch / rollout_group.replicas),
      sequences=bench.batch,
      prompt_len=bench.prompt_len,
      mean=bench.mean_len,
      max_len=bench.max_len,
    )
    scorer = Scorer(
      role="reference",
      model=model,
      head="lm",
      devices=scorer_devices,
      group=costs.Group(devices=len(scorer_devices)),
    )
    score_s = make_score_s(
      hw, eff, prompt_len=bench.prompt_len, width=bench.max_len, micro_batch=1, bucketed=True
    )
    phases = {
      way: replay_phase(
        lengths,
        rollout,
        [scorer],
        score_s,
        way,
        micro_batch=bench.micro_batch,
        threshold=bench.tail_threshold,
        serial=hw.host_shared,
      )
      for way in ("continuous", "fused")
    }
    out.append(
      {
        "placement": placement,
        "predicted": True,
        "iteration_s": {k: p.scored_s for k, p in phases.items()},
        "decode_steps_by_batch": {
          k: {str(b): s for b, s in p.decode_steps_by_batch.items()} for k, p in phases.items()
        },
        "speedup": phases["continuous"].scored_s / phases["fused"].scored_s,
      }
    )
  return out
