"""What `scripts/train.py` (and `train_ppo.py`, `train_sft.py`, `train_rm.py`) do once flags are
parsed."""

from __future__ import annotations

import os
from typing import Any

from rlhfjax import launch


def train(config_dict: Any, workdir: str) -> None:
  """Runs the config's flow in `workdir` (made absolute and locked), resuming from its latest
  checkpoint; a finished run (`rlhfjax.rerun`) says so and changes nothing. Failures propagate
  to `launch.run`, which prints them as one `error:` line."""
  from rlhfjax import config as config_lib
  from rlhfjax import distributed, rerun
  from rlhfjax.observe.metrics import MetricsWriter
  from rlhfjax.runner import loop

  workdir = launch.open_run(config_dict, workdir)
  config = config_lib.from_config_dict(config_dict)
  if config.checkpoint.resume and rerun.is_finished(workdir, config.total_steps):
    if distributed.is_primary():
      print(rerun.finished_line(workdir))
    return
  runner = loop.Runner(config, workdir)  # says what it resumes from
  result = runner.run()
  if not distributed.is_primary():
    return
  headline = getattr(runner.flow, "headline", None)
  if headline is not None:  # the first and last held-out value of the whole run
    path = os.path.join(result.workdir, "metrics.jsonl")
    values = [row[headline] for row in MetricsWriter.read(path) if headline in row]
    first_last = f"{values[0]:.3f} -> {values[-1]:.3f}" if values else "-"
    print(
      f"{headline} {first_last}; steps {result.start_step} -> {result.final_step}; "
      f"outputs in {result.workdir}"
    )
  if result.preempted:
    written = (
      "checkpoint written" if headline else f"checkpoint of step {result.final_step} written"
    )
    print(f"stopped: {written}; rerun the same command to resume")
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
