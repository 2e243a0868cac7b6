"""Multi-process runs end to end: scripts/train_ppo.py as processes joined by jax.distributed
(gloo: 2 processes of 4 CPU devices, or 4 of 2) gives the numbers of one process of 8 devices,
for placements whose roles' meshes meet across processes in every way (`_PLACED`); a killed
process stops the others; a rerun resumes, across process layouts too. The config section
and the placement checks are tested in test_distributed_config.py.

The single-process runs the jobs compare with are made once for the module, all variants in
turn in one process (`references`), and the placements across two processes in turn in one job
of two processes (`placed`), by `tests/placements_job.py`: the processes start and join once,
and the programs the placements have in common are compiled once."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest
from runs_testing import assert_same_numbers

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_SCRIPT = _ROOT / "scripts" / "train_ppo.py"
_JOB = _ROOT / "tests" / "placements_job.py"
_RUN = (
  "--config=configs/ppo_tiny.py",
  "--config.total_steps=3",  # the chain of kill and resume takes a step each; the rows match
  "--config.rollout.batch_size=8",
  "--config.rollout.max_new_tokens=8",
  "--config.reward.model_coef=0.5",  # the reward model's scores are gathered too
  "--config.eval.num_prompts=8",  # one batch: the evaluation gathers across processes too
  # One pass over the batch in its 2 mini-batches: each optimizer step across processes is
  # mostly the collectives' hand-offs (gloo), and a second epoch doubled the update (3.2 s an
  # iteration of the co-located placement as 2 x 4 against 1.3) for nothing more checked.
  "--config.ppo.ppo_epochs=1",
)
_TIMEOUT_S = 900  # for one run of each process; shared CI machines can be slow
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
_PLACED_STEPS = 2
"""The placements across two processes run 2 of the references' 3 steps (configs/ppo_tiny.py
has a constant learning rate, so the rows of a shorter run are the longer one's first rows):
the second generates from the weights the first update synced, the second update trains on
it."""


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
  # Every line in the log, also from a process that ends by `os._exit` (a lost peer).
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _start(args: list[str], log: pathlib.Path, script: pathlib.Path = _SCRIPT) -> subprocess.Popen:
  log.parent.mkdir(parents=True, exist_ok=True)
  with open(log, "w") as out:
    return subprocess.Popen(
      [sys.executable, str(script), *args], cwd=_ROOT, env=_env(), stdout=out,
      stderr=subprocess.STDOUT,
    )  # fmt: skip


def _run_all(
  commands: dict[str, list[str]], logs: pathlib.Path, script: pathlib.Path = _SCRIPT,
  timeout_s: float = _TIMEOUT_S,
) -> dict[str, tuple[int, str]]:  # fmt: skip
  """Runs the commands at the same time; returns each one's exit status and output."""
  procs = {name: _start(args, logs / f"{name}.log", script) for name, args in commands.items()}
  deadline = time.monotonic() + timeout_s
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
    pytest.fail(f"{timed_out} still running after {timeout_s}s: {_tails(out)}")
  return out


def _assert_exited_cleanly(results: dict[str, tuple[int, str]]) -> None:
  assert {name: rc for name, (rc, _) in results.items()} == dict.fromkeys(results, 0), _tails(
    results
  )


def _tails(results: dict[str, tuple[int, str]]) -> str:
  lines = lambda text: text.splitlines()[-5:]
  return "\n".join(f"--- {name} (exit {rc}):\n" + "\n".join(lines(text))
                   for name, (rc, text) in results.items())  # fmt: skip


def _distributed(process_id: int, port: int, num_processes: int = 2) -> list[str]:
  return [
    "--config.distributed.enabled=True",
    f"--config.distributed.coordinator_address=localhost:{port}",
    f"--config.distributed.num_processes={num_processes}",
    f"--config.distributed.process_id={process_id}",
  ]


def _config(variant: str) -> list[str]:
  """The run of configs/ppo_tiny.py's `variant`."""
  return [f"--config=configs/ppo_tiny.py:{variant}", *_RUN[1:]]


def _metrics(workdir: pathlib.Path) -> list[dict]:
  return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


_PLACED = {
  # variant of configs/ppo_tiny.py: where its groups land with 2 processes of 4 devices
  # Actor, critic and rollout on both processes, as in 'colocated' (the co-located weight sync
  # on a mesh spanning processes among them), and the scoring models on one process each.
  "interleaved": "reference on process 0, reward on process 1, the rest on both",
  # Generation of the next batch on process 1 while process 0 trains (two threads each); the
  # disaggregated placement itself runs as 2 x 4 (and 4 x 2) in the kill chain below.
  "disaggregated_async": "training roles on process 0, rollout on process 1, one batch ahead",
}
"""The placements run across processes: between them (and the kill chain's) every way a role's
mesh meets another's across processes, a mesh spanning both processes, one process's sub-mesh
to the other's and to one spanning both. 'colocated' (every role on both processes, a layout
'interleaved' holds) and 'explicit' (each role on one process, as 'disaggregated') move arrays
no other way, and every synchronous placement gives the co-located numbers in one process
(test_ppo.py): as 2 x 4 they checked no new crossing, and the module's set-up took 165 s in
CI with them against 118 s without (with the kill chain's start from the references)."""
_REFERENCE = {
  "disaggregated": "disaggregated",  # the kill chain's, first: the chain starts from it
  # Every synchronous placement gives the co-located numbers (in one process: test_ppo.py).
  "interleaved": "colocated",
  "disaggregated_async": "disaggregated_async",  # one step off-policy: numbers of its own
}
"""The single-process run each variant's numbers are compared with."""


