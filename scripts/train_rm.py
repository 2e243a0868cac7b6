"""Reward-model training on preference pairs (Bradley-Terry loss, held-out pair accuracy).

  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm
  python scripts/train_rm.py --config=configs/rm_tiny.py --workdir=workdirs/rm \
      --config.init.checkpoint=workdirs/sft/checkpoints

Writes `metrics.jsonl`, TensorBoard events, `loss.png`, `eval_accuracy.png` and checkpoints
(WORKDIR/checkpoints, item 'reward') into the workdir; a rerun resumes from the latest
checkpoint and ends with the rows and plots of an uninterrupted run; a rerun of a finished run
says so in one line and changes no file. Bad input: one `error:` line, exit status 2.
"""

from absl import flags
from ml_collections import config_flags

from rlhfjax import launch

_CONFIG = config_flags.DEFINE_config_file("config", None, "Reward-model config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and plots go.")
_MAX_CPU_DEVICES = flags.DEFINE_integer(
  "max_cpu_devices", 64, "Most host devices to emulate when running on CPU."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
  launch.start(argv, _CONFIG.value, _MAX_CPU_DEVICES.value)

  # Imported only now: JAX (which rlhfjax imports) must start after XLA_FLAGS is set.
  from rlhfjax import config as config_lib
  from rlhfjax.training import reward_model, supervised

  supervised.run_script(
    reward_model.RewardModelTrainer, config_lib.RewardModelConfig, _CONFIG.value, _WORKDIR.value
  )


if __name__ == "__main__":
  launch.run(main)
