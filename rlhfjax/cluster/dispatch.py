"""Running stages of one iteration over the placement: concurrently where devices are disjoint.

Stages whose device sets overlap run one after another (co-located roles share their devices);
groups of stages with disjoint devices run at the same time, each group in its own thread. JAX
releases the GIL while XLA executes, so the device work of disjoint meshes overlaps. JAX keeps
transfer guards per thread: each group's thread runs under the caller's guards.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from rlhfjax import distributed
from rlhfjax.observe.timeline import Timeline


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
  role: str
  name: str
  devices: tuple[int, ...]
  fn: Callable[[], Any]
  """Does the stage's work; its result is waited for before the stage counts as ended."""


def device_groups(stages: Sequence[Stage]) -> list[list[int]]:
  """Indices of `stages` grouped into connected components of overlapping device sets."""
  parent = list(range(len(stages)))

  def find(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  for i, a in enumerate(stages):
    for j in range(i):
      if set(a.devices) & set(stages[j].devices):
        parent[find(i)] = find(j)
  groups: dict[int, list[int]] = {}
  for i in range(len(stages)):
    groups.setdefault(find(i), []).append(i)
  return list(groups.values())


_GUARDS = ("host_to_device", "device_to_device", "device_to_host")


def _transfer_guards() -> dict[str, str | None]:
  """The calling thread's transfer guards."""
  return {kind: getattr(jax.config, f"jax_transfer_guard_{kind}") for kind in _GUARDS}


@contextlib.contextmanager
def _under(guards: dict[str, str | None]):
  with contextlib.ExitStack() as stack:
    for kind, level in guards.items():
      if level is not None:
        stack.enter_context(getattr(jax, f"transfer_guard_{kind}")(level))
    yield


def _processes(devices: Sequence[int]) -> set[int]:
  """The processes owning these devices (indices into `jax.devices()`)."""
  if jax.process_count() == 1:
    return set()
  every = jax.devices()
  return {every[i].process_index for i in devices}


def run_stages(
  stages: Sequence[Stage],
  timeline: Timeline,
  iteration: int,
  *,
  before: Callable[[int], None] | None = None,
  after: Callable[[int], None] | None = None,
) -> list[Any]:
  """Runs every stage, recording it on the timeline; returns results in the input order.

  `before(i)` and `after(i)` are called in the stage's own thread just before stage i starts
  and just after it ends (the cluster moves offloaded state there)."""
  results: list[Any] = [None] * len(stages)
  guards = _transfer_guards()

  def run_group(indices: list[int]) -> None:
    with _under(guards):
      for i in indices:
        stage = stages[i]
        if before is not None:
          before(i)
        distributed.wait_for(_processes(stage.devices), f"stage {stage.role}/{stage.name}")
        with timeline.stage(iteration, stage.role, stage.name, stage.devices):
          results[i] = jax.block_until_ready(stage.fn())
        if after is not None:
          after(i)

  groups = device_groups(stages)
  if len(groups) == 1:
    run_group(groups[0])
    return results
  with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
    for future in [pool.submit(run_group, g) for g in groups]:
      future.result()
  return results
