"""Range checks of numeric config fields, each failure one line naming the field.

A section's `__post_init__` lists its fields with their ranges:

  ranges.check("ppo", self, clip_eps=ranges.above(0), gamma=ranges.between(0, 1))

`None` values (optional fields left unset) are not checked. Non-finite floats are refused by
the config conversion itself (`rlhfjax.config`), for every float field. Imports nothing.
"""

from __future__ import annotations

from collections.abc import Callable

Rule = Callable[[float], str | None]
"""Returns what the value must be (e.g. '> 0') when it is out of range, else None."""


class RangeError(ValueError):
  """A numeric config field is out of its range."""


def at_least(low: float) -> Rule:
  return lambda v: None if v >= low else f">= {low}"


def above(low: float) -> Rule:
  return lambda v: None if v > low else f"> {low}"


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Rule:
  """low <= v <= high, with either end open on request."""
  lo, hi = "(" if low_open else "[", ")" if high_open else "]"

  def rule(v: float) -> str | None:
    ok_low = v > low if low_open else v >= low
    ok_high = v < high if high_open else v <= high
    return None if ok_low and ok_high else f"in {lo}{low}, {high}{hi}"

  return rule


def check(section: str, obj: object, **rules: Rule) -> None:
  """Checks `obj.<name>` against each rule.

  Raises:
    RangeError: "'<section>.<name>' must be <range>, got <value>" for the first failure.
  """
  prefix = f"{section}." if section else ""
  for name, rule in rules.items():
    value = getattr(obj, name)
    if value is None:
      continue
    wanted = rule(value)
    if wanted:
      raise RangeError(f"'{prefix}{name}' must be {wanted}, got {value!r}")


SEED = between(0, 2**31 - 1)
"""Seeds feed `jax.random.key` and NumPy generators (offset by small constants)."""
COUNT = at_least(1)
NON_NEGATIVE = at_least(0)
POSITIVE = above(0)
FRACTION = between(0, 1)
