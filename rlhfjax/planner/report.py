"""Text rendering of ranked plans: one row per plan, then the reason for the winner."""

from __future__ import annotations

from collections.abc import Sequence

from rlhfjax.costmodel.replay import STAGES
from rlhfjax.costmodel.workload import Workload
from rlhfjax.observe.timeline import StageRecord
from rlhfjax.placement.report import format_devices
from rlhfjax.placement.spec import Role
from rlhfjax.planner.evaluate import Plan, present_roles
from rlhfjax.planner.search import explain

_SHORT = {"actor": "A", "critic": "C", "reference": "Ref", "reward": "Rw", "rollout": "G"}


_TRAINING_AXES = (("stage", "p"), ("data", "d"), ("fsdp", "f"), ("context", "c"), ("tensor", "t"))
"""A training mesh's axes in order, by letter: fsdp and tensor always, the others when > 1."""


def format_groups(plan: Plan, roles: Sequence[str]) -> str:
  """Devices and mesh per role, e.g. 'A:0-7 f8t1 | G:0-7 d2t4' (with pipeline stages, data or
  context parallelism: 'p4f2t1', 'd2f4t1', 'f4c2t1')."""
  parts = []
  for role in roles:
    spec = plan.spec[role]
    axes = dict(spec.axes)
    if "fsdp" in axes:
      mesh = "".join(
        f"{short}{axes.get(name, 1)}"
        for name, short in _TRAINING_AXES
        if name in ("fsdp", "tensor") or axes.get(name, 1) > 1
      )
    else:
      mesh = f"d{axes['data']}t{axes['tensor']}"
    # An extra role by its own name.
    parts.append(f"{_SHORT.get(role, role)}:{format_devices(spec.devices)} {mesh}")
  return " | ".join(parts)


def format_plans(plans: Sequence[Plan], workload: Workload, *, top: int = 10) -> str:
  """The `top` plans as an aligned table, the rest counted, and why the winner wins."""
  roles = present_roles(workload)
  header = (
    "#",
    "placement",
    "groups (devices, mesh)",
    "mb",
    *STAGES,
    "iter s",
    "tok/s/dev",
    "peak GiB",
  )
  rows = [header]
  for i, plan in enumerate(plans[:top]):
    rows.append(
      (
        str(i + 1),
        plan.label,
        format_groups(plan, roles),
        str(plan.micro_batch),
        *(f"{plan.stages[s]:.2f}" for s in STAGES),
        f"{plan.iteration_s:.2f}",
        f"{plan.tokens_per_s_per_device:.1f}",
        f"{plan.peak_memory_gib:.1f}" + ("" if plan.fits else " (!)"),
      )
    )
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
  lines = [
    "  ".join(
      c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
    ).rstrip()
    for r in rows
  ]
  if len(plans) > top:
    lines.append(f"... {len(plans) - top} more candidates")
  lines.append("why: " + explain(plans))
  return "\n".join(lines)


PREDICTED_TIMELINE = "timeline_predicted.json"
"""A planned run's predicted timeline, written beside its measured `timeline.json`."""


def write_beside(
  plan: Plan, measured: Sequence[StageRecord], directory: str, title: str
) -> tuple[str, str]:
  """The plan's predicted timeline as `timeline_predicted.json` (the measured file's format;
  without generation and sync when nothing is generated) and `timeline.png` with two panels on one
  time axis: predicted above, the `measured` records below, each from its first shown start,
  over as many iterations as `measured` shows."""
  import dataclasses
  import json
  import os

  from rlhfjax.observe.timeline import plot_gantt_panels

  generates = Role.ROLLOUT in plan.spec.roles
  predicted = [r for r in plan.replay.records if generates or r.role != Role.ROLLOUT.value]
  json_path = os.path.join(directory, PREDICTED_TIMELINE)
  with open(json_path, "w") as f:
    json.dump([dataclasses.asdict(r) for r in predicted], f, indent=1)
  shown = len({r.iteration for r in measured}) or 1
  last = max(r.iteration for r in predicted)
  predicted = [r for r in predicted if r.iteration > last - shown]
  png_path = os.path.join(directory, "timeline.png")
  plot_gantt_panels(
    [
      (f"predicted: {plan.label}, {plan.iteration_s:.3g} s/iteration", predicted),
      (f"measured: {title}", measured),
    ],
    png_path,
    align=True,
  )
  return json_path, png_path


def write_timeline(plan: Plan, directory: str) -> tuple[str, str]:
  """The plan's predicted timeline as `timeline.json` (the measured file's format) and its
  Gantt chart `timeline.png`, drawn by the code that draws a measured run's."""
  import dataclasses
  import json
  import os

  from rlhfjax.observe.timeline import plot_gantt

  os.makedirs(directory, exist_ok=True)
  json_path = os.path.join(directory, "timeline.json")
  with open(json_path, "w") as f:
    json.dump([dataclasses.asdict(r) for r in plan.replay.records], f, indent=1)
  png_path = os.path.join(directory, "timeline.png")
  plot_gantt(plan.replay.records, png_path, title=f"predicted: {plan.label}")
  return json_path, png_path
