"""Pipeline schedules as data: which device runs which micro-batch's forward or backward when.

A pipeline splits a model's layers into `stages` consecutive groups, one per position of the
`stage` mesh axis ("device" below: a position on that axis, standing for every device at it).
Each micro-batch's forward (F) passes through the stages in order and its backward (B) in
reverse. A `Schedule` is the table of every op at its tick; `rlhfjax.training.pipeline`
executes one in a compiled step, a tick at a time in lock-step (every device runs its op of
the tick, then activations and gradients move one stage), and the cost model prices its
bubbles.

Time is counted in ticks: an op takes one tick and its result is on the next stage's device by
the next tick. With equal op costs the textbook fractions follow: GPipe and 1F1B over p stages
and m micro-batches take 2 (m + p - 1) ticks for 2 m ops per device, a bubble fraction of
(p - 1) / (m + p - 1); 1F1B keeps at most p - j micro-batches in flight on stage j instead of
GPipe's m. `bubble_fraction` also takes unequal costs (a backward is about twice a forward),
where a lock-step tick lasts as long as its slowest op.

Two models (PPO's actor and critic) can share the devices in one schedule (RLHFuse's
intra-stage fusion): the second runs its stages in the reverse device order, so its warm-up
fills the first's drain and the reverse. `fused` builds that table by list scheduling: each
tick, every device runs a ready op, backwards before forwards, within each model's 1F1B limit
on micro-batches in flight.

No JAX here: the planner and the cost model read these tables too.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from rlhfjax.config.choices import PIPELINE_SCHEDULES

FORWARD, BACKWARD = "F", "B"

SCHEDULES = PIPELINE_SCHEDULES
"""The single-model schedules `placement.pipeline_schedule` names."""


@dataclasses.dataclass(frozen=True, order=True)
class Op:
  """One micro-batch's forward or backward through one model's stage, at one tick."""

  tick: int
  device: int
  """Position on the `stage` mesh axis that runs it."""
  model: int
  """Index into `Schedule.models`."""
  micro: int
  kind: str
  """`FORWARD` or `BACKWARD`."""


class Direction(enum.IntEnum):
  """Which way a model's stages run over the devices."""

  FORWARD_ORDER = 0
  """Stage j on device j."""
  REVERSE_ORDER = 1
  """Stage j on device p - 1 - j."""


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Every op of one optimizer step's pipelined forwards and backwards, by tick."""

  name: str
  stages: int
  micro_batches: int
  models: tuple[str, ...]
  directions: tuple[Direction, ...]
  ops: tuple[Op, ...]

  @property
  def ticks(self) -> int:
    return 1 + max(op.tick for op in self.ops)

  def device_of(self, model: int, stage: int) -> int:
    """The device that runs `model`'s stage `stage`."""
    if self.directions[model] is Direction.REVERSE_ORDER:
      return self.stages - 1 - stage
    return stage

  def stage_of(self, model: int, device: int) -> int:
    """`model`'s stage on `device` (the map is its own inverse)."""
    return self.device_of(model, device)

  def table(self) -> list[list[Op | None]]:
    """`[tick][device]`: the op a device runs at a tick, None while it idles."""
    grid: list[list[Op | None]] = [[None] * self.stages for _ in range(self.ticks)]
    for op in self.ops:
      if grid[op.tick][op.device] is not None:
        raise ValueError(f"two ops on device {op.device} at tick {op.tick}")
      grid[op.tick][op.device] = op
    return grid


def bubble_fraction(
  schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 1.0
) -> float:
  """The fraction of device time spent idle, with ticks in lock-step: a tick lasts as long as
  its slowest op, and every device not running an op that long waits."""
  cost = {FORWARD: forward_cost, BACKWARD: backward_cost}
  busy = sum(cost[op.kind] for op in schedule.ops)
  span = sum(max((cost[op.kind] for op in row if op), default=0.0) for row in schedule.table())
  return 1.0 - busy / (schedule.stages * span)


