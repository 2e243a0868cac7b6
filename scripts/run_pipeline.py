"""The whole path from a base model to an aligned one: SFT -> reward model -> PPO.

  python scripts/run_pipeline.py --config=configs/pipeline_tiny.py --workdir=workdirs/pipeline
  python scripts/run_pipeline.py --config=configs/pipeline_arithmetic.py --workdir=workdirs/arith

Stages write into WORKDIR/sft, WORKDIR/rm and WORKDIR/ppo (each what its own script writes:
metrics, plots, checkpoints); the reward model starts from the SFT trunk, PPO from the SFT
policy and the reward model. A config without an `rm` section skips the reward model: its RL
stage (`ppo`, any online algorithm, e.g. GRPO) is rewarded by its rule (`reward.fn`).
WORKDIR/summary.md reports every stage, and the RL outputs a user looks at first are copied
beside it: reward.png (the reward curve), eval.md (the policy on held-out prompts before and
after RL) and timeline.png (which devices ran what, when).

Rerunning the same command resumes: finished stages are not even built again, an interrupted one
continues from its latest checkpoint, and the outputs end as an uninterrupted run's; a finished
pipeline says so in one line and changes no file. SIGTERM or Ctrl-C stops the current stage with
a checkpoint. While it runs, the pipeline holds WORKDIR and each stage's directory: a stage's own
script started on one of them is refused in one line. Any failure: one `error:` line, exit
status 2 (`--debug`: the traceback).
"""

import json
import os
import shutil

from rlhfjax import launch, rerun

_CONFIG, _WORKDIR, _MAX_CPU_DEVICES = launch.define_flags(
  "Pipeline config file.", "Where every stage writes."
)

_COPIED = ("reward.png", "eval.md", "timeline.png")


def main(argv: list[str]) -> None:
  config = _CONFIG.value
  names = [name for name in ("sft", "rm", "ppo") if name in config]
  if "sft" not in names or "ppo" not in names:
    launch.fail(f"the pipeline config needs sections sft and ppo (and rm, optional); has {names}")
  # One JAX start for all three stages: as many host devices as the largest one asks for.
  widest = max(
    (config[name] for name in names),
    key=lambda s: launch.requested_devices(s, _MAX_CPU_DEVICES.value) or 0,
  )
  launch.start(argv, widest, _MAX_CPU_DEVICES.value)

  # Imported only now: JAX (which rlhfjax imports) must start after XLA_FLAGS is set.
  from rlhfjax import config as config_lib
  from rlhfjax import runner
  from rlhfjax.observe.metrics import MetricsWriter

  workdir = launch.open_run(config, _WORKDIR.value)
  dirs = {name: os.path.join(workdir, name) for name in names}
  for path in dirs.values():  # the pipeline writes there: nobody else may while it runs
    launch.hold(path, run=workdir)
  config.ppo.init.actor = os.path.join(dirs["sft"], "checkpoints")
  if "rm" in dirs:
    config.rm.init.reward = os.path.join(dirs["sft"], "checkpoints")
    config.ppo.init.reward = os.path.join(dirs["rm"], "checkpoints")
  cfgs = {name: config_lib.from_config_dict(config[name]) for name in names}
  done = {name: _finished(dirs[name], cfgs[name]) for name in names}
  if all(done.values()) and rerun.finished_step(workdir) is not None:
    stages = ", ".join(f"{name} at step {rerun.finished_step(dirs[name])}" for name in names)
    print(
      f"{workdir}: finished ({stages}); nothing to do (delete the workdir or raise a stage's "
      "total_steps, e.g. --config.ppo.total_steps, to train more)"
    )
    return
  rerun.clear(workdir)
  algorithm = cfgs["ppo"].algorithm.name.upper()
  titles = {"sft": "supervised fine-tuning", "rm": "reward model", "ppo": algorithm}
  short = {"sft": "SFT", "rm": "reward model", "ppo": algorithm}
  for number, name in enumerate(names, 1):
    title = f"stage {number}/{len(names)}: {titles[name]}"
    if done[name]:  # not built at all: a finished stage's files stay as they are
      print(f"{title}: finished at step {rerun.finished_step(dirs[name])}", flush=True)
      continue
    print(title, flush=True)
    if runner.Runner(cfgs[name], dirs[name]).run().preempted:
      return _stopped(short[name])

  # Everything from the stages' files, never from this process's memory: a rerun skips the
  # finished stages, and its summary must read as the uninterrupted run's.
  rows = {name: MetricsWriter.read(os.path.join(dirs[name], "metrics.jsonl")) for name in dirs}
  evaluation = _read_evaluation(dirs["ppo"])
  scorer = (
    "environment" if cfgs["ppo"].rollout.environment else "reward model" if "rm" in rows else "rule"
  )
  summary = _summary(rows, evaluation, runner.format_evaluation, algorithm, scorer)
  with open(os.path.join(workdir, "summary.md"), "w") as f:
    f.write(summary)
  copied = []
  for name in _COPIED:
    source, target = os.path.join(dirs["ppo"], name), os.path.join(workdir, name)
    if os.path.exists(source):  # eval.md: not with the evaluation off
      shutil.copyfile(source, target)
      copied.append(name)
    elif os.path.exists(target):  # an earlier run's, which this run's summary does not match
      os.remove(target)
  rerun.mark_finished(workdir, cfgs["ppo"].total_steps)
  print(summary)
  print(f"outputs in {workdir}: summary.md, {', '.join(copied)}; each stage in its subdirectory")


