"""One line for any failure a user can cause or meet, and the exit status that goes with it.

`describe(error)` walks an exception and what caused it (orbax re-raises the errors of its
background threads wrapped, sometimes several times) and returns the most useful single line:

- the exceptions rlhfjax defines (config, placement, data, checkpoint, workdir, reward
  function errors) say what is wrong already, and what they wrap;
- an `OSError` (a full or read-only disk, a missing permission) names the file and the reason,
  whatever other exceptions wrapped it;
- of those two, the outermost in the chain wins;
- anything else is reported as an internal error with its type, pointing at `--debug`.

Nothing here imports JAX.
"""

from __future__ import annotations

import errno
import logging
import os
import sys

USER_ERROR = 2
"""Exit status of bad input or a failed environment (disk, permissions, a damaged file)."""
INTERNAL_ERROR = 1
"""Exit status of a bug: an exception nobody anticipated."""
INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT), as shells report it."""

DEBUG_ENV = "RLHFJAX_DEBUG"

_DISK_ERRNOS = {
  errno.ENOSPC: "no space left on the device",
  errno.EDQUOT: "disk quota exceeded",
  errno.EROFS: "read-only file system",
  errno.EACCES: "permission denied",
  errno.EPERM: "operation not permitted",
  errno.EFBIG: "file too large (a file-size limit)",
}


def chain(error: BaseException) -> list[BaseException]:
  """`error` and its causes (`__cause__`, else `__context__`), outermost first."""
  seen: list[BaseException] = []
  while error is not None and all(error is not e for e in seen):
    seen.append(error)
    error = error.__cause__ or error.__context__
  return seen


def one_line(text: object) -> str:
  return " ".join(str(text).split())


def status_line(error: object, limit: int = 200) -> str:
  """A gRPC failure of JAX's coordination client (`UNAVAILABLE: ...`) in one short line: its
  status and first message, without the transport's 'Additional GRPC error information'."""
  line = one_line(error).split(" Additional GRPC error information", 1)[0]
  return line[:limit]


def error_line(message: object) -> str:
  """`error: <one line>` and a newline, as the scripts end, starting on a line of its own: after
  a newline when a progress bar (tqdm) is open, whose line has none yet."""
  bars = getattr(sys.modules.get("tqdm"), "tqdm", None)
  open_bar = bool(getattr(bars, "_instances", None))
  return ("\n" if open_bar else "") + f"error: {one_line(message)}\n"


def _os_error_line(error: OSError) -> str:
  reason = _DISK_ERRNOS.get(error.errno) or error.strerror or one_line(error)
  where = error.filename or ""
  if error.filename2:
    where = f"{where} -> {error.filename2}"
  return f"{reason}: {where}" if where else reason


def _disk_errno_in_text(error: BaseException) -> str | None:
  """TensorStore and orbax report OS errors as text (e.g. 'No space left on device')."""
  text = str(error)
  for code, reason in _DISK_ERRNOS.items():
    if os.strerror(code) in text:
      return reason
  return None


PEER_LOST = "another process of the job ended or failed"
"""How the line of a collective whose peer closed its connection starts."""


def describe(error: BaseException) -> tuple[str, int]:
  """The one line (without the `error: ` prefix) and the exit status for `error`."""
  errors = chain(error)
  for e in errors:
    # Exceptions rlhfjax defines are raised on purpose, with a message meant for the user that
    # already says what it wraps (a failed save names its step and the cause's line), so they
    # outrank what they wrap; an OS error under other wrappers names its file and reason.
    if type(e).__module__.startswith("rlhfjax"):
      return one_line(e), USER_ERROR
    if isinstance(e, OSError) and (e.errno in _DISK_ERRNOS or e.filename):
      return _os_error_line(e), USER_ERROR
  for e in errors:
    reason = _disk_errno_in_text(e)
    if reason:
      return f"{reason}: {one_line(e)[:300]}", USER_ERROR
  first = errors[0]
  if "Connection closed by peer" in str(first) or "Connection reset by peer" in str(first):
    return (
      f"{PEER_LOST} (see its log): {one_line(first)[:300]}",
      USER_ERROR,
    )
  if isinstance(first, ValueError | OSError):
    return one_line(first), USER_ERROR
  return (
    f"internal error {type(first).__name__}: {one_line(first)[:300]} "
    f"(rerun with --debug or {DEBUG_ENV}=1 for the traceback)",
    INTERNAL_ERROR,
  )


def debug_requested() -> bool:
  return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class _OrbaxFailureFilter(logging.Filter):
  """Drops orbax's logged tracebacks of failed background writes: the failure reaches the
  caller, which reports it on one line (`rlhfjax.checkpoint`)."""

  def filter(self, record: logging.LogRecord) -> bool:
    from_orbax = f"{os.sep}orbax{os.sep}" in record.pathname
    return not (from_orbax and record.levelno >= logging.ERROR)


class _UnretrievedFutureFilter(logging.Filter):
  """Drops asyncio's "exception was never retrieved" reports of orbax's write futures, logged
  when they are garbage-collected after the failure already reached the caller."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in record.getMessage()


def quiet_background_failures() -> None:
  """Keeps stderr to one line per failure: tracebacks that libraries print from their own
  threads and callbacks (orbax's log of a failed write, TensorStore callbacks finding their
  event loop closed after it) are dropped; the failure itself surfaces in the caller. An entry
  point's `--debug` skips this."""
  logging.getLogger("absl").addFilter(_OrbaxFailureFilter())
  logging.getLogger("asyncio").addFilter(_UnretrievedFutureFilter())
  # C++ callbacks report their Python exceptions as unraisable (PyErr_WriteUnraisable) or
  # through sys.excepthook (PyErr_Print); the main thread's own exceptions never get there (the
  # entry point catches them).
  sys.unraisablehook = lambda unraisable: None
  sys.excepthook = lambda *exc_info: None
