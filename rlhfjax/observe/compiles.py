"""Counting traces of jitted functions: each trace of a jitted function is one compilation."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable


class TraceCounter:
  """Wraps functions before `jax.jit` so that every (re)trace is counted by name."""

  def __init__(self):
    self._counts: collections.Counter[str] = collections.Counter()

  def wrap(self, name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def traced(*args, **kwargs):
      self._counts[name] += 1
      return fn(*args, **kwargs)

    return traced

  @property
  def counts(self) -> dict[str, int]:
    return dict(self._counts)

  @property
  def total(self) -> int:
    return sum(self._counts.values())
