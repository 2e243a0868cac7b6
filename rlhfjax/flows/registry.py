"""Flows by name: `algorithm.name` picks a registered flow, `algorithm.flow='module:function'`
a user's own (a factory `make_flow(ctx: FlowContext) -> flow`).

A flow is an object with:
  iteration(i) -> dict[str, float]   one iteration's metrics row;
  checkpoint_items() -> dict          arrays to save beside the trained roles' states;
  abstract_items() -> dict            their shapes and shardings, to restore into;
  meta() -> dict / restore(items, meta)  its JSON state (see `rlhfjax.runner`);
  close()                             stops background work.
`rlhfjax.flows.base.Flow` implements the parts most flows share.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rlhfjax import tasks

FLOWS: dict[str, Callable[..., Any]] = {}
"""Registered flow factories by name."""

_BUILTIN = ("ppo", "dpo", "online_dpo")
"""Modules of `rlhfjax.flows` whose import registers the built-in flows."""


def register(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorator: registers a flow factory (or class) under `name`."""

  def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
    FLOWS[name] = factory
    return factory

  return wrap


def builtin() -> dict[str, Callable[..., Any]]:
  """The registered flows, the built-in ones imported."""
  for module in _BUILTIN:
    importlib.import_module(f"rlhfjax.flows.{module}")
  return FLOWS


def resolve(name: str, flow: str = "") -> Callable[..., Any]:
  """The factory of `flow` ('module:function') if given, else of the registered `name`."""
  if flow:
    return tasks.load_callable(flow, "flow")
  flows = builtin()
  if name not in flows:
    raise ValueError(f"'algorithm.name' must be one of {', '.join(sorted(flows))}, got {name!r}")
  return flows[name]
