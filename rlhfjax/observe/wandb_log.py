"""Metrics rows mirrored into one Weights & Biases run per workdir (`logging.wandb=True`)."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Mapping
from typing import Any

from rlhfjax.config import LoggingSection

RUN_FILE = "wandb_run.json"


def _read_state(path: str) -> dict:
  try:
    with open(path) as f:
      state = json.load(f)
  except (OSError, ValueError):
    return {}
  return state if isinstance(state, dict) else {}


def _write_state(path: str, state: dict) -> None:
  with open(path + ".tmp", "w") as f:
    json.dump(state, f)
  os.replace(path + ".tmp", path)  # atomic: a crash leaves the old state or the new one


class WandbLog:
  """One W&B run per workdir, started at the first logged row, so a rerun that logs nothing (a
  finished one) starts no run and changes no file.

  `WORKDIR/wandb_run.json` keeps the run's id and the first step it does not have yet: a resumed
  run continues the same W&B run (`resume='allow'`) and skips steps an interrupted run already
  logged there, since a W&B run's history cannot be rewritten (metrics.jsonl has the rerun's
  values of those steps).
  """

  def __init__(self, workdir: str, section: LoggingSection, config: Mapping[str, Any]):
    import wandb  # only when enabled; `LoggingSection` has checked that it is installed

    self._wandb = wandb
    self.workdir = workdir
    self.section = section
    self.config = dict(config)
    self.path = os.path.join(workdir, RUN_FILE)
    self._state = _read_state(self.path)
    self._run = None

  @property
  def run_id(self) -> str | None:
    return self._state.get("id")

  def log(self, step: int, metrics: Mapping[str, float]) -> None:
    if step < self._state.get("next_step", 0):
      return  # the W&B run has this step from an interrupted run
    if self._run is None:
      self._run = self._start()
    self._run.log({k: float(v) for k, v in metrics.items()}, step=int(step))
    _write_state(self.path, {**self._state, "next_step": int(step) + 1})
    self._state["next_step"] = int(step) + 1

  def _start(self):
    s = self.section
    if not self.run_id:
      # Saved before the run starts: a crash at any later point resumes this id.
      self._state["id"] = secrets.token_hex(6)  # W&B ids: [a-z0-9], unique per project
      _write_state(self.path, self._state)
    return self._wandb.init(
      project=s.wandb_project,
      entity=s.wandb_entity or None,
      name=s.wandb_run_name or os.path.basename(os.path.abspath(self.workdir)),
      id=self.run_id,
      resume="allow",
      dir=self.workdir,
      config=self.config,
      mode=s.wandb_mode or None,
      # The console stays rlhfjax's: progress bars and one-line errors, not a W&B copy of them.
      settings=self._wandb.Settings(console="off"),
    )

  def close(self) -> None:
    if self._run is not None:
      self._run.finish()
      self._run = None


def for_run(cfg: Any, workdir: str, *, enabled: bool = True) -> WandbLog | None:
  """The W&B mirror of a run's metrics when `cfg.logging.wandb` is set (and this process
  writes metrics, `enabled`), with the whole typed config `cfg` as the W&B config; else None."""
  if not (enabled and cfg.logging.wandb):
    return None
  return WandbLog(workdir, cfg.logging, dataclasses.asdict(cfg))
