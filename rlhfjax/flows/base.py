"""What most flows share (see `rlhfjax.flows.registry` for what a flow is): no arrays to save
beyond the trained roles' states, which the runner checkpoints itself; the count of updates
skipped in a row as their JSON state; nothing running in the background."""

from __future__ import annotations

from typing import Any


class Flow:
  """Base of a flow; subclasses write `iteration` and override what they keep beyond this."""

  skipped_in_row: int = 0
  """Updates skipped in a row for non-finite values (the runner stops the run at a limit)."""

  def abstract_items(self) -> dict[str, Any]:
    return {}

  def checkpoint_items(self) -> dict[str, Any]:
    return {}

  def meta(self) -> dict[str, Any]:
    return {"skipped_in_row": self.skipped_in_row}

  def restore(self, items: dict[str, Any], meta: dict[str, Any]) -> None:
    del items
    self.skipped_in_row = int(meta.get("skipped_in_row", 0))

  def close(self) -> None:
    pass
