"""DPO on the tiny model and the bundled 'vowels' preferences, 8 devices: the actor against the
frozen reference (its log-probs computed once per batch on its own mesh), no rollout.

  python scripts/train.py --config=configs/dpo_tiny.py --workdir=workdirs/dpo
  python scripts/train.py --config=configs/dpo_tiny.py:interleaved --workdir=... \
      --config.dpo.loss=ipo

`rollout.batch_size` is the preference pairs per step, `rollout.max_prompt_len +
max_new_tokens` their length. Metrics: loss/dpo, dpo/accuracy, dpo/margin and the held-out
batch's eval/accuracy and eval/margin. The optional argument after ':' picks a placement
variant of configs/ppo_tiny.py.
"""

import os
import runpy


def get_config(variant: str = "colocated"):
  here = os.path.dirname(os.path.abspath(__file__))
  config = runpy.run_path(os.path.join(here, "ppo_tiny.py"))["get_config"](variant)
  config.algorithm.name = "dpo"
  config.total_steps = 40
  config.rollout.batch_size = 16
  config.rollout.max_prompt_len = 48
  config.rollout.max_new_tokens = 48
  config.eval.num_prompts = 0
  config.dpo = {
    "beta": 0.1,
    "loss": "sigmoid",
    "label_smoothing": 0.0,
    "packing": False,
    "max_tokens_per_micro_batch": 0,
  }
  config.actor_optimizer.learning_rate = 1e-4
  return config
