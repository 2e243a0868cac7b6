"""Stopping a run on request: SIGTERM (preemption) and SIGINT (Ctrl-C) alike.

The first signal sets a flag the training loop checks after each iteration: it finishes (or
abandons) the iteration, writes a checkpoint and returns normally. A second Ctrl-C (or
SIGTERM) exits at once with status 130: checkpoints are written into a temporary directory and
renamed into place only when complete, so an interrupted save never damages the last complete
one.

The handler never raises: a `KeyboardInterrupt` raised at an arbitrary bytecode can land in a
garbage-collection callback (where Python prints it and carries on) or inside a library's
clean-up, which is how Ctrl-C used to be lost or leave a save half-done.

A Python signal handler runs only when the main thread comes back to Python code, so a process
blocked in a native call (a wait for another process at a meeting point, a collective, a long
computation) would not hear a stop at all. Every signal also reaches a watch thread here
(`signal.set_wakeup_fd`): a delivery the main thread's handler has not taken within
`_GRACE_S` is handled by that thread instead, so the first stop is acknowledged at once (with
what the process waits for, `waiting`) and a second one ends the process at once wherever it
is. Each delivery is handled once, by whichever comes first.

Under a supervisor (each process of a multi-process job, `rlhfjax.supervisor`) both arrive as
the real-time signals it forwards them as (`supervisor.stop_signals`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from rlhfjax import errors, supervisor

_requested = threading.Event()
"""Set by the first signal while a `StopRequest` is active: work inside an iteration that may
run long (DAPO's sampling rounds) checks `requested()` to end early."""

_GRACE_S = 1.0
"""How long a delivery waits for the main thread's handler before the watch thread takes it."""

_lock = threading.RLock()  # a second signal's handler may run inside the first's
_state = {"seen": 0, "by_main": 0, "by_watch": 0, "skipped": 0}
"""Deliveries the watch thread has read (`seen`), handled by the main thread's handler
(`by_main`) and by the watch thread (`by_watch`); the main thread's handler calls skipped
because the watch thread had taken their delivery (`skipped`)."""
_handled = threading.Condition(_lock)
_active: list[StopRequest] = []  # innermost last; the main thread pushes and pops
_default_interrupt = False  # `install_default_interrupt` was called
_watching = False
_waits: list[str] = []  # what the main thread waits for (`waiting`), innermost last
_before_exit: list[Callable[[], None]] = []


def requested() -> bool:
  """Whether a stop was asked for (SIGTERM or Ctrl-C) in the active training loop."""
  return _requested.is_set()


@contextlib.contextmanager
def waiting(what: str) -> Iterator[None]:
  """Marks the main thread as waiting for `what` (other processes at a meeting point): a stop
  asked for meanwhile says so, since it takes effect only once the wait ends."""
  _waits.append(what)
  try:
    yield
  finally:
    _waits.pop()


def before_exiting_at_once(callback: Callable[[], None]) -> None:
  """Calls `callback` (from any thread, once) before a second stop request ends the process:
  the job's other processes hear of it then instead of at their liveness time-out."""
  _before_exit.append(callback)


class StopRequest:
  """Handles SIGINT and SIGTERM while active (see the module docstring).

  Use as a context manager around a training loop, and check `is_set()` between iterations.
  Outside the main thread (a trainer run from a worker thread) signals cannot be caught, and
  this does nothing.
  """

  def __init__(self, on_stop: Callable[[], None] | None = None, what: str = "run"):
    self._event = threading.Event()
    self._on_stop = on_stop
    self._what = what
    self._previous: dict[int, object] = {}
    self.signal_name = ""

  def is_set(self) -> bool:
    return self._event.is_set()

  def _handle(self, signum: int, late: bool) -> None:
    """One delivery of a stop signal; from either thread, under `_lock`. `late`: the main
    thread did not take it in time (it is blocked, in a wait it then names)."""
    if self._event.is_set():
      _exit_at_once(
        "\nerror: interrupted again: stopped at once; rerun the same command to resume from the "
        "last complete checkpoint\n"
      )
    self.signal_name = supervisor.stop_signals().get(signum, str(signum))
    self._event.set()
    _requested.set()
    # os.write: no buffered I/O (the interrupted code may be inside print). The leading newline
    # ends a progress bar's unfinished line, so that the message is a line of its own.
    waits = f", once this process's wait for {_waits[-1]} ends" if late and _waits else ""
    os.write(2, f"\n{self.signal_name}: stopping the {self._what} after this iteration with a "
             f"checkpoint{waits} (Ctrl-C again to stop at once)\n".encode())  # fmt: skip
    if self._on_stop is not None:
      self._on_stop()

  def __enter__(self) -> StopRequest:
    if threading.current_thread() is threading.main_thread():
      _watch()
      for signum in supervisor.stop_signals():
        self._previous[signum] = signal.signal(signum, _from_main)
      _active.append(self)
    return self

  def __exit__(self, *exc_info) -> None:
    if self in _active:
      _active.remove(self)
    _requested.clear()
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous.clear()


def _exit_at_once(line: str) -> None:
  for callback in _before_exit:
    with contextlib.suppress(Exception):
      callback()
  os.write(2, line.encode())
  with contextlib.suppress(Exception):
    sys.stderr.flush()
  os._exit(errors.INTERRUPTED)


def _dispatch(signum: int, late: bool = False) -> None:
  """Handles one delivery of `signum` (under `_lock`): the active `StopRequest`'s, else the
  default interrupt's."""
  if _active:
    _active[-1]._handle(signum, late)  # noqa: SLF001
  elif _default_interrupt and signum == supervisor.received_as(signal.SIGINT):
    _exit_at_once(errors.error_line("interrupted"))


def _from_main(signum, frame) -> None:
  """The Python handler (main thread): takes the delivery unless the watch thread already
  did."""
  del frame
  with _lock:
    if _state["by_watch"] > _state["skipped"]:
      _state["skipped"] += 1
      return
    _state["by_main"] += 1
    _handled.notify_all()
    _dispatch(signum)


def _watch() -> None:
  """Starts the watch thread (main thread, once; see the module docstring)."""
  global _watching
  if _watching:
    return
  read, write = os.pipe()
  os.set_blocking(write, False)
  signal.set_wakeup_fd(write, warn_on_full_buffer=False)
  _watching = True

  def run():
    stops = supervisor.stop_signals()
    while True:
      for signum in os.read(read, 64):
        if signum not in stops or signal.getsignal(signum) is not _from_main:
          continue  # a signal another Python handler takes
        with _lock:
          _state["seen"] += 1
          mine = _state["seen"]
          if not _handled.wait_for(
            lambda: _state["by_main"] + _state["by_watch"] >= mine,  # noqa: B023
            timeout=_GRACE_S,
          ):
            _state["by_watch"] += 1
            _dispatch(signum, late=True)

  threading.Thread(target=run, name="rlhfjax-signals", daemon=True).start()


def install_default_interrupt() -> None:
  """Makes Ctrl-C outside a training loop (set-up, compilation) exit at once, quietly, with
  status 130 rather than raise `KeyboardInterrupt` into arbitrary code."""
  global _default_interrupt
  if threading.current_thread() is not threading.main_thread():
    return
  _watch()
  _default_interrupt = True
  signal.signal(supervisor.received_as(signal.SIGINT), _from_main)


def on_stop(callback: Callable[[], None], what: str = "run") -> Callable[[], None]:
  """Calls `callback` on the first SIGINT or SIGTERM (see `StopRequest`); returns the undo."""
  request = StopRequest(callback, what).__enter__()
  return request.__exit__
