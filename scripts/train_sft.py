"""Supervised fine-tuning of the policy on demonstrations (loss on response tokens only):
`scripts/train.py` with a config of `algorithm.name='sft'` (the same flags; see there).

  python scripts/train_sft.py --config=configs/sft_tiny.py --workdir=workdirs/sft
  python scripts/train_sft.py --config=configs/sft_tiny.py --workdir=workdirs/sft \
      --config.total_steps=200 --config.init.actor=/path/to/hf_model

Writes `metrics.jsonl`, TensorBoard events, `loss.png`, `eval_loss.png` and checkpoints
(WORKDIR/checkpoints, item 'actor') into the workdir; a rerun resumes from the latest
checkpoint and ends with the rows and plots of an uninterrupted run; a rerun of a finished run
says so in one line and changes no file. Bad input: one `error:` line, exit status 2.
"""

from train import main

from rlhfjax import launch

if __name__ == "__main__":
  launch.run(main)
