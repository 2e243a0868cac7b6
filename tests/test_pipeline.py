"""The README's main job, scripts/run_pipeline.py, end to end on short schedules: SFT, reward
model and PPO chained through their checkpoints, the outputs a user reads, a rerun of a finished
pipeline that changes nothing, an interrupted one that ends as the uninterrupted one (and holds
its stage directories while it runs), and the evaluation turned off."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import runs_testing

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPO_STEPS = 3
SHORT = (
  # Rows and checkpoints at every other step: an interrupted stage resumes mid-way.
  *(
    f"--config.{stage}.{flag}"
    for stage in ("sft", "rm")
    for flag in ("total_steps=4", "eval.every_steps=2", "log_every=1", "checkpoint.every_steps=2")
  ),
  f"--config.ppo.total_steps={PPO_STEPS}",
  "--config.ppo.checkpoint.every_steps=1",
  "--config.ppo.rollout.batch_size=8",
  "--config.ppo.rollout.max_new_tokens=8",
  "--config.ppo.eval.num_prompts=8",
)
STAGES = ("sft", "rm", "ppo")
OUTPUTS = ("summary.md", "reward.png", "eval.md", "timeline.png")


def _command(workdir: str, *extra: str) -> list[str]:
  return [
    sys.executable,
    os.path.join(ROOT, "scripts", "run_pipeline.py"),
    f"--config={os.path.join(ROOT, 'configs', 'pipeline_tiny.py')}",
    f"--workdir={workdir}",
    *SHORT,
    *extra,
  ]


def _run(workdir: str, *extra: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
  return subprocess.run(
    _command(workdir, *extra), capture_output=True, text=True, timeout=900, cwd=cwd
  )


def _start(workdir: str, *extra: str) -> subprocess.Popen:
  return subprocess.Popen(
    _command(workdir, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
  )


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
  """One uninterrupted pipeline, run as the README runs it: a relative workdir (here from
  another current directory)."""
  cwd = tmp_path_factory.mktemp("uninterrupted")
  done = _run("workdirs/pipeline", cwd=str(cwd))
  assert done.returncode == 0, done.stderr[-3000:]
  return str(cwd / "workdirs" / "pipeline")


@pytest.mark.slow
def test_pipeline_chains_the_stages(uninterrupted):
  workdir = uninterrupted
  for name in OUTPUTS:
    assert os.path.getsize(os.path.join(workdir, name)) > 0, name
  # PPO started from the SFT policy and the trained reward model: both stages' checkpoints
  # exist, and PPO scored with the reward model (its evaluation reports it).
  for stage, item in (("sft", "actor_params"), ("rm", "reward_params")):
    assert os.path.isdir(os.path.join(workdir, stage, "checkpoints", "4", item))
  evaluation = json.loads(_read(os.path.join(workdir, "ppo", "eval.json")))
  assert set(evaluation) == {"before", "after"}
  for phase in evaluation.values():
    assert {"reward_model", "task_reward", "response_length"} <= set(phase)
    assert phase["num_prompts"] == 8 and len(phase["samples"]) == 8
  summary = _read(os.path.join(workdir, "summary.md"))
  assert "Reward model held-out accuracy" in summary and "| task_reward |" in summary
  # The summary's first -> last held-out numbers are the stages' first and last eval rows.
  for stage, key, label in (
    ("sft", "eval/loss", "SFT held-out loss"),
    ("rm", "eval/accuracy", "Reward model held-out accuracy"),
  ):
    rows = runs_testing.rows(os.path.join(workdir, stage))
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    values = [row[key] for row in rows if key in row]
    assert f"- {label}: {values[0]:.4f} -> {values[-1]:.4f}" in summary


@pytest.mark.slow
def test_a_finished_pipeline_says_so_and_changes_no_file(uninterrupted, tmp_path):
  runs_testing.assert_rerun_changes_nothing(
    uninterrupted,
    str(tmp_path / "w"),
    _run,
    lambda w: (
      f"{w}: finished (sft at step 4, rm at step 4, ppo at step {PPO_STEPS}); nothing to "
      "do (delete the workdir or raise a stage's total_steps, e.g. --config.ppo.total_steps, to "
      "train more)"
    ),
  )


def _assert_same_outputs(workdir: str, reference: str) -> None:
  """Metrics rows (but their timings), summary.md, eval.md and the timeline's entries equal the
  uninterrupted run's; the plots are drawn (from those same rows and entries)."""
  for stage in STAGES:
    got = runs_testing.deterministic_rows(os.path.join(workdir, stage))
    assert got == runs_testing.deterministic_rows(os.path.join(reference, stage)), stage
  for name in ("summary.md", "eval.md", "ppo/eval.json"):
    assert _read(os.path.join(workdir, name)) == _read(os.path.join(reference, name)), name
  entries = runs_testing.timeline_entries(os.path.join(workdir, "ppo"))
  assert entries == runs_testing.timeline_entries(os.path.join(reference, "ppo"))
  assert {entry[0] for entry in entries} == set(range(PPO_STEPS))
  for name in OUTPUTS:
    assert os.path.getsize(os.path.join(workdir, name)) > 0, name