def textbook_bubble(stages: int, micro_batches: int) -> float:
  """(p - 1) / (m + p - 1): the bubble of GPipe and 1F1B with equal op costs."""
  return (stages - 1) / (micro_batches + stages - 1)


def scoring_micro_batches(rows: int, stages: int, row_shards: int) -> int:
  """Micro-batches of a pipelined scoring call of `rows` rows (a forward-only pipeline,
  `training.pipeline.pipelined_forward`): the most, up to `2 x stages`, that split the rows
  evenly into micro-batches of a multiple of `row_shards` rows (the batch devices of a stage);
  1 when none does."""
  for m in range(min(2 * stages, rows), 1, -1):
    if rows % m == 0 and (rows // m) % row_shards == 0:
      return m
  return 1


# ---------------------------------------------------------------------------------------------
# Building tables.


@dataclasses.dataclass
class _Model:
  """List-scheduling state of one model."""

  index: int
  direction: Direction
  in_flight_limit: Sequence[int]
  """Per stage: how many micro-batches may have run their forward and not their backward."""
  forwards_first: bool
  """GPipe: every forward of a stage before its first backward."""
  next_forward: list[int]
  next_backward: list[int]
  done: dict[tuple[str, int, int], int] = dataclasses.field(default_factory=dict)
  """(kind, micro, stage) -> tick it ran."""


def _ready(model: _Model, kind: str, stage: int, tick: int, stages: int, m: int) -> int | None:
  """The micro-batch of `model`'s next `kind` op on `stage` when it can run at `tick`."""
  if kind == FORWARD:
    micro = model.next_forward[stage]
    if micro >= m or micro - model.next_backward[stage] >= model.in_flight_limit[stage]:
      return None
    before = model.done.get((FORWARD, micro, stage - 1)) if stage > 0 else -1
  else:
    micro = model.next_backward[stage]
    if micro >= m or micro >= model.next_forward[stage]:
      return None
    if model.forwards_first and model.next_forward[stage] < m:
      return None
    if stage == stages - 1:
      before = model.done.get((FORWARD, micro, stage))
    else:
      before = model.done.get((BACKWARD, micro, stage + 1))
  return micro if before is not None and before < tick else None


def _list_schedule(
  name: str,
  stages: int,
  micro_batches: int,
  models: Sequence[_Model],
  start: int = 0,
) -> list[Op]:
  """Greedy lock-step scheduling: each tick, each device runs the first ready op in the order
  backward before forward, then the models in order of the op's micro-batch (oldest first)."""
  if stages < 1 or micro_batches < 1:
    raise ValueError(
      f"a pipeline needs stages >= 1 and micro_batches >= 1, got {stages}, {micro_batches}"
    )
  total = 2 * stages * micro_batches * len(models)
  ops: list[Op] = []
  tick = start
  limit = start + 4 * total + 4
  while len(ops) < total:
    if tick > limit:
      raise RuntimeError(f"schedule {name!r} did not finish: {len(ops)} of {total} ops placed")
    chosen = []
    for device in range(stages):
      candidates = []
      for model in models:
        stage = device if model.direction is Direction.FORWARD_ORDER else stages - 1 - device
        for rank, kind in enumerate((BACKWARD, FORWARD)):
          micro = _ready(model, kind, stage, tick, stages, micro_batches)
          if micro is not None:
            candidates.append((rank, micro, model.index, kind, stage))
      if candidates:
        _, micro, index, kind, stage = min(candidates)
        chosen.append((device, index, micro, kind, stage))
    for device, index, micro, kind, stage in chosen:
      model = next(mo for mo in models if mo.index == index)
      model.done[(kind, micro, stage)] = tick
      if kind == FORWARD:
        model.next_forward[stage] += 1
      else:
        model.next_backward[stage] += 1
      ops.append(Op(tick=tick, device=device, model=index, micro=micro, kind=kind))
    tick += 1
  return ops


def _model(index: int, stages: int, m: int, direction: Direction, style: str) -> _Model:
  if style == "gpipe":
    limit, forwards_first = [m] * stages, True
  else:  # 1f1b: stage j holds at most p - j micro-batches between its forward and backward
    limit, forwards_first = [stages - j for j in range(stages)], False
  return _Model(
    index=index,
    direction=direction,
    in_flight_limit=limit,
    forwards_first=forwards_first,
    next_forward=[0] * stages,
    next_backward=[0] * stages,
  )


def single(style: str, stages: int, micro_batches: int, model: str = "model") -> Schedule:
  """GPipe ('gpipe') or 1F1B ('1f1b') of one model."""
  if style not in SCHEDULES:
    raise ValueError(f"unknown pipeline schedule {style!r}; known: {', '.join(SCHEDULES)}")
  state = _model(0, stages, micro_batches, Direction.FORWARD_ORDER, style)
  ops = _list_schedule(style, stages, micro_batches, [state])
  return Schedule(
    name=style,
    stages=stages,
    micro_batches=micro_batches,
    models=(model,),
    directions=(Direction.FORWARD_ORDER,),
    ops=tuple(ops),
  )


def sequential(
  stages: int, micro_batches: int, models: Sequence[str] = ("actor", "critic")
) -> Schedule:
  """Two models' 1F1B pipelines back to back on the same devices (the second in the reverse
  device order, as `fused` places it): what training them one after the other costs."""
  ops: list[Op] = []
  for index, direction in enumerate((Direction.FORWARD_ORDER, Direction.REVERSE_ORDER)):
    state = _model(index, stages, micro_batches, direction, "1f1b")
    start = 1 + max((op.tick for op in ops), default=-1)
    ops += _list_schedule("two_1f1b", stages, micro_batches, [state], start)
  return Schedule(
    name="two_1f1b",
    stages=stages,
    micro_batches=micro_batches,
    models=tuple(models),
    directions=(Direction.FORWARD_ORDER, Direction.REVERSE_ORDER),
    ops=tuple(ops),
  )


def fused(stages: int, micro_batches: int, models: Sequence[str] = ("actor", "critic")) -> Schedule:
  """Two models' pipelines in one table, the second in the reverse device order, each within
  its 1F1B in-flight limits: one model's forwards and backwards fill the other's bubbles."""
  states = [
    _model(index, stages, micro_batches, direction, "1f1b")
    for index, direction in enumerate((Direction.FORWARD_ORDER, Direction.REVERSE_ORDER))
  ]
  ops = _list_schedule("fused", stages, micro_batches, states)
  return Schedule(
    name="fused",
    stages=stages,
    micro_batches=micro_batches,
    models=tuple(models),
    directions=(Direction.FORWARD_ORDER, Direction.REVERSE_ORDER),
    ops=tuple(ops),
  )


# ---------------------------------------------------------------------------------------------
# What the executor needs: where each message goes and which buffer slot holds it.


@dataclasses.dataclass(frozen=True)
class Slots:
  """Buffer slots of the activations and gradients a schedule keeps waiting on each device.

  A stage's input activation arrives (from the previous stage's forward) a tick after that
  forward and is kept until the stage's backward; the residuals a stage's forward keeps for
  its backward (what the model's remat policy saves) live from the forward to the backward; the
  gradient of a stage's output arrives a tick after the next stage's backward and is kept until
  this stage's backward. Slots are reused once free, so a device needs only as many as it has
  messages waiting at once: for 1F1B about p (stage j holds up to p - j, counted from its
  forward) where GPipe's is m.
  """

  activation: dict[tuple[int, int, int], int]
  """(model, micro, device) -> slot of the stage input (stages after the first)."""
  gradient: dict[tuple[int, int, int], int]
  """(model, micro, device) -> slot of the output's gradient (stages before the last)."""
  activation_slots: tuple[int, ...]
  """Per model: the slots its activation buffer needs (the most on any device)."""
  gradient_slots: tuple[int, ...]
  residual: dict[tuple[int, int, int], int] = dataclasses.field(default_factory=dict)
  """(model, micro, device) -> slot of the residuals of the stage's forward (every stage)."""
  residual_slots: tuple[int, ...] = ()


def slots(schedule: Schedule) -> Slots:
  """Assigns every waiting message a slot (the lowest free one when it arrives)."""
  p = schedule.stages
  when = {(op.model, op.micro, op.kind, op.device): op.tick for op in schedule.ops}
  # (device, model, buffer) -> list of (arrival tick, consuming tick, key)
  waits: dict[tuple[int, int, str], list[tuple[int, int, tuple[int, int, int]]]] = {}
  for op in schedule.ops:
    stage = schedule.stage_of(op.model, op.device)
    if op.kind == FORWARD:
      waits.setdefault((op.device, op.model, "residual"), []).append(
        (op.tick, when[(op.model, op.micro, BACKWARD, op.device)], (op.model, op.micro, op.device))
      )
    if op.kind == FORWARD and stage > 0:
      sender = schedule.device_of(op.model, stage - 1)
      arrives = when[(op.model, op.micro, FORWARD, sender)] + 1
      consumed = when[(op.model, op.micro, BACKWARD, op.device)]
      waits.setdefault((op.device, op.model, "activation"), []).append(
        (arrives, consumed, (op.model, op.micro, op.device))
      )
    if op.kind == BACKWARD and stage < p - 1:
      sender = schedule.device_of(op.model, stage + 1)
      arrives = when[(op.model, op.micro, BACKWARD, sender)] + 1
      waits.setdefault((op.device, op.model, "gradient"), []).append(
        (arrives, op.tick, (op.model, op.micro, op.device))
      )
  buffers = ("activation", "gradient", "residual")
  assigned: dict[str, dict[tuple[int, int, int], int]] = {name: {} for name in buffers}
  counts = {name: [0] * len(schedule.models) for name in buffers}
  for (_, model, buffer), intervals in waits.items():
    free_at: list[int] = []  # slot -> the tick after which it is free again
    for arrives, consumed, key in sorted(intervals):
      slot = next((s for s, free in enumerate(free_at) if free < arrives), len(free_at))
      if slot == len(free_at):
        free_at.append(consumed)
      else:
        free_at[slot] = consumed
      assigned[buffer][key] = slot
    counts[buffer][model] = max(counts[buffer][model], len(free_at))
  return Slots(
    activation=assigned["activation"],
    gradient=assigned["gradient"],
    activation_slots=tuple(max(c, 1) for c in counts["activation"]),
    gradient_slots=tuple(max(c, 1) for c in counts["gradient"]),
    residual=assigned["residual"],
    residual_slots=tuple(max(c, 1) for c in counts["residual"]),
  )


def check(schedule: Schedule) -> None:
  """Raises ValueError unless every op of every model's micro-batches runs once, after what it
  needs, at most one op per device and tick."""
  schedule.table()
  p, m = schedule.stages, schedule.micro_batches
  when = {}
  for op in schedule.ops:
    key = (op.model, op.micro, op.kind, schedule.stage_of(op.model, op.device))
    if key in when:
      raise ValueError(f"op {key} runs twice")
    when[key] = op.tick
  for model in range(len(schedule.models)):
    for micro in range(m):
      for stage in range(p):
        f, b = when.get((model, micro, FORWARD, stage)), when.get((model, micro, BACKWARD, stage))
        if f is None or b is None:
          raise ValueError(f"model {model} micro-batch {micro} stage {stage} is missing an op")
        if stage > 0 and not when[(model, micro, FORWARD, stage - 1)] < f:
          raise ValueError(f"forward of {(model, micro, stage)} before its input")
        after = when[(model, micro, FORWARD, stage)] if stage == p - 1 else None
        if stage < p - 1:
          after = when.get((model, micro, BACKWARD, stage + 1))
        if not after < b:
          raise ValueError(f"backward of {(model, micro, stage)} before its gradient")
