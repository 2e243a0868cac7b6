"""Bundled offline tasks: prompts plus a rule-based reward, for demos and learning tests.

A reward function is called as `fn(prompts, responses, metadata) -> float32[batch]`, where
`prompts` and `responses` are lists of int token-id arrays (no padding; a response includes its
stop token if it produced one) and `metadata` is a dict with 'step', 'tokenizer' and 'records'
(per response, its prompt line's extra fields: `rlhfjax.data.records.Record`).

Tasks:
  vowels      continue a sentence with vowel-rich text (`vowel_reward`);
  arithmetic  "37+48=" -> "85": a verifiable reward, exact match against the prompt record's
              "answer" (`exact_match_reward`).
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Sequence
from typing import Any

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


ARITHMETIC_SEED = 1729
ARITHMETIC_DIGITS = 2
ARITHMETIC_DEMONSTRATED = 0.5
ARITHMETIC_HELD_OUT = 0.1
"""The bundled 'arithmetic' files: the seed, the operands' digits, the fraction of the sums
demonstrated for SFT (the first ones) and the fraction held out (the last ones)."""


def arithmetic_datasets(
  seed: int = ARITHMETIC_SEED,
  digits: int = ARITHMETIC_DIGITS,
  held_out: float = ARITHMETIC_HELD_OUT,
  demonstrated: float = ARITHMETIC_DEMONSTRATED,
) -> dict[str, list[dict[str, Any]]]:
  """The 'arithmetic' task's records, a function of its arguments only.

  Every sum `a+b=` of two operands of at most `digits` digits, in a seeded order, split three
  ways as an RLHF run uses its data: the first `demonstrated` fraction for SFT, the last
  `held_out` fraction for evaluation, and the sums between them for RL, which SFT never saw.
  'prompt': all of them in that order, as {"prompt": "37+48=", "answer": "85"} (the configs'
  RL `train_split` 'train[50%:90%]' and `eval_split` 'train[90%:]' for the defaults);
  'demonstration': the first part, as {"prompt", "response"}.

  Raises:
    ValueError: fractions that do not leave each part at least one sum.
  """
  top = 10**digits
  sums = [(a, b) for a in range(top) for b in range(top)]
  random.Random(seed).shuffle(sums)
  num_demonstrated = round(demonstrated * len(sums))
  rl_end = len(sums) - round(held_out * len(sums))
  if not 0 < num_demonstrated < rl_end < len(sums):
    raise ValueError(
      f"demonstrated={demonstrated} and held_out={held_out} of {len(sums)} sums leave no "
      "demonstrations, RL prompts or held-out sums"
    )
  prompts = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in sums]
  demos = [{"prompt": p["prompt"], "response": p["answer"]} for p in prompts[:num_demonstrated]]
  return {"prompt": prompts, "demonstration": demos}


def response_texts(responses: Sequence[np.ndarray], tokenizer: Any) -> list[str]:
  """Each response's text up to its stop token (EOS and other special ids dropped)."""
  out = []
  for r in responses:
    ids = [int(i) for i in r]
    if ids and ids[-1] == tokenizer.eos_id:
      ids = ids[:-1]
    out.append(tokenizer.decode(ids))
  return out


def exact_match_reward(
  prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], metadata: dict
) -> np.ndarray:
  """1 where the response's text (up to its stop token, surrounding whitespace aside) equals
  its prompt record's "answer" (a string or an integer), else 0."""
  del prompts
  records = metadata["records"]
  if len(records) != len(responses):
    raise ValueError(f"{len(responses)} responses but {len(records)} prompt records")
  texts = response_texts(responses, metadata["tokenizer"])
  answers = [str(r.require("answer", str, int)).strip() for r in records]
  return np.array([t.strip() == a for t, a in zip(texts, answers, strict=True)], np.float32)


TASK_REWARDS: dict[str, RewardFn] = {"vowels": vowel_reward, "arithmetic": exact_match_reward}
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
