"""Stopping a run on request: SIGTERM (preemption) and SIGINT (Ctrl-C) alike.

The first signal sets a flag the training loop checks after each iteration: it finishes (or
abandons) the iteration, writes a checkpoint and returns normally. A second Ctrl-C (or
SIGTERM) exits at once with status 130: checkpoints are written into a temporary directory and
renamed into place only when complete, so an interrupted save never damages the last complete
one.

The handler never raises: a `KeyboardInterrupt` raised at an arbitrary bytecode can land in a
garbage-collection callback (where Python prints it and carries on) or inside a library's
clean-up, which is how Ctrl-C used to be lost or leave a save half-done.

Under a supervisor (each process of a multi-process job, `rlhfjax.supervisor`) both arrive as
the real-time signals it forwards them as (`supervisor.stop_signals`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

from rlhfjax import errors, supervisor

_requested = threading.Event()
"""Set by the first signal while a `StopRequest` is active: work inside an iteration that may
run long (DAPO's sampling rounds) checks `requested()` to end early."""


def requested() -> bool:
  """Whether a stop was asked for (SIGTERM or Ctrl-C) in the active training loop."""
  return _requested.is_set()


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

  def _handle(self, signum, frame) -> None:
    del frame
    if self._event.is_set():
      # os.write: no buffered I/O (the interrupted code may be inside print). The leading newline
      # ends a progress bar's unfinished line, so that the error is a line of its own.
      os.write(2, b"\nerror: interrupted again: stopped at once; rerun the same command to "
               b"resume from the last complete checkpoint\n")  # fmt: skip
      os._exit(errors.INTERRUPTED)
    self.signal_name = supervisor.stop_signals().get(signum, str(signum))
    self._event.set()
    _requested.set()
    os.write(2, f"\n{self.signal_name}: stopping the {self._what} after this iteration with a "
             "checkpoint (Ctrl-C again to stop at once)\n".encode())  # fmt: skip
    if self._on_stop is not None:
      self._on_stop()

  def __enter__(self) -> StopRequest:
    if threading.current_thread() is threading.main_thread():
      for signum in supervisor.stop_signals():
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    _requested.clear()
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous.clear()


def install_default_interrupt() -> None:
  """Makes Ctrl-C outside a training loop (set-up, compilation) exit at once, quietly, with
  status 130 rather than raise `KeyboardInterrupt` into arbitrary code."""
  if threading.current_thread() is not threading.main_thread():
    return

  def handle(signum, frame):
    del signum, frame
    os.write(2, errors.error_line("interrupted").encode())
    sys.stderr.flush()
    os._exit(errors.INTERRUPTED)

  signal.signal(supervisor.received_as(signal.SIGINT), handle)


def on_stop(callback: Callable[[], None], what: str = "run") -> Callable[[], None]:
  """Calls `callback` on the first SIGINT or SIGTERM (see `StopRequest`); returns the undo."""
  request = StopRequest(callback, what).__enter__()
  return request.__exit__
