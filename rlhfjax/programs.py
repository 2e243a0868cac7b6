"""Compiled programs shared by everything in a process that builds the same one, and counted.

A flow, a rollout engine or a model builds its programs as `jax.jit` of a function and its
shardings. Two `Runner`s of one config (a resume check, a reference run, the four placements of
the planner's local check, the stages of a pipeline) build the same programs again, and a fresh
`jax.jit` of a new function object is traced and lowered afresh every time: the persistent
compilation cache saves only XLA's compile. `jit` returns one jitted function per *program*, so
the second builder calls the first one's, whose traces and executables JAX already holds.

A program is its function and its `jax.jit` arguments, compared by value (`key`): a
`functools.partial` or a closure of module-level code over values (numbers, strings, enums,
frozen dataclasses such as the configs, meshes and shardings, and such functions again). A
function over anything else (an array, a mutable object) is not shared: it gets a `jax.jit` of
its own, as before. The same rule as JAX's own cache for a module-level jitted function applies:
what the function reads from module globals at trace time is not part of the key (a test that
patches such a global calls `clear` before and after).

`TraceCounter` counts, per name, the traces each builder (a cluster, an engine) needs: a
program it calls that another builder already traced for the same arguments counts once, as
the compile it would have made, so "each program compiled once" reads the same whether or not
the program was shared.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import enum
import functools
import threading
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


class _Unkeyable(Exception):
  """A value that a program's key cannot stand for (see `key`)."""


_DEPTH = 64
_VALUES = (type(None), bool, int, str, bytes, type, enum.Enum, np.dtype)
_JAX_VALUES = (jax.sharding.Sharding, jax.sharding.Mesh, jax.sharding.PartitionSpec)


def key(value: Any, depth: int = 0) -> Any:
  """A hashable stand-in for `value` that equals another's exactly when the two are the same
  program's parts: by value for plain values, containers, frozen dataclasses, meshes and
  shardings; by code and captured values for functions. Raises `_Unkeyable` for anything that
  may change after it is taken (an array, a mutable object)."""
  if depth > _DEPTH:
    raise _Unkeyable("nested too deeply")
  d = depth + 1
  if isinstance(value, float | complex):  # by repr: -0.0 is not 0.0, nan is nan
    return (type(value), repr(value))
  if isinstance(value, _VALUES):
    return (type(value), value)
  if isinstance(value, _JAX_VALUES):
    return (type(value), value)
  if isinstance(value, tuple | list):  # NamedTuples (optax's transformations) included
    return (type(value), tuple(key(v, d) for v in value))
  if isinstance(value, dict):
    return (type(value), tuple((key(k, d), key(v, d)) for k, v in value.items()))
  if isinstance(value, functools.partial):  # jax.tree_util.Partial too
    return (type(value), key(value.func, d), key(value.args, d), key(value.keywords, d))
  if isinstance(value, types.FunctionType):
    cells = tuple(key(c.cell_contents, d) for c in value.__closure__ or ())
    defaults = (key(value.__defaults__, d), key(value.__kwdefaults__, d))
    # The module's namespace itself, not its name: two files loaded under one module name
    # (users' reward or flow files) are different programs.
    name = (value.__module__, value.__qualname__, value.__code__, _Same(value.__globals__))
    return (types.FunctionType, name, cells, defaults)
  if isinstance(value, types.MethodType):
    return (types.MethodType, key(value.__func__, d), key(value.__self__, d))
  if isinstance(value, types.BuiltinFunctionType | types.ModuleType | np.ufunc):
    return (type(value), id(value), value)  # module-level singletons: alive as long as we are
  if dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:
    fields = dataclasses.fields(value)
    return (type(value), tuple((f.name, key(getattr(value, f.name), d)) for f in fields))
  raise _Unkeyable(type(value).__qualname__)


class _Same:
  """Stands for an object by its identity (and keeps it alive, so the identity is not reused)."""

  __slots__ = ("obj",)

  def __init__(self, obj: Any):
    self.obj = obj

  def __hash__(self) -> int:
    return id(self.obj)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Same) and other.obj is self.obj


# ---------------------------------------------------------------------------------------------
# Counting traces.

_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("rlhfjax_call", default=None)


@dataclasses.dataclass
class _Call:
  counter: TraceCounter
  name: str
  traced: bool = False


def _counted(fn: Callable, name: str | None = None) -> Callable:
  """`fn`, telling the builder whose call traces it (see `Program.__call__`), under `name`:
  JAX names the program after the function (the compile log, the profiler's traces, XLA's
  dumps), so a program reads `jit(generate_steps)`, not the name of a wrapper."""

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    call = _CALL.get()
    if call is not None:
      call.traced = True
      call.counter._add(call.name)
    return fn(*args, **kwargs)

  if name is not None:
    traced.__name__ = traced.__qualname__ = name
  return traced


