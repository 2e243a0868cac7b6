"""Per-iteration metrics: one JSON object per line in `metrics.jsonl`, TensorBoard, and plots."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from rlhfjax.observe.wandb_log import WandbLog


class MetricsError(ValueError):
  """A metrics file cannot be read: a line that is not JSON (not a crash's cut-short last one)."""


def _tensorboardx():
  """tensorboardX's modules, imported without PyTorch unless it is loaded already.

  tensorboardX imports torch whenever it is installed, only to accept torch tensors, which
  rlhfjax never passes; that import costs seconds of start-up in every run. A `None` entry in
  `sys.modules` makes `import torch` raise ImportError, which tensorboardX handles; the entry is
  removed at once, so a later `import torch` works as usual.
  """
  loaded = "torch" in sys.modules
  if not loaded:
    sys.modules["torch"] = None  # type: ignore[assignment]
  try:
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto import event_pb2, summary_pb2
  finally:
    if not loaded:
      del sys.modules["torch"]
  return EventsWriter, event_pb2, summary_pb2


class _TensorBoard:
  """Scalars as TensorBoard events under `logdir`, written in the calling thread.

  tensorboardX's `SummaryWriter` writes from a thread of its own: on a full disk that thread
  died with a traceback and the next flush waited for it forever. Here a failed write is an
  `OSError` in the caller, which reports it in one line. `purge_step` (a resumed run's first
  step) tells TensorBoard to hide the steps from there that an interrupted run wrote, as
  `SummaryWriter(purge_step=...)` does.
  """

  def __init__(self, logdir: str, purge_step: int = 0):
    events_writer, self._event_pb2, self._summary_pb2 = _tensorboardx()
    os.makedirs(logdir, exist_ok=True)
    # The file's name has the second it was made: a run resumed within that second would
    # overwrite the first file without the nanoseconds after it.
    suffix = f".{time.time_ns() % 10**9:09d}"
    self._writer = events_writer(os.path.join(logdir, "events"), filename_suffix=suffix)
    if purge_step:
      log = self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)
      self._write(self._event_pb2.Event(step=purge_step, session_log=log))

  def _write(self, event) -> None:
    event.wall_time = time.time()
    self._writer.write_event(event)

  def add_scalars(self, step: int, metrics: Mapping[str, float]) -> None:
    values = [
      self._summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()
    ]
    self._write(self._event_pb2.Event(step=step, summary=self._summary_pb2.Summary(value=values)))
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


def _plain(value):
  value = float(value)
  return value if math.isfinite(value) else str(value)


class MetricsWriter:
  """Appends metrics to `workdir/metrics.jsonl` and TensorBoard events under `workdir/tb`.

  A run that starts at `start_step` (resumed from a checkpoint, or restarted from scratch)
  first drops the rows of steps >= `start_step` that an earlier, interrupted run wrote: those
  steps are about to be run again, and the file must read as one run. TensorBoard is told the
  same (`purge_step`). Each row is appended with a single `write` of the whole line to a file
  opened with O_APPEND, then fsynced, so a crash leaves at most a cut-short last line, which
  `read` ignores and the next run's start drops. Only one process of a multi-host job should
  write: pass `enabled=False` elsewhere. `wandb`, when given, gets every row too.
  """

  def __init__(
    self,
    workdir: str,
    *,
    enabled: bool = True,
    tensorboard: bool = True,
    start_step: int = 0,
    wandb: WandbLog | None = None,
  ):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.enabled = enabled
    self._tb = None
    self._wandb = wandb if enabled else None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      self._drop_rows_from(start_step)
      if tensorboard:
        self._tb = _TensorBoard(os.path.join(workdir, "tb"), purge_step=start_step)

  def _drop_rows_from(self, step: int) -> None:
    if not os.path.exists(self.path):
      return
    kept = [row for row in self.read(self.path) if row["step"] < step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in kept)
    os.replace(tmp, self.path)  # atomic: a crash leaves the old file or the new one

  def rows(self) -> list[dict]:
    """Every row written so far, earlier runs' kept rows included."""
    return self.read(self.path) if os.path.exists(self.path) else []

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
    line = (json.dumps(row) + "\n").encode()
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      written = os.write(fd, line)
      if written != len(line):  # a full disk: no half row left behind for the next write
        os.ftruncate(fd, os.fstat(fd).st_size - written)
        raise OSError(28, "No space left on device", self.path)
      os.fsync(fd)
    finally:
      os.close(fd)
    if self._tb is not None:
      self._tb.add_scalars(int(step), metrics)
    if self._wandb is not None:
      self._wandb.log(int(step), metrics)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.close()

  @staticmethod
  def read(path: str) -> list[dict]:
    """The rows of a metrics file; a last line cut short by a crash is left out.

    Raises:
      MetricsError: a complete line is not a JSON object with a 'step' (naming file:line).
    """
    rows = []
    with open(path, errors="replace") as f:
      for number, line in enumerate(f, 1):
        try:
          row = json.loads(line)
        except json.JSONDecodeError:
          if not line.endswith("\n"):
            continue  # cut short by a crash
          row = None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
          raise MetricsError(
            f"{path}:{number} is not a metrics row (a JSON object with a 'step'); fix or "
            "delete that line"
          )
        rows.append(row)
    return rows


def plot_metric(rows: Sequence[Mapping], key: str, path: str, title: str = "") -> None:
  """A line plot of `key` against `step`, for rows that have it."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), int | float)]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  if points:
    ax.plot(*zip(*points, strict=True), marker="o", markersize=3)
  ax.set_xlabel("step")
  ax.set_ylabel(key)
  ax.set_title(title or key)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
