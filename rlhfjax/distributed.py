"""Multi-process (multi-host) runs: one JAX controller per process, all running the same program.

`initialize` joins the processes of a job with `jax.distributed.initialize`, before JAX starts
its backends; on CPU it also picks gloo collectives and the host devices each process emulates
(two processes of 4 CPU devices on one machine behave as one job of 8 devices). Afterwards a
global array can span devices that other processes own:

- `to_host` reads arrays on the host, gathering the ones this process holds only part of;
- `is_primary` says whether this process writes files (metrics, plots, checkpoint metadata);
- `check_placement` rejects placements whose cross-mesh moves multi-process runs do not support.

Every process must run the same computations in the same order on the same host data: seeds,
prompts and host arrays are the same in every process by construction, and `jax.device_put` of
a NumPy array to a global sharding checks that they are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import jax
from jax.experimental import multihost_utils

from rlhfjax import liveness
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
    # JAX aborts the process (a C++ fatal error and a stack trace) when its own time-outs
    # expire: ours expire first and say what was waited for in one line.
    with liveness.start_deadline(section.start_timeout_s, _waiting_for(args)):
      jax.distributed.initialize(
        **args,
        initialization_timeout=section.start_timeout_s + _JAX_MARGIN_S,
        heartbeat_timeout_seconds=max(100, section.peer_timeout_s + _JAX_MARGIN_S),
      )
    if jax.default_backend() == "cpu":
      # Gloo waits a fixed 30 s for the other processes at each new collective group. With a
      # persistent compilation cache, one process may load a program in a second while another
      # compiles it for longer than that (an entry written in between): without the cache the
      # processes compile alike and reach their collectives together.
      jax.config.update("jax_enable_compilation_cache", False)
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


def _waiting_for(args: Mapping[str, Any]) -> str:
  process = "this process" if args["process_id"] is None else f"process {args['process_id']}"
  count = "" if args["num_processes"] is None else f" of {args['num_processes']}"
  address = args["coordinator_address"] or "the cluster's coordinator"
  return (
    f"{process}{count} to join the job at the coordinator {address} (process 0 runs it; "
    "every process must start with the same num_processes and a distinct process_id)"
  )


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
  multihost_utils.sync_global_devices("rlhfjax: process 0 done first")
  if not is_primary():
    out = fn()
  return out


def to_host(tree: Any) -> Any:
  """NumPy copies of a pytree of arrays, global ones included.

  An array this process holds only part of (not fully addressable and not replicated) is
  gathered from every process first: a collective, so every process must call this for the
  same arrays in the same order. Other arrays are read locally.
  """

  def gather(x):
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
      return multihost_utils.process_allgather(x, tiled=True)
    return x

  return jax.device_get(jax.tree.map(gather, tree))


def _span(indices: tuple[int, ...]) -> str:
  return f"{indices[0]}-{indices[-1]}" if indices == tuple(range(indices[0], indices[-1] + 1)) \
    else ",".join(map(str, indices))  # fmt: skip


def check_placement(spec: PlacementSpec, devices: list[jax.Device] | None = None) -> None:
  """With more than one process: every role on the same devices, some of them in every process.

  Moves between different device sets (for example the weight sync of a disaggregated
  placement) and the concurrent stages of disjoint device groups are not supported across
  processes; meshes with different axes or layouts on the same devices are.

  Raises:
    DistributedError: Naming the roles, their devices and the processes that own them.
  """
  if jax.process_count() == 1:
    return
  devices = jax.devices() if devices is None else devices
  owners = lambda indices: sorted({devices[i].process_index for i in indices})
  by_devices: dict[frozenset[int], list[str]] = {}
  for role, role_spec in spec.roles.items():
    by_devices.setdefault(frozenset(role_spec.devices), []).append(str(role))
  if len(by_devices) > 1:
    groups = "; ".join(
      f"{', '.join(roles)} on devices {_span(tuple(sorted(d)))} (processes {owners(d)})"
      for d, roles in by_devices.items()
    )
    raise DistributedError(
      f"multi-process runs need every role on the same devices "
      f"(placement.strategy='colocated'); placement {spec.strategy!r} has {groups}"
    )
  (indices,) = by_devices
  if missing := sorted(set(range(jax.process_count())) - set(owners(indices))):
    raise DistributedError(
      f"processes {missing} own none of the placement's devices "
      f"{_span(tuple(sorted(indices)))}; use all {len(devices)} devices of the job"
    )
