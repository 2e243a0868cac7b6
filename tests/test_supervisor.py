"""The supervisor of each process of a multi-process job, in this process: JAX's abort when
process 0 is lost ends as one line, other output passes as it came, and the stop signals a
supervised child listens for. (Supervised programs: tests/test_supervisor_e2e.py; a job of two
processes: tests/test_supervisor_multiprocess.py.)"""

from __future__ import annotations

import signal

import pytest

from rlhfjax import supervisor

pytestmark = pytest.mark.pure

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


_GLOO = (
  b"[Gloo] Rank %d is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
)


def test_gloos_connection_lines_are_dropped_however_the_pipe_splits_them():
  """Issue 43: a dozen `[Gloo] Rank i is connected` lines per process, some interleaved by two
  threads; the rest passes, a progress bar's unfinished line at once."""
  bar = b"\rgrpo:  3%|3         | 1/30 [00:09<04:45]"
  interleaved = (
    b"[Gloo] Rank 1 is connected to 1 peer ranks. [Gloo] Rank 0 is connected to 1 peer ranks. "
    b"Expected number of connected peer ranks is : 1\nExpected number of connected peer ranks "
    b"is : 1\n"
  )
  # Two threads' lines interleaved word by word, as the placements' job once printed them.
  interleaved += (
    b"[Gloo] Rank [Gloo] Rank 0 is connected to 0 is connected to 1 peer ranks. 3 peer ranks. "
    b"Expected number of connected peer ranks is : Expected number of connected peer ranks is "
    b": 1\n3\n"
  )
  kept = b"step 1 [not gloo]: the node is connected to 2 peer ranks.\n"
  text = _GLOO % 0 + kept + interleaved + bar + _GLOO % 1 + b"the end [G"
  for cut in range(len(text) + 1):  # every split of the pipe's reads in two
    gloo = supervisor.GlooFilter()
    first = gloo.feed(text[:cut])
    assert b"Gloo]" not in first and (first.startswith(kept) or cut < len(_GLOO + kept))
    assert first + gloo.feed(text[cut:]) + gloo.finish() == kept + bar + b"the end [G", cut
  gloo = supervisor.GlooFilter()
  assert gloo.feed(bar) == bar  # not held


def test_stop_signals_are_the_forwarded_ones_under_a_supervisor(monkeypatch):
  monkeypatch.delenv(supervisor.ENV, raising=False)
  assert supervisor.stop_signals() == {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
  monkeypatch.setenv(supervisor.ENV, "1")
  assert supervisor.received_as(signal.SIGINT) == signal.SIGRTMIN + 1
  assert supervisor.stop_signals() == {
    signal.SIGRTMIN + 1: "Ctrl-C",
    signal.SIGRTMIN + 2: "SIGTERM",
  }


def test_the_liveness_watch_says_the_supervisors_line_when_the_service_is_gone(monkeypatch):
  """The other watcher of process 0's end: the liveness thread's read of the coordination
  service fails before JAX's client aborts the process. The same line as the supervisor's, but
  for who noticed, and none of gRPC's transport details."""
  import atexit
  import threading

  import jax
  from jax._src import distributed as jax_distributed

  from rlhfjax import liveness

  class Gone:  # JAX 0.10's client once process 0, which ran the service, ended
    def key_value_set(self, *args, **kwargs):
      raise RuntimeError(
        "UNAVAILABLE: recvmsg:Connection reset by peer\nAdditional GRPC error information from "
        "remote target coordination_service while calling "
        "/xla.coordination.CoordinationService/GetKeyValueDir:\n:UNKNOWN:Error received from peer"
      )

    key_value_dir_get = key_value_set

  said, ended = [], threading.Event()

  def die(message, leave=False):  # instead of ending the process
    said.append(message)
    ended.set()

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax_distributed.global_state, "client", Gone())
  monkeypatch.setattr(liveness, "_die", die)
  monkeypatch.setattr(liveness, "_watch", None)
  monkeypatch.setattr(atexit, "register", lambda fn: fn)
  liveness.watch_peers(30, "host:1234")
  assert ended.wait(30)
  assert f"error: {said[0]}\n" == _LINE.replace(
    "JAX stopped it: UNAVAILABLE: Failed to send RPC to coordination service",
    "UNAVAILABLE: recvmsg:Connection reset by peer",
  )


@pytest.mark.parametrize("leaves", [True, False])
def test_a_peers_failure_stops_this_process_through_the_barrier_only_if_it_leaves_too(
  monkeypatch, leaves
):
  """A failed process that leaves through JAX's shutdown barrier takes the others there; one
  that lost a peer of its own (a collective's connection closed) does not come, so the others
  must not wait there either: the barrier would hold them for JAX's heartbeat time-out."""
  import atexit
  import threading

  import jax
  from jax._src import distributed as jax_distributed

  from rlhfjax import liveness

  class Store:  # the coordination service's key-value store
    def __init__(self):
      self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
      self.values[key] = value

    def key_value_dir_get(self, prefix):
      return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]

  store, said, ended = Store(), [], threading.Event()

  def die(message, leave=False):
    said.append((message, leave))
    ended.set()

  monkeypatch.setattr(jax, "process_count", lambda: 3)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  monkeypatch.setattr(jax_distributed.global_state, "client", store)
  monkeypatch.setattr(liveness, "_die", die)
  monkeypatch.setattr(atexit, "register", lambda fn: fn)
  # Process 2 failed; it reports through the same function as a real failure does.
  monkeypatch.setattr(liveness, "_leave", lambda: None)
  monkeypatch.setattr(
    liveness, "_watch", liveness._Watch(store, 2, threading.Event(), threading.Lock())
  )
  why = "another process of the job ended or failed (see its log): connection closed"
  liveness.report_failure(why, leave=leaves)
  monkeypatch.setattr(liveness, "_watch", None)
  liveness.watch_peers(30, "host:1234")
  assert ended.wait(30)
  liveness._watch.stop.set()
  assert said[0] == (f"process 2 of 3 failed, so process 0 stops too: {why}", leaves)
