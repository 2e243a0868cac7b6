"""Checkpoint and resume of PPO runs: kill -9, SIGTERM, another placement, bad checkpoints,
non-finite updates. The subprocess tests run scripts/train_ppo.py as a user would."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import runs_testing

from rlhfjax import checkpoint as ckpt
from rlhfjax import config as config_lib
from rlhfjax import runner as trainer_lib
from rlhfjax.placement.spec import Role

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
  tests/test_front_door.py): finish the iteration, checkpoint, exit 0, no traceback."""
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


def _config(strategy: str, steps: int, reward=None, **ppo) -> config_lib.ExperimentConfig:
  import runpy

  cd = runpy.run_path(os.path.join(ROOT, "configs", "ppo_tiny.py"))["get_config"](strategy)
  cd.total_steps = steps
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.ppo.ppo_epochs = 1
  cd.checkpoint = {"every_steps": 2, "async_save": True}
  cd.eval = {"num_prompts": 0}
  cd.ppo.update(ppo)
  if reward:
    cd.reward.update(reward)
  return config_lib.from_config_dict(cd)


@pytest.mark.slow
def test_saved_under_colocated_resumes_under_disaggregated(tmp_path):
  workdir = str(tmp_path)
  first = trainer_lib.Runner(_config("colocated", 2), workdir, show_progress=False)
  first.run()
  saved = jax.device_get(first.cluster.states[Role.ACTOR].params)
  saved_critic = jax.device_get(first.cluster.states[Role.CRITIC].params)

  second = trainer_lib.Runner(_config("disaggregated", 3), workdir, show_progress=False)
  assert second.start_step == 2
  actor_devices = {jax.devices()[i] for i in second.placement[Role.ACTOR].devices}
  assert actor_devices != set(jax.devices())  # the actor really moved to a sub-mesh
  for state, want, role in (
    (second.cluster.states[Role.ACTOR], saved, Role.ACTOR),
    (second.cluster.states[Role.CRITIC], saved_critic, Role.CRITIC),
  ):
    devices = {jax.devices()[i] for i in second.placement[role].devices}
    for leaf, expected, sharding in zip(
      jax.tree.leaves(state.params),
      jax.tree.leaves(want),
      jax.tree.leaves(second.cluster.roles[role].param_shardings),
      strict=True,
    ):
      assert leaf.sharding == sharding
      assert {s.device for s in leaf.addressable_shards} == devices
      for shard in leaf.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
  # The rollout engine starts from the restored weights, and the run continues.
  result = second.run()
  assert [r["step"] for r in result.metrics] == [2]
  assert [r["step"] for r in runs_testing.rows(workdir)] == [0, 1, 2]


def huge_reward(prompts, responses, metadata):
  """Finite scores (a NaN one is refused when the reward function returns it) whose sums
  overflow float32: the advantages and the value loss become non-finite."""
  del responses, metadata
  return np.full(len(prompts), 3e38, np.float32)


@pytest.mark.slow
def test_non_finite_updates_are_skipped_then_the_run_stops(tmp_path):
  cfg = _config("colocated", 4, reward={"fn": "test_resume:huge_reward"}, max_skipped_updates=3)
  trainer = trainer_lib.Runner(cfg, str(tmp_path), show_progress=False)
  before = jax.device_get(trainer.cluster.states[Role.ACTOR].params)
  with pytest.raises(trainer_lib.TooManySkippedUpdates, match="non-finite"):
    trainer.run()
  rows = runs_testing.rows(str(tmp_path))
  # Two updates per iteration (mini_batches=2): the limit of 3 is reached in iteration 1.
  assert [r["step"] for r in rows] == [0, 1]
  assert rows[0]["update/skipped"] == 2 and rows[1]["update/skipped_in_row"] == 4
  after = jax.device_get(trainer.cluster.states[Role.ACTOR].params)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(a, b)
