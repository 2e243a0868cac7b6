"""A run's working directory: absolute paths, a usable directory, and one owner at a time.

- `absolute` turns a user's path into the absolute one every later step uses (orbax refuses
  relative checkpoint paths, and a resumed run must name the same files whatever its cwd);
  `absolute_config_paths` does that once for every path field of a config file.
- `prepare` creates the workdir or says in one line why it cannot be used.
- `WorkdirLock` makes a second run on the same workdir fail at start with one line naming the
  holder, instead of both interleaving their metrics and checkpoints. A run holds every
  directory it writes: a pipeline also holds each stage's, so a stage's script started on one
  of them beside it is refused too. It is an advisory
  `flock` on `WORKDIR/.lock`: the kernel drops it when its process dies however it dies, so the
  lock of a killed run is stale by construction and the next run takes it over.
- `file_lock` serialises short critical sections between processes (dataset preparation).

Nothing here imports JAX.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

LOCK_FILE = ".lock"

# Config fields that hold paths, by section name; the sections may sit at any depth (the
# pipeline config nests a whole config per stage). Empty values and the built-in tokenizer
# name are not paths.
PATH_FIELDS = {
  "data": ("prompts", "demonstrations", "preferences", "data_dir", "tokenizer"),
  "init": ("actor", "critic", "reward"),
  "model": ("hf",),
  # model.roles.critic / model.roles.reward
  "critic": ("hf",),
  "reward": ("hf",),
}
_NOT_PATHS = ("", "byte")


class WorkdirError(ValueError):
  """The workdir cannot be used: empty, a file, not writable, or held by another run."""


def absolute(path: str | os.PathLike) -> str:
  """`path` with `~` expanded, made absolute against the current directory."""
  return os.path.abspath(os.path.expanduser(os.fspath(path)))


def absolute_config_paths(config_dict: Any) -> None:
  """Makes every path field (`PATH_FIELDS`) of a `ConfigDict` absolute, in place."""
  for key in list(config_dict.keys()):
    value = config_dict[key]
    if not hasattr(value, "keys"):
      continue
    for field in PATH_FIELDS.get(key, ()):
      if field in value and isinstance(value[field], str) and value[field] not in _NOT_PATHS:
        value[field] = absolute(value[field])
    absolute_config_paths(value)


def prepare(path: str | None) -> str:
  """The absolute workdir, created if missing.

  Raises:
    WorkdirError: If `path` is empty, names a file, or cannot be created or written to.
  """
  if path is None or not str(path).strip():
    raise WorkdirError("--workdir is empty: name a directory for the run's outputs")
  path = absolute(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f"workdir {path} is a file, not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"cannot create workdir {path}: {e.strerror}") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise WorkdirError(f"workdir {path} is not writable")
  return path


def _holder(lock_path: str) -> dict[str, Any]:
  try:
    with open(lock_path) as f:
      return json.loads(f.read() or "{}")
  except (OSError, ValueError):
    return {}


def _describe(holder: dict[str, Any]) -> str:
  if not holder:
    return "another process"
  started = f"started {holder.get('started')}"
  if holder.get("run"):  # a directory held by a run of another workdir (a pipeline's stage)
    started += f", the run of {holder['run']}"
  return f"process {holder.get('pid')} on {holder.get('host')} ({started})"


class WorkdirLock:
  """Exclusive ownership of a workdir by this process until `release` (or its death).

  Raises (on construction) `WorkdirError` naming the holder when another live process holds
  it. `took_over` is the holder record of a dead run whose lock file was left behind. `run`:
  the workdir of the run that holds this one as part of its own (a pipeline holds its
  stages' directories), named to whoever finds it in use.
  """

  def __init__(self, workdir: str, *, run: str | None = None):
    self.path = os.path.join(workdir, LOCK_FILE)
    try:
      self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise WorkdirError(f"cannot create the lock file {self.path}: {e.strerror}") from None
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(self._fd)
      raise WorkdirError(
        f"workdir {workdir} is in use by {_describe(_holder(self.path))}; wait for it to end, "
        f"stop it, or choose another --workdir"
      ) from None
    previous = _holder(self.path)
    self.took_over = previous or None
    record = {
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "started": time.strftime("%Y-%m-%d %H:%M:%S"),
      **({"run": run} if run else {}),
    }
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, json.dumps(record).encode(), 0)
    atexit.register(self.release)  # a normal exit leaves an empty file: nothing to take over

  def release(self) -> None:
    if self._fd is None:
      return
    with contextlib.suppress(OSError):
      os.ftruncate(self._fd, 0)  # an empty file: nobody holds it
    os.close(self._fd)  # closing drops the flock
    self._fd = None


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
  """Blocks until this process holds the exclusive lock on file `path` (created if missing)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)
