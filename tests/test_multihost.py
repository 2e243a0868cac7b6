"""Multi-process runs end to end: scripts/train_ppo.py as processes joined by jax.distributed
(gloo: 2 processes of 4 CPU devices, or 4 of 2) gives the numbers of one process of 8 devices,
for every placement; a killed process stops the others; a rerun resumes, across process layouts
too. The config section and the placement checks are tested in test_distributed_config.py.

Each single-process run the jobs compare with is made once for the module (`references`)."""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_SCRIPT = _ROOT / "scripts" / "train_ppo.py"
_RUN = (
  "--config=configs/ppo_tiny.py",
  "--config.total_steps=3",
  "--config.rollout.batch_size=8",
  "--config.rollout.max_new_tokens=8",
  "--config.reward.model_coef=0.5",  # the reward model's scores are gathered too
  "--config.eval.num_prompts=8",  # one batch: the evaluation gathers across processes too
)
_TIMEOUT_S = 900  # the three runs need about 4 CPU-minutes; shared CI machines can be slow
_COMPARED = (
  "reward/mean",
  "reward/std",
  "response/length",
  "kl/mean",
  "loss/policy",
  "loss/value",
  "policy/entropy",
  "actor/grad_norm",
  "critic/grad_norm",
  "sync/bytes",
)
_OUTPUTS = ("metrics.jsonl", "timeline.json", "timeline.png", "reward.png", "tb")


