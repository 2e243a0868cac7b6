"""PPO: `scripts/train.py` under its first name (the same flags and outputs; see there).

python scripts/train_ppo.py --config=configs/ppo_tiny.py --workdir=workdirs/ppo
"""

from train import main

from rlhfjax import launch

if __name__ == "__main__":
  launch.run(main)
