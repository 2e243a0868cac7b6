"""Bounded waits for the other processes of a multi-process job.

JAX's coordination service stops a process whose peers do not arrive, or stop answering, by
aborting it with a C++ fatal error and a stack trace, after minutes (and at once when process
0, which runs the service, ends: `rlhfjax.supervisor` turns that abort into one line). Here:

- `start_deadline` bounds `jax.distributed.initialize`: past it, one `error:` line says what
  was waited for (the coordinator address, this process's id and the process count), exit 2;
- `watch_peers` runs a daemon thread in which every process posts a counter to the job's
  key-value store each second and reads the others'. A process whose counter stands still for
  `timeout_s`, or a coordination service that stops answering (process 0 ended), ends this
  process with one `error:` line naming it, instead of a wait in a collective that never ends.
  A process that finishes normally marks itself done (at exit) so the others do not mistake
  the end of its work for a failure;
- `report_failure` posts a failing process's error line for the others, whose liveness threads
  stop them with it in one line. All of them then leave through JAX's own shutdown (a barrier
  of every process, then each disconnects from the coordination service): were a process
  still connected when process 0, which runs the service, exits, JAX would abort it with a
  C++ fatal error and a stack trace (for example when every process fails on the same bad
  config, process 0 first). Unless the failure is a lost peer: that one never reaches the
  barrier, so none of them waits there (JAX's abort of a process still connected when process
  0 ends is turned into one line by `rlhfjax.supervisor`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from rlhfjax import errors, signals

_KEY = "rlhfjax/alive/"
_DONE = "done"
_FAILED = "failed: "  # the failed process leaves through JAX's shutdown barrier
_LOST = "lost a peer: "  # it does not: a process it needs is gone, so the barrier never passes
_PERIOD_S = 1.0


@dataclasses.dataclass(frozen=True)
class _Watch:
  client: Any
  me: int
  stop: threading.Event
  posting: threading.Lock  # held while the liveness thread posts: `report_failure` waits it out


_watch: _Watch | None = None  # this process's, once `watch_peers` started it
_ending = threading.Lock()  # held by the one thread that ends the process (`_claim_the_end`)


def _claim_the_end() -> None:
  """Returns in the first thread to end the process; blocks any later one until that one's
  `os._exit`. Two threads ending it at once (the liveness thread hears of a failed peer while
  the main thread's collective fails because of it) would print two lines and call JAX's
  shutdown twice, and the second, finding the coordination service gone, aborts the process."""
  if not _ending.acquire(blocking=False):
    threading.Event().wait()


def _die(message: str, leave: bool = False) -> None:
  """Ends the process from any thread: the main one may be blocked in a collective. `leave`:
  through JAX's shutdown first (`_leave`)."""
  _claim_the_end()
  os.write(2, errors.error_line(message).encode())
  if leave:
    _leave()
  os._exit(errors.USER_ERROR)


@contextlib.contextmanager
def start_deadline(timeout_s: float, who: str, waiting_for: str) -> Iterator[None]:
  """Ends the process with one line ("`who` gave up after ... waiting for `waiting_for`") if
  the body has not finished within `timeout_s`."""
  done = threading.Event()

  def expire():
    if not done.wait(timeout_s):
      _die(
        f"{who} gave up after {timeout_s:g} s (distributed.start_timeout_s) waiting for "
        f"{waiting_for}"
      )

  thread = threading.Thread(target=expire, name="rlhfjax-start-deadline", daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()


def watch_peers(timeout_s: float, coordinator_address: str | None) -> None:
  """Starts the liveness thread of this process (see the module docstring); no-op with one
  process."""
  import jax
  from jax._src import distributed as jax_distributed

  count, me = jax.process_count(), jax.process_index()
  client = jax_distributed.global_state.client
  if count == 1 or client is None:
    return
  global _watch
  stop = threading.Event()
  where = coordinator_address or "the cluster's coordinator"
  _watch = watch = _Watch(client, me, stop, threading.Lock())

  def beat():
    last_change = {p: time.monotonic() for p in range(count) if p != me}
    last_value: dict[int, str | None] = {}
    tick = 0
    while not stop.is_set():
      try:
        with watch.posting:
          if stop.is_set():  # a failure reported by the main thread, whose post stays
            return
          client.key_value_set(f"{_KEY}{me}", str(tick), allow_overwrite=True)
        posted = dict(client.key_value_dir_get(_KEY))
        values = {p: posted.get(f"{_KEY}{p}") for p in last_change}
      except Exception as e:  # noqa: BLE001 - any failure means the service is gone
        if stop.is_set():
          return
        _die(
          f"process {me} of {count} lost the job's coordination service at {where} (process "
          f"0 ended or is unreachable; see its log): {errors.status_line(e)}"
        )
        return  # (`_die` does not return)
      now = time.monotonic()
      for p, value in values.items():
        for prefix, leave in ((_FAILED, True), (_LOST, False)):
          if value and value.startswith(prefix) and not stop.is_set():
            why = value.removeprefix(prefix)
            # Into the shutdown barrier only where every other process comes too: one lost
            # waits there for JAX's heartbeat time-out (a minute or more) and then aborts.
            _die(f"process {p} of {count} failed, so process {me} stops too: {why}", leave)
        if value == _DONE:
          continue
        if value != last_value.get(p):
          last_value[p], last_change[p] = value, now
        elif now - last_change[p] > timeout_s:
          _die(
            f"process {p} of {count} gave no sign of life for {timeout_s:g} s "
            "(distributed.peer_timeout_s): it ended or hangs; see its log. Stopping process "
            f"{me} too"
          )
      tick += 1
      stop.wait(_PERIOD_S)

  def finish():
    stop.set()
    with contextlib.suppress(Exception):
      client.key_value_set(f"{_KEY}{me}", _DONE, allow_overwrite=True)

  threading.Thread(target=beat, name="rlhfjax-liveness", daemon=True).start()
  signals.before_exiting_at_once(
    lambda: report_failure(f"process {me} was stopped at once by a second stop request", False)
  )
  # Registered after JAX's own shutdown handler, so it runs first (atexit is LIFO).
  atexit.register(finish)


def fail(line: str, status: int) -> NoReturn:
  """Ends this process of a multi-process job, from its main thread, with the error `line` and
  exit `status`: the line first, then `report_failure` (leaving through JAX's shutdown unless
  the failure is a lost peer), then the exit. Not through atexit: the others learn of the
  failure first, so that they too come to JAX's shutdown barrier, which it then passes
  through. When the liveness thread is already ending the process (a peer failed, and this
  thread's collective failed because of it), this one waits for that end and says nothing."""
  _claim_the_end()
  sys.stderr.write(errors.error_line(line))
  sys.stderr.flush()
  sys.stdout.flush()
  report_failure(line, leave=not line.startswith(errors.PEER_LOST))
  os._exit(status)


def report_failure(line: str, leave: bool = True) -> None:
  """Posts this process's error `line` for the job's other processes, then leaves the job with
  them (`_leave`; see the module docstring) unless not `leave` (a peer is gone: JAX's shutdown
  barrier would wait for it until its heartbeat time-out, then abort this process). The caller
  exits next. No-op outside a multi-process job.

  A process blocked in a call that holds Python's lock (the first collective's set-up, gloo's
  context) hears of the failure only when that call returns; the others wait for it at most
  JAX's shutdown timeout (`jax.distributed.initialize(shutdown_timeout_seconds=...)`, 300 s)."""
  watch = _watch
  if watch is None:
    return
  with watch.posting:  # this process's liveness thread posts no more
    watch.stop.set()
  with contextlib.suppress(Exception):
    watch.client.key_value_set(
      f"{_KEY}{watch.me}",
      (_FAILED if leave else _LOST) + errors.one_line(line)[:1000],
      allow_overwrite=True,
    )
  if leave:
    _leave()


def _leave() -> None:
  """`jax.distributed.shutdown()`: a barrier of every process, then this one disconnects from
  the coordination service, so that process 0's exit, which ends the service, finds no
  process still connected (JAX aborts those)."""
  import jax

  with contextlib.suppress(Exception):  # the service gone, or the barrier timed out
    jax.distributed.shutdown()
