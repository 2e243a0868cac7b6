"""Exact resume of every flow beyond PPO (PPO's kill -9, Ctrl-C and SIGTERM tests are in
test_resume_e2e.py and test_front_door_e2e.py).

`scripts/train.py` runs each algorithm's shipped config in a subprocess, as a user would; it is
killed with SIGKILL as soon as its first checkpoint is complete, while the run goes on, so the
kill lands anywhere in the iterations or saves after it. The rerun resumes from the latest
complete checkpoint and must repeat the uninterrupted run exactly: every metrics row, and the
final checkpoint's fingerprints, which hash every array (parameters, optimizer state, the flow's
own arrays) and the JSON state (data iterators, controllers). The uninterrupted run and the rerun
run in this process, on the same programs (the persistent compilation cache that conftest sets).
"""

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from runs_testing import shipped_config

from rlhfjax import checkpoint as ckpt
from rlhfjax.runner import Runner

pytestmark = pytest.mark.e2e

_ROOT = pathlib.Path(__file__).parent.parent
_VOLATILE = ("time/", "throughput/")
_STEPS = 4
_COMMON = {
  "total_steps": _STEPS,
  "checkpoint.every_steps": 2,
  "rollout.batch_size": 8,
  "rollout.max_new_tokens": 8,
  "eval.num_prompts": 0,
  "reward.model_coef": 0.5,  # continuous scores: every group and pair carries a signal
}
# Each run: its shipped config and what it changes beyond _COMMON.
_RUNS = {
  "grpo": ("grpo", {}),
  "rloo": ("rloo", {}),
  "reinforce_pp": ("reinforce_pp", {}),
  "dapo": ("dapo", {}),
  "dpo": ("dpo", {"rollout.max_prompt_len": 40, "rollout.max_new_tokens": 40}),
  "online_dpo": ("online_dpo", {}),
  "rejection_sampling": (
    "ppo",
    {"algorithm.flow": "examples.rejection_sampling:make_flow", "ppo.group_size": 4},
  ),
}


def _changes(name: str, steps: int) -> tuple[str, dict]:
  config, own = _RUNS[name]
  return config, {**_COMMON, **own, "total_steps": steps}


def _config(name: str, steps: int = _STEPS):
  config, changes = _changes(name, steps)
  return shipped_config(f"{config}_tiny", changes)


def _start(name: str, workdir: pathlib.Path) -> subprocess.Popen:
  config, changes = _changes(name, _STEPS)
  command = [
    sys.executable,
    str(_ROOT / "scripts" / "train.py"),
    f"--config={_ROOT / 'configs' / f'{config}_tiny.py'}",
    f"--workdir={workdir}",
    *(f"--config.{k}={v}" for k, v in changes.items()),
  ]
  # cwd: the user flow's module (examples/) imports from the directory the script runs in.
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


def _rows(workdir: pathlib.Path) -> list[dict]:
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)} for r in rows]


def _final_fingerprints(workdir: pathlib.Path) -> dict:
  step_dir = workdir / "checkpoints" / str(_STEPS)
  return json.loads((step_dir / "fingerprints" / "metadata").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """name -> the workdir of the uninterrupted run, run once per module."""
  done = {}

  def get(name: str) -> pathlib.Path:
    if name not in done:
      workdir = tmp_path_factory.mktemp(f"whole_{name}")
      Runner(_config(name), str(workdir), show_progress=False).run()
      assert ckpt.complete_steps(workdir / "checkpoints") == [2, _STEPS]
      done[name] = workdir
    return done[name]

  return get


def _assert_same_run(got: pathlib.Path, want: pathlib.Path) -> None:
  assert [r["step"] for r in _rows(got)] == list(range(_STEPS))
  assert _rows(got) == _rows(want)
  assert _final_fingerprints(got) == _final_fingerprints(want)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_RUNS))
def test_killed_with_sigkill_and_rerun_repeats_the_uninterrupted_run(name, uninterrupted, tmp_path):
  whole, workdir = uninterrupted(name), tmp_path / "run"
  proc = _start(name, workdir)
  complete = _kill_after_first_checkpoint(proc, workdir)
  assert complete and complete[-1] < _STEPS, complete
  resumed = Runner(_config(name), str(workdir), show_progress=False)
  assert resumed.start_step == complete[-1]
  resumed.run()
  _assert_same_run(workdir, whole)


@pytest.mark.slow
def test_a_finished_run_rerun_for_more_steps_repeats_the_longer_run(uninterrupted, tmp_path):
  """A run that ended (its last checkpoint forced at `total_steps`, off the `every_steps` grid)
  extended by a rerun with more steps; the runner's path, the same for every flow: checked on
  DPO, whose data differ most."""
  whole = uninterrupted("dpo")
  Runner(_config("dpo", 3), str(tmp_path), show_progress=False).run()
  resumed = Runner(_config("dpo"), str(tmp_path), show_progress=False)
  assert resumed.start_step == 3
  resumed.run()
  _assert_same_run(tmp_path, whole)
