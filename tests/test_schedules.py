"""Pipeline schedule tables (`rlhfjax.schedules`, no JAX) and the executor's decoding of them
(`rlhfjax.training.pipeline.executor_table`), checked by replaying its message routing."""

from __future__ import annotations

import dataclasses

import pytest

from rlhfjax import schedules

pytestmark = pytest.mark.pure

STAGES = (2, 3, 4, 8)
MICRO_BATCHES = (1, 2, 4, 8, 16)
BUILDERS = {
  "gpipe": lambda p, m: schedules.single("gpipe", p, m),
  "1f1b": lambda p, m: schedules.single("1f1b", p, m),
  "sequential": schedules.sequential,
  "fused": schedules.fused,
}
GRID = [(name, p, m) for name in BUILDERS for p in STAGES for m in MICRO_BATCHES]


@pytest.mark.parametrize("name,p,m", GRID)
def test_every_schedule_passes_its_check(name, p, m):
  schedule = BUILDERS[name](p, m)
  schedules.check(schedule)
  # Every device runs a forward and a backward of each micro-batch of each model.
  per_device = {d: 0 for d in range(p)}
  for op in schedule.ops:
    per_device[op.device] += 1
  assert per_device == {d: 2 * m * len(schedule.models) for d in range(p)}


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_single_and_sequential_bubbles_are_the_textbooks(p, m):
  # With unit costs both take 2 (m + p - 1) ticks per model for 2 m ops per device, so the
  # fraction is exactly (p - 1) / (m + p - 1); two pipelines back to back keep it.
  textbook = schedules.textbook_bubble(p, m)
  assert textbook == (p - 1) / (m + p - 1)
  for style in ("gpipe", "1f1b"):
    schedule = schedules.single(style, p, m)
    assert schedule.ticks == 2 * (m + p - 1)
    assert schedules.bubble_fraction(schedule) == pytest.approx(textbook, abs=1e-15)
  sequential = schedules.sequential(p, m)
  assert sequential.ticks == 4 * (m + p - 1)
  assert schedules.bubble_fraction(sequential) == pytest.approx(textbook, abs=1e-15)


