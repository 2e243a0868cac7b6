"""Adaptive model placement: which devices and which mesh each RLHF role gets."""

from rlhfjax.placement.memory import MemoryEstimate, estimate_memory, estimate_placement_memory
from rlhfjax.placement.report import (
  format_adapters,
  format_batches,
  format_placement_table,
  option_report,
)
from rlhfjax.placement.spec import LAYOUT_AXES, Layout, PlacementSpec, Role, RoleSpec
from rlhfjax.placement.strategies import (
  build_placement,
  colocated,
  disaggregated,
  from_explicit,
  interleaved,
  register_strategy,
  reverse_stages,
  strategy_names,
)
from rlhfjax.placement.validate import PlacementError

__all__ = [
  "LAYOUT_AXES",
  "Layout",
  "MemoryEstimate",
  "PlacementError",
  "PlacementSpec",
  "Role",
  "RoleSpec",
  "build_placement",
  "colocated",
  "disaggregated",
  "estimate_memory",
  "estimate_placement_memory",
  "format_adapters",
  "format_batches",
  "format_placement_table",
  "from_explicit",
  "interleaved",
  "register_strategy",
  "reverse_stages",
  "strategy_names",
  "option_report",
]
