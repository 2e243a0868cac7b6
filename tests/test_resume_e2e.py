"""Checkpoint and resume of PPO runs through scripts/train_ppo.py, as a user runs it: kill -9,
Ctrl-C once and twice, a finished run, a corrupt checkpoint. (Another placement and non-finite
updates, in this process: tests/test_resume.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import runs_testing

from rlhfjax import checkpoint as ckpt

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_ppo.py")
STEPS = 6
FLAGS = (
  f"--config.total_steps={STEPS}",
  "--config.rollout.batch_size=8",
  "--config.rollout.max_new_tokens=8",
  "--config.ppo.ppo_epochs=1",
  "--config.checkpoint.every_steps=2",
  "--config.eval.num_prompts=0",
)


def _command(workdir: str, *extra: str) -> list[str]:
  config = os.path.join(ROOT, "configs", "ppo_tiny.py")
  return [sys.executable, SCRIPT, f"--config={config}", f"--workdir={workdir}", *FLAGS, *extra]


def _run(workdir: str, *extra: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
  return subprocess.run(
    _command(workdir, *extra), capture_output=True, text=True, timeout=600, cwd=cwd
  )


def _start(workdir: str, cwd: str) -> subprocess.Popen:
  return subprocess.Popen(
    _command(workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
  )


@pytest.fixture(scope="module")
def uninterrupted_workdir(tmp_path_factory) -> str:
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  done = _run(workdir)
  assert done.returncode == 0, done.stderr[-3000:]
  assert [r["step"] for r in runs_testing.rows(workdir)] == list(range(STEPS))
  assert ckpt.complete_steps(os.path.join(workdir, "checkpoints")) == [4, 6]  # keep=2
  return workdir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_workdir) -> list[dict]:
  return runs_testing.rows(uninterrupted_workdir)


@pytest.mark.slow
def test_kill_9_then_rerun_repeats_the_uninterrupted_run(
  uninterrupted, uninterrupted_workdir, tmp_path
):
  # A relative workdir from another current directory, as a user types it.
  workdir = str(tmp_path / "runs" / "ppo")
  proc = _start("runs/ppo", cwd=str(tmp_path))
  # Iteration 3's row is written just before its checkpoint is due (step 4): the kill lands
  # in iteration 3's save or early in iteration 4, after the step-2 checkpoint is complete.
  runs_testing.wait_for_row(proc, workdir, 3)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  complete = ckpt.complete_steps(os.path.join(workdir, "checkpoints"))
  assert complete and complete[-1] < STEPS
  # The killed run's lock is left behind, stale: the rerun takes it over.
  with open(os.path.join(workdir, ".lock")) as f:
    assert json.load(f)["pid"] == proc.pid

  done = _run("runs/ppo", cwd=str(tmp_path))
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"resuming from the checkpoint of step {complete[-1]}" in done.stdout
  resumed = runs_testing.rows(workdir)
  assert [r["step"] for r in resumed] == list(range(STEPS))
  for got, want in zip(resumed, uninterrupted, strict=True):
    assert runs_testing.deterministic(got) == runs_testing.deterministic(want), got["step"]
  # The timeline keeps the killed run's iterations (those its checkpoint holds) and continues.
  want = runs_testing.timeline_entries(uninterrupted_workdir)
  assert runs_testing.timeline_entries(workdir) == want
  assert {entry[0] for entry in want} == set(range(STEPS))


@pytest.mark.slow
def test_a_finished_run_says_so_and_changes_no_file(uninterrupted_workdir, tmp_path):
  runs_testing.assert_rerun_changes_nothing(
    uninterrupted_workdir,
    str(tmp_path / "w"),
    _run,
    lambda w: (
      f"{w}: finished at step {STEPS}; nothing to do (delete the workdir or raise "
      "total_steps to train more)"
    ),
  )


@pytest.mark.slow
def test_ctrl_c_writes_a_checkpoint_and_exits_cleanly(uninterrupted, tmp_path):
  """SIGINT behaves as SIGTERM (the same handler, `rlhfjax.signals`; SIGTERM is checked in
  tests/test_front_door_e2e.py): finish the iteration, checkpoint, exit 0, no traceback."""
  workdir = str(tmp_path / "w")
  proc = _start("w", cwd=str(tmp_path))
  runs_testing.wait_for_row(proc, workdir, 0)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
  assert "stopped: checkpoint of step" in out
  stopped_at = int(out.split("checkpoint of step ")[1].split()[0])
  assert stopped_at < STEPS
  assert stopped_at in ckpt.complete_steps(os.path.join(workdir, "checkpoints"))
  assert [r["step"] for r in runs_testing.rows(workdir)] == list(range(stopped_at))

  done = _run("w", cwd=str(tmp_path))
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"resuming from the checkpoint of step {stopped_at}" in done.stdout
  for got, want in zip(runs_testing.rows(workdir), uninterrupted, strict=True):
    assert runs_testing.deterministic(got) == runs_testing.deterministic(want), got["step"]


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_the_rerun_repeats_the_run(uninterrupted, tmp_path):
  workdir = str(tmp_path)
  proc = _start(workdir, cwd=ROOT)
  # As in the kill -9 test: the step-4 save is due, or in flight, when the signals land.
  runs_testing.wait_for_row(proc, workdir, 3)
  proc.send_signal(signal.SIGINT)
  # Signals sent back to back may be delivered as one: send the second once the first is seen.
  seen = ""
  while "Ctrl-C again to stop at once" not in seen:
    line = proc.stderr.readline()
    assert line, seen[-3000:]
    seen += line
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err[-3000:]
  assert err.strip().splitlines()[-1].startswith("error: interrupted again: stopped at once")
  assert "Traceback" not in err, err[-3000:]

  done = _run(workdir)
  assert done.returncode == 0, done.stderr[-3000:]
  resumed = runs_testing.rows(workdir)
  assert [r["step"] for r in resumed] == list(range(STEPS))
  for got, want in zip(resumed, uninterrupted, strict=True):
    assert runs_testing.deterministic(got) == runs_testing.deterministic(want), got["step"]


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_a_one_line_error_naming_the_file(uninterrupted_workdir, tmp_path):
  # A copy of the finished uninterrupted run (its checkpoints of steps 4 and 6), extended: the
  # rerun must resume from step 6, whose meta is now cut short.
  workdir = str(tmp_path / "w")
  shutil.copytree(uninterrupted_workdir, workdir)
  meta = os.path.join(workdir, "checkpoints", str(STEPS), "meta", "metadata")
  with open(meta, "w") as f:
    f.write(f'{{"step": {STEPS}, "se')
  failed = _run(workdir, f"--config.total_steps={STEPS + 2}")
  assert failed.returncode == 2
  error = failed.stderr.strip().splitlines()[-1]
  assert error.startswith("error: ") and meta in error