def test_fused_fills_the_bubbles_of_two_1f1b_at_4_stages_8_micro_batches():
  p, m = 4, 8
  one = schedules.single("1f1b", p, m)
  two = schedules.sequential(p, m)
  fused = schedules.fused(p, m)
  # 1F1B: 2 (m + p - 1) = 22 ticks for 2 m = 16 ops per device: 6 / 22 idle.
  assert (one.ticks, len(one.ops) // p) == (22, 16)
  assert schedules.bubble_fraction(one) == pytest.approx(6 / 22, abs=1e-15)
  # Two 1F1B back to back: 44 ticks for 32 ops per device, the same 12 / 44 = 6 / 22.
  assert (two.ticks, len(two.ops) // p) == (44, 32)
  assert schedules.bubble_fraction(two) == pytest.approx(12 / 44, abs=1e-15)
  # Fused (the table `schedules.fused(4, 8)` builds): 34 ticks for the same 32 ops per device,
  # 2 / 34 idle, a quarter of the sequential pipelines' 6 / 22.
  assert (fused.ticks, len(fused.ops) // p) == (34, 32)
  assert schedules.bubble_fraction(fused) == pytest.approx(2 / 34, abs=1e-15)
  assert schedules.bubble_fraction(fused) < schedules.bubble_fraction(two)
  # With a backward twice a forward, lock-step ticks last as long as their slowest op: still
  # fewer bubbles fused (the two pipelines are 0.4 idle, as 1F1B alone).
  assert schedules.bubble_fraction(two, 1.0, 2.0) == pytest.approx(0.4, abs=1e-15)
  assert schedules.bubble_fraction(fused, 1.0, 2.0) < 0.4


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_1f1b_keeps_p_activations_where_gpipe_keeps_m(p, m):
  one, gpipe = (schedules.slots(schedules.single(s, p, m)) for s in ("1f1b", "gpipe"))
  assert one.activation_slots == (min(p, m),)
  assert gpipe.activation_slots == (m,)

  def per_device(slots: schedules.Slots) -> list[int]:
    return [
      1 + max((s for (_, _, d), s in slots.activation.items() if d == device), default=-1)
      for device in range(p)
    ]

  # Stage j > 0 holds what stage j - 1 (in-flight limit p - j + 1) sent and it has not yet
  # run backward; stage 0 reads the tokens, no activation.
  assert per_device(one) == [0] + [min(p - j + 1, m) for j in range(1, p)]
  assert per_device(gpipe) == [0] + [m] * (p - 1)


@pytest.mark.parametrize("p", STAGES)
def test_fused_runs_the_second_model_in_reverse_device_order(p):
  schedule = schedules.fused(p, 4)
  assert schedule.directions == (
    schedules.Direction.FORWARD_ORDER,
    schedules.Direction.REVERSE_ORDER,
  )
  for model, order in ((0, list(range(p))), (1, list(range(p - 1, -1, -1)))):
    for micro in range(4):
      forwards = sorted(
        (op.tick, op.device)
        for op in schedule.ops
        if (op.model, op.micro, op.kind) == (model, micro, schedules.FORWARD)
      )
      backwards = sorted(
        (op.tick, op.device)
        for op in schedule.ops
        if (op.model, op.micro, op.kind) == (model, micro, schedules.BACKWARD)
      )
      assert [d for _, d in forwards] == order
      assert [d for _, d in backwards] == order[::-1]
  # The critic's stage 0 is on the last device: its first forward runs there at tick 0.
  assert schedules.Op(0, p - 1, 1, 0, schedules.FORWARD) in schedule.ops
  assert schedule.device_of(1, 0) == p - 1


def test_check_rejects_a_broken_dependency():
  schedule = schedules.single("1f1b", 4, 8)
  schedules.check(schedule)
  # Device 1's forward and backward of micro-batch 0 swap ticks: the backward now runs at tick
  # 1, before stage 2's backward sent its gradient (tick 5). No two ops share a tick.
  f = next(op for op in schedule.ops if (op.device, op.micro, op.kind) == (1, 0, "F"))
  b = next(op for op in schedule.ops if (op.device, op.micro, op.kind) == (1, 0, "B"))
  assert (f.tick, b.tick) == (1, 6)
  ops = [
    dataclasses.replace(op, tick=b.tick)
    if op == f
    else dataclasses.replace(op, tick=f.tick)
    if op == b
    else op
    for op in schedule.ops
  ]
  broken = dataclasses.replace(schedule, ops=tuple(ops))
  broken.table()  # still one op per device and tick
  with pytest.raises(ValueError, match="backward of .* before its gradient"):
    schedules.check(broken)
  # And an op dropped, or run twice.
  with pytest.raises(ValueError, match="missing"):
    schedules.check(dataclasses.replace(schedule, ops=schedule.ops[:-1]))
  twice = dataclasses.replace(schedule.ops[0], tick=schedule.ticks)
  with pytest.raises(ValueError, match="twice"):
    schedules.check(dataclasses.replace(schedule, ops=(*schedule.ops, twice)))


# ---------------------------------------------------------------------------------------------
# The executor's table, replayed: what it says each stage runs, reads and receives.


def _replay(schedule: schedules.Schedule, table) -> None:
  """Runs the executor's routing on tags instead of arrays: each tick every device runs the op
  of its row (reading the buffer slots it names), the outputs move one device up or down as
  the executor's ppermutes move them, and each device stores what arrives where its row's
  (kind, slot) columns say. Asserts every op reads the message it needs and no message is lost.

  Columns (see `pipeline._FIELDS`): branch (0 idle, else 1 + model * 6 + one of forward
  first / mid / last, backward first / mid / last), micro-batch, activation slot, gradient
  slot, (kind, slot) from the device below, (kind, slot) from the device above (kind 1 + 2 k is
  model k's activation, 2 + 2 k its gradient), residual slot: a forward stores its residuals
  there, its backward reads them back.
  """
  p = schedule.stages
  places = ("first", "mid", "last")
  acts: dict[tuple[int, int, int], tuple[int, int]] = {}  # (device, model, slot) -> (model, micro)
  grads: dict[tuple[int, int, int], tuple[int, int]] = {}
  residuals: dict[tuple[int, int, int], tuple[int, int]] = {}
  ran = []
  for tick in range(schedule.ticks):
    up: list[tuple[str, int, int] | None] = [None] * p
    down: list[tuple[str, int, int] | None] = [None] * p
    for device in range(p):
      branch, micro, a_slot, g_slot = (int(v) for v in table[tick, device, :4])
      if branch == 0:
        continue
      model, index = divmod(branch - 1, 6)
      kind = schedules.FORWARD if index < 3 else schedules.BACKWARD
      stage = schedule.stage_of(model, device)
      assert places[index % 3] == ("first" if stage == 0 else "last" if stage == p - 1 else "mid")
      ran.append(schedules.Op(tick, device, model, micro, kind))
      if stage > 0:  # a forward reads its input, and a backward may (a residual)
        assert acts.get((device, model, a_slot)) == (model, micro), (tick, device)
      r_slot = int(table[tick, device, 8])
      if kind == schedules.FORWARD:
        residuals[(device, model, r_slot)] = (model, micro)
      else:
        assert residuals.get((device, model, r_slot)) == (model, micro), (tick, device)
      if kind == schedules.BACKWARD and stage < p - 1:
        assert grads.get((device, model, g_slot)) == (model, micro), (tick, device)
      # A forward's output goes to the model's next stage, a backward's to its previous one.
      to_stage = stage + 1 if kind == schedules.FORWARD else stage - 1
      if 0 <= to_stage < p:
        to = schedule.device_of(model, to_stage)
        assert abs(to - device) == 1
        (up if to == device + 1 else down)[device] = (kind, model, micro)
    for device in range(p):
      arrivals = (
        (up[device - 1] if device > 0 else None, table[tick, device, 4:6]),
        (down[device + 1] if device < p - 1 else None, table[tick, device, 6:8]),
      )
      for message, (code, slot) in arrivals:
        code, slot = int(code), int(slot)
        if message is None:
          assert code == 0, (tick, device)
          continue
        kind, model, micro = message
        buffers = acts if kind == schedules.FORWARD else grads
        assert code == (1 if kind == schedules.FORWARD else 2) + 2 * model, (tick, device)
        buffers[(device, model, slot)] = (model, micro)
  assert sorted(ran) == sorted(schedule.ops)


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 4), (4, 8), (8, 16)])
def test_executor_table_routes_every_message(name, p, m):
  from rlhfjax.training import pipeline

  schedule = BUILDERS[name](p, m)
  table = pipeline.executor_table(schedule)
  assert table.shape == (schedule.ticks, p, 9)
  assert int((table[:, :, 0] > 0).sum()) == len(schedule.ops)
  _replay(schedule, table)


def test_executor_replay_catches_a_misrouted_slot():
  from rlhfjax.training import pipeline

  schedule = schedules.single("1f1b", 4, 8)
  table = pipeline.executor_table(schedule).copy()
  # Stage 1's first arrival from below stored in another slot than its forward reads.
  tick = next(t for t in range(schedule.ticks) if table[t, 1, 4] != 0)
  table[tick, 1, 5] += 1
  with pytest.raises(AssertionError):
    _replay(schedule, table)
  # The first stage's second forward keeps its residuals where the first one's wait.
  table = pipeline.executor_table(schedule).copy()
  forwards = [t for t in range(schedule.ticks) if table[t, 0, 0] == 1]
  table[forwards[1], 0, 8] = table[forwards[0], 0, 8]
  with pytest.raises(AssertionError):
    _replay(schedule, table)
