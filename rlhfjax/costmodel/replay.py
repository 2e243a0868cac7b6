"""Replays one PPO iteration's dependency graph on a placement: a predicted timeline.

Stages are issued in the trainer's order; a stage starts when its inputs are ready and every
one of its devices is free, so stages that share devices run one after another and stages on
disjoint devices run at the same time. With `async_rollout` the generation of the next batch
is issued right after the weight sync, before this batch is scored (one step off-policy), as
the trainer does. Several iterations are replayed; the last one is the steady state.

The records are `rlhfjax.observe.timeline.StageRecord`s, the format of the measured
`timeline.json`, so a predicted timeline draws with the same code as a measured one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from rlhfjax.observe.timeline import StageRecord

STAGES = ("generate", "score", "advantages", "update", "sync")
"""Stage names, as the trainer records them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCost:
  """One stage of one role: its devices and its predicted duration."""

  role: str
  stage: str
  devices: tuple[int, ...]
  seconds: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replay:
  records: tuple[StageRecord, ...]
  iteration_s: float
  """Steady-state iteration time: the distance between the last two iterations' ends."""
  stages: Mapping[str, float]
  """Seconds per stage name in the steady-state iteration (span of its records)."""


@functools.lru_cache(maxsize=4096)
def cells(device_sets: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], tuple[int, ...]]:
  """Devices grouped by which of `device_sets` hold them: {indices of the sets: devices}.

  Devices in one cell always run the same stages, so the replay and the memory check work per
  cell instead of per device (256 devices make a handful of cells)."""
  masks: dict[int, int] = {}
  for i, devices in enumerate(device_sets):
    bit = 1 << i
    for d in devices:
      masks[d] = masks.get(d, 0) | bit
  out: dict[tuple[int, ...], list[int]] = {}
  for d in sorted(masks):
    key = tuple(i for i in range(len(device_sets)) if masks[d] >> i & 1)
    out.setdefault(key, []).append(d)
  return {key: tuple(devices) for key, devices in out.items()}


def replay(
  generate: StageCost,
  scores: Sequence[StageCost],
  advantages: StageCost,
  updates: Sequence[StageCost],
  sync: StageCost,
  *,
  async_rollout: bool,
  iterations: int = 4,
  serial: bool = False,
) -> Replay:
  """The predicted timeline of `iterations` iterations of the given stages; with `serial`
  every stage takes turns (devices that share one host's cores)."""
  groups = sorted({c.devices for c in (generate, *scores, advantages, *updates, sync)})
  lanes_of = {g: [] for g in groups}
  for lane, key in enumerate(cells(tuple(groups))):
    for i in key:
      lanes_of[groups[i]].append(0 if serial else lane)
  free: dict[int, float] = {}
  records: list[StageRecord] = []

  def run(cost: StageCost, iteration: int, ready: float) -> float:
    lanes = lanes_of[cost.devices]
    start = max([ready, *(free.get(lane, 0.0) for lane in lanes)])
    end = start + cost.seconds
    for lane in lanes:
      free[lane] = end
    records.append(
      StageRecord(
        iteration=iteration,
        role=cost.role,
        stage=cost.stage,
        start=start,
        end=end,
        devices=cost.devices,
      )
    )
    return end

  ends: list[float] = []
  last_update = 0.0  # end of the previous iteration's actor update
  generated = {0: run(generate, 0, 0.0)} if async_rollout else {}
  for i in range(iterations):
    if async_rollout:
      batch_ready = generated[i]
      synced = run(sync, i, last_update) if i > 0 else batch_ready
      # Issued in the last iteration too: it takes its devices before this batch is scored.
      generated[i + 1] = run(generate, i + 1, synced)
    else:
      batch_ready = run(generate, i, ends[-1] if ends else 0.0)
    scored = max(run(s, i, batch_ready) for s in scores)
    adv = run(advantages, i, scored)
    update_ends = {u.role: run(u, i, adv) for u in updates}
    last_update = update_ends.get("actor", adv)
    end = max(update_ends.values())
    if not async_rollout:
      end = max(end, run(sync, i, last_update))
    ends.append(end)
  steady = iterations - 1
  stages = {}
  for name in STAGES:
    rs = [r for r in records if r.iteration == steady and r.stage == name]
    stages[name] = (max(r.end for r in rs) - min(r.start for r in rs)) if rs else 0.0
  iteration_s = ends[-1] - ends[-2] if len(ends) > 1 else ends[-1]
  return Replay(records=tuple(records), iteration_s=iteration_s, stages=stages)
