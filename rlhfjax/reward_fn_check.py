"""A user's reward function, called so that its failures name it.

`config.reward.fn` names any importable 'module:function'. `checked` wraps it: a function that
cannot take `(prompts, responses, metadata)` is refused at load time, and at every call an
exception it raises, or a result that is not `batch` finite numbers, becomes one
`RewardFnError` naming the function (instead of a traceback through the trainer, or a NumPy
message that names nothing). A prompt record's missing or mistyped field
(`rlhfjax.data.records.RecordFieldError`) is named by the record's 'file:line' and the field.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import numpy as np

from rlhfjax.data.records import RecordFieldError


class RewardFnError(ValueError):
  """A reward function cannot be called as one, raised, or returned the wrong thing."""


def checked(name: str, fn: Callable) -> Callable[..., np.ndarray]:
  """`fn` as `(prompts, responses, metadata) -> float32[batch]` with one-line errors naming
  `name`.

  Raises:
    RewardFnError: `fn`'s signature cannot take three positional arguments.
  """
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # some builtins have none: checked at the first call
    signature = None
  if signature is not None:
    try:
      signature.bind(None, None, None)
    except TypeError as e:
      raise RewardFnError(
        f"reward function {name!r} must take (prompts, responses, metadata); its signature is "
        f"{name.partition(':')[2]}{signature}: {e}"
      ) from None

  def call(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], metadata: dict):
    try:
      out = fn(prompts, responses, metadata)
    except RecordFieldError as e:  # the data's fault: name the record and the field
      raise RewardFnError(f"reward function {name!r}: {e}") from e
    except Exception as e:  # noqa: BLE001 - whatever user code raises, name the function
      raise RewardFnError(
        f"reward function {name!r} raised {type(e).__name__}: {' '.join(str(e).split())}"
      ) from e
    return _as_scores(name, out, len(responses))

  call.__name__ = getattr(fn, "__name__", name)
  call.__wrapped__ = fn
  return call


def _as_scores(name: str, out: object, batch: int) -> np.ndarray:
  expected = f"expected float32[{batch}] (one score per response)"
  try:
    array = np.asarray(out)
  except Exception:  # noqa: BLE001 - ragged lists and odd objects
    array = None
  if array is None or array.dtype.kind not in "biuf":
    kind = type(out).__name__ if array is None else f"{type(out).__name__} of {array.dtype}"
    raise RewardFnError(f"reward function {name!r} returned {kind}; {expected}")
  if array.shape != (batch,):
    raise RewardFnError(f"reward function {name!r} returned shape {array.shape}; {expected}")
  array = array.astype(np.float32)
  if not np.all(np.isfinite(array)):
    raise RewardFnError(f"reward function {name!r} returned non-finite scores: {array}")
  return array