def _finished(stage_dir: str, cfg) -> bool:
  return cfg.checkpoint.resume and rerun.is_finished(stage_dir, cfg.total_steps)


def _read_evaluation(ppo_dir: str) -> dict:
  path = os.path.join(ppo_dir, "eval.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _stopped(stage: str) -> None:
  print(f"stopped: {stage} checkpoint written; rerun the same command to resume")


def _first_last(rows: list[dict], key: str) -> str:
  values = [row[key] for row in rows if key in row]
  return f"{values[0]:.4f} -> {values[-1]:.4f}" if values else "-"


def _before_after(evaluation: dict, key: str) -> str:
  values = [evaluation[p][key] for p in ("before", "after") if key in evaluation.get(p, {})]
  return " -> ".join(f"{v:.4f}" for v in values) or "-"


def _summary(
  rows: dict[str, list[dict]],
  evaluation: dict,
  format_evaluation,
  algorithm: str = "PPO",
  scorer: str = "rule",
) -> str:
  lines = [
    "# Pipeline summary",
    "",
    f"- SFT held-out loss: {_first_last(rows['sft'], 'eval/loss')}",
  ]
  if "rm" in rows:
    lines.append(
      f"- Reward model held-out accuracy: {_first_last(rows['rm'], 'eval/accuracy')} (pairs "
      f"scored equal, which count as wrong: {_first_last(rows['rm'], 'eval/ties')}; the value "
      "head starts at zero, so before training every pair ties)"
    )
  # The task's own rule where it has one, else the run's reward (an environment's, say).
  own = not evaluation or "task_reward" in evaluation.get("before", {})
  key = "task_reward" if own else "reward"
  task = _before_after(evaluation, key) if evaluation else "evaluation off"
  lines += [
    f"- {algorithm} mean reward ({scorer}): {_first_last(rows['ppo'], 'reward/mean')}",
    f"- Held-out {key.replace('_', ' ')} before -> after {algorithm}: {task}",
  ]
  if not evaluation:  # ppo.eval.num_prompts=0, or a flow without a rollout
    return "\n".join([*lines, ""])
  lines += ["", f"## {algorithm} policy on held-out prompts", "", format_evaluation(evaluation)]
  return "\n".join(lines)


if __name__ == "__main__":
  launch.run(main)
