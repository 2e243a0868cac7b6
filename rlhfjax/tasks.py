"""Bundled offline tasks: prompts plus a rule-based reward, for demos and learning tests.

A reward function is called as `fn(prompts, responses, metadata) -> float32[batch]`, where
`prompts` and `responses` are lists of int token-id arrays (no padding; a response includes its
stop token if it produced one) and `metadata` is a dict with at least 'step'.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import numpy as np

from rlhfjax import reward_fn_check

RewardFn = Callable[[Sequence[np.ndarray], Sequence[np.ndarray], dict], np.ndarray]

_SUBJECTS = (
  "the cat",
  "a river",
  "my friend",
  "the old clock",
  "a small bird",
  "the city",
  "our garden",
  "the night sky",
  "a quiet road",
  "the teacher",
  "a red kite",
  "the ocean",
)
_VERBS = (
  "sees",
  "sings about",
  "remembers",
  "walks past",
  "dreams of",
  "writes to",
  "waits for",
  "paints",
)
_OBJECTS = (
  "the moon",
  "an open door",
  "a long summer",
  "the mountains",
  "a blue boat",
  "the first snow",
  "an apple tree",
  "the market",
)


def vowel_prompts() -> list[str]:
  """The 768 prompts of the 'vowels' task: short sentences to continue."""
  return [f"{s} {v} {o}" for s in _SUBJECTS for v in _VERBS for o in _OBJECTS]


_VOWELS = np.frombuffer(b"aeiou", dtype=np.uint8).astype(np.int64)


def vowel_reward(
  prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], metadata: dict
) -> np.ndarray:
  """Fraction of the response's tokens that are lowercase vowel bytes (0 for an empty one)."""
  del prompts, metadata
  return np.array([np.isin(r, _VOWELS).mean() if len(r) else 0.0 for r in responses], np.float32)


TASK_REWARDS: dict[str, RewardFn] = {"vowels": vowel_reward}
"""The rule that defines each task's goal: what evaluations report, whatever PPO optimises
(a reward model trained on preferences only approximates it)."""


def load_callable(path: str, what: str) -> Callable:
  """Imports 'module:function' with a clear error naming `what` it is for."""
  module_name, _, attr = path.partition(":")
  try:
    fn = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError) as e:
    hint = ""
    if isinstance(e, ModuleNotFoundError) and module_name.startswith(e.name or "\0"):
      hint = " (a module of your own: on PYTHONPATH or, for the scripts, the current directory)"
    raise ValueError(f"cannot import {what} {path!r}: {e}{hint}") from None
  if not callable(fn):
    raise ValueError(f"{what} {path!r} is not callable")
  return fn


def load_reward_fn(path: str) -> RewardFn:
  """Imports 'module:function' (e.g. 'rlhfjax.tasks:vowel_reward') with a clear error; the
  function's signature and results are checked (`reward_fn_check`)."""
  return reward_fn_check.checked(path, load_callable(path, "reward function"))
