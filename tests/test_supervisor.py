"""The supervisor of each process of a multi-process job: JAX's abort when process 0 is lost
ends as one line, signals reach the work once, exit statuses pass through."""

from __future__ import annotations

import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rlhfjax import supervisor

_ROOT = pathlib.Path(__file__).resolve().parent.parent

# What JAX 0.10's coordination client writes when the service is gone, then Python's fault
# handler (addresses, thread ids and paths shortened).
_ABORT = (
  b"E1126 13:57:58.785435   23471 coordination_service_agent.cc:289] Polled an error from "
  b"coordination service (this can be an error from this or another task).\n"
  b"F1126 13:57:58.785532   23471 client.h:80] Terminating process because the JAX distributed "
  b"service detected fatal errors. This most likely indicates that another task died; see the "
  b"other task logs for more details. absl::Status: UNAVAILABLE: Failed to send RPC to "
  b"coordination service. Either the leader task was preempted/died/restarted unexpectedly or "
  b"this task is experiencing network issues.\n"
  b"Additional GRPC error information from remote target coordination_service while calling "
  b"/xla.coordination.CoordinationService/PollForError:\n"
  b':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}\n'
  b"*** Check failure stack trace: ***\n"
  b"    @     0x7ff8ff240634  absl::log_internal::LogMessage::SendToLog()\n"
  b"    @     0x7ff8fb3040ee  xla::CoordinationServiceAgent::SetError()\n"
  b"Fatal Python error: Aborted\n\n"
  b"Thread 0x00007ff907027b80 (most recent call first):\n"
  b'  File "rlhfjax/liveness.py", line 155 in report_failure\n'
  b"Extension modules: jaxlib.cpu_feature_guard, numpy._core._multiarray_umath (total: 2)"
)
_LINE = (
  "error: process 1 of 2 lost the job's coordination service at host:1234 (process 0 ended or "
  "is unreachable; see its log): JAX stopped it: UNAVAILABLE: Failed to send RPC to "
  "coordination service\n"
)


def _guarded(chunks: list[bytes]) -> tuple[bytes, str | None]:
  guard = supervisor.AbortGuard("process 1 of 2", "host:1234")
  passed = b"".join(guard.feed(chunk) for chunk in chunks)
  return passed, guard.finish()


def test_the_abort_is_replaced_by_one_line_and_what_came_before_passes():
  before = b"ppo:  40%|####      | 2/5 [00:03<00:04]\rppo:  60%|######    | 3/5 [00:04<00:02]"
  # The child's own line for the same loss (a collective that lost its peer) comes first.
  own = b"\nerror: another process of the job ended or failed (see its log): Gloo failed\n"
  for cut in (1, 37, 300, len(_ABORT) - 5):  # however the pipe splits it
    passed, line = _guarded([before, own, _ABORT[:cut], _ABORT[cut:]])
    assert passed == before + b"\n" and line == _LINE


def test_a_progress_bar_on_the_same_line_is_kept():
  bar = b"\rppo:  60%|######    | 3/5 [00:04<00:02]"
  passed, line = _guarded([bar + _ABORT])
  assert passed == bar and line == _LINE


def test_a_failure_the_service_reports_is_named_as_such():
  other = _ABORT.replace(
    b"UNAVAILABLE: Failed to send RPC to coordination service",
    b"INTERNAL: Task /job:jax_worker/replica:0/task:2 heartbeat timeout",
  )
  _, line = _guarded([other])
  assert line == (
    "error: process 1 of 2 was stopped by JAX: the job's coordination service at host:1234 "
    "reported a failure (another process ended or hangs; see its log): INTERNAL: Task "
    "/job:jax_worker/replica:0/task:2 heartbeat timeout\n"
  )


def test_output_without_the_abort_passes_unchanged(capfd):
  text = [b"W1126 12:00:00.000000 1 gloo.cc:1] a warning\n", b"step 1\n", b"\rbar 10%", b"\n"]
  passed, line = _guarded(text)
  assert passed == b"".join(text) and line is None
  # An error line is held to the end (the child's last words), then passed on as it was.
  error = b"error: bad input\nerror: more\n"
  passed, line = _guarded([b"step 1\n", error])
  assert (passed, line) == (b"step 1\n", None)
  assert capfd.readouterr().err == error.decode()


def test_a_polled_error_without_the_abort_is_passed_on_after_a_few_reads():
  polled = _ABORT.split(b"\n")[0] + b"\n"
  guard = supervisor.AbortGuard("process 1 of 2", "host:1234")
  assert guard.feed(b"a\n" + polled) == b"a\n"
  later = [guard.feed(b"%d\n" % i) for i in range(supervisor._PATIENCE + 1)]  # noqa: SLF001
  assert b"".join(later) == polled + b"".join(b"%d\n" % i for i in range(len(later)))
  assert guard.feed(b"next\n") == b"next\n" and guard.finish() is None


