"""Reruns of the supervised scripts (train_sft.py, train_rm.py), from another current
directory with a relative workdir and data directory: an interrupted run (SIGTERM, kill -9)
ends with the uninterrupted run's rows; rerun again, finished, it says so and changes no file;
given a step more and `placement.strategy=auto`, it resumes onto the planner's split. One
workdir per script goes through all three, against the uninterrupted run in this process. (The
pieces that make it so: tests/test_reruns.py. PPO's reruns:
tests/test_resume_e2e.py; the pipeline's: tests/test_pipeline.py.)"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import runs_testing
from runs_testing import shipped_config

from rlhfjax.runner import Runner

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
CHANGES = {"total_steps": STEPS, "eval.every_steps": 2, "log_every": 1, "checkpoint.every_steps": 2}
SCRIPTS = {"sft": ("train_sft.py", "sft_tiny"), "rm": ("train_rm.py", "rm_tiny")}
PLOTS = {"sft": ("loss.png", "eval_loss.png"), "rm": ("loss.png", "eval_accuracy.png")}
# One interruption per script keeps the suite short: both go through the same resume.
INTERRUPTION = {"sft": signal.SIGTERM, "rm": signal.SIGKILL}


RELATIVE = os.path.join("runs", "run")
"""The interrupted run's workdir, relative to the directory it runs in, as a user types it; its
data directory is relative too ('data'): orbax wants absolute paths, the entry point makes
them so."""


def _command(stage: str, workdir: str, *extra: str) -> list[str]:
  script, config = SCRIPTS[stage]
  return [
    sys.executable,
    os.path.join(ROOT, "scripts", script),
    f"--config={os.path.join(ROOT, 'configs', config)}.py",
    f"--workdir={workdir}",
    *(f"--config.{k}={v}" for k, v in CHANGES.items()),
    "--config.data.data_dir=data",
    *extra,
  ]


def _run(stage: str, workdir: str, *extra: str, cwd: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    _command(stage, workdir, *extra), capture_output=True, text=True, timeout=600, cwd=cwd
  )


def _start(stage: str, workdir: str, cwd: str) -> subprocess.Popen:
  return subprocess.Popen(
    _command(stage, workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
  )


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def stage(request) -> str:
  return request.param


@pytest.fixture(scope="module")
def uninterrupted(stage, tmp_path_factory) -> tuple[str, str]:
  """(workdir, the start of the script's last line: the held-out metric, first -> last) of the
  uninterrupted run, in this process: the same config and XLA flags give the script's numbers
  (the same programs, from the persistent compilation cache)."""
  path = str(tmp_path_factory.mktemp(f"uninterrupted_{stage}"))
  runner = Runner(shipped_config(SCRIPTS[stage][1], CHANGES, None), path, show_progress=False)
  runner.run()
  rows = runs_testing.rows(path)
  assert [row["step"] for row in rows] == list(range(STEPS + 1))
  values = [row[runner.flow.headline] for row in rows if runner.flow.headline in row]
  return path, f"{runner.flow.headline} {values[0]:.3f} -> {values[-1]:.3f}"


@pytest.fixture(scope="module")
def resumed(stage, tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, str]:
  """(workdir, the rerun, the directory both ran in) of a run interrupted after its row 3 (the
  checkpoint of step 2 is complete, step 4's not yet due), by SIGTERM, which stops after the
  step it lands in with a checkpoint of it, or kill -9, which leaves the checkpoint of step 2;
  then rerun. Both run from another current directory with a relative workdir (`RELATIVE`)."""
  cwd = str(tmp_path_factory.mktemp(f"interrupted_{stage}"))
  path = os.path.join(cwd, RELATIVE)
  signum = INTERRUPTION[stage]
  proc = _start(stage, RELATIVE, cwd)
  runs_testing.wait_for_row(proc, path, 3)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=300)
  if signum == signal.SIGTERM:
    assert proc.returncode == 0, err[-3000:]
    assert "stopped: checkpoint written" in out
  else:
    assert proc.returncode == -signum
  done = _run(stage, RELATIVE, cwd=cwd)
  assert done.returncode == 0, done.stderr[-3000:]
  assert os.path.isdir(os.path.join(cwd, "data"))
  return path, done, cwd


@pytest.mark.slow
def test_an_interrupted_run_ends_as_the_uninterrupted_one(stage, uninterrupted, resumed):
  reference, held_out = uninterrupted
  path, done, _ = resumed
  assert runs_testing.deterministic_rows(path) == runs_testing.deterministic_rows(reference)
  # The held-out metric's first -> last covers the whole run, its interrupted part too.
  assert done.stdout.strip().splitlines()[-1].split("; steps")[0] == held_out
  for name in PLOTS[stage]:
    assert os.path.getsize(os.path.join(path, name)) > 0, name


@pytest.mark.slow
def test_a_finished_run_says_so_and_changes_no_file(stage, resumed):
  path, _, cwd = resumed
  runs_testing.assert_rerun_of_finished_changes_nothing(
    path,
    functools.partial(_run, stage, cwd=cwd),
    lambda w: (
      f"{w}: finished at step {STEPS}; nothing to do (delete the workdir or raise "
      "total_steps to train more)"
    ),
  )


@pytest.mark.slow
def test_more_steps_resume_onto_the_planners_split(stage, resumed):
  """The finished run given one step more and `placement.strategy=auto` (last: it changes the
  workdir) resumes onto the split the planner chooses, printed with the runner-up, restoring
  the checkpoint onto its own meshes."""
  path, _, cwd = resumed
  auto = ("--config.placement.strategy=auto", "--config.placement.hardware=h100")
  more = _run(stage, RELATIVE, f"--config.total_steps={STEPS + 1}", *auto, cwd=cwd)
  assert more.returncode == 0, more.stderr[-3000:]
  assert f"; steps {STEPS} -> {STEPS + 1}" in more.stdout, more.stdout
  assert os.path.isdir(os.path.join(path, "checkpoints", str(STEPS + 1)))
  chosen = [line for line in more.stdout.splitlines() if line.startswith("placement auto ")]
  assert chosen[0].startswith("placement auto chosen: data="), more.stdout
  assert chosen[1].startswith("placement auto runner-up: "), more.stdout
  rows = runs_testing.rows(path)
  assert [row["step"] for row in rows] == list(range(STEPS + 2))
  assert all(np.isfinite(v) for row in rows for k, v in row.items() if k.startswith("eval/"))
