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

Rerunning the same command resumes: finished stages are not trained again, an interrupted one
continues from its latest checkpoint; SIGTERM or Ctrl-C stops the current stage with a
checkpoint. Any failure: one `error:` line, exit status 2 (`--debug`: the traceback).
"""

import os
import shutil

from absl import flags
from ml_collections import config_flags

from rlhfjax import launch

_CONFIG = config_flags.DEFINE_config_file("config", None, "Pipeline config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where every stage writes.")
_MAX_CPU_DEVICES = flags.DEFINE_integer(
  "max_cpu_devices", 64, "Most host devices to emulate when running on CPU."
)
flags.mark_flags_as_required(["config", "workdir"])

_COPIED = ("reward.png", "eval.md", "timeline.png")


def main(argv: list[str]) -> None:
  config = _CONFIG.value
  names = [name for name in ("sft", "rm", "ppo") if name in config]
  if "sft" not in names or "ppo" not in names:
    launch.fail(f"the pipeline config needs sections sft and ppo (and rm, optional); has {names}")
  stages = [config[name] for name in names]
  # One JAX start for all three stages: as many host devices as the largest one asks for.
  widest = max(stages, key=lambda s: launch.requested_devices(s, _MAX_CPU_DEVICES.value) or 0)
  launch.start(argv, widest, _MAX_CPU_DEVICES.value)

  # Imported only now: JAX (which rlhfjax imports) must start after XLA_FLAGS is set.
  from rlhfjax import config as config_lib
  from rlhfjax import runner as ppo_runner
  from rlhfjax.observe.metrics import MetricsWriter
  from rlhfjax.training import reward_model, sft

  workdir = launch.open_run(config, _WORKDIR.value)
  dirs = {name: os.path.join(workdir, name) for name in names}
  config.ppo.init.actor = os.path.join(dirs["sft"], "checkpoints")
  if "rm" in dirs:
    config.rm.init.checkpoint = os.path.join(dirs["sft"], "checkpoints")
    config.ppo.init.reward = os.path.join(dirs["rm"], "checkpoints")
  sft_cfg = config_lib.from_config_dict(config.sft, config_lib.SFTConfig)
  rm_cfg = (
    config_lib.from_config_dict(config.rm, config_lib.RewardModelConfig) if "rm" in dirs else None
  )
  ppo_cfg = config_lib.from_config_dict(config.ppo)
  algorithm = ppo_cfg.algorithm.name.upper()
  count = len(names)
  print(f"stage 1/{count}: supervised fine-tuning", flush=True)
  if sft.SFTTrainer(sft_cfg, dirs["sft"]).run().stopped:
    return _stopped("SFT")
  if rm_cfg is not None:
    print(f"stage 2/{count}: reward model", flush=True)
    if reward_model.RewardModelTrainer(rm_cfg, dirs["rm"]).run().stopped:
      return _stopped("reward model")
  print(f"stage {count}/{count}: {algorithm}", flush=True)
  result = ppo_runner.Runner(ppo_cfg, dirs["ppo"]).run()
  if result.preempted:
    return _stopped(algorithm)

  rows = {name: MetricsWriter.read(os.path.join(dirs[name], "metrics.jsonl")) for name in dirs}
  summary = _summary(rows, result.evaluation, ppo_runner.format_evaluation, algorithm)
  with open(os.path.join(workdir, "summary.md"), "w") as f:
    f.write(summary)
  for name in _COPIED:
    shutil.copyfile(os.path.join(dirs["ppo"], name), os.path.join(workdir, name))
  print(summary)
  print(f"outputs in {workdir}: summary.md, {', '.join(_COPIED)}; each stage in its subdirectory")


def _stopped(stage: str) -> None:
  print(f"stopped: {stage} checkpoint written; rerun the same command to resume")


def _first_last(rows: list[dict], key: str) -> str:
  values = [row[key] for row in rows if key in row]
  return f"{values[0]:.4f} -> {values[-1]:.4f}" if values else "-"


def _before_after(evaluation: dict, key: str) -> str:
  values = [evaluation[p][key] for p in ("before", "after") if key in evaluation.get(p, {})]
  return " -> ".join(f"{v:.4f}" for v in values) or "-"


def _summary(
  rows: dict[str, list[dict]], evaluation: dict, format_evaluation, algorithm: str = "PPO"
) -> str:
  lines = [
    "# Pipeline summary",
    "",
    f"- SFT held-out loss: {_first_last(rows['sft'], 'eval/loss')}",
  ]
  if "rm" in rows:
    lines.append(f"- Reward model held-out accuracy: {_first_last(rows['rm'], 'eval/accuracy')}")
  scorer = "reward model" if "rm" in rows else "rule"
  task = _before_after(evaluation, "task_reward")
  lines += [
    f"- {algorithm} mean reward ({scorer}): {_first_last(rows['ppo'], 'reward/mean')}",
    f"- Held-out task reward before -> after {algorithm}: {task}",
    "",
    f"## {algorithm} policy on held-out prompts",
    "",
    format_evaluation(evaluation),
  ]
  return "\n".join(lines)


if __name__ == "__main__":
  launch.run(main)