def test_stop_signals_are_the_forwarded_ones_under_a_supervisor(monkeypatch):
  monkeypatch.delenv(supervisor.ENV, raising=False)
  assert supervisor.stop_signals() == {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
  monkeypatch.setenv(supervisor.ENV, "1")
  assert supervisor.received_as(signal.SIGINT) == signal.SIGRTMIN + 1
  assert supervisor.stop_signals() == {
    signal.SIGRTMIN + 1: "Ctrl-C",
    signal.SIGRTMIN + 2: "SIGTERM",
  }


# ---------------------------------------------------------------------------------------------
# A supervised program without JAX: exit statuses, signals, the child's death with its parent.

_PROGRAM = """
import os, signal, sys, time
from rlhfjax import signals, supervisor
if not supervisor.in_child():
  supervisor.supervise("process 0 of 1", "nowhere")
supervisor.adopt()
print("child", os.getpid(), flush=True)
{body}
"""


def _supervised(body: str) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items() if k != supervisor.ENV}
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
  code = _PROGRAM.format(body=textwrap.dedent(body))
  return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _child(proc: subprocess.Popen) -> int:
  line = proc.stdout.readline()
  assert line.startswith("child "), (line, proc.stderr.read())
  return int(line.split()[1])


def _gone(pid: int) -> bool:
  """Whether `pid` has ended (a zombie nobody reaped yet counts as ended)."""
  try:
    status = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except FileNotFoundError:
    return True
  return status.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait_ended(pidfd: int, timeout_s: float = 30) -> None:
  """Waits until the process of `pidfd` (opened while it ran: no other process can take its
  pid) has ended, for one that is not this process's child; at most `timeout_s`."""
  select.select([pidfd], [], [], timeout_s)
  os.close(pidfd)


