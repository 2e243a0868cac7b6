"""Multi-process waits: the processes of a job joined by `jax.distributed` (`launch.run`) give
up in one line when the job never starts, and stop with a clear error when another dies or fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from test_front_door_e2e import ROOT, _env, _python

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]


# A job's processes as the entry points run them (`launch.run`): joined, then `then`.
_PROCESS = """
import time
from rlhfjax import distributed, launch
from rlhfjax.config import DistributedSection

def main(argv):
  launch.quiet_logging()
  section = DistributedSection(
      enabled=True, coordinator_address="localhost:{port}", num_processes=2,
      process_id={process_id}, start_timeout_s={start}, peer_timeout_s={peer})
  distributed.initialize(section, 2)
  from jax.experimental import multihost_utils
  print("joined", flush=True)
{then}

launch.run(main)
"""
# Collectives until killed.
_JOIN = _PROCESS.replace("{peer}", "5").replace(
  "{then}",
  """  for i in range(10_000):
    multihost_utils.sync_global_devices(f"step {{i}}")
    time.sleep(0.2)""",
)


def test_a_process_whose_job_never_starts_gives_up_in_one_line(reserve_port):
  """Alone, process 1 waits for the job to start; process 0, for the process that is missing
  (each on its own port, at once)."""
  ports = {k: reserve_port() for k in (0, 1)}
  start = time.monotonic()
  procs = {k: _python(_JOIN.format(port=ports[k], process_id=k, start=3)) for k in (0, 1)}
  rule = "every process must start with the same num_processes and a distinct process_id"
  want = {
    0: "error: process 0 of 2 gave up after 3 s (distributed.start_timeout_s) waiting for "
    f"process 1 to join the job at its coordinator localhost:{ports[0]} ({rule})",
    1: "error: process 1 of 2 gave up after 3 s (distributed.start_timeout_s) waiting for the "
    f"job to start at the coordinator localhost:{ports[1]} (process 0 runs it; {rule})",
  }
  for k, proc in procs.items():
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]
    assert err.strip().splitlines() == [want[k]], err[-3000:]
  assert time.monotonic() - start < 60


def test_when_a_process_dies_the_others_stop_with_a_clear_error(reserve_port):
  port = reserve_port()
  procs = [_python(_JOIN.format(port=port, process_id=k, start=120)) for k in (0, 1)]
  for proc in procs:
    assert proc.stdout.readline().strip() == "joined", proc.stderr.read()[-3000:]
  procs[1].kill()
  start = time.monotonic()
  out, err = procs[0].communicate(timeout=120)
  procs[1].wait()
  assert procs[0].returncode == 2, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: ") and (
    "process 1 of 2 gave no sign of life" in last or "another process of the job" in last
  ), err[-3000:]
  assert time.monotonic() - start < 60


# One process fails at start-up while the other is still busy in Python (importing, planning).
_FAIL_AFTER_JOINING = _PROCESS.replace("{peer}", "30").replace(
  "{then}",
  """  if {process_id} == {failing}:
    raise ValueError("bad input on process {failing}")
  while True:
    time.sleep(0.05)""",
)


@pytest.mark.parametrize("failing", [0, 1])
def test_when_a_process_fails_the_others_stop_with_its_error(reserve_port, failing):
  # Process 0 runs the coordination service: were it to exit while process 1 is connected, JAX
  # would abort process 1 with a C++ fatal error and a stack trace; both leave through JAX's
  # shutdown barrier.
  # (The peer timeout, 30 s, is not what stops them: the test's bound is 20 s.)
  port = reserve_port()
  procs = [
    _python(_FAIL_AFTER_JOINING.format(port=port, process_id=k, start=120, failing=failing))
    for k in (0, 1)
  ]
  start = time.monotonic()
  results = [proc.communicate(timeout=120) for proc in procs]
  assert time.monotonic() - start < 20
  for k, (proc, (out, err)) in enumerate(zip(procs, results, strict=True)):
    assert proc.returncode == 2, err[-3000:]
    assert out.strip() == "joined", err[-3000:]
    lines = err.strip().splitlines()
    want = f"error: bad input on process {failing}"
    if k != failing:
      want = (
        f"error: process {failing} of 2 failed, so process {k} stops too: "
        f"bad input on process {failing}"
      )
    assert lines == [want], err[-3000:]


def test_processes_started_with_different_flags_stop_at_the_join_in_one_line(
  reserve_port, tmp_path
):
  """One process told to run 1 step, the other 2 (which once hung both for 16 minutes): each
  ends within the bound at the join, before anything compiles, naming the field and who has
  which value."""
  port = reserve_port()
  start = time.monotonic()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        os.path.join(ROOT, "scripts", "train.py"),
        f"--config={os.path.join(ROOT, 'configs', 'grpo_tiny.py')}",
        f"--workdir={tmp_path / 'run'}",
        f"--config.total_steps={k + 1}",
        "--config.distributed.enabled=True",
        f"--config.distributed.coordinator_address=localhost:{port}",
        "--config.distributed.num_processes=2",
        f"--config.distributed.process_id={k}",
        "--config.distributed.start_timeout_s=60",
      ],
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for k in (0, 1)
  ]
  for proc in procs:
    out, err = proc.communicate(timeout=120)
    lines = [x for x in err.strip().splitlines() if "[Gloo]" not in x]
    assert proc.returncode == 2, err[-3000:]
    assert lines == [
      "error: the job's 2 processes disagree: total_steps is 1 on process 0, 2 on process 1: "
      "every process must start with the same config, code and data"
    ], err[-3000:]
  assert time.monotonic() - start < 60
  assert not (tmp_path / "run").exists()  # nothing written, nothing compiled