def _signature(args: tuple, kwargs: dict) -> tuple:
  """The shapes of a call: its tree, each array's shape and dtype, every other leaf's type.
  (Not the arrays' shardings: calls whose shardings differ in form only run one executable.
  Two shardings of the same shapes that another builder traced both count once here.)"""
  leaves, tree = jax.tree.flatten((args, kwargs))
  return tree, tuple(
    (x.shape, x.dtype) if isinstance(x, jax.Array | np.ndarray) else type(x) for x in leaves
  )


class Program:
  """One builder's handle on a (possibly shared) jitted program: calls run it and count its
  traces under the builder's name for it; anything else (`lower`, `eval_shape`,
  `_cache_size`) is the jitted function's."""

  __slots__ = ("_jitted", "_counter", "_name", "_seen")

  def __init__(self, jitted: Callable, counter: TraceCounter, name: str):
    self._jitted, self._counter, self._name = jitted, counter, name
    self._seen: set[tuple] = set()

  def __call__(self, *args, **kwargs):
    signature = _signature(args, kwargs)  # before the call: it may donate the arguments
    call = _Call(self._counter, self._name)
    token = _CALL.set(call)
    try:
      out = self._jitted(*args, **kwargs)
    finally:
      _CALL.reset(token)
    if signature not in self._seen:
      self._seen.add(signature)
      if not call.traced:  # another builder traced it for these arguments: its one compile
        self._counter._add(self._name)
    return out

  def __getattr__(self, attr: str) -> Any:
    return getattr(self._jitted, attr)


class TraceCounter:
  """Builds a builder's programs (`jit`) and counts the traces each needs, by name."""

  def __init__(self):
    self._counts: collections.Counter[str] = collections.Counter()

  def _add(self, name: str) -> None:
    self._counts[name] += 1

  def jit(self, name: str, fn: Callable, **jit_kwargs) -> Program:
    """`jax.jit(fn, **jit_kwargs)`, shared with every builder of the same program in this
    process (`jit` below), its traces counted under `name`."""
    return Program(jit(fn, name=name, **jit_kwargs), self, name)

  @property
  def counts(self) -> dict[str, int]:
    return dict(self._counts)

  @property
  def total(self) -> int:
    return sum(self._counts.values())


# ---------------------------------------------------------------------------------------------
# The process's programs.

_MAX_PROGRAMS = 1024
"""Programs kept (least recently built dropped first): a dropped one is built anew."""
_programs: collections.OrderedDict[Any, Callable] = collections.OrderedDict()
_lock = threading.Lock()
_stats: collections.Counter[str] = collections.Counter()
_unshared: collections.Counter[str] = collections.Counter()


def jit(fn: Callable, name: str | None = None, **jit_kwargs) -> Callable:
  """`jax.jit(fn, **jit_kwargs)`: the one this process already built for the same program
  (`key` of the function and of the arguments) when there is one. A function whose key cannot
  be taken gets a jitted function of its own."""
  try:
    program = (key(fn), key(jit_kwargs))
  except _Unkeyable as why:
    _stats["unshared"] += 1
    _unshared[f"{getattr(fn, '__qualname__', type(fn).__qualname__)}: {why}"] += 1
    return jax.jit(_counted(fn, name), **jit_kwargs)
  with _lock:
    jitted = _programs.get(program)
    if jitted is not None:
      _programs.move_to_end(program)
      _stats["shared"] += 1
      return jitted
    jitted = _programs[program] = jax.jit(_counted(fn, name), **jit_kwargs)
    _stats["built"] += 1
    while len(_programs) > _MAX_PROGRAMS:
      _programs.popitem(last=False)
    return jitted


def eval_shape(fn: Callable, *args, **kwargs) -> Any:
  """`jax.eval_shape(fn, *args, **kwargs)` through `jit`'s shared function, whose traces JAX
  keeps: shapes a builder derives from a whole model (a rollout engine's prefill, a train
  state's optimizer state) are traced once per process for each program and argument shapes,
  not again by every engine or train state built for the same model."""
  return jit(fn).eval_shape(*args, **kwargs)


def clear() -> None:
  """Forgets the shared programs: each is built anew by its next builder. For code that
  changes what a program reads at trace time besides its key (a test patching a module's
  function), before and after the change."""
  with _lock:
    _programs.clear()


def stats() -> dict[str, Any]:
  """Programs built, shared (built before) and unshared (not keyable) so far, and why each
  unshared one was not (its function and the type of the value its key could not take)."""
  return {**_stats, "unshared_why": dict(_unshared)}
