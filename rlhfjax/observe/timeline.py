"""Stage timeline: every stage of an iteration records (role, stage, start, end, devices).

The records are written as JSON and drawn as a Gantt chart with one lane per device group, so
a run shows where its time goes and which stages overlap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageRecord:
  iteration: int
  role: str
  stage: str
  start: float
  """Seconds since the timeline began."""
  end: float
  devices: tuple[int, ...]
  chunk: int = -1
  """A fused scoring block: the index of the micro-batch of samples it scored (-1: a whole
  stage)."""

  @property
  def seconds(self) -> float:
    return self.end - self.start


class Timeline:
  """Thread-safe list of stage records; stages running in threads record concurrently."""

  def __init__(self, clock=time.perf_counter):
    self._clock = clock
    self._origin = clock()
    self._lock = threading.Lock()
    self.records: list[StageRecord] = []

  def now(self) -> float:
    return self._clock() - self._origin

  @contextlib.contextmanager
  def stage(self, iteration: int, role: str, stage: str, devices: Sequence[int]) -> Iterator[None]:
    """Records the wall time of the block. The block must wait for its device work."""
    start = self.now()
    try:
      yield
    finally:
      record = StageRecord(
        iteration=iteration,
        role=role,
        stage=stage,
        start=start,
        end=self.now(),
        devices=tuple(devices),
      )
      with self._lock:
        self.records.append(record)

  def add(self, record: StageRecord) -> None:
    """Adds a record timed by the caller (work waited for in another thread)."""
    with self._lock:
      self.records.append(record)

  def for_iteration(self, iteration: int) -> list[StageRecord]:
    with self._lock:
      return [r for r in self.records if r.iteration == iteration]

  def continue_from(self, records: Sequence[StageRecord]) -> None:
    """Starts with `records` (an interrupted run's) and goes on timing after their last end,
    so that a resumed run's timeline reads as one run."""
    with self._lock:
      self._origin = self._clock() - max((r.end for r in records), default=0.0)
      self.records = [*records, *self.records]

  def write_json(self, path: str, *, before: int | None = None) -> None:
    """The records as a JSON list (with `before`, those of earlier iterations only), written
    atomically: a crash leaves the old file or the new one."""
    with self._lock:
      rows = [dataclasses.asdict(r) for r in self.records if before is None or r.iteration < before]
    with open(path + ".tmp", "w") as f:
      json.dump(rows, f, indent=1)
    os.replace(path + ".tmp", path)

  @staticmethod
  def read_json(path: str) -> list[StageRecord]:
    with open(path) as f:
      return [StageRecord(**{**row, "devices": tuple(row["devices"])}) for row in json.load(f)]


def _lane_name(devices: tuple[int, ...]) -> str:
  if not devices:
    return "host"
  if len(devices) > 1 and devices == tuple(range(devices[0], devices[-1] + 1)):
    return f"devices {devices[0]}-{devices[-1]}"
  return "devices " + ",".join(map(str, devices))


def plot_gantt(records: Sequence[StageRecord], path: str, title: str = "") -> None:
  """One lane per distinct device group; bars coloured by stage, labelled by role."""
  plot_gantt_panels([(title or "stage timeline", records)], path)


def plot_gantt_panels(
  panels: Sequence[tuple[str, Sequence[StageRecord]]], path: str, *, align: bool = False
) -> None:
  """`plot_gantt` of several timelines, one panel each, stacked on one time axis with one
  colour per stage name across panels (e.g. predicted above measured). With `align`, each
  panel's records are shifted to start at 0."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  if align:
    panels = [(title, _from_zero(records)) for title, records in panels]
  stages = sorted({r.stage for _, records in panels for r in records})
  colours = dict(zip(stages, plt.get_cmap("tab10").colors, strict=False))
  lanes = [_lanes(records) for _, records in panels]
  fig, axes = plt.subplots(
    len(panels),
    1,
    sharex=True,
    squeeze=False,
    figsize=(12, sum(0.7 * max(len(x), 1) + 1.2 for x in lanes) + 0.3),
    gridspec_kw={"height_ratios": [max(len(x), 1) + 1 for x in lanes]},
  )
  for ax, (title, records), panel_lanes in zip(axes[:, 0], panels, lanes, strict=True):
    _draw(ax, records, panel_lanes, colours)
    ax.set_title(title)
  axes[-1, 0].set_xlabel("seconds")
  handles = [plt.Rectangle((0, 0), 1, 1, color=colours[s]) for s in stages]
  axes[0, 0].legend(handles, stages, loc="upper right", fontsize=7, ncols=min(len(stages), 6))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _from_zero(records: Sequence[StageRecord]) -> list[StageRecord]:
  origin = min((r.start for r in records), default=0.0)
  return [dataclasses.replace(r, start=r.start - origin, end=r.end - origin) for r in records]


def _lanes(records: Sequence[StageRecord]) -> list[tuple[int, ...]]:
  return sorted({r.devices for r in records}, key=lambda d: (d[0] if d else -1, -len(d)))


def _draw(ax, records: Sequence[StageRecord], lanes, colours) -> None:
  for record in records:
    lane = lanes.index(record.devices)
    ax.barh(
      lane,
      record.seconds,
      left=record.start,
      height=0.6 if record.chunk < 0 else 0.3,  # fused scoring blocks show over generation
      color=colours[record.stage],
      edgecolor="black",
      linewidth=0.3,
      hatch=None if record.chunk < 0 else "//",
      zorder=2 if record.chunk < 0 else 3,
    )
    if record.seconds > 0:
      ax.text(
        record.start + record.seconds / 2,
        lane,
        record.role if record.chunk < 0 else f"{record.role} #{record.chunk}",
        ha="center",
        va="center",
        fontsize=6,
        clip_on=True,
      )
  ax.set_yticks(range(len(lanes)), [_lane_name(d) for d in lanes])
  ax.invert_yaxis()
