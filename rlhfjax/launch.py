"""What every entry point does: flags with one-line errors, host devices before JAX starts,
the workdir and its lock, and one `error:` line for any failure.

A script's `__main__` is `launch.run(main)`. Inside `main`, `start` (before JAX is imported)
then `open_run` (the absolute workdir, owned by this run, and absolute config paths).

Nothing here imports JAX at import time: `emulate_host_devices` must run before the CPU
backend starts.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from absl import app, flags, logging

from rlhfjax import config, errors, liveness, signals, supervisor, workdir

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def fail(error: object, status: int = errors.USER_ERROR) -> NoReturn:
  """Prints `error: <one line>` on stderr and exits with `status` (2: bad input)."""
  sys.stderr.write(errors.error_line(error))
  sys.exit(status)


def define_flags(
  config_help: str, workdir_help: str
) -> tuple[flags.FlagHolder, flags.FlagHolder, flags.FlagHolder]:
  """The flags of a training entry point: `--config` (a config file; `--config.x.y=...`
  overrides any field), `--workdir` (both required) and `--max_cpu_devices`."""
  from ml_collections import config_flags

  config = config_flags.DEFINE_config_file("config", None, config_help)
  workdir = flags.DEFINE_string("workdir", None, workdir_help)
  max_cpu_devices = flags.DEFINE_integer(
    "max_cpu_devices", 64, "Most host devices to emulate when running on CPU."
  )
  flags.mark_flags_as_required(["config", "workdir"])
  return config, workdir, max_cpu_devices


_DEBUG = flags.DEFINE_boolean(
  "debug", False, f"Show the traceback of a failure (also ${errors.DEBUG_ENV}=1)."
)


def run(main: Callable[[list[str]], None]) -> None:
  """`absl.app.run(main)` where any failure ends as one `error:` line and a non-zero status
  (2: bad input or environment, 1: internal error, 130: interrupted); `--debug` or
  `RLHFJAX_DEBUG=1` also print the traceback."""

  def guarded(argv: list[str]) -> None:
    collect_garbage_less()
    if supervisor.in_child():
      supervisor.adopt()
    import_from_current_directory()
    signals.install_default_interrupt()
    if not (_DEBUG.value or errors.debug_requested()):
      errors.quiet_background_failures()
    try:
      main(argv)
    except SystemExit:
      raise
    except KeyboardInterrupt:
      fail("interrupted", errors.INTERRUPTED)
    except Exception as error:  # noqa: BLE001 - the one place that turns failures into a line
      if _DEBUG.value or errors.debug_requested():
        traceback.print_exc()
      line, status = errors.describe(error)
      if "jax" in sys.modules and sys.modules["jax"].process_count() > 1:
        liveness.fail(line, status)
      fail(line, status)

  app.run(guarded, flags_parser=parse_flags)


_GC_YOUNG_THRESHOLD = 100_000


def collect_garbage_less() -> None:
  """Python's cyclic garbage collector, tuned for JAX: what is loaded so far (the modules) is
  frozen out of its scans, and its youngest generation is collected every 100,000 net
  allocations instead of 700. Tracing and lowering a program allocate millions of short-lived
  objects, so at the default a collection runs every few microseconds of tracing and the older
  generations' scans walk every live object: about a tenth of a short run's CPU time (a
  1-iteration GRPO run of the tiny model, 10.5-11.5 CPU-s at the default, 8.7-9.8 s tuned).
  Memory freed by reference counting (nearly everything, arrays included) is unaffected."""
  gc.freeze()
  young, middle, old = gc.get_threshold()
  gc.set_threshold(max(young, _GC_YOUNG_THRESHOLD), middle, old)


def import_from_current_directory() -> None:
  """Puts the current directory on `sys.path`, as `python -m` and the interactive interpreter
  do (a script gets only its own directory), so that the 'module:function' of a user's own file
  there (`reward.fn`, `algorithm.flow`) imports. Last, so it shadows no installed module."""
  cwd = os.getcwd()
  if cwd not in sys.path and "" not in sys.path:
    sys.path.append(cwd)


_OPEN_LOCKS: list[workdir.WorkdirLock] = []  # held until the process exits


def open_run(config_dict, path: str | None) -> str:
  """The absolute workdir (created, checked, and locked by this job's process 0) and every
  path field of `config_dict` made absolute in place. Call it after `start`.

  Raises:
    WorkdirError: the workdir is empty, a file, not writable or in use by another run.
  """
  workdir.absolute_config_paths(config_dict)
  path = workdir.prepare(path)
  hold(path)
  return path


def hold(path: str, run: str | None = None) -> None:
  """Locks directory `path` (created if missing) for this job until it exits: process 0
  takes `WorkdirLock`, naming `run` (the workdir of the run that writes into `path` as part
  of its own, e.g. a pipeline's stage) to whoever finds it in use.

  Raises:
    WorkdirError: `path` cannot be used or is in use by another run.
  """
  from rlhfjax import distributed  # imports JAX: after `start`

  path = workdir.prepare(path)
  if distributed.is_primary():
    lock = workdir.WorkdirLock(path, run=run)
    _OPEN_LOCKS.append(lock)
    if lock.took_over:
      logging.warning("took over the lock of an ended run: %s", lock.took_over)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing whose errors (bad `--config.x=...` overrides too) are one line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    fail(error)
  except (AttributeError, KeyError, TypeError, ValueError) as error:
    # config_flags wraps the KeyError of an unknown `--config.x.y` field in an AttributeError.
    while error.args and isinstance(error.args[0], Exception):
      error = error.args[0]
    what = str(error.args[0] if error.args else error)
    fail(_unknown_override(argv, what) or f"bad --config override: {what}")


def _unknown_override(argv: list[str], what: str) -> str | None:
  """The error line for the first override in `argv` that names no field (the one `what`,
  ml_collections' message, quotes, if any), with what it may have meant; None if none does."""
  quoted = re.match(r"\s*'([^']+)'", what)
  paths = [arg.removeprefix("--config.").split("=", 1)[0] for arg in argv[1:]
           if arg.startswith("--config.")]  # fmt: skip
  unknown = {path: m for path in paths if (m := config.unknown_override(path)) is not None}
  if not unknown:
    return None
  path = next((p for p in unknown if quoted and quoted[1] in p.split(".")), next(iter(unknown)))
  return f"bad --config override --config.{path}: {unknown[path]}"


def quiet_logging() -> None:
  """Keeps stderr for errors unless --verbosity was given: JAX logs at INFO level which
  backends it could not start."""
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def emulate_host_devices(num_devices: int) -> None:
  """Asks XLA for `num_devices` host devices unless it already has as many.

  XLA reads the flag when JAX starts its CPU backend, so this must run before JAX is imported;
  only the host (CPU) platform uses it, so it changes nothing on GPU or TPU.
  """
  xla_flags = os.environ.get("XLA_FLAGS", "")
  match = re.search(rf"{_COUNT_FLAG}=(\d+)", xla_flags)
  if match and int(match.group(1)) >= num_devices:
    return
  xla_flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", xla_flags)
  os.environ["XLA_FLAGS"] = f"{xla_flags} {_COUNT_FLAG}={num_devices}".strip()


def requested_devices(config_dict, max_cpu_devices: int) -> int | None:
  """`placement.num_devices` of a config file, capped, or None when it does not say."""
  try:
    num_devices = config_dict.placement.num_devices
  except OSError as error:  # the config file could not be loaded
    fail(error)
  except AttributeError:  # no placement section: from_config_dict says what is wrong
    return None
  if isinstance(num_devices, int) and num_devices > 0:
    return min(num_devices, max_cpu_devices)
  return None


def start(argv: list[str], config_dict, max_cpu_devices: int) -> None:
  """The common start of an entry point: no stray arguments, quiet logs, and as many host
  devices as the config's placement asks for (on CPU). Call it before importing JAX.

  With `distributed.enabled`, joins the job's processes instead (`rlhfjax.distributed`), each
  emulating its share of the devices; with `distributed.supervise` too, this process becomes
  the supervisor of a child that runs the same command (`rlhfjax.supervisor`) and never
  returns."""
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])}")
  quiet_logging()
  num_devices = requested_devices(config_dict, max_cpu_devices)
  if _distributed_enabled(config_dict):
    # Imports JAX, which is fine: only its backends must start after this.
    from rlhfjax import distributed

    try:
      section = config.distributed_from_config_dict(config_dict)
      if section.supervise and supervisor.available() and not supervisor.in_child():
        supervisor.supervise(*distributed.identity(distributed.resolve(section)))
      distributed.initialize(section, num_devices)
      distributed.agree(job_fingerprint(config_dict), section.start_timeout_s)
    except ValueError as error:
      fail(error)
  elif num_devices:
    emulate_host_devices(num_devices)


