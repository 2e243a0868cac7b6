"""Checkpoint and resume of PPO runs through scripts/train_ppo.py, as a user runs it: Ctrl-C
once and twice, kill -9, a finished run, a corrupt checkpoint. (Another placement and
non-finite updates, in this process: tests/test_resume.py.)

One workdir goes through every way a run stops, each rerun resuming what the one before left
(`stopped`), and must end as the uninterrupted run, which runs in this process: the same config
and XLA flags give the script's numbers (the same programs, from the persistent compilation
cache)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import runs_testing

from rlhfjax import checkpoint as ckpt
from rlhfjax.observe.metrics import MetricsWriter
from rlhfjax.runner import Runner

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_ppo.py")
STEPS = 6
CHANGES = {
  "total_steps": STEPS,
  "rollout.batch_size": 8,
  "rollout.max_new_tokens": 8,
  "ppo.ppo_epochs": 1,
  "checkpoint.every_steps": 2,
  "eval.num_prompts": 0,
}
RELATIVE = os.path.join("runs", "ppo")
"""The chain's workdir, relative to the directory it runs in, as a user types it."""


def _command(workdir: str, *extra: str) -> list[str]:
  config = os.path.join(ROOT, "configs", "ppo_tiny.py")
  flags = (f"--config.{k}={v}" for k, v in CHANGES.items())
  return [sys.executable, SCRIPT, f"--config={config}", f"--workdir={workdir}", *flags, *extra]


