"""Multi-process (multi-host) runs: one JAX controller per process, all running the same program.

`initialize` joins the processes of a job with `jax.distributed.initialize`, before JAX starts
its backends; on CPU it also picks gloo collectives and the host devices each process emulates
(two processes of 4 CPU devices on one machine behave as one job of 8 devices). Afterwards a
global array can span devices that other processes own:

- `is_primary` says whether this process writes files (metrics, plots, checkpoint metadata);
- `check_placement` rejects placements that leave a process without devices.

Roles may live on any processes (`rlhfjax.mesh.transfer` moves arrays between them and reads
them on the host).

Every process must run the same computations in the same order on the same host data: seeds,
prompts and host arrays are the same in every process by construction, and `jax.device_put` of
a NumPy array to a global sharding checks that they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax._src.distributed
from jax._src import cache_key as jax_cache_key

from rlhfjax import liveness, signals
from rlhfjax.config import DistributedSection

if TYPE_CHECKING:  # annotations only: the placement package pulls in much more than specs
  from rlhfjax.placement.spec import PlacementSpec

T = TypeVar("T")


class DistributedError(ValueError):
  """A multi-process run cannot start: something it needs is missing or does not fit."""


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
  value = environ.get(name, "").strip()
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise DistributedError(f"${name} must be an integer, got {value!r}") from None


def resolve(section: DistributedSection, environ: Mapping[str, str] = os.environ) -> dict:
  """The `jax.distributed.initialize` arguments: the section's fields, else the environment
  ($JAX_COORDINATOR_ADDRESS, which JAX reads itself, and $JAX_NUM_PROCESSES / $JAX_PROCESS_ID,
  which this library reads); None where neither says (JAX then asks the cluster)."""
  return {
    "coordinator_address": section.coordinator_address
    or environ.get("JAX_COORDINATOR_ADDRESS")
    or None,
    "num_processes": section.num_processes or _env_int(environ, "JAX_NUM_PROCESSES"),
    "process_id": section.process_id if section.process_id >= 0
    else _env_int(environ, "JAX_PROCESS_ID"),
  }  # fmt: skip


def local_device_count(
  section: DistributedSection, num_devices: int | None, num_processes: int | None
) -> int | None:
  """Host devices one process emulates, or None when neither the section nor an even split of
  `num_devices` (the placement's) over `num_processes` says."""
  if section.local_device_count:
    return section.local_device_count
  if not num_devices or not num_processes:
    return None
  if num_devices % num_processes:
    raise DistributedError(
      f"placement.num_devices={num_devices} does not split evenly over {num_processes} "
      "processes; set distributed.local_device_count"
    )
  return num_devices // num_processes


def initialize(section: DistributedSection, num_devices: int | None = None) -> None:
  """Joins this process to the job. Must run before JAX computes anything (or lists devices).

  On CPU: gloo collectives across processes (unless $JAX_CPU_COLLECTIVES_IMPLEMENTATION says
  otherwise) and `local_device_count(...)` host devices in this process, which overrides
  `--xla_force_host_platform_device_count`.

  Args:
    section: The config's distributed section; nothing happens unless `enabled`.
    num_devices: Devices of the whole job (the placement's `num_devices`), split evenly over the
      processes when `section.local_device_count` is 0.

  Raises:
    DistributedError: What is missing or wrong, on one line.
  """
  if not section.enabled:
    return
  args = resolve(section)
  count = local_device_count(section, num_devices, args["num_processes"])
  try:
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if count:
      jax.config.update("jax_num_cpu_devices", count)
    # JAX's preemption service: its own SIGTERM handler (`rlhfjax.signals` handles SIGTERM),
    # and its poll of the coordination service logs errors when process 0 ends.
    jax.config.update("jax_enable_preemption_service", False)
    # JAX aborts the process (a C++ fatal error and a stack trace) when its own time-outs
    # expire: ours expire first and say what was waited for in one line.
    with liveness.start_deadline(section.start_timeout_s, *_waiting_for(args)):
      jax.distributed.initialize(
        **args,
        initialization_timeout=section.start_timeout_s + _JAX_MARGIN_S,
        heartbeat_timeout_seconds=max(100, section.peer_timeout_s + _JAX_MARGIN_S),
      )
    global _wait_timeout_s
    _wait_timeout_s = float(section.wait_timeout_s)
    if jax.default_backend() == "cpu":
      _share_programs(section.start_timeout_s)
    liveness.watch_peers(section.peer_timeout_s, args["coordinator_address"])
  except (RuntimeError, ValueError, TypeError) as error:
    missing = [
      f"{flag} (or ${env})"
      for key, flag, env in (
        ("coordinator_address", "distributed.coordinator_address", "JAX_COORDINATOR_ADDRESS"),
        ("num_processes", "distributed.num_processes", "JAX_NUM_PROCESSES"),
        ("process_id", "distributed.process_id", "JAX_PROCESS_ID"),
      )
      if args[key] is None
    ]
    hint = f"; no cluster detected, so set {', '.join(missing)}" if missing else ""
    message = " ".join(str(error).split()).rstrip(".")
    raise DistributedError(f"jax.distributed.initialize failed: {message}{hint}") from None


_JAX_MARGIN_S = 30


def _share_programs(timeout_s: float) -> None:
  """CPU: no persistent compilation cache and, when every process runs on this host, each
  program whose devices span processes compiled once, by the process of its first device, whose
  executable the others load through the coordination service (`jax_share_binary_between_hosts`)
  instead of compiling it too.

  Gloo waits a fixed 30 s for the other processes at each new collective group. With a
  persistent cache, one process may load a program in a second while another compiles it for
  longer than that (an entry written in between, or found by the sharing process only, the
  others then waiting for an executable it never sends). Without the cache, a shared program's
  compile ends in every process at once. Another host may lack CPU features this one compiles
  for (XLA refuses such an executable): across hosts every process compiles its own.

  JAX shares a program under its cache key, which it computes with the persistent cache enabled
  (`jax_enable_compilation_cache`, kept) even when no cache directory is set. On CPU that key
  hashes the topology of the program's devices as the calling process sees it, which differs
  between processes (another process's devices have no local hardware id), so the others would
  wait for a key never written: here it hashes the devices' kinds instead, JAX's own fall-back
  for backends without a topology (the compile options in the key still name every device).
  Without that hook (another JAX version), every process compiles every program as before.

  The others wait on the shared program at most `distributed.wait_timeout_s`, like `wait_for`; a
  process that ended is noticed sooner by the liveness watch (`distributed.peer_timeout_s`).
  """
  jax.config.update("jax_compilation_cache_dir", None)
  hashing = getattr(jax_cache_key, "_hash_accelerator_config", None)
  store, me = client(), jax.process_index()
  store.key_value_set(f"rlhfjax/host/{me}", socket.gethostname())
  hosts = {store.blocking_key_value_get(f"rlhfjax/host/{p}", int(timeout_s * 1000))
           for p in range(jax.process_count())}  # fmt: skip
  if hashing is None or not hasattr(jax_cache_key, "_hash_devices") or len(hosts) > 1:
    jax.config.update("jax_enable_compilation_cache", False)
    return

  def hash_devices(hash_obj, devices):
    if all(device.platform == "cpu" for device in devices.flat):
      return jax_cache_key._hash_devices(hash_obj, devices)  # noqa: SLF001
    return hashing(hash_obj, devices)

  jax_cache_key._hash_accelerator_config = hash_devices  # noqa: SLF001
  jax.config.update("jax_share_binary_between_hosts", True)
  jax.config.update("jax_share_binary_between_hosts_timeout_ms", int(_wait_timeout_s * 1000))


def identity(args: Mapping[str, Any]) -> tuple[str, str]:
  """This process ("process 1 of 2") and the coordinator's address, from `resolve`'s result,
  for messages."""
  process = "this process" if args["process_id"] is None else f"process {args['process_id']}"
  count = "" if args["num_processes"] is None else f" of {args['num_processes']}"
  return process + count, args["coordinator_address"] or "the cluster's coordinator"


def _waiting_for(args: Mapping[str, Any]) -> tuple[str, str]:
  """Who waits at the join, and for what: process 0 runs the coordinator and waits for the
  others to connect to it; every other process waits for the job to start there."""
  who, where = identity(args)
  rule = "every process must start with the same num_processes and a distinct process_id"
  n = args["num_processes"]
  if args["process_id"] == 0 and n:
    others = "process 1" if n == 2 else f"some of processes 1 to {n - 1}"
    return who, f"{others} to join the job at its coordinator {where} ({rule})"
  return who, f"the job to start at the coordinator {where} (process 0 runs it; {rule})"


def is_primary() -> bool:
  """Whether this process writes the run's files and prints progress: process 0."""
  return jax.process_index() == 0


def primary_first(fn: Callable[[], T]) -> T:
  """`fn()` on process 0, then on the others once it is done: for work whose result other
  processes then find on the shared disk (a dataset prepared into the workdir) and which must
  not run twice at once there."""
  if jax.process_count() == 1:
    return fn()
  if is_primary():
    out = fn()
  wait_for(range(jax.process_count()), "process 0 done first")
  if not is_primary():
    out = fn()
  return out


def client() -> Any:
  """The job's coordination-service client (key-value store, barriers); JAX has no public
  handle for it."""
  return jax._src.distributed.global_state.client  # noqa: SLF001


def agree(parts: Mapping[str, str], timeout_s: float) -> None:
  """Every process of the job holds the same `parts` (a name -> value fingerprint of what must
  be identical: the resolved config, the code, the data files), or each one raises, naming
  the fields that differ and the processes, before anything compiles: a job whose processes
  disagree (one told to run 1 step, another 2) would otherwise hang in a collective that one of
  them never reaches. Returns at once in a single-process job.

  Raises:
    ValueError: the processes disagree, or one did not post its fingerprint within `timeout_s`.
  """
  n, me = jax.process_count(), jax.process_index()
  if n < 2:
    return
  c = client()
  c.key_value_set(f"rlhfjax:agree:{me}", json.dumps(dict(parts), sort_keys=True))
  theirs = {}
  for k in range(n):
    try:
      theirs[k] = json.loads(c.blocking_key_value_get(f"rlhfjax:agree:{k}", int(timeout_s * 1e3)))
    except Exception as error:  # noqa: BLE001 - the client's time-out is a plain error
      raise ValueError(
        f"process {me} of {n} gave up after {timeout_s:g} s (distributed.start_timeout_s) "
        f"waiting for process {k} to say what it runs"
      ) from error
  differ = []
  for name in sorted({key for values in theirs.values() for key in values}):
    values = {k: theirs[k].get(name, "(absent)") for k in range(n)}
    if len(set(values.values())) > 1:
      by_value: dict[str, list[int]] = {}
      for k, value in values.items():
        by_value.setdefault(value, []).append(k)
      differ.append(
        f"{name} is "
        + ", ".join(f"{_shorten(v)} on {_processes(ks)}" for v, ks in by_value.items())
      )
  if differ:
    more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
    raise ValueError(
      f"the job's {n} processes disagree: {'; '.join(differ[:4])}{more}: every process must "
      "start with the same config, code and data"
    )


def _processes(ids: list[int]) -> str:
  return f"process {ids[0]}" if len(ids) == 1 else f"processes {_span(tuple(ids))}"


def _shorten(value: str, limit: int = 40) -> str:
  return value if len(value) <= limit else value[: limit - 3] + "..."


_wait_timeout_s = 3600.0
"""`distributed.wait_timeout_s` of the job (`initialize`): how long a process waits for the
others at a meeting point (`wait_for`, `flagged`, a program another process compiles)."""

_meetings_lock = threading.Lock()
_meetings: dict[tuple[str, tuple[int, ...]], int] = {}
_AT = "rlhfjax/at/"  # each process's current meeting point, for the message of one that expires


def _meeting(what: str, ids: tuple[int, ...]) -> int:
  """How often this process met `ids` at `what` before: the processes of a meeting must reach
  it the same number of times."""
  with _meetings_lock:
    n = _meetings.get((what, ids), 0)
    _meetings[what, ids] = n + 1
  return n


def wait_for(processes: Iterable[int], what: str) -> None:
  """Waits until every process in `processes` has reached this point (a barrier through the
  coordination service), at most `distributed.wait_timeout_s`; returns at once on other
  processes.

  Called before a program whose collectives span processes: gloo gives the processes only 30
  seconds to meet when it first connects a set of devices, and one process may reach a program
  minutes before another (say, while that one still generates the batch it waits for). The
  processes of `processes` must call this the same number of times with the same `what`.

  Raises:
    DistributedError: The wait expired, naming where each missing process is.
  """
  ids = tuple(sorted(set(processes)))
  if len(ids) < 2 or jax.process_index() not in ids:
    return
  n = _meeting(what, ids)
  with _at(what, ids):
    client().wait_at_barrier(f"rlhfjax:{what}:{','.join(map(str, ids))}:{n}",
                             int(_wait_timeout_s * 1000), list(ids))  # fmt: skip


def shared(value: str, what: str) -> dict[int, str]:
  """Every process's `value`, the same mapping on every process: this one posts its own and
  reads the others' through the coordination service. Every process calls it the same number
  of times with the same `what`; waits for the others at most `distributed.wait_timeout_s`
  (`wait_for`'s error past that). One process: {0: value}."""
  count, me = jax.process_count(), jax.process_index()
  if count == 1:
    return {0: value}
  ids = tuple(range(count))
  n = _meeting(f"share:{what}", ids)
  c, key = client(), f"rlhfjax/share/{what}/"
  c.key_value_set(f"{key}{n}/{me}", value)
  with _at(what, ids):
    values = {p: c.blocking_key_value_get(f"{key}{n}/{p}", int(_wait_timeout_s * 1000))
              for p in ids}  # fmt: skip
  # Every process has posted round n, so each has read every key of round n - 1: this one's goes.
  if n:
    with contextlib.suppress(Exception):
      c.key_value_delete(f"{key}{n - 1}/{me}")
  return values


def flagged(flag: bool, what: str) -> list[int]:
  """The processes of the job where `flag` is set, the same list on every process: a decision
  they must take together (stop after this iteration when any one was asked to). Called as
  `shared` is. One process: [0] or []."""
  return [p for p, value in shared("1" if flag else "0", what).items() if value == "1"]


@contextlib.contextmanager
def _at(what: str, ids: tuple[int, ...]) -> Iterator[None]:
  """The main thread waits for `ids` at `what`: posted for the others' messages, said by a
  stop asked for meanwhile (`signals.waiting`), and an expired wait raised as one line."""
  me, c = jax.process_index(), client()
  others = [p for p in ids if p != me]
  with contextlib.suppress(Exception):
    c.key_value_set(f"{_AT}{me}", what, allow_overwrite=True)
  try:
    with signals.waiting(f"{_processes(others)} at {what!r}"):
      yield
  except Exception as error:  # noqa: BLE001 - the client's errors are plain runtime errors
    if "DEADLINE_EXCEEDED" not in str(error):
      raise
    raise DistributedError(_expired(what, others)) from None
  finally:
    with contextlib.suppress(Exception):
      c.key_value_set(f"{_AT}{me}", "", allow_overwrite=True)


def _expired(what: str, others: list[int]) -> str:
  """The line of a wait at `what` that expired: where each of `others` is."""
  try:
    at = {key.removeprefix(_AT): value for key, value in client().key_value_dir_get(_AT)}
  except Exception:  # noqa: BLE001 - the service gone: say what is known
    at = {}
  where = []
  for p in others:
    theirs = at.get(str(p), "")
    if theirs == what:
      continue  # it came
    where.append(
      f"process {p} waits at {theirs!r}" if theirs
      else f"process {p} never came (still working, or stuck outside any meeting point)"
    )  # fmt: skip
  me, count = jax.process_index(), jax.process_count()
  return (
    f"process {me} of {count} gave up after {_wait_timeout_s:g} s (distributed.wait_timeout_s) "
    f"waiting for the others at {what!r}: {'; '.join(where) or 'they came too late'}: the "
    "processes took different paths through the program, or one is far slower"
  )


def _span(indices: tuple[int, ...]) -> str:
  return f"{indices[0]}-{indices[-1]}" if indices == tuple(range(indices[0], indices[-1] + 1)) \
    else ",".join(map(str, indices))  # fmt: skip


def check_placement(spec: PlacementSpec, devices: list[jax.Device] | None = None) -> None:
  """With more than one process: every process owns some of the placement's devices.

  Roles may sit on any processes: a process runs the programs of the meshes holding its
  devices (JAX skips the others), and arrays move between processes through
  `rlhfjax.mesh.transfer`. A process owning none of the devices would only wait.

  Raises:
    DistributedError: Naming the processes left out and the devices used.
  """
  if jax.process_count() == 1:
    return
  devices = jax.devices() if devices is None else devices
  used = sorted({i for role_spec in spec.roles.values() for i in role_spec.devices})
  owners = {devices[i].process_index for i in used}
  if missing := sorted(set(range(jax.process_count())) - owners):
    raise DistributedError(
      f"processes {missing} own none of the placement's devices {_span(tuple(used))}; "
      f"use all {len(devices)} devices of the job"
    )
