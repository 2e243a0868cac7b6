"""Kill -9 across the process boundary beyond PPO (PPO's kill -9, Ctrl-C and SIGTERM: tests/
test_resume_e2e.py and test_front_door_e2e.py; every flow's exact resume, in this process:
tests/test_resume_algorithms_runs.py).

`scripts/train.py` runs DPO's shipped config in a subprocess, as a user would: the flow furthest
from PPO's (no rollout; its own preference-data stream, whose position the checkpoint's meta
carries beside the prompts'); and GRPO with conversations (an environment per trajectory,
observations in the rollout). It is killed with SIGKILL as soon as its first checkpoint is
complete, while the run goes on, so the kill lands anywhere in the iterations or saves after
it. A rerun in this process resumes from the latest complete checkpoint and must repeat the
uninterrupted run exactly: every metrics row, the timeline, and the final checkpoint's
fingerprints. The uninterrupted run and the rerun run in this process, on the same programs
(the persistent compilation cache that conftest sets).
"""

import pathlib
import signal
import subprocess
import sys
import time

import pytest
from test_resume_algorithms_runs import STEPS, assert_same_run, changes, config, uninterrupted_run

from rlhfjax import checkpoint as ckpt
from rlhfjax.runner import Runner

pytestmark = pytest.mark.e2e

_ROOT = pathlib.Path(__file__).parent.parent
_NAMES = ("dpo", "grpo_conversations")


def _start(name: str, workdir: pathlib.Path) -> subprocess.Popen:
  shipped, changed = changes(name)
  command = [
    sys.executable,
    str(_ROOT / "scripts" / "train.py"),
    f"--config={_ROOT / 'configs' / f'{shipped}_tiny.py'}",
    f"--workdir={workdir}",
    *(f"--config.{k}={v}" for k, v in changed.items()),
  ]
  # cwd: a user flow's module (examples/) imports from the directory the script runs in.
  # Its output goes to a file: a pipe nobody reads could fill and stall the run.
  with open(workdir.parent / f"{workdir.name}.log", "w") as log:
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=_ROOT)


def _kill_after_first_checkpoint(proc: subprocess.Popen, workdir: pathlib.Path) -> list[int]:
  """SIGKILL once a checkpoint is complete; the steps complete when the process died."""
  directory = workdir / "checkpoints"
  deadline = time.monotonic() + 500
  while not ckpt.complete_steps(directory):
    if proc.poll() is not None:
      log = (workdir.parent / f"{workdir.name}.log").read_text()
      raise AssertionError(f"the run ended before its first checkpoint: {log[-3000:]}")
    if time.monotonic() > deadline:
      proc.kill()
      raise AssertionError("no complete checkpoint within 500 s")
    time.sleep(0.02)  # polling cadence; the event waited on is the checkpoint's commit marker
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL, "the run ended before the kill"
  return ckpt.complete_steps(directory)


@pytest.mark.slow
@pytest.mark.parametrize("name", _NAMES)
def test_killed_with_sigkill_and_rerun_repeats_the_uninterrupted_run(
  name, tmp_path_factory, tmp_path
):
  whole, workdir = uninterrupted_run(name, tmp_path_factory), tmp_path / "run"
  proc = _start(name, workdir)
  complete = _kill_after_first_checkpoint(proc, workdir)
  assert complete and complete[-1] < STEPS, complete
  resumed = Runner(config(name), str(workdir), show_progress=False)
  assert resumed.start_step == complete[-1]
  resumed.run()
  assert_same_run(workdir, whole, name, complete[-1])