def _holder_pid(lock: str) -> int | None:
  """The pid in a lock file's holder record; None while it is empty (or being written)."""
  try:
    return json.loads(_read(lock))["pid"]
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def _assert_rm_script_refused(proc: subprocess.Popen, workdir: str) -> None:
  """While the pipeline `proc` runs on `workdir`, the reward model's own script started on the
  pipeline's rm/ directory is refused at start, in one line naming the pipeline."""
  rm_dir = os.path.join(workdir, "rm")
  lock = os.path.join(rm_dir, ".lock")
  # This run's record: an earlier, killed run's is left in the file until this one takes over.
  runs_testing.wait_until(proc, lambda: _holder_pid(lock) == proc.pid, "rm/ held")
  beside = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "scripts", "train_rm.py"),
      f"--config={os.path.join(ROOT, 'configs', 'rm_tiny.py')}",
      f"--workdir={rm_dir}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
  )
  assert proc.poll() is None  # the refusal came while the pipeline ran
  holder = json.loads(_read(lock))
  assert beside.returncode == 2, beside.stderr[-3000:]
  assert beside.stderr.strip().splitlines() == [
    f"error: workdir {rm_dir} is in use by process {proc.pid} on {holder['host']} (started "
    f"{holder['started']}, the run of {workdir}); wait for it to end, stop it, or choose "
    "another --workdir"
  ]


@pytest.mark.slow
def test_an_interrupted_pipeline_ends_as_the_uninterrupted_one(uninterrupted, tmp_path):
  workdir = str(tmp_path / "w")

  # SIGTERM mid-SFT: it stops after step 2 with a checkpoint.
  proc = _start(workdir)
  runs_testing.wait_for_row(proc, os.path.join(workdir, "sft"), 1)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  assert "stopped: SFT checkpoint written" in out

  # This run resumes SFT, trains the reward model (and holds its directory: the stage's own
  # script is refused there), then is killed -9 mid-PPO, once iteration 1 is written (its
  # checkpoint is due right after it).
  proc = _start(workdir)
  _assert_rm_script_refused(proc, workdir)
  runs_testing.wait_for_row(proc, os.path.join(workdir, "ppo"), 1)
  proc.kill()
  proc.wait(timeout=60)
  lines = [x.strip() for x in proc.stdout.read().splitlines()]
  resumed = [x for x in lines if x.startswith("resuming from the checkpoint of step ")]
  # SFT resumed; the reward model and PPO started afresh.
  assert len(resumed) == 1 and resumed[0].endswith(f" in {os.path.join(workdir, 'sft')}"), lines
  assert not os.path.exists(os.path.join(workdir, "summary.md"))

  done = _run(workdir)
  assert done.returncode == 0, done.stderr[-3000:]
  # The same rows as the uninterrupted run's: rm/ has the pipeline's rows alone.
  _assert_same_outputs(workdir, uninterrupted)
  # The stages finished before are not even built again.
  assert "stage 1/3: supervised fine-tuning: finished at step 4" in done.stdout
  assert "stage 2/3: reward model: finished at step 4" in done.stdout


@pytest.mark.slow
def test_a_pipeline_without_evaluation_finishes(uninterrupted, tmp_path):
  # The SFT and reward model stages of the uninterrupted run, finished: this run only trains
  # PPO, with the evaluation off, from them.
  workdir = str(tmp_path)
  for stage in ("sft", "rm"):
    shutil.copytree(os.path.join(uninterrupted, stage), os.path.join(workdir, stage))
  short = ("--config.ppo.total_steps=1", "--config.ppo.eval.num_prompts=0")
  done = _run(workdir, *short)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "stage 2/3: reward model: finished at step 4" in done.stdout
  assert [row["step"] for row in runs_testing.rows(os.path.join(workdir, "ppo"))] == [0]

  summary = _read(os.path.join(workdir, "summary.md"))
  assert "- Held-out task reward before -> after PPO: evaluation off" in summary
  assert "held-out prompts" not in summary
  assert not os.path.exists(os.path.join(workdir, "eval.md"))
  for name in ("reward.png", "timeline.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0, name
  again = _run(workdir, *short)
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.startswith(f"{workdir}: finished (")
