"""Reruns of the supervised scripts (train_sft.py, train_rm.py): a finished run says so and
changes no file; an interrupted one (SIGTERM, kill -9) ends with the uninterrupted run's rows.
(The pieces that make it so: tests/test_reruns.py. PPO's reruns: tests/test_resume_e2e.py; the
pipeline's: tests/test_pipeline.py.)"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

import pytest
import runs_testing

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
FLAGS = (
  f"--config.total_steps={STEPS}",
  "--config.eval.every_steps=2",
  "--config.log_every=1",
  "--config.checkpoint.every_steps=2",
)
SCRIPTS = {"sft": ("train_sft.py", "sft_tiny.py"), "rm": ("train_rm.py", "rm_tiny.py")}
PLOTS = {"sft": ("loss.png", "eval_loss.png"), "rm": ("loss.png", "eval_accuracy.png")}
# One interruption per script keeps the suite short: both go through the same resume.
INTERRUPTION = {"sft": signal.SIGTERM, "rm": signal.SIGKILL}


def _command(stage: str, workdir: str) -> list[str]:
  script, config = SCRIPTS[stage]
  return [
    sys.executable,
    os.path.join(ROOT, "scripts", script),
    f"--config={os.path.join(ROOT, 'configs', config)}",
    f"--workdir={workdir}",
    *FLAGS,
  ]


def _run(stage: str, workdir: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    _command(stage, workdir), capture_output=True, text=True, timeout=600, cwd=ROOT
  )


def _start(stage: str, workdir: str) -> subprocess.Popen:
  return subprocess.Popen(
    _command(stage, workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
  )


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def uninterrupted(request, tmp_path_factory) -> tuple[str, str, str]:
  """(stage, workdir, the run's last stdout line) of one uninterrupted run per script."""
  stage = request.param
  path = str(tmp_path_factory.mktemp(f"uninterrupted_{stage}"))
  done = _run(stage, path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert [row["step"] for row in runs_testing.rows(path)] == list(range(STEPS + 1))
  return stage, path, done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_finished_run_says_so_and_changes_no_file(uninterrupted, tmp_path):
  stage, reference, _ = uninterrupted
  runs_testing.assert_rerun_changes_nothing(
    reference,
    str(tmp_path / "w"),
    functools.partial(_run, stage),
    lambda w: (
      f"{w}: finished at step {STEPS}; nothing to do (delete the workdir or raise "
      "total_steps to train more)"
    ),
  )


def _interrupt(stage: str, path: str, signum: int) -> None:
  proc = _start(stage, path)
  # Row 3: the checkpoint of step 2 is complete, step 4's not yet due. SIGTERM stops after the
  # step it lands in, with a checkpoint of it; kill -9 leaves the checkpoint of step 2.
  runs_testing.wait_for_row(proc, path, 3)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=300)
  if signum == signal.SIGTERM:
    assert proc.returncode == 0, err[-3000:]
    assert "stopped: checkpoint written" in out
  else:
    assert proc.returncode == -signum


@pytest.mark.slow
def test_an_interrupted_run_ends_as_the_uninterrupted_one(uninterrupted, tmp_path):
  stage, reference, last_line = uninterrupted
  path = str(tmp_path)
  _interrupt(stage, path, INTERRUPTION[stage])
  done = _run(stage, path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert runs_testing.deterministic_rows(path) == runs_testing.deterministic_rows(reference)
  # The held-out metric's first -> last covers the whole run, its interrupted part too.
  held_out = done.stdout.strip().splitlines()[-1].split("; steps")[0]
  assert held_out == last_line.split("; steps")[0]
  for name in PLOTS[stage]:
    assert os.path.getsize(os.path.join(path, name)) > 0, name
