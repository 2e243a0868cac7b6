"""What `scripts/train.py` (and `scripts/train_ppo.py`) do once flags are parsed."""

from __future__ import annotations

from typing import Any

from rlhfjax import launch


def train(config_dict: Any, workdir: str) -> None:
  """Runs the config's flow in `workdir` (made absolute and locked), resuming from its latest
  checkpoint; a finished run (`rlhfjax.rerun`) says so and changes nothing. Failures propagate
  to `launch.run`, which prints them as one `error:` line."""
  from rlhfjax import config as config_lib
  from rlhfjax import distributed, rerun
  from rlhfjax.runner import loop

  workdir = launch.open_run(config_dict, workdir)
  config = config_lib.from_config_dict(config_dict)
  if config.checkpoint.resume and rerun.is_finished(workdir, config.total_steps):
    if distributed.is_primary():
      print(rerun.finished_line(workdir))
    return
  runner = loop.Runner(config, workdir)
  if runner.start_step:
    print(f"resuming from the checkpoint of step {runner.start_step}")
  result = runner.run()
  if not distributed.is_primary():
    return
  if result.preempted:
    last = result.metrics[-1]["step"] + 1 if result.metrics else result.start_step
    print(f"stopped: checkpoint of step {last} written; rerun the same command to resume")
    return
  if result.metrics and "reward/mean" in result.metrics[0]:
    first, last = result.metrics[0], result.metrics[-1]
    print(
      f"reward/mean {first['reward/mean']:.3f} -> {last['reward/mean']:.3f} over iterations "
      f"{first['step']}..{last['step']}; outputs in {result.workdir}"
    )
  for phase, ev in result.evaluation.items():
    shown = ", ".join(f"{k} {v:.3f}" for k, v in ev.items() if isinstance(v, float))
    print(f"eval {phase} training: {shown}")