@pytest.mark.parametrize(
  ("body", "status", "err"),
  [
    ("sys.exit(3)", 3, ""),
    ("print('error: bad input', file=sys.stderr); sys.exit(2)", 2, "error: bad input\n"),
    ("os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
    # Any other abort passes through as it was, the error line before it included.
    (
      "print('error: x', file=sys.stderr, flush=True); print('F0 1 a.cc:1] Check failed', "
      "file=sys.stderr, flush=True); os.abort()",
      -signal.SIGABRT,
      "error: x\nF0 1 a.cc:1] Check failed\n",
    ),
  ],
)
def test_the_supervisor_exits_as_its_child(body, status, err):
  proc = _supervised(body)
  child = _child(proc)
  out, got = proc.communicate(timeout=60)
  assert proc.returncode == status and got == err, got
  assert child != proc.pid and _gone(child)


_STOPPING = """
with signals.StopRequest() as stop:
  print("ready", flush=True)
  while not stop.is_set():
    time.sleep(0.01)  # the loop's iteration; the stop is the flag, not the time
  print("stopped by", stop.signal_name, flush=True)
  sys.stdin.readline()  # a save, until the test says; a second stop request ends it at once
"""
_STOPPING_LINE = (
  "{}: stopping the run after this iteration with a checkpoint (Ctrl-C again to stop at once)"
)
_SIGNALS = [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")]


def _lines(err: str) -> list[str]:
  return [x for x in err.splitlines() if x.strip()]


@pytest.mark.parametrize(("signum", "name"), _SIGNALS)
def test_a_signal_sent_to_both_reaches_the_child_once(signum, name):
  proc = _supervised(_STOPPING)
  child = _child(proc)
  assert proc.stdout.readline() == "ready\n"
  # Sent to both, as a terminal's Ctrl-C or a scheduler's signal to every process of a job.
  os.kill(proc.pid, signum)
  os.kill(child, signum)
  assert proc.stdout.readline() == f"stopped by {name}\n"
  out, err = proc.communicate("saved\n", timeout=60)
  # Counted twice, the second would have stopped it at once, with status 130.
  assert proc.returncode == 0 and _lines(err) == [_STOPPING_LINE.format(name)], err


@pytest.mark.parametrize(("signum", "name"), _SIGNALS)
def test_a_second_signal_to_the_supervisor_stops_the_child_at_once(signum, name):
  proc = _supervised(_STOPPING)
  _child(proc)
  assert proc.stdout.readline() == "ready\n"
  os.kill(proc.pid, signum)
  assert proc.stdout.readline() == f"stopped by {name}\n"
  os.kill(proc.pid, signum)
  proc.wait(timeout=60)  # stdin stays open: the save would go on without the signal
  err = proc.stderr.read()
  assert proc.returncode == 130, err
  assert _lines(err) == [
    _STOPPING_LINE.format(name),
    "error: interrupted again: stopped at once; rerun the same command to resume from the "
    "last complete checkpoint",
  ]


def test_a_signal_before_the_child_handles_it_ends_both_as_the_signal():
  proc = _supervised("while True: time.sleep(0.01)")
  _child(proc)
  proc.terminate()  # no stop request active: SIGTERM's default, to end the process
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGTERM


def test_killing_the_supervisor_kills_its_child():
  proc = _supervised("while True: time.sleep(0.01)")
  child = _child(proc)
  ended = os.pidfd_open(child)
  proc.kill()
  proc.wait()
  _wait_ended(ended)  # the kernel's SIGKILL to the orphan
  assert _gone(child)


# ---------------------------------------------------------------------------------------------
# A job of two processes through the entry points' start (`launch.start`).

_JOB = """
import os, sys, time
import ml_collections
import numpy as np
from rlhfjax import launch, signals

def main(argv):
  cfg = ml_collections.ConfigDict({{"distributed": dict(
      enabled=True, coordinator_address="localhost:{port}", num_processes=2,
      process_id={process_id}, start_timeout_s=120, peer_timeout_s=30, supervise={supervise}),
      "placement": {{"num_devices": 2}}}})
  launch.start(argv, cfg, 8)
  from jax.experimental import multihost_utils
  with signals.StopRequest() as stop:
    print("joined", os.getpid(), flush=True)
    while True:
      # Every process stops at the same iteration: any one's request is everyone's.
      if multihost_utils.process_allgather(np.int32(stop.is_set())).any():
        print("stopped by", stop.signal_name or "a peer", flush=True)
        return
      time.sleep(0.05)

launch.run(main)
"""


def _job(port: int, supervise: bool = True) -> list[subprocess.Popen]:
  env = {k: v for k, v in os.environ.items() if k != supervisor.ENV}
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                            env.get("XLA_FLAGS", "")).strip()  # fmt: skip
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
  env["JAX_PLATFORMS"] = "cpu"
  programs = [_JOB.format(port=port, process_id=k, supervise=supervise) for k in (0, 1)]
  return [
    subprocess.Popen([sys.executable, "-c", program], env=env, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    for program in programs
  ]  # fmt: skip


def _joined(proc: subprocess.Popen) -> int:
  """The pid of the process doing the work (the supervisor's child)."""
  line = proc.stdout.readline()
  assert line.startswith("joined "), (line, proc.stderr.read()[-3000:])
  return int(line.split()[1])


def _stop(procs: list[subprocess.Popen]) -> None:
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


@pytest.mark.parametrize("target", ["supervisor", "child"])
def test_killing_process_0_stops_process_1_with_one_line(reserve_port, target):
  port = reserve_port()
  procs = _job(port)
  try:
    workers = [_joined(proc) for proc in procs]
    assert workers[0] != procs[0].pid and workers[1] != procs[1].pid
    ended = os.pidfd_open(workers[0])  # once killed with its supervisor, nobody reaps it
    os.kill(procs[0].pid if target == "supervisor" else workers[0], signal.SIGKILL)
    killed_at = time.monotonic()
    out, err = procs[1].communicate(timeout=120)
    waited = time.monotonic() - killed_at
    procs[0].wait(timeout=60)
  finally:
    _stop(procs)
  assert procs[1].returncode == 2, err[-3000:]
  assert err.splitlines() == [
    f"error: process 1 of 2 lost the job's coordination service at localhost:{port} (process 0 "
    "ended or is unreachable; see its log): JAX stopped it: UNAVAILABLE: Failed to send RPC to "
    "coordination service"
  ], err[-3000:]
  assert waited < 30  # the abort is at once; the liveness watch's peer time-out is 30 s
  assert procs[0].returncode == -signal.SIGKILL  # the child's death is its supervisor's
  _wait_ended(ended)
  assert _gone(workers[0]) and _gone(workers[1])


@pytest.mark.parametrize("supervise", [True, False])
def test_a_job_stops_once_when_a_scheduler_signals_every_process(reserve_port, supervise):
  procs = _job(reserve_port(), supervise)
  try:
    workers = [_joined(proc) for proc in procs]
    # distributed.supervise=False: the process started does the work.
    assert (workers == [proc.pid for proc in procs]) != supervise
    for pid in dict.fromkeys((procs[0].pid, workers[0], procs[1].pid, workers[1])):
      os.kill(pid, signal.SIGTERM)  # each process once
    results = [proc.communicate(timeout=120) for proc in procs]
  finally:
    _stop(procs)
  for proc, (out, err) in zip(procs, results, strict=True):
    assert proc.returncode == 0, err[-3000:]
    assert out.splitlines()[-1] == "stopped by SIGTERM", out
    assert [x for x in err.splitlines() if x.strip() and "Gloo" not in x] == [
      "SIGTERM: stopping the run after this iteration with a checkpoint (Ctrl-C again to stop "
      "at once)"
    ], err[-3000:]
