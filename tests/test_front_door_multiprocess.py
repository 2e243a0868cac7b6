"""Multi-process waits: the processes of a job joined by `jax.distributed` (`launch.run`) give
up in one line when the job never starts, stop with a clear error when another dies or fails,
end at a bound when they wait at different meeting points, and hear a stop request while they
wait."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest
from test_front_door_e2e import ROOT, _env, _python

from rlhfjax import errors

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
      process_id={process_id}, start_timeout_s={start}, peer_timeout_s={peer},
      wait_timeout_s={wait})
  distributed.initialize(section, 2)
  from jax.experimental import multihost_utils
  print("joined", flush=True)
{then}

launch.run(main)
"""
# Collectives until killed.
_JOIN = (
  _PROCESS.replace("{peer}", "5")
  .replace("{wait}", "3600")
  .replace(
    "{then}",
    """  for i in range(10_000):
    multihost_utils.sync_global_devices(f"step {{i}}")
    time.sleep(0.2)""",
  )
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
_FAIL_AFTER_JOINING = (
  _PROCESS.replace("{peer}", "30")
  .replace("{wait}", "3600")
  .replace(
    "{then}",
    """  if {process_id} == {failing}:
    raise ValueError("bad input on process {failing}")
  while True:
    time.sleep(0.05)""",
  )
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
    # The other may hear of the failure (its liveness watch, started as it joins) before its
    # main thread prints.
    assert out.strip() == "joined" or (k != failing and not out), err[-3000:]
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
    lines = err.strip().splitlines()
    assert proc.returncode == 2, err[-3000:]
    assert lines == [
      "error: the job's 2 processes disagree: total_steps is 1 on process 0, 2 on process 1: "
      "every process must start with the same config, code and data"
    ], err[-3000:]
  assert time.monotonic() - start < 60
  assert not (tmp_path / "run").exists()  # nothing written, nothing compiled


# Process 0 waits for the others at `first`, process 1 at `second` (with a stop request active):
# different paths through the program, a deadlock without a bound.
_DIFFERENT_PATHS = (
  _PROCESS.replace("{peer}", "30")
  .replace("wait_timeout_s={wait}", "wait_timeout_s=600")
  .replace(
    "{then}",
    """  import threading
  from rlhfjax import signals

  def say_when_waiting():  # for the test: once the main thread is at its meeting point
    while not signals._waits:
      time.sleep(0.01)
    print("waiting", flush=True)

  # Both at one point first (the job's bound would cover a slow start too). Then process 1
  # waits at its point (bounded by 60 s at least), and once it is there, process 0 at its own
  # with the bound `wait`: process 0's wait expires first, finding process 1 where it waits,
  # however slowly a loaded machine runs either (a bound of 3 s on both once raced).
  distributed.wait_for([0, 1], "the start")
  distributed._wait_timeout_s = {wait} if {process_id} == 0 else max({wait}, 60)
  def point_of_1():
    try:
      return distributed.client().key_value_try_get(distributed._AT + "1")
    except Exception:  # not posted yet
      return None

  while {process_id} == 0 and point_of_1() != "the scoring":
    time.sleep(0.01)  # polls process 1's posted meeting point
  with signals.StopRequest():
    threading.Thread(target=say_when_waiting, daemon=True).start()
    distributed.wait_for([0, 1], ["the update", "the scoring"][{process_id}])""",
  )
)


def test_processes_waiting_at_different_points_stop_at_the_bound_in_one_line(reserve_port):
  port = reserve_port()
  start = time.monotonic()
  procs = [_python(_DIFFERENT_PATHS.format(port=port, process_id=k, start=120, wait=3))
           for k in (0, 1)]  # fmt: skip
  results = [proc.communicate(timeout=120) for proc in procs]
  assert [proc.returncode for proc in procs] == [2, 2], [err[-3000:] for _, err in results]
  # Process 0's bound expired, with process 1 waiting elsewhere; process 1 heard of it through
  # the job (its liveness watch), long before its own bound.
  assert results[0][1].strip().splitlines() == [
    "error: process 0 of 2 gave up after 3 s (distributed.wait_timeout_s) waiting for the "
    "others at 'the update': process 1 waits at 'the scoring': the processes took different "
    "paths through the program, or one is far slower"
  ], results[0][1][-3000:]
  lines = results[1][1].strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
    "error: process 0 of 2 failed, so process 1 stops too: "
  ), results[1][1][-3000:]
  assert time.monotonic() - start < 60


def test_a_stop_request_reaches_a_process_blocked_in_a_wait(reserve_port):
  """Process 1, blocked in a wait for process 0 (a native call, where Python's signal handler
  never runs), says at once that it will stop once the wait ends; a second request ends it at
  once, and process 0 hears of it through the job (not at its liveness time-out, 30 s)."""
  port = reserve_port()
  procs = [_python(_DIFFERENT_PATHS.format(port=port, process_id=k, start=120, wait=3600))
           for k in (0, 1)]  # fmt: skip
  for proc in procs:
    assert proc.stdout.readline().strip() == "joined", proc.stderr.read()[-3000:]
  assert procs[1].stdout.readline().strip() == "waiting", procs[1].stderr.read()[-3000:]
  procs[1].send_signal(signal.SIGTERM)
  # Bounded: without the watch thread nothing would come. The message is one write, starting
  # with a newline (it ends a progress bar's unfinished line).
  assert select.select([procs[1].stderr], [], [], 30)[0], "no word of the stop within 30 s"
  assert procs[1].stderr.readline() == "\n"
  assert procs[1].stderr.readline().strip() == (
    "SIGTERM: stopping the run after this iteration with a checkpoint, once this process's "
    "wait for process 0 at 'the scoring' ends (Ctrl-C again to stop at once)"
  )
  procs[1].send_signal(signal.SIGTERM)
  start = time.monotonic()
  results = [proc.communicate(timeout=60) for proc in procs]
  assert time.monotonic() - start < 20
  assert procs[1].returncode == errors.INTERRUPTED, results[1][1][-3000:]
  assert (
    results[1][1].strip().splitlines()[-1].startswith("error: interrupted again: stopped at once")
  )
  assert procs[0].returncode == 2, results[0][1][-3000:]
  assert results[0][1].strip().splitlines() == [
    "error: process 1 of 2 failed, so process 0 stops too: process 1 was stopped at once by a "
    "second stop request"
  ], results[0][1][-3000:]


def test_a_process_ends_once_when_two_threads_end_it_together():
  """The liveness thread hears of a failed peer and leaves through JAX's shutdown while the
  main thread's collective fails because of it: the main thread says nothing more and calls no
  second shutdown (the second found the service gone and aborted the process), and the
  process ends with the liveness thread's line and status."""
  proc = _python(
    """
    import threading, time
    from rlhfjax import liveness

    leaving = threading.Event()

    def leave():  # JAX's shutdown barrier, while the main thread's collective fails
      leaving.set()
      time.sleep(0.5)

    liveness._leave = leave
    threading.Thread(target=liveness._die, args=("the peer failed", True)).start()
    leaving.wait()
    liveness.fail("the collective failed", 1)
    """
  )
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 2, err[-3000:]
  assert err.splitlines() == ["error: the peer failed"], err[-3000:]
