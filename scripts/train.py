"""Any algorithm (the config's `algorithm.name` or `algorithm.flow`) with every role on its own
sub-mesh, as the config's placement says.

  python scripts/train.py --config=configs/grpo_tiny.py --workdir=workdirs/grpo
  python scripts/train.py --config=configs/ppo_tiny.py --workdir=workdirs/dis \
      --config.placement.strategy=disaggregated --config.total_steps=30 --config.seed=3

Multi-process (here two processes of 4 CPU devices on one machine; run once per K = 0, 1):

  python scripts/train.py --config=configs/ppo_tiny.py --workdir=workdirs/mh \
      --config.distributed.enabled=True --config.distributed.coordinator_address=localhost:1234 \
      --config.distributed.num_processes=2 --config.distributed.process_id=K

SFT and the reward model (`algorithm.name` 'sft', 'rm'; `train_sft.py` and `train_rm.py` are
this script) run on the same loop: see those scripts for what they write.

Writes `metrics.jsonl`, TensorBoard events, `timeline.json` / `timeline.png` (one lane per
device group), `reward.png`, `eval.json` / `eval.md` (held-out prompts before and after PPO) and
`checkpoints/<step>/` into the workdir (in a multi-process run, process 0 writes the files and
every process takes part in the checkpoints). Rerunning the same command resumes from the latest
complete checkpoint (and ends with the rows, evaluation and timeline of an uninterrupted run); a
finished run says so in one line and changes no file. SIGTERM or Ctrl-C writes one and exits
with status 0 (a second Ctrl-C stops at once). Any failure: one `error:` line, exit status 2
(`--debug`: the traceback).
"""

from rlhfjax import launch

_CONFIG, _WORKDIR, _MAX_CPU_DEVICES = launch.define_flags(
  "Experiment config file.", "Where checkpoints, metrics and plots go."
)


def main(argv: list[str]) -> None:
  launch.start(argv, _CONFIG.value, _MAX_CPU_DEVICES.value)

  # Imported only now: JAX (which rlhfjax imports) must start after XLA_FLAGS is set.
  from rlhfjax.runner import cli

  cli.train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  launch.run(main)
