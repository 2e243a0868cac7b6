"""Reward-model training on preference pairs (Bradley-Terry loss, held-out pair accuracy):
`scripts/train.py` with a config of `algorithm.name='rm'` (the same flags; see there).

  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm
  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm \
      --config.init.reward=workdirs/sft/checkpoints

Writes `metrics.jsonl`, TensorBoard events, `loss.png`, `eval_accuracy.png` and checkpoints
(WORKDIR/checkpoints, item 'reward') into the workdir; a rerun resumes from the latest
checkpoint and ends with the rows and plots of an uninterrupted run; a rerun of a finished run
says so in one line and changes no file. Bad input: one `error:` line, exit status 2.
"""

from train import main

from rlhfjax import launch

if __name__ == "__main__":
  launch.run(main)
