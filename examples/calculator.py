"""A calculator tool in a multi-turn rollout: the model may ask for a product (or a sum), then
answers.

Each trajectory is one prompt "37*48=" whose record's "answer" is "1776" (or a bundled
'arithmetic' sum, "37+48=" -> "85"). Each of the model's turns ends on a stop token (the EOS,
the run's `rollout.stop_token_ids`: here `;`, or `rollout.max_turn_tokens`), and the environment
reads it:

  * a call `a*b` or `a+b` (digits and one operator): the tool runs and the observation is the
    result, `=1776;`: the model goes on from it, in the same KV cache;
  * digits alone: the final answer; reward 1 when it is the record's, else 0, and done;
  * anything else: the observation `?;` (not understood), and another try, up to
    `rollout.max_turns`.

`NoTool` is the same environment without the tool (a call is not understood), so that a run
with the tool and one without differ in the tool alone. configs/pipeline_calculator.py runs SFT
then GRPO on products with either (the same SFT); its data comes from this module:

  python -m examples.calculator --out=workdirs/calculator-data

writes prompts.jsonl (every product of two numbers below 100, in a seeded order: the first
half demonstrated to SFT, the next 40% GRPO's prompts, the last 10% held out) and
demonstrations.jsonl: a fifth of them a call, the tool's result and the answer ("37*48=" ->
"37*48;=1776;1776"), the rest the answer alone ("1776"). SFT sees the tool's result written in
the demonstration; in GRPO's conversations the tool gives it, as an observation. The bundled
sums work too:

  python scripts/train.py --config=configs/grpo_tiny.py --workdir=workdirs/calculator \
      --config.data.task=arithmetic --config.reward.fn= \
      --config.rollout.environment=examples.calculator:Calculator \
      --config.rollout.max_turns=3 --config.rollout.max_turn_tokens=8

(`examples` must be importable: run from the repository root, or put it on PYTHONPATH.)
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
from absl import app, flags

_CALL = re.compile(r"^\s*(\d{1,6})\s*([+*])\s*(\d{1,6})\s*$")
_ANSWER = re.compile(r"^\s*(\d+)\s*$")
SEPARATOR = ";"
"""Ends a call and an observation: a stop token of the runs (`rollout.stop_token_ids`)."""


def calculate(expression: str) -> int | None:
  """The tool: `a+b` or `a*b` of non-negative integers, or None for anything else."""
  match = _CALL.match(expression)
  if match is None:
    return None
  a, op, b = int(match[1]), match[2], int(match[3])
  return a + b if op == "+" else a * b


class Calculator:
  """The environment of one trajectory (`rlhfjax.flows.environments`)."""

  tool = True

  def __init__(self, tokenizer: Any):
    self.tokenizer = tokenizer
    self.answer = ""
    self.calls = 0

  def reset(self, record) -> None:
    self.answer = str(record.require("answer", str, int)).strip()
    return None  # the record's own prompt

  def _text(self, tokens: np.ndarray) -> str:
    """The turn's text without the stop token that ended it."""
    text = self.tokenizer.decode([int(t) for t in tokens])  # (special ids, the EOS, dropped)
    return text.removesuffix(SEPARATOR)

  def step(self, tokens: np.ndarray) -> tuple[str | None, float, bool]:
    text = self._text(tokens)
    if _ANSWER.match(text):
      return None, float(text.strip() == self.answer), True
    result = calculate(text) if self.tool else None
    if result is not None:
      self.calls += 1
      return f"={result}{SEPARATOR}", 0.0, False
    return f"?{SEPARATOR}", 0.0, False


class NoTool(Calculator):
  """The calculator's protocol without the tool: only an answer is understood."""

  tool = False


def products(seed: int = 0, digits: int = 2) -> list[dict[str, str]]:
  """Every product `a*b` of operands below `10**digits` as prompt records, in a seeded order:
  {"prompt": "37*48=", "answer": "1776"}."""
  top = 10**digits
  pairs = [(a, b) for a in range(top) for b in range(top)]
  order = np.random.default_rng(seed).permutation(len(pairs))
  return [
    {"prompt": f"{pairs[i][0]}*{pairs[i][1]}=", "answer": str(pairs[i][0] * pairs[i][1])}
    for i in order
  ]


def demonstration(record: dict[str, str], tool: bool) -> dict[str, str]:
  """SFT's demonstration of a product: the answer, or (`tool`) a call, the tool's result and
  the answer, "37*48;=1776;1776" (the result written out: in GRPO the tool gives it)."""
  a, answer = record["prompt"][:-1], record["answer"]
  response = f"{a}{SEPARATOR}={answer}{SEPARATOR}{answer}" if tool else answer
  return {"prompt": record["prompt"], "response": response}


def write_data(
  out: str, seed: int = 0, demonstrated: float = 0.5, with_tool: float = 0.2
) -> dict[str, str]:
  """The pipeline's files in `out` (see the module docstring); returns their paths by name."""
  os.makedirs(out, exist_ok=True)
  records = products(seed)
  demos = records[: round(demonstrated * len(records))]
  calls = round(with_tool * len(demos))
  files = {
    "prompts": records,
    "demonstrations": [demonstration(r, tool=i < calls) for i, r in enumerate(demos)],
  }
  paths = {}
  for name, lines in files.items():
    paths[name] = os.path.join(out, f"{name}.jsonl")
    with open(paths[name], "w") as f:
      f.writelines(json.dumps(line) + "\n" for line in lines)
  return paths


_OUT = flags.DEFINE_string("out", "workdirs/calculator-data", "Where to write the JSONL files.")


def main(argv):
  del argv
  for name, path in write_data(_OUT.value).items():
    print(f"{name}: {path}")


if __name__ == "__main__":
  app.run(main)
