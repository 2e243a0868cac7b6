"""A tool learnt by RL: SFT then GRPO on two-digit products ("37*48=" -> "1776") with a
calculator the policy may call in a multi-turn rollout, or (':no_tool') the same without it.

  python -m examples.calculator --out=workdirs/calculator-data
  python scripts/run_pipeline.py --config=configs/pipeline_calculator.py \
      --workdir=workdirs/calculator-tool
  python scripts/run_pipeline.py --config=configs/pipeline_calculator.py:no_tool \
      --workdir=workdirs/calculator-no-tool

The first command writes the products and SFT's demonstrations (`examples/calculator.py`): a
fifth of them show a call, the tool's result and the answer, the rest the answer alone. The
two runs differ in the tool alone: the same model (the arithmetic pipeline's), the same SFT, the
same GRPO (iterations of 64 products x 8 samples) and environment protocol (digits alone are
the answer, rewarded 1 when exact; anything else another try, up to 3 turns), and the same
evaluation (greedy, 512 held-out products, the environment's reward as `environment` in
eval.json and eval.md). With the tool, a call gets the product; without it, a call gets `?;`.
docs/data.md ("A tool in the rollout") has the measured runs.
"""

import os
import runpy

import ml_collections

_HERE = os.path.dirname(os.path.abspath(__file__))
DATA = "workdirs/calculator-data"
"""Where `python -m examples.calculator` writes by default (relative to the repository root,
where the commands run)."""
_SEPARATOR = ord(";")  # the byte tokenizer's id of ';': ends a call (examples.calculator)
_ENVIRONMENTS = {"tool": "Calculator", "no_tool": "NoTool"}


def get_config(variant: str = "tool") -> ml_collections.ConfigDict:
  if variant not in _ENVIRONMENTS:
    raise ValueError(f"variant must be one of {', '.join(_ENVIRONMENTS)}, got {variant!r}")
  # The arithmetic pipeline's model, SFT and GRPO, on other data and with an environment.
  config = runpy.run_path(os.path.join(_HERE, "pipeline_arithmetic.py"))["get_config"]()
  sft, grpo = config.sft, config.ppo
  sft.data.demonstrations = os.path.join(DATA, "demonstrations.jsonl")
  sft.supervised.max_len = 32

  # The products between the demonstrated ones and the held-out ones (the arithmetic
  # pipeline's splits): new to the SFT policy.
  grpo.data.prompts = os.path.join(DATA, "prompts.jsonl")
  grpo.reward.fn = ""
  grpo.rollout.environment = f"examples.calculator:{_ENVIRONMENTS[variant]}"
  grpo.rollout.stop_token_ids = (_SEPARATOR,)
  grpo.rollout.max_turns = 3
  grpo.rollout.max_turn_tokens = 8
  grpo.rollout.batch_size = 512
  grpo.rollout.max_new_tokens = 24
  grpo.total_steps = 40
  grpo.checkpoint.every_steps = 20
  return config
