"""GRPO with LoRA on the tiny model and the bundled 'vowels' task: rank-8 adapters on every
projection of the actor and its LM head (`model.lora`), the base weights frozen with no
optimizer state; the rollout runs the adapted weights merged. Otherwise configs/grpo_tiny.py.

  python scripts/train.py --config=configs/grpo_lora_tiny.py --workdir=workdirs/grpo_lora
  python scripts/train.py --config=configs/grpo_lora_tiny.py:disaggregated --workdir=...

Adapters learn at a larger rate than full weights (`actor_optimizer.learning_rate`).
"""

import os
import runpy


def get_config(variant: str = "colocated"):
  here = os.path.dirname(os.path.abspath(__file__))
  config = runpy.run_path(os.path.join(here, "grpo_tiny.py"))["get_config"](variant)
  config.model.lora.rank = 8
  config.model.lora.alpha = 16.0
  # The tiny random model's logits are bounded by its frozen head and final norm (a row of 0.02
  # weights against a unit-RMS hidden state): it learns only with the head adapted too.
  config.model.lora.targets = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")
  config.actor_optimizer.learning_rate = 2e-2
  return config
