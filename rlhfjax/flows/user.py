"""A user's own flow (`algorithm.flow='module:function'`), called so that its faults name it.

The library's own faults are reported as internal errors (`rlhfjax.errors`); a fault in the
user's file is not one. `load` imports the factory and wraps it: a file that does not import
(a syntax error, an exception at import), a factory that raises or returns something that is
not a flow, and an iteration that raises or returns something other than a row of scalar
metrics each become one `FlowError` line that starts with the user's file and line and names
the flow.
"""

from __future__ import annotations

import importlib
import numbers
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

_METHODS = ("iteration", "checkpoint_items", "abstract_items", "meta", "restore", "close")
"""What the runner calls on a flow (`rlhfjax.flows.registry`); `rlhfjax.flows.base.Flow`
gives every one but `iteration`."""


DECLARED = "__flow_spec__"
"""The attribute `rlhfjax.flows.registry.declare` sets on a user's factory: its spec's fields,
kept on the checked factory `load` returns."""


class FlowError(ValueError):
  """A user's flow cannot be imported, raised, or returned the wrong thing."""


def _where(error: BaseException, files: tuple[str, ...]) -> str:
  """'file:line: ' of the innermost frame of `error` in one of `files` (the user's module), or
  of the error itself for a syntax error; '' when none is the user's."""
  if isinstance(error, SyntaxError) and error.filename:
    return f"{error.filename}:{error.lineno}: "
  frames = traceback.extract_tb(error.__traceback__)
  mine = [f for f in frames if os.path.abspath(f.filename) in files]
  return f"{mine[-1].filename}:{mine[-1].lineno}: " if mine else ""


def _raised(name: str, what: str, error: BaseException, files: tuple[str, ...]) -> FlowError:
  text = " ".join(str(error).split())
  return FlowError(f"{_where(error, files)}flow {name!r} {what} {type(error).__name__}: {text}")


def load(path: str) -> Callable[[Any], Any]:
  """The factory of 'module:function', wrapped so that what it builds is checked (`checked`).

  Raises:
    FlowError: the module does not import, or has no such callable.
  """
  module_name, _, attr = path.partition(":")
  if not module_name or not attr:
    raise FlowError(f"'algorithm.flow' must be 'module:function', got {path!r}")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if not module_name.startswith(e.name or "\0"):
      raise _raised(path, "could not be imported:", e, ()) from e
    raise FlowError(
      f"cannot import flow {path!r}: {e} (a module of your own: on PYTHONPATH or, for the "
      "scripts, the current directory)"
    ) from None
  except Exception as e:  # noqa: BLE001 - whatever importing the user's file raises
    frames = traceback.extract_tb(e.__traceback__)
    files = tuple(os.path.abspath(f.filename) for f in frames[1:])
    raise _raised(path, "could not be imported:", e, files) from e
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise FlowError(f"flow {path!r}: module {module_name!r} has no callable {attr!r}")
  return checked(path, factory, _module_files(module))


def _module_files(module) -> tuple[str, ...]:
  """The source file of the user's module (and of its package's modules, for a package)."""
  files = {os.path.abspath(module.__file__)} if getattr(module, "__file__", None) else set()
  prefix = module.__name__.partition(".")[0] + "."
  for other in list(sys.modules.values()):
    if getattr(other, "__name__", "").startswith(prefix) and getattr(other, "__file__", None):
      files.add(os.path.abspath(other.__file__))
  return tuple(sorted(files))


def checked(name: str, factory: Callable[[Any], Any], files: tuple[str, ...]) -> Callable:
  """`factory`, whose failures and results become `FlowError`s naming `name`."""

  def build(ctx):
    try:
      flow = factory(ctx)
    except FlowError:
      raise
    except Exception as e:  # noqa: BLE001 - whatever the user's factory raises
      raise _raised(name, "raised", e, files) from e
    missing = [m for m in _METHODS if not callable(getattr(flow, m, None))]
    if missing:
      raise FlowError(
        f"flow {name!r} returned {type(flow).__name__}, not a flow: it has no "
        f"{', '.join(missing)} (subclass rlhfjax.flows.base.Flow and write `iteration`)"
      )
    return CheckedFlow(name, flow, files)

  setattr(build, DECLARED, getattr(factory, DECLARED, None))
  return build


class CheckedFlow:
  """A user's flow whose iterations are checked: one row of scalar metrics per iteration."""

  def __init__(self, name: str, flow: Any, files: tuple[str, ...]):
    self._name, self._flow, self._files = name, flow, files

  def __getattr__(self, attr: str) -> Any:
    return getattr(self._flow, attr)

  def iteration(self, i: int) -> dict[str, float]:
    try:
      row = self._flow.iteration(i)
    except Exception as e:  # noqa: BLE001 - whatever the user's iteration raises
      raise _raised(self._name, f"iteration {i} raised", e, self._files) from e
    return self._row(i, row)

  def _row(self, i: int, row: Any) -> dict[str, float]:
    where = f"flow {self._name!r} iteration {i}"
    expected = "expected a dict of metric names to numbers"
    if not isinstance(row, dict):
      raise FlowError(f"{where} returned {type(row).__name__}; {expected}")
    out = {}
    for key, value in row.items():
      if not isinstance(key, str):
        raise FlowError(f"{where} returned a metric named {key!r}; {expected}")
      scalar = np.asarray(value) if not isinstance(value, numbers.Number) else value
      if isinstance(scalar, np.ndarray) and (scalar.shape != () or scalar.dtype.kind not in "biuf"):
        shape = f"an array of shape {scalar.shape}" if scalar.shape else type(value).__name__
        raise FlowError(f"{where} returned metric {key!r} as {shape}; {expected}")
      out[key] = float(scalar)
    step = out.setdefault("step", i)
    if step != i:
      raise FlowError(f"{where} returned step {step:g}; a row's 'step' is its iteration")
    return out
