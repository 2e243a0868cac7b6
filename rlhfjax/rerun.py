"""Whether a workdir holds a finished run, so that rerunning it changes nothing.

A run that reaches `total_steps` and has written every output (metrics, evaluations, plots,
timeline) writes `WORKDIR/finished.json` last. A rerun whose `total_steps` is not beyond that
step is finished: the entry point prints `finished_line` and returns before building anything,
so no file is touched, not even a new TensorBoard events file. A rerun with a larger
`total_steps` (or any run that gets as far as training) removes the marker first: its outputs
are about to change, and a run killed in between must not look finished.

A run killed before the marker is written (even after its last checkpoint) is not finished:
its rerun resumes and redoes what is missing. The marker is written by process 0 and read by
every process, from the shared disk the checkpoints are on.

Nothing here imports JAX.
"""

from __future__ import annotations

import contextlib
import json
import os

MARKER = "finished.json"


def finished_step(workdir: str) -> int | None:
  """The step the run in `workdir` finished at, or None when it has not finished."""
  try:
    with open(os.path.join(workdir, MARKER)) as f:
      step = json.load(f).get("step")
  except (OSError, ValueError, AttributeError):
    return None
  return step if isinstance(step, int) else None


def is_finished(workdir: str, total_steps: int) -> bool:
  """Whether a run of `total_steps` in `workdir` has nothing left to do."""
  step = finished_step(workdir)
  return step is not None and step >= total_steps


def finished_line(workdir: str, what: str = "total_steps") -> str:
  """The one line a rerun of a finished run prints; `what` names the setting that trains
  more."""
  return (
    f"{workdir}: finished at step {finished_step(workdir)}; nothing to do (delete the workdir "
    f"or raise {what} to train more)"
  )


def mark_finished(workdir: str, step: int) -> None:
  """Records that the run in `workdir` finished at `step`, atomically: call it after every
  other output is written."""
  path = os.path.join(workdir, MARKER)
  with open(path + ".tmp", "w") as f:
    json.dump({"step": int(step)}, f)
  os.replace(path + ".tmp", path)


def clear(workdir: str) -> None:
  """Forgets that the run in `workdir` finished: it is about to train or rewrite outputs."""
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(workdir, MARKER))
