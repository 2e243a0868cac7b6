"""A verifiable reward of your own: partial credit for the answer's leading characters.

Each line of `examples/capitals.jsonl` carries its `answer` beside the prompt; the line's extra
fields reach the reward as `metadata["records"]`, one per response, in order. A response scores
the fraction of the answer it spells out correctly from its start (after leading spaces), so a
policy is rewarded on its way to the whole word and 1.0 means an exact answer:

  python scripts/train.py --config=configs/grpo_tiny.py --workdir=workdirs/capitals \
      --config.data.prompts=examples/capitals.jsonl \
      --config.reward.fn=examples.capital_reward:leading_characters

(`examples` must be importable: run from the repository root, or put it on PYTHONPATH.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def leading_characters(
  prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], metadata: dict
) -> np.ndarray:
  """float32[batch]: the matching prefix of each response over its record's answer length."""
  del prompts
  tokenizer = metadata["tokenizer"]
  scores = []
  for response, record in zip(responses, metadata["records"], strict=True):
    answer = record.require("answer", str)
    text = tokenizer.decode(response).lstrip()
    matched = 0
    while matched < min(len(text), len(answer)) and text[matched] == answer[matched]:
      matched += 1
    scores.append(matched / len(answer) if text.strip() != answer else 1.0)
  return np.asarray(scores, np.float32)
