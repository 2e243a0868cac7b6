"""A supervised program without JAX, in processes of its own: the supervisor exits as its child,
signals reach the child once, a second one stops it at once, and killing the supervisor kills
its child. (The abort guard in this process: tests/test_supervisor.py.)"""

from __future__ import annotations

import os
import pathlib
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from rlhfjax import supervisor

pytestmark = pytest.mark.e2e

_ROOT = pathlib.Path(__file__).resolve().parent.parent

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