_PER_PROCESS = ("distributed.process_id", "distributed.local_device_count")
"""Config fields that may differ between the processes of a job."""
_DATA_FILES = ("data.prompts", "data.demonstrations", "data.preferences", "data.tokenizer")
"""Config fields naming files whose contents every process must read alike."""


def job_fingerprint(config_dict) -> dict[str, str]:
  """What must be identical in every process of a job (`rlhfjax.distributed.agree`): each
  field of the resolved config (but `_PER_PROCESS`), the code (a hash of the package's source
  files), and each data file's size and a hash of its first and last MiB (a resume re-reads
  nothing whole)."""
  flat = {}

  def walk(node, prefix):
    for key, value in node.items():
      path = f"{prefix}{key}"
      if hasattr(value, "items"):
        walk(value, f"{path}.")
      elif path not in _PER_PROCESS:
        flat[path] = value

  walk(config_dict, "")
  parts = {name: json.dumps(value, sort_keys=True, default=str) for name, value in flat.items()}
  parts["code"] = _source_hash()
  for name in _DATA_FILES:
    path = os.path.expanduser(str(flat.get(name) or ""))
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if path and os.path.isfile(path):
      parts[f"contents of {name}"] = _file_hash(path)
  return parts


def _source_hash() -> str:
  package = os.path.dirname(os.path.abspath(__file__))
  digest = hashlib.sha256()
  for root, dirs, files in os.walk(package):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__")
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(root, name)
      digest.update(os.path.relpath(path, package).encode())
      with open(path, "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()[:16]


def _file_hash(path: str, edge: int = 2**20) -> str:
  size = os.path.getsize(path)
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    digest.update(f.read(edge))
    if size > edge:
      f.seek(max(edge, size - edge))
      digest.update(f.read(edge))
  return f"{size} bytes, {digest.hexdigest()[:16]}"


def _distributed_enabled(config_dict) -> bool:
  try:
    return config_dict.distributed.enabled is True
  except (AttributeError, KeyError):  # no such section: single process
    return False
