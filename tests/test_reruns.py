"""The pieces that make a rerun of a supervised script finish or resume as the uninterrupted run
(tests/test_reruns_e2e.py): the finished marker, the timeline a resumed run continues, the lock
that names the run holding a directory."""

from __future__ import annotations

import os

import pytest

from rlhfjax import rerun, workdir
from rlhfjax.observe.timeline import StageRecord, Timeline

pytestmark = pytest.mark.pure


def test_a_run_is_finished_until_total_steps_is_raised(tmp_path):
  path = str(tmp_path)
  assert not rerun.is_finished(path, 4)
  rerun.mark_finished(path, 4)
  assert rerun.finished_step(path) == 4
  assert rerun.is_finished(path, 4) and rerun.is_finished(path, 3)
  assert not rerun.is_finished(path, 5)  # raised: the run resumes and trains on
  rerun.clear(path)
  rerun.clear(path)  # nothing to clear: no error
  assert not rerun.is_finished(path, 4)
  (tmp_path / rerun.MARKER).write_text('{"step": 4')  # cut short: not finished
  assert rerun.finished_step(path) is None


def _record(iteration: int, stage: str, start: float, end: float) -> StageRecord:
  return StageRecord(
    iteration=iteration, role="actor", stage=stage, start=start, end=end, devices=(0, 1)
  )


def test_a_resumed_timeline_keeps_the_earlier_records_and_goes_on_after_them(tmp_path):
  clock = iter([100.0, 105.0, 106.0, 107.0]).__next__
  timeline = Timeline(clock=clock)  # origin 100
  earlier = [_record(0, "generate", 0.0, 2.0), _record(0, "update", 2.0, 30.0)]
  timeline.continue_from(earlier)  # at 105: now() is 30, the end of the last record
  with timeline.stage(1, "actor", "update", (0, 1)):  # from 106 to 107
    pass
  assert timeline.records[:2] == earlier
  assert (timeline.records[2].start, timeline.records[2].end) == (31.0, 32.0)
  path = str(tmp_path / "timeline.json")
  timeline.write_json(path, before=1)
  assert Timeline.read_json(path) == earlier
  timeline.write_json(path)
  assert Timeline.read_json(path) == timeline.records


def test_a_directory_held_for_another_run_names_that_run(tmp_path):
  stage_dir = tmp_path / "rm"
  stage_dir.mkdir()
  held = workdir.WorkdirLock(str(stage_dir), run=str(tmp_path))
  try:
    # flock is per open file: a second lock in this process conflicts as another process's.
    with pytest.raises(workdir.WorkdirError) as error:
      workdir.WorkdirLock(str(stage_dir))
    message = str(error.value)
    assert message.startswith(f"workdir {stage_dir} is in use by process {os.getpid()} on ")
    assert f", the run of {tmp_path}); wait for it to end" in message
  finally:
    held.release()
