"""A small parent process for each process of a multi-process job, so that JAX's abort ends as
one line.

When the job's coordination service goes away (process 0, which runs it, was killed or
crashed), JAX's coordination client in every other process logs a C++ fatal error and aborts
the process at once (`abort()`, a stack trace of every thread) before any Python code of ours
can run, and it offers no way to change that (its callback cannot be given from Python). So
`supervise` turns the process that the user started into a supervisor of a child that runs the
same command and does the work:

- the child's stdout and stderr pass through the supervisor unchanged, except for JAX's abort
  on stderr: from its first line (`coordination_service_agent.cc ... Polled an error`, or
  `client.h ... Terminating process because the JAX distributed service detected fatal
  errors`) the rest is held, and replaced by one `error:` line naming what was lost, with exit
  status 2; and gloo's `[Gloo] Rank i is connected to n peer ranks ...` on stdout, a line for
  each group of devices it connects (a dozen or more per process, expected, written by C++
  threads at once, so sometimes interleaved), which `GlooFilter` drops;
- the child's exit status is the supervisor's (a death by a signal is re-raised);
- SIGINT and SIGTERM sent to the supervisor reach the child once, as the real-time signals of
  `FORWARDED`. The child ignores SIGINT and SIGTERM sent to it directly (`adopt`): a terminal's
  Ctrl-C or a scheduler that signals every process of a job (Slurm's cgroup tracking) reaches
  both, and the child's first stop must not be counted twice ("Ctrl-C again stops at once");
- the child dies with the supervisor (`PR_SET_PDEATHSIG`): killing the process you started
  kills the work.

Standard library only: the supervisor never starts JAX's backends.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import re
import resource
import select
import signal
import subprocess
import sys
from typing import NoReturn

ENV = "RLHFJAX_SUPERVISOR"
"""Set in the child's environment to the supervisor's process id."""

FORWARDED = (
  {signal.SIGRTMIN + 1: signal.SIGINT, signal.SIGRTMIN + 2: signal.SIGTERM}
  if sys.platform == "linux"
  else {}
)
"""The signal a supervised child receives for each one its supervisor received (Linux's
real-time signals; elsewhere there is no supervisor)."""
_FORWARD = {original: rt for rt, original in FORWARDED.items()}
_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

_HOLD = re.compile(
  rb"(?P<error>(?:^|(?<=[\r\n]))error: )"
  rb"|[EF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ (?:coordination_service_agent\.cc:\d+\] Polled an error"
  rb"|client\.h:\d+\] Terminating process because the JAX distributed service)"
)
_FATAL = re.compile(
  rb"Terminating process because the JAX distributed service detected fatal errors.*?"
  rb"absl::Status: (?P<code>[A-Z_]+): (?P<what>[^.\n]*)"
)
_PATIENCE = 4
"""Reads of the child's stderr after a held `Polled an error` line without the fatal line that
always follows it (the same C++ thread writes both): past that, the held text is passed on."""


_adopted = False  # by `adopt`, which takes ENV out of the environment of what this one starts


def available() -> bool:
  """Whether processes can be supervised here (Linux)."""
  return bool(FORWARDED)


def in_child() -> bool:
  """Whether this process runs under a supervisor."""
  return _adopted or bool(os.environ.get(ENV))


def received_as(signum: int) -> int:
  """The signal this process receives when `signum` is sent to the process the user started:
  itself, or its supervisor, which forwards SIGINT and SIGTERM as `FORWARDED`."""
  return _FORWARD.get(signum, signum) if in_child() else signum


def stop_signals() -> dict[int, str]:
  """The signals that ask this process to stop (`received_as` SIGINT and SIGTERM), named as
  the user sent them."""
  return {received_as(signum): name for signum, name in _NAMES.items()}


def adopt() -> None:
  """The child's side, first thing in its entry point: dies with its supervisor, ignores
  SIGINT and SIGTERM sent to it directly (they reach it through the supervisor, once), then
  accepts the forwarded ones, which the supervisor held blocked from its start."""
  global _adopted
  supervisor = int(os.environ.pop(ENV))
  _adopted = True
  libc = ctypes.CDLL(None, use_errno=True)
  libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  if os.getppid() != supervisor:  # it died before the line above
    os._exit(128 + signal.SIGKILL)
  for signum in _NAMES:
    signal.signal(signum, _ignore)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)


def _ignore(signum, frame) -> None:  # a Python handler, unlike SIG_IGN, is not inherited by exec
  del signum, frame


def supervise(who: str, where: str) -> NoReturn:
  """Runs this process's command again as a supervised child and exits as it does (see the
  module docstring). `who` ("process 1 of 2") and `where` (the coordinator's address) name
  them in the line that replaces JAX's abort."""
  command = [sys.executable, *sys.orig_argv[1:]]
  child: subprocess.Popen | None = None
  early: list[int] = []  # received before the child existed

  def forward(signum, frame):
    del frame
    if child is None:
      early.append(signum)
      return
    with contextlib.suppress(ProcessLookupError):
      os.kill(child.pid, _FORWARD[signum])

  for signum in _FORWARD:
    signal.signal(signum, forward)
  # Blocked until the child's `adopt`: one forwarded before then waits instead of killing it.
  signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
  # Its stdout through a pipe too (gloo writes there): unbuffered, so a line reaches the user
  # when it is printed, as on a terminal.
  env = {"PYTHONUNBUFFERED": "1", **os.environ, ENV: str(os.getpid())}
  child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  for signum in early:
    forward(signum, None)
  guard = AbortGuard(who, where)
  _relay(child, guard)
  returncode = child.wait()
  line = guard.finish()
  if line is not None:
    os.write(2, line.encode())
    os._exit(2 if returncode == -signal.SIGABRT else returncode or 2)
  _exit_as(returncode)


_GLOO_MARKS = (
  b"[Gloo] Rank",
  b"is connected to",
  b"peer ranks.",
  b"Expected number of connected peer ranks is :",
)
"""The words of gloo's line `[Gloo] Rank i is connected to n peer ranks. Expected number of
connected peer ranks is : n`, which C++ threads writing at once interleave word by word."""
_GLOO = re.compile(
  rb" ?(?:" + b"|".join(map(re.escape, _GLOO_MARKS[:-1])) + rb") ?\d*"
  rb"| ?" + re.escape(_GLOO_MARKS[-1]) + rb" ?\d*\n?"  # its newline goes with its last words
)


class GlooFilter:
  """The child's output without gloo's connection lines (see the module docstring). `feed`
  takes what the child wrote and returns what to pass on: at once, except from gloo's first
  word in the last, unfinished line of `data` (or what may be its start) to the end of that
  line; `finish` returns what is held."""

  def __init__(self):
    self._held = b""
    self._after_gloo = False  # the last line passed on was gloo's

  def feed(self, data: bytes) -> bytes:
    data, self._held = self._held + data, b""
    end = data.rfind(b"\n") + 1
    lines, rest = data[:end], data[end:]
    lines = self._drop(lines)
    start = min(_mark_at(rest, mark) for mark in _GLOO_MARKS)
    if self._after_gloo and not rest[:start].strip(b" 0123456789"):
      start = 0  # perhaps another thread's number after gloo's line
    rest, self._held = rest[:start], rest[start:]
    return lines + rest

  def finish(self) -> bytes:
    held, self._held = self._held, b""
    return self._drop(held)

  def _drop(self, lines: bytes) -> bytes:
    """`lines` without gloo's words: a line left with nothing but digits and spaces goes, and
    so does one of digits alone right after such a line (another thread's number, after the
    first's newline)."""
    if not any(mark in lines for mark in _GLOO_MARKS) and not self._after_gloo:
      return lines
    kept = []
    for line in lines.splitlines(keepends=True):
      # A line that gloo's newline ends holds its last words: a line without them is another
      # writer's, but for digits alone just after gloo's.
      strong = _GLOO_MARKS[0] in line or _GLOO_MARKS[-1] in line
      cleaned = _GLOO.sub(b"", line) if strong else line
      gloo_only = not cleaned.strip(b" 0123456789\n")
      if (strong and gloo_only) or (self._after_gloo and gloo_only and line.strip()):
        self._after_gloo = True
        continue
      self._after_gloo = False
      kept.append(cleaned)
    return b"".join(kept)


def _mark_at(text: bytes, mark: bytes) -> int:
  """Where `mark` starts in `text`, or the start of a part of it `text` ends with (the rest may
  follow), else len(text)."""
  at = text.find(mark)
  if at >= 0:
    return at
  return next((i for i in range(max(len(text) - len(mark) + 1, 0), len(text))
               if mark.startswith(text[i:])), len(text))  # fmt: skip


def _relay(child: subprocess.Popen, guard: AbortGuard) -> None:
  """Passes the child's stdout and stderr on to this process's (both without gloo's lines,
  `GlooFilter`; stderr through `guard`) until the child has exited and its pipes hold nothing
  more."""
  streams = {
    child.stdout.fileno(): (1, GlooFilter(), lambda data: data),
    child.stderr.fileno(): (2, GlooFilter(), guard.feed),
  }

  def read(fd: int) -> bool:
    data = os.read(fd, 1 << 16)
    if not data:
      pipes.discard(fd)
      return False
    out, gloo, then = streams[fd]
    _write(then(gloo.feed(data)), out)
    return True

  pipes = set(streams)
  try:
    ended = os.pidfd_open(child.pid)
  except OSError:  # an old kernel: until the pipes close (every writer gone)
    ended = None
  while pipes:
    ready, _, _ = select.select([*pipes, *([] if ended is None else [ended])], [], [])
    for fd in pipes & set(ready):
      read(fd)
    if ended in ready:  # exited: what it wrote is in the pipes; its own children may hold them
      for fd in list(pipes):
        os.set_blocking(fd, False)
        with contextlib.suppress(BlockingIOError):
          while read(fd):
            pass
      break
  for out, gloo, then in streams.values():
    _write(then(gloo.finish()), out)
  if ended is not None:
    os.close(ended)


def _write(data: bytes, fd: int = 2) -> None:
  with contextlib.suppress(OSError):  # our own output closed: the child still runs to its end
    while data:
      data = data[os.write(fd, data) :]


def _exit_as(returncode: int) -> NoReturn:
  """Exits with `returncode`, or by the same signal (the one forwarded stands for the one the
  user sent), without Python's fault handler printing this process's stack."""
  if returncode >= 0:
    os._exit(returncode)
  signum = FORWARDED.get(-returncode, -returncode)
  faulthandler.disable()
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the child's crash, not a core of this one
  with contextlib.suppress(OSError, ValueError):
    signal.signal(signum, signal.SIG_DFL)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
  os.kill(os.getpid(), signum)
  os._exit(128 + signum)  # a signal whose default is not to end the process


class AbortGuard:
  """The child's stderr, with JAX's abort on a lost coordination service replaced by one line.
  `feed` takes what the child wrote and returns what to pass on; `finish`, at the child's end,
  returns the line, or None after passing on what it held.

  Held from the first line of the abort (see the module docstring) or from the child's first
  `error:` line (its last words: every path that prints one exits next; one raced with the
  abort says the same, that a peer is gone) to the end. A held `Polled an error` line without
  the fatal one after `_PATIENCE` more reads is passed on."""

  def __init__(self, who: str, where: str):
    self._who, self._where = who, where
    self._held: bytes | None = None
    self._reads: int | None = None  # reads since a held `Polled an error`; None: to the end

  def feed(self, data: bytes) -> bytes:
    if self._held is None:
      match = _HOLD.search(data)
      if match is None:
        return data
      self._held = data[match.start() :]
      self._reads = None if match["error"] else 0
      return data[: match.start()]
    self._held += data
    if self._reads is not None:
      self._reads += 1
      if self._reads > _PATIENCE and _FATAL.search(self._held) is None:
        held, self._held = self._held, None
        return held
    return b""

  def finish(self) -> str | None:
    held, self._held = self._held, None
    if held is None:
      return None
    fatal = _FATAL.search(held)
    if fatal is None:
      _write(held)
      return None
    code, what = fatal["code"].decode(), fatal["what"].decode(errors="replace").strip()
    status = f"{code}: {what}" if what else code
    if code == "UNAVAILABLE":
      return (
        f"error: {self._who} lost the job's coordination service at {self._where} (process 0 "
        f"ended or is unreachable; see its log): JAX stopped it: {status}\n"
      )
    return (
      f"error: {self._who} was stopped by JAX: the job's coordination service at "
      f"{self._where} reported a failure (another process ended or hangs; see its log): "
      f"{status}\n"
    )
