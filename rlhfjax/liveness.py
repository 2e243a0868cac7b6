"""Bounded waits for the other processes of a multi-process job.

JAX's coordination service stops a process whose peers do not arrive, or stop answering, by
aborting it with a C++ fatal error and a stack trace, after minutes. Here:

- `start_deadline` bounds `jax.distributed.initialize`: past it, one `error:` line says what
  was waited for (the coordinator address, this process's id and the process count), exit 2;
- `watch_peers` runs a daemon thread in which every process posts a counter to the job's
  key-value store each second and reads the others'. A process whose counter stands still for
  `timeout_s`, or a coordination service that stops answering (process 0 ended), ends this
  process with one `error:` line naming it, instead of a wait in a collective that never ends.
  A process that finishes normally marks itself done (at exit) so the others do not mistake
  the end of its work for a failure.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Iterator

from rlhfjax import errors

_KEY = "rlhfjax/alive/"
_DONE = "done"
_PERIOD_S = 1.0


def _die(message: str) -> None:
  """Ends the process from any thread: the main one may be blocked in a collective."""
  os.write(2, f"error: {errors.one_line(message)}\n".encode())
  os._exit(errors.USER_ERROR)


@contextlib.contextmanager
def start_deadline(timeout_s: float, waiting_for: str) -> Iterator[None]:
  """Ends the process with one line if the body has not finished within `timeout_s`."""
  done = threading.Event()

  def expire():
    if not done.wait(timeout_s):
      _die(f"gave up after {timeout_s:g} s (distributed.start_timeout_s) waiting for {waiting_for}")

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
  stop = threading.Event()
  where = coordinator_address or "the cluster's coordinator"

  def beat():
    last_change = {p: time.monotonic() for p in range(count) if p != me}
    last_value: dict[int, str | None] = {}
    tick = 0
    while not stop.is_set():
      try:
        client.key_value_set(f"{_KEY}{me}", str(tick), allow_overwrite=True)
        posted = dict(client.key_value_dir_get(_KEY))
        values = {p: posted.get(f"{_KEY}{p}") for p in last_change}
      except Exception as e:  # noqa: BLE001 - any failure means the service is gone
        if stop.is_set():
          return
        _die(
          f"process {me} of {count} lost the job's coordination service at {where} (process "
          f"0 ended or is unreachable): {errors.one_line(e)[:200]}"
        )
      now = time.monotonic()
      for p, value in values.items():
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
  # Registered after JAX's own shutdown handler, so it runs first (atexit is LIFO).
  atexit.register(finish)
