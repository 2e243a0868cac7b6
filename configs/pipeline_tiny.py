"""The bundled pipeline on the tiny model and the 'vowels' task: SFT -> reward model -> PPO.

  python scripts/run_pipeline.py --config=configs/pipeline_tiny.py --workdir=workdirs/pipeline
  python scripts/run_pipeline.py --config=configs/pipeline_tiny.py --workdir=workdirs/pipeline \
      --config.ppo.placement.strategy=disaggregated --config.sft.total_steps=100

Each stage is the config of its own script (`configs/sft_tiny.py`, `configs/rm_tiny.py`,
`configs/ppo_tiny.py`), changed where the stages meet: the reward model starts from the SFT
trunk; PPO starts its actor, reference and critic from the SFT policy and scores with the
trained reward model instead of the task's rule. The rule (the fraction of vowels) is what the
preferences were written to express, so the evaluation before and after PPO reports it as
`task_reward`: how far optimising a learned reward moved the real goal.
"""

import os
import runpy

import ml_collections

_HERE = os.path.dirname(os.path.abspath(__file__))


def _stage(name: str) -> ml_collections.ConfigDict:
  return runpy.run_path(os.path.join(_HERE, f"{name}.py"))["get_config"]()


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.sft = _stage("sft_tiny")
  config.rm = _stage("rm_tiny")
  config.ppo = _stage("ppo_tiny")
  # The learned reward replaces the rule; run_pipeline.py fills in the checkpoint paths.
  config.ppo.reward.fn = ""
  config.ppo.reward.model_coef = 1.0
  config.ppo.total_steps = 40
  config.ppo.actor_optimizer.learning_rate = 3e-4
  config.ppo.critic_optimizer.learning_rate = 1e-3
  config.ppo.ppo.kl_coef = 0.02
  return config