class _References:
  """The single-process runs (one process of 8 devices) that the jobs compare with, those of
  `_REFERENCE` (variants of configs/ppo_tiny.py), made once for the module in turn by one process
  (`tests/placements_job.py`): started beside the first job that needs them (it keeps the
  cores busy while the job's processes wait on each other), and read once that job is done."""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self.run: tuple[subprocess.Popen, float] | None = None

  def workdir(self, variant: str) -> pathlib.Path:
    """The workdir of the run `variant`'s numbers are compared with (`_REFERENCE`)."""
    return self.root / _REFERENCE[variant]

  def start(self) -> None:
    if self.run is None:
      variants = ",".join(dict.fromkeys(_REFERENCE.values()))
      # A checkpoint at every step, all kept: the kill chain resumes the one of step 1.
      every_step = ("--config.checkpoint.every_steps=1", "--config.checkpoint.keep=3")
      args = [*_RUN, *every_step, f"--variants={variants}", f"--workdir={self.root}"]
      self.run = _start(args, self.root / "logs" / "single.log", _JOB), time.monotonic()

  def result(self) -> tuple[int, str]:
    """The runs' exit status and output, once they ended (started here if they were not)."""
    self.start()
    proc, started = self.run
    log = self.root / "logs" / "single.log"
    timeout_s = _TIMEOUT_S * len(set(_REFERENCE.values()))
    try:
      proc.wait(timeout=max(started + timeout_s - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      tail = _tails({log.stem: (proc.returncode, log.read_text())})
      pytest.fail(f"the single runs still running after {timeout_s}s: {tail}")
    return proc.returncode, log.read_text()

  def close(self) -> None:
    if self.run is not None and self.run[0].poll() is None:
      self.run[0].kill()
      self.run[0].wait()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
  refs = _References(tmp_path_factory.mktemp("single"))
  yield refs
  refs.close()


# ---------------------------------------------------------------------------------------------
# Every placement of configs/ppo_tiny.py as two processes and as one: one job of two processes
# that runs the placements in turn.


@pytest.fixture(scope="module")
def placed(tmp_path_factory, reserve_port, references):
  root = tmp_path_factory.mktemp("multihost")
  port = reserve_port()
  references.start()
  # One workdir per placement, as multi-host checkpoints need (a shared filesystem): every
  # process takes part in the checkpoints, process 0 alone writes the files and prints.
  run = [*_RUN[:1], f"--config.total_steps={_PLACED_STEPS}", *_RUN[2:]]
  results = _run_all({
    f"process{k}": [*run, f"--variants={','.join(_PLACED)}", f"--workdir={root}",
                    *_distributed(k, port)]
    for k in (0, 1)
  }, root / "logs", _JOB, _TIMEOUT_S * len(_PLACED))  # fmt: skip
  return root, {"single": references.result(), **results}


@pytest.mark.slow
def test_every_process_exits_cleanly(placed):
  """... and quietly: no gloo connection lines (the supervisor drops them) and no XLA
  "involuntary full rematerialization" (a co-located weight sync on a mesh spanning processes
  once went through a jitted identity, which gathered every parameter whole)."""
  _, results = placed
  _assert_exited_cleanly(results)
  for name, (_, log) in results.items():
    for noise in ("[Gloo]", "Involuntary full rematerialization"):
      assert noise not in log, (name, noise)


def _assert_same_numbers(single: list[dict], multi: list[dict]) -> None:
  """`multi`'s rows are `single`'s (its first ones, for a shorter run): the same programs, the
  reductions in another order (gloo's across processes against XLA's in one) and the sampled
  tokens identical (`runs_testing.assert_same_numbers`)."""
  assert [r["step"] for r in single] == [0, 1, 2]
  assert [r["step"] for r in multi] == list(range(len(multi))) and len(multi) >= 2
  assert_same_numbers(single[: len(multi)], multi, _COMPARED)
  # Not trivially equal: training moved the numbers.
  assert single[0]["loss/policy"] != single[1]["loss/policy"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(_PLACED))
def test_placements_across_two_processes(variant, placed, references):
  root, results = placed
  _assert_exited_cleanly(results)
  _assert_same_numbers(_metrics(references.workdir(variant)), _metrics(root / variant))
  assert (root / variant / "checkpoints" / str(_PLACED_STEPS) / "commit_success.txt").exists()


@pytest.mark.slow
def test_only_process_zero_writes_and_prints(placed):
  root, results = placed
  for variant in _PLACED:
    for name in _OUTPUTS:
      assert (root / variant / name).exists(), (variant, name)
    # Written once: a second writer would have doubled the rows.
    rows = (root / variant / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in rows] == list(range(_PLACED_STEPS)), variant
    # The final checkpoint is complete: both processes took part.
    final = root / variant / "checkpoints" / str(_PLACED_STEPS) / "commit_success.txt"
    assert final.exists(), variant
  # Each placement's summary, by process 0 alone.
  summary = f"over iterations 0..{_PLACED_STEPS - 1}"
  assert results["process0"][1].count(summary) == len(_PLACED)
  assert summary not in results["process1"][1]
  assert "ppo: 100%" not in results["process1"][1]


# ---------------------------------------------------------------------------------------------
# Four processes, a killed process, and resuming across process layouts: one chain of runs.


@pytest.mark.slow
def test_kill_and_resume_across_process_layouts(tmp_path, reserve_port, references):
  """One chain of runs of the disaggregated placement in one workdir: step 0 by one process of
  8 devices (the module's reference run, as if killed after its checkpoint of step 1: its
  workdir without the later checkpoints and the marker of a finished run); that checkpoint
  resumed by four processes of 2 devices (training on processes 0-1, the rollout on 2-3, every
  group's mesh spanning two processes), one of which is killed with SIGKILL mid-run once the
  checkpoint of step 2 is complete, which stops the others within a bounded time with one line
  each; rerunning as two processes of 4 devices resumes and ends with the numbers of an
  uninterrupted run: step 1 by four processes, step 2 by two."""
  run = [*_config("disaggregated"), "--config.checkpoint.every_steps=1",
         "--config.distributed.peer_timeout_s=10"]  # fmt: skip
  logs = tmp_path / "logs"
  multi = tmp_path / "multi"
  # The uninterrupted run is the module's single-process one (checkpoint frequency and
  # peer_timeout_s change no number); its first step is the chain's (a resume drops the rows
  # and timeline entries of the steps after the one it resumes).
  single = references.result()
  assert single[0] == 0, _tails({"single": single})
  uninterrupted = references.workdir("disaggregated")
  shutil.copytree(uninterrupted, multi, ignore=shutil.ignore_patterns(".lock", "finished.json"))
  for step in (2, 3):
    shutil.rmtree(multi / "checkpoints" / str(step))

  # Resumed as 4 x 2, then killed mid-run: process 3 (a rollout process) dies once the
  # checkpoint of step 2, which all four wrote, is complete.
  port = reserve_port()
  procs = [_start([*run, f"--workdir={multi}", *_distributed(k, port, 4)], logs / f"killed{k}.log")
           for k in range(4)]  # fmt: skip
  committed = multi / "checkpoints" / "2" / "commit_success.txt"
  deadline = time.monotonic() + _TIMEOUT_S
  try:
    while not committed.exists() and time.monotonic() < deadline:
      assert all(p.poll() is None for p in procs), "a process ended before step 2"
      time.sleep(0.2)  # polling the file system for the checkpoint; the assertion is the kill
    assert committed.exists(), "no checkpoint of step 2"
    procs[3].kill()
    killed_at = time.monotonic()
    procs[3].wait()
    # The others notice within distributed.peer_timeout_s (10 s) and their once-a-second check.
    codes = [proc.wait(timeout=max(killed_at + 10 + 60 - time.monotonic(), 1))
             for proc in procs[:3]]  # fmt: skip
    waited = time.monotonic() - killed_at
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  # Process 0 names the lost process (its liveness watch), or first the collective or JAX's
  # coordination service that lost it; the others may instead see process 0 end first. One
  # line each.
  clear = (
    "process 3 of 4",
    "another process of the job ended or failed",
    "another process ended or hangs",
  )
  coordinator_gone = "lost the job's coordination service"
  for k, rc in enumerate(codes):
    text = (logs / f"killed{k}.log").read_text()
    if k == 0:  # the single process's checkpoint of step 1, resumed as four processes
      assert "resuming from the checkpoint of step 1" in text, text[-2000:]
    errors = [x for x in text.splitlines() if x.startswith("error:")]
    named = clear if k == 0 else (*clear, coordinator_gone)
    assert rc != 0 and len(errors) == 1 and any(c in errors[0] for c in named), text[-2000:]
  assert waited < 10 + 60

  # Rerun as 2 x 4: resumed, then the numbers of the uninterrupted run (step 0 by one process,
  # step 1 by the four killed processes, step 2 by the rerun's two).
  port = reserve_port()
  rerun = _run_all({f"process{k}": [*run, f"--workdir={multi}", *_distributed(k, port)]
                    for k in (0, 1)}, logs / "rerun")  # fmt: skip
  _assert_exited_cleanly(rerun)
  assert "resuming from the checkpoint of step 2" in rerun["process0"][1]
  _assert_same_numbers(_metrics(uninterrupted), _metrics(multi))