def _run(workdir: str, *extra: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
  return subprocess.run(
    _command(workdir, *extra), capture_output=True, text=True, timeout=600, cwd=cwd
  )


def _start(workdir: str, cwd: str) -> subprocess.Popen:
  # Unbuffered, as on a terminal: a run stopped at once or killed has printed what it said.
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  return subprocess.Popen(
    _command(workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env
  )


def _finished_line(workdir: str) -> str:
  return (
    f"{workdir}: finished at step {STEPS}; nothing to do (delete the workdir or raise "
    "total_steps to train more)"
  )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
  """The workdir of the uninterrupted run."""
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  config = runs_testing.shipped_config("ppo_tiny", CHANGES)
  Runner(config, workdir, show_progress=False).run()
  assert [r["step"] for r in runs_testing.rows(workdir)] == list(range(STEPS))
  assert ckpt.complete_steps(os.path.join(workdir, "checkpoints")) == [4, 6]  # keep=2
  return workdir


@dataclasses.dataclass
class Stop:
  """What one run of the chain left: its process id, exit status and output, the complete
  checkpoints and metrics rows after it, and the lock file's holder record."""

  pid: int
  returncode: int
  out: str
  err: str
  complete: list[int]
  rows: list[dict]
  lock: str


@dataclasses.dataclass
class Chain:
  cwd: str
  workdir: str
  once: Stop
  twice: Stop
  killed: Stop
  done: subprocess.CompletedProcess


def _stop(workdir: str, proc: subprocess.Popen, out: str, err: str) -> Stop:
  with open(os.path.join(workdir, ".lock")) as f:
    lock = f.read()
  complete = ckpt.complete_steps(os.path.join(workdir, "checkpoints"))
  rows = MetricsWriter.read(os.path.join(workdir, "metrics.jsonl"))  # a cut-short line left out
  return Stop(proc.pid, proc.returncode, out, err, complete, rows, lock)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Chain:
  """One workdir stopped in every way, each time rerun with the same command (the next
  stop's run), from another current directory:
  1. Ctrl-C once, after its row 0;
  2. Ctrl-C twice, after its row 3: the checkpoint of step 4 is due, or its save in flight;
  3. kill -9, after its row 3 (or 4, had the save of step 4 been complete);
  4. the rerun to the end.
  """
  cwd = str(tmp_path_factory.mktemp("chain"))
  workdir = os.path.join(cwd, RELATIVE)

  proc = _start(RELATIVE, cwd)
  runs_testing.wait_for_row(proc, workdir, 0)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  once = _stop(workdir, proc, out, err)

  proc = _start(RELATIVE, cwd)
  runs_testing.wait_for_row(proc, workdir, 3, earlier=once.rows)
  proc.send_signal(signal.SIGINT)
  # Signals sent back to back may be delivered as one: send the second once the first is seen.
  seen = ""
  while "Ctrl-C again to stop at once" not in seen:
    line = proc.stderr.readline()
    assert line, seen[-3000:]
    seen += line
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, (seen + err)[-3000:]
  twice = _stop(workdir, proc, out, seen + err)

  proc = _start(RELATIVE, cwd)
  runs_testing.wait_for_row(proc, workdir, 3, earlier=twice.rows)
  proc.send_signal(signal.SIGKILL)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL, err[-3000:]
  killed = _stop(workdir, proc, out, err)

  done = _run(RELATIVE, cwd=cwd)
  assert done.returncode == 0, done.stderr[-3000:]
  return Chain(cwd, workdir, once, twice, killed, done)


def _assert_rows_of(got: list[dict], uninterrupted: str) -> None:
  """`got` are the first rows of the uninterrupted run."""
  want = runs_testing.rows(uninterrupted)[: len(got)]
  assert [r["step"] for r in got] == list(range(len(got)))
  for a, b in zip(got, want, strict=True):
    assert runs_testing.deterministic(a) == runs_testing.deterministic(b), a["step"]


@pytest.mark.slow
def test_ctrl_c_writes_a_checkpoint_and_exits_cleanly(stopped, uninterrupted):
  """SIGINT behaves as SIGTERM (the same handler, `rlhfjax.signals`; SIGTERM is checked in
  tests/test_front_door_e2e.py): finish the iteration, checkpoint, exit 0 (checked by
  `stopped`), no traceback; the rerun resumes from that checkpoint."""
  once = stopped.once
  assert "Traceback" not in once.err and "KeyboardInterrupt" not in once.err, once.err[-3000:]
  assert "stopped: checkpoint of step" in once.out
  stopped_at = int(once.out.split("checkpoint of step ")[1].split()[0])
  # Sent after row 0: the signal lands in iteration 0 or 1, which it lets finish.
  assert stopped_at in (1, 2)
  assert stopped_at in once.complete
  assert [r["step"] for r in once.rows] == list(range(stopped_at))
  _assert_rows_of(once.rows, uninterrupted)
  assert f"resuming from the checkpoint of step {stopped_at}" in stopped.twice.out


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once(stopped, uninterrupted):
  """Exit status 130 (checked by `stopped`), one error line, no traceback; what it left is
  resumed (the next run's) and the run ends as the uninterrupted one (`test_the_rerun_...`)."""
  err = stopped.twice.err
  assert err.strip().splitlines()[-1].startswith("error: interrupted again: stopped at once")
  assert "Traceback" not in err, err[-3000:]
  _assert_rows_of(stopped.twice.rows, uninterrupted)
  resumed = stopped.twice.complete[-1]
  assert f"resuming from the checkpoint of step {resumed}" in stopped.killed.out


@pytest.mark.slow
def test_kill_9_leaves_a_stale_lock_that_the_rerun_takes_over(stopped):
  complete = stopped.killed.complete
  assert complete and complete[-1] < STEPS
  assert json.loads(stopped.killed.lock)["pid"] == stopped.killed.pid
  assert f"resuming from the checkpoint of step {complete[-1]}" in stopped.done.stdout


@pytest.mark.slow
def test_the_rerun_repeats_the_uninterrupted_run(stopped, uninterrupted):
  rows = runs_testing.rows(stopped.workdir)
  assert [r["step"] for r in rows] == list(range(STEPS))
  assert ckpt.complete_steps(os.path.join(stopped.workdir, "checkpoints")) == [4, 6]  # keep=2
  _assert_rows_of(rows, uninterrupted)
  # The timeline keeps each stopped run's iterations (those its checkpoint holds) and continues.
  want = runs_testing.timeline_entries(uninterrupted)
  assert runs_testing.timeline_entries(stopped.workdir) == want
  assert {entry[0] for entry in want} == set(range(STEPS))


@pytest.mark.slow
def test_a_finished_run_says_so_and_changes_no_file(stopped):
  runs_testing.assert_rerun_of_finished_changes_nothing(
    stopped.workdir, lambda _: _run(RELATIVE, cwd=stopped.cwd), _finished_line
  )


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_a_one_line_error_naming_the_file(stopped, tmp_path):
  # A copy of the finished run (its checkpoints of steps 4 and 6), extended: the rerun must
  # resume from step 6, whose meta is now cut short.
  workdir = str(tmp_path / "w")
  shutil.copytree(stopped.workdir, workdir)
  meta = os.path.join(workdir, "checkpoints", str(STEPS), "meta", "metadata")
  with open(meta, "w") as f:
    f.write(f'{{"step": {STEPS}, "se')
  failed = _run(workdir, f"--config.total_steps={STEPS + 2}")
  assert failed.returncode == 2
  error = failed.stderr.strip().splitlines()[-1]
  assert error.startswith("error: ") and meta in error
