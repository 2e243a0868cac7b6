"""When offloaded state is in device memory: for its stage, prefetched while the stage before runs.

`cfg.offload` names parts of roles that live in host memory while idle (`rlhfjax.mesh.offload`):
a frozen role's parameters, used by its 'score' stages, a trained role's parameters, used by
its 'score' and 'update' stages, and a trained role's optimizer state, used by its 'update'
stages. Stages on shared devices run one after another (`dispatch`), so
while one runs, the next one's parts can come back: `to_device` only enqueues the copies (JAX
dispatches them asynchronously and the next stage's program waits for them), so issuing them
before the current stage runs overlaps them with it where the backend copies concurrently (a
GPU's copy engines). After its stage a part goes back to host memory unless a later stage of the
call, or of the next call (`then`), uses it.

Every decision is written to `events` (the current and the previous iteration's), in the order
it was taken on each device group: a stage's 'start' (with the memory kinds its parts then
report) and 'end', and each part's 'prefetch' and 'park'. Tests read the order from there, not
from clocks.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rlhfjax.cluster import dispatch
from rlhfjax.mesh import offload

Key = tuple[str, str]
"""(role, stage name) of a stage."""


@dataclasses.dataclass(frozen=True)
class Part:
  """One offloadable piece of one role's state."""

  role: str
  kind: str
  """'params' (a role's parameters) or 'optimizer' (a trained role's optimizer state)."""
  stages: tuple[str, ...]
  """The names of the role's stages that use it."""

  @property
  def keys(self) -> frozenset[Key]:
    return frozenset((self.role, stage) for stage in self.stages)


def part_of(role: str, kind: str, trained: bool) -> Part:
  """The part `kind` of `role`, with the stages that use it: a frozen role's parameters its
  'score' stages; a trained role's its 'score' and 'update' stages, its moments the latter."""
  if kind == "optimizer":
    return Part(role, kind, ("update",))
  return Part(role, kind, ("score", "update") if trained else ("score",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
  iteration: int
  event: str
  """'start' or 'end' of a stage; 'prefetch' or 'park' of a part."""
  role: str
  what: str
  """The stage's name, or the part's kind."""
  memory_kinds: tuple[str, ...] = ()
  """At a stage's 'start': the memory kinds its offloaded parts report."""


class Residency:
  """Moves offloaded parts between host and device memory around stages; see the module."""

  def __init__(
    self,
    parts: Callable[[], Sequence[Part]],
    get: Callable[[Part], Any],
    put: Callable[[Part, Any], None],
    devices: Callable[[str], tuple[int, ...]],
  ):
    """`parts()`: the offloaded parts that exist now; `get`/`put` read and replace one;
    `devices(role)`: the device indices of a role."""
    self._parts, self._get, self._put, self._devices = parts, get, put, devices
    self._lock = threading.Lock()
    self.events: list[Event] = []
    """The decisions of the current and the previous iteration, in order."""

  def _log(self, iteration: int, event: str, role: str, what: str, kinds=()) -> None:
    with self._lock:
      if self.events and iteration > self.events[-1].iteration:
        # A long run keeps the events of the last two iterations only.
        self.events = [e for e in self.events if e.iteration >= iteration - 1]
      self.events.append(Event(iteration=iteration, event=event, role=role, what=what,
                               memory_kinds=tuple(sorted(kinds))))  # fmt: skip

  def _move(self, part: Part, to_device: bool, iteration: int | None = None) -> None:
    tree = self._get(part)
    want = offload.DEVICE if to_device else offload.HOST
    if offload.memory_kinds(tree) <= {want}:
      return
    self._put(part, (offload.to_device if to_device else offload.to_host)(tree))
    if iteration is not None:
      self._log(iteration, "prefetch" if to_device else "park", part.role, part.kind)

  def place(self, active: set[Key] | None) -> None:
    """Parts used by a stage in `active` (every part with None) to device memory, the rest to
    host memory; no events."""
    for p in self._parts():
      self._move(p, active is None or bool(p.keys & active))

  def _used(self, keys: Iterable[Key]) -> list[Part]:
    keys = set(keys)
    return [p for p in self._parts() if p.keys & keys]

  def run(
    self,
    stages: Sequence[dispatch.Stage],
    timeline: Any,
    iteration: int,
    then: Iterable[Key] = (),
  ) -> list[Any]:
    """Runs `stages` (`dispatch.run_stages`) with each stage's parts in device memory while it
    runs, prefetched while the stage before it on its devices runs; `then` names the stages of
    the next call, whose parts are prefetched during this call's last stage on their devices."""
    keys = [(s.role, s.name) for s in stages]
    then = set(then)
    # Parts no stage of this call or of the next uses go to host memory now; the others stay
    # where they are until their turn.
    wanted = set(keys) | then
    for p in self._parts():
      if not p.keys & wanted:
        self._move(p, False, iteration)
    groups = dispatch.device_groups(stages)
    following: dict[int, list[Part]] = {}
    """Per stage: the parts to prefetch when it starts."""
    keep: dict[int, set[Part]] = {}
    """Per stage: its parts that stay on device after it (a later stage or `then` uses them)."""
    claimed: set[Part] = set()
    for group in groups:
      devices = set().union(*(stages[i].devices for i in group))
      for n, i in enumerate(group):
        later = [keys[j] for j in group[n + 1 :]] + list(then)
        keep[i] = set(self._used(later))
        if n + 1 < len(group):
          following[i] = self._used([keys[group[n + 1]]])
        else:
          # Each `then` part goes with one group (its moves then stay in one thread).
          nxt = [
            p for p in self._used(then) if p not in claimed and devices & set(self._devices(p.role))
          ]
          following[i] = nxt
          claimed.update(nxt)
    # `then` parts on devices this call does not use: prefetched at once.
    for part in self._used(then):
      if part not in claimed:
        self._move(part, True, iteration)
    for group in groups:  # the first stage of each group: its parts now
      for part in self._used([keys[group[0]]]):
        self._move(part, True, iteration)

    def before(i: int) -> None:
      mine = self._used([keys[i]])
      for part in mine:  # normally prefetched already
        self._move(part, True, iteration)
      kinds = set().union(*(offload.memory_kinds(self._get(p)) for p in mine)) if mine else set()
      self._log(iteration, "start", *keys[i], kinds)
      for part in following[i]:
        self._move(part, True, iteration)

    def after(i: int) -> None:
      self._log(iteration, "end", *keys[i])
      for part in self._used([keys[i]]):
        if part not in keep[i]:
          self._move(part, False, iteration)

    return dispatch.run_stages(stages, timeline, iteration, before=before, after=after)