def _env() -> dict[str, str]:
  """The test session's environment without its 8 host devices (each process sets its own)
  and with this worktree first on the path."""
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = flags.strip()
  for name in ("JAX_NUM_CPU_DEVICES", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES"):
    env.pop(name, None)
  env.pop("JAX_PROCESS_ID", None)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _start(args: list[str], log: pathlib.Path) -> subprocess.Popen:
  log.parent.mkdir(parents=True, exist_ok=True)
  with open(log, "w") as out:
    return subprocess.Popen(
      [sys.executable, str(_SCRIPT), *args], cwd=_ROOT, env=_env(), stdout=out,
      stderr=subprocess.STDOUT,
    )  # fmt: skip


def _run_all(commands: dict[str, list[str]], logs: pathlib.Path) -> dict[str, tuple[int, str]]:
  """Runs the commands at the same time; returns each one's exit status and output."""
  procs = {name: _start(args, logs / f"{name}.log") for name, args in commands.items()}
  deadline = time.monotonic() + _TIMEOUT_S
  try:
    for proc in procs.values():
      proc.wait(timeout=max(deadline - time.monotonic(), 1))
  except subprocess.TimeoutExpired:
    pass
  finally:
    timed_out = [name for name, proc in procs.items() if proc.poll() is None]
    for name in timed_out:
      procs[name].kill()
      procs[name].wait()
  out = {
    name: (proc.returncode, (logs / f"{name}.log").read_text()) for name, proc in procs.items()
  }
  if timed_out:
    pytest.fail(f"{timed_out} still running after {_TIMEOUT_S}s: {_tails(out)}")
  return out


def _tails(results: dict[str, tuple[int, str]]) -> str:
  lines = lambda text: [x for x in text.splitlines() if "[Gloo]" not in x][-5:]
  return "\n".join(f"--- {name} (exit {rc}):\n" + "\n".join(lines(text))
                   for name, (rc, text) in results.items())  # fmt: skip


def _distributed(process_id: int, port: int, num_processes: int = 2) -> list[str]:
  return [
    "--config.distributed.enabled=True",
    f"--config.distributed.coordinator_address=localhost:{port}",
    f"--config.distributed.num_processes={num_processes}",
    f"--config.distributed.process_id={process_id}",
  ]


def _config(variant: str | None) -> list[str]:
  """The run of configs/ppo_tiny.py (colocated), or of its `variant`."""
  run = list(_RUN)
  if variant:
    run[0] = f"--config=configs/ppo_tiny.py:{variant}"
  return run


def _metrics(workdir: pathlib.Path) -> list[dict]:
  return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


class _References:
  """The single-process runs (one process of 8 devices) that the jobs compare with, one per
  variant of configs/ppo_tiny.py, each made once for the module: started beside the first job
  that needs it, as each job's own single run was (it keeps the cores busy while the job's
  processes wait on each other), and read once that job is done."""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self.runs: dict[str | None, tuple[subprocess.Popen, float]] = {}

  def workdir(self, variant: str | None) -> pathlib.Path:
    return self.root / (variant or "colocated")

  def start(self, variant: str | None) -> None:
    if variant not in self.runs:
      workdir = self.workdir(variant)
      proc = _start([*_config(variant), f"--workdir={workdir}"], workdir.with_suffix(".log"))
      self.runs[variant] = proc, time.monotonic()

  def result(self, variant: str | None) -> tuple[int, str]:
    """The run's exit status and output, once it ended (started here if it was not)."""
    self.start(variant)
    proc, started = self.runs[variant]
    log = self.workdir(variant).with_suffix(".log")
    try:
      proc.wait(timeout=max(started + _TIMEOUT_S - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      tail = _tails({log.stem: (proc.returncode, log.read_text())})
      pytest.fail(f"the single run still running after {_TIMEOUT_S}s: {tail}")
    return proc.returncode, log.read_text()

  def close(self) -> None:
    for proc, _ in self.runs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
  refs = _References(tmp_path_factory.mktemp("single"))
  yield refs
  refs.close()


# ---------------------------------------------------------------------------------------------
# configs/ppo_tiny.py (colocated) as two processes and as one.


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reserve_port, references):
  root = tmp_path_factory.mktemp("multihost")
  port = reserve_port()
  references.start(None)
  # One workdir, as multi-host checkpoints need (a shared filesystem): every process takes
  # part in the checkpoints, process 0 alone writes the files and prints.
  results = _run_all({f"process{k}": [*_RUN, f"--workdir={root / 'multi'}", *_distributed(k, port)]
                      for k in (0, 1)}, root / "logs")  # fmt: skip
  return root, {"single": references.result(None), **results}


@pytest.mark.slow
def test_every_process_exits_cleanly(runs):
  _, results = runs
  assert {name: rc for name, (rc, _) in results.items()} == {
    "single": 0,
    "process0": 0,
    "process1": 0,
  }, _tails(results)


@pytest.mark.slow
def test_two_processes_give_the_single_process_numbers(runs, references):
  root, results = runs
  single = _metrics(references.workdir(None))
  multi = _metrics(root / "multi")
  assert [r["step"] for r in single] == [r["step"] for r in multi] == [0, 1, 2]
  for a, b in zip(single, multi, strict=True):
    for key in _COMPARED:
      # Measured: at most 1.1e-5 relative (loss/value); the sampled tokens are identical. The
      # rest is the order of cross-process (gloo) reductions against in-process ones.
      assert b[key] == pytest.approx(a[key], rel=5e-5, abs=1e-7), (a["step"], key)
  # Not trivially equal: training moved the numbers.
  assert single[0]["loss/policy"] != single[1]["loss/policy"]


@pytest.mark.slow
def test_only_process_zero_writes_and_prints(runs):
  root, results = runs
  for name in _OUTPUTS:
    assert (root / "multi" / name).exists(), name
  # Written once: a second writer would have doubled the rows.
  rows = (root / "multi" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(x)["step"] for x in rows] == [0, 1, 2]
  # The final checkpoint is complete: both processes took part.
  assert (root / "multi" / "checkpoints" / "3" / "commit_success.txt").exists()
  assert "over iterations 0..2" in results["process0"][1]
  assert "over iterations 0..2" not in results["process1"][1]
  assert "ppo: 100%" not in results["process1"][1]


# ---------------------------------------------------------------------------------------------
# Every placement with its groups on different processes.

_PLACED = {
  # variant of configs/ppo_tiny.py: where its groups land with 2 processes of 4 devices
  "disaggregated": "training roles on process 0, rollout on process 1",
  # Generation of the next batch on process 1 while process 0 trains (two threads each).
  "disaggregated_async": "as disaggregated, generating one batch ahead",
  "interleaved": "reference on process 0, reward on process 1, the rest on both",
  "explicit": "actor, reference and rollout on process 0, critic and reward on process 1",
}


def _assert_same_numbers(single: list[dict], multi: list[dict]) -> None:
  assert [r["step"] for r in single] == [r["step"] for r in multi] == [0, 1, 2]
  for a, b in zip(single, multi, strict=True):
    for key in _COMPARED:
      # As in the colocated test: the programs are the same; XLA's CPU thread pool splits
      # reductions by the devices in a process (4 against 8), measured at most 4.9e-5 relative
      # (kl/mean, a mean of differences near 0) and otherwise under 5e-6.
      assert b[key] == pytest.approx(a[key], rel=5e-5, abs=1e-7), (a["step"], key)
  assert single[0]["loss/policy"] != single[1]["loss/policy"]


def _placed_runs(root: pathlib.Path, variant: str, num_processes: int, port: int, references):
  """configs/ppo_tiny.py:`variant` as `num_processes` processes, and as one process of 8
  devices (`references`, beside them the first time)."""
  references.start(variant)
  results = _run_all({
    f"process{k}": [*_config(variant), f"--workdir={root / 'multi'}",
                    *_distributed(k, port, num_processes)]
    for k in range(num_processes)
  }, root / "logs")  # fmt: skip
  return {"single": references.result(variant), **results}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(_PLACED))
def test_placements_across_two_processes(variant, tmp_path, reserve_port, references):
  results = _placed_runs(tmp_path, variant, 2, reserve_port(), references)
  assert {name: rc for name, (rc, _) in results.items()} == {
    "single": 0,
    "process0": 0,
    "process1": 0,
  }, _tails(results)
  _assert_same_numbers(_metrics(references.workdir(variant)), _metrics(tmp_path / "multi"))
  assert (tmp_path / "multi" / "checkpoints" / "3" / "commit_success.txt").exists()


@pytest.mark.slow
def test_disaggregated_across_four_processes(tmp_path, reserve_port, references):
  # 4 processes of 2 devices: training on processes 0-1, rollout on processes 2-3, every
  # group's mesh spanning two processes.
  results = _placed_runs(tmp_path, "disaggregated", 4, reserve_port(), references)
  assert {name: rc for name, (rc, _) in results.items()} == {
    "single": 0, **{f"process{k}": 0 for k in range(4)}
  }, _tails(results)  # fmt: skip
  _assert_same_numbers(_metrics(references.workdir("disaggregated")), _metrics(tmp_path / "multi"))


@pytest.mark.slow
def test_kill_and_resume_across_process_layouts(tmp_path, reserve_port, references):
  """A disaggregated run across 2 processes: one killed with SIGKILL mid-run stops the other
  within a bounded time with one line; rerunning both resumes and ends with the numbers of an
  uninterrupted run. A checkpoint of 1 process x 8 devices resumes as 2 x 4 too."""
  run = [*_config("disaggregated"), "--config.checkpoint.every_steps=1",
         "--config.distributed.peer_timeout_s=10"]  # fmt: skip
  logs = tmp_path / "logs"
  # The uninterrupted run is the module's single-process one (checkpoint frequency and
  # peer_timeout_s change no number).
  references.start("disaggregated")
  # Beside the killed run: the same run saved at step 1 by one process of 8 devices, continued
  # below by two (beside the rerun).
  first_step = _start([*run, "--config.total_steps=1", f"--workdir={tmp_path / 'relaid'}"],
                      logs / "first_step.log")  # fmt: skip

  # Killed mid-run: process 1 dies once the checkpoint of step 1 is complete.
  port = reserve_port()
  multi = tmp_path / "multi"
  procs = [_start([*run, f"--workdir={multi}", *_distributed(k, port)], logs / f"killed{k}.log")
           for k in (0, 1)]  # fmt: skip
  committed = multi / "checkpoints" / "1" / "commit_success.txt"
  deadline = time.monotonic() + _TIMEOUT_S
  try:
    while not committed.exists() and time.monotonic() < deadline:
      assert procs[0].poll() is None and procs[1].poll() is None, "a process ended before step 1"
      time.sleep(0.2)  # polling the file system for the checkpoint; the assertion is the kill
    assert committed.exists(), "no checkpoint of step 1"
    procs[1].kill()
    killed_at = time.monotonic()
    procs[1].wait()
    # Process 0 notices within distributed.peer_timeout_s (10 s) and its once-a-second check.
    rc = procs[0].wait(timeout=10 + 60)
    waited = time.monotonic() - killed_at
    first_step.wait(timeout=max(deadline - time.monotonic(), 1))
  finally:
    for proc in (*procs, first_step):
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  text = (logs / "killed0.log").read_text()
  errors = [x for x in text.splitlines() if x.startswith("error:")]
  # Named by the liveness watch, or first by the collective that lost its peer.
  clear = ("process 1 of 2", "another process of the job ended or failed")
  assert rc != 0 and len(errors) == 1 and any(c in errors[0] for c in clear), text[-2000:]
  assert waited < 10 + 60
  baseline = {
    "single": references.result("disaggregated"),
    "first_step": (first_step.returncode, (logs / "first_step.log").read_text()),
  }
  assert {name: rc for name, (rc, _) in baseline.items()} == {"single": 0, "first_step": 0}, _tails(
    baseline
  )
  single = _metrics(references.workdir("disaggregated"))

  # Both rerun: resumed, then the numbers of the uninterrupted run. Beside them, the
  # one-process checkpoint of step 1 resumed by two processes of 4 devices.
  ports = {"rerun": reserve_port(), "relaid": reserve_port()}
  workdirs = {"rerun": multi, "relaid": tmp_path / "relaid"}
  both = _run_all({f"{job}/process{k}": [*run, f"--workdir={workdirs[job]}",
                                         *_distributed(k, ports[job])]
                   for job in ("rerun", "relaid") for k in (0, 1)}, logs)  # fmt: skip
  rerun, relaid = ({name.split("/")[1]: out for name, out in both.items()
                    if name.startswith(f"{job}/")} for job in ("rerun", "relaid"))  # fmt: skip
  assert {name: rc for name, (rc, _) in rerun.items()} == {"process0": 0, "process1": 0}, _tails(
    rerun
  )
  assert "resuming from the checkpoint of step" in rerun["process0"][1]
  _assert_same_numbers(single, _metrics(multi))

  assert {name: rc for name, (rc, _) in relaid.items()} == {"process0": 0, "process1": 0}, _tails(
    relaid
  )
  assert "resuming from the checkpoint of step 1" in relaid["process0"][1]
  _assert_same_numbers(single, _metrics(tmp_path / "relaid"))
