"""Ranks the placements of an RLHF job on given hardware: stage times, iteration, memory.

  python scripts/plan_placement.py --actor=7b --critic=7b --reward=7b --hardware=a800 \
      --devices=8 --prompts=1024 --prompt_len=1024 --response_len_mean=512 --response_len_max=1024

Prints the ranked table (or one JSON object per plan with --json) and why the winner wins. No
JAX devices are used: the plan is computed from the shapes and the hardware description.
"""

import json
import sys

from absl import app, flags

from rlhfjax import launch

_ACTOR = flags.DEFINE_string("actor", "7b", "Actor size name or HF config.json path.")
_CRITIC = flags.DEFINE_string(
  "critic", None, "Critic size/path or 'none' (critic-free; default: the actor for ppo)."
)
_REWARD = flags.DEFINE_string("reward", None, "Reward size/path or 'none' (default: the critic).")
_REFERENCE = flags.DEFINE_string("reference", None, "Reference size/path (default: the actor).")
_HARDWARE = flags.DEFINE_string("hardware", "h100", "Preset name or 'local' (needs --efficiency).")
_DEVICES = flags.DEFINE_integer("devices", 8, "Devices of the job.")
_PER_NODE = flags.DEFINE_integer("devices_per_node", None, "Override the preset's node size.")
_ALGORITHM = flags.DEFINE_string(
  "algorithm",
  "ppo",
  "A registered flow, priced as it registered: ppo (critic), grpo, rloo, ... (no critic), dpo "
  "(no rollout), online_dpo (pairs).",
)
_PROMPTS = flags.DEFINE_integer("prompts", 1024, "Prompts per iteration.")
_SAMPLES = flags.DEFINE_integer("samples_per_prompt", 1, "Responses per prompt.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 1024, "Longest prompt tokens (padded to it).")
flags.DEFINE_float("prompt_len_mean", 0, "Mean prompt tokens (0: every prompt is --prompt_len).")
_MEAN = flags.DEFINE_float("response_len_mean", 512, "Mean response tokens.")
_MAX = flags.DEFINE_integer("response_len_max", 1024, "Longest response tokens.")
flags.DEFINE_float("turns", 1, "Multi-turn rollouts: the model's turns per conversation (mean).")
flags.DEFINE_float(
  "observation_tokens",
  0,
  "--turns: the environment's tokens per conversation (mean; counted in the response lengths).",
)
flags.DEFINE_float("environment_s", 0, "--turns: seconds one environment step takes.")
flags.DEFINE_integer("environment_workers", 1, "--turns: environment steps run at once.")
_EPOCHS = flags.DEFINE_integer("ppo_epochs", 1, "PPO epochs per iteration.")
_STEPS = flags.DEFINE_integer("optimizer_steps", 1, "Optimizer updates per epoch.")
_MICRO = flags.DEFINE_integer("micro_batch", 0, "Sequences per device per micro-step (0: search).")
_STRATEGY = flags.DEFINE_string(
  "strategy", "auto", "auto (every registered strategy) or one registered strategy to plan."
)
_ROLLOUT_DEVICES = flags.DEFINE_integer("rollout_devices", None, "Fix the disaggregated split.")
_ASYNC = flags.DEFINE_bool("async_rollout", False, "One-step off-policy generation overlap.")
_CONTINUOUS = flags.DEFINE_bool("continuous_batching", False, "Rollout refills finished slots.")
flags.DEFINE_bool(
  "packed",
  False,
  "Score and train on packed rows of real lengths (ppo.packing), priced with the packing's fill "
  "loss; default: every sequence padded to prompt_len + response_len_max.",
)
flags.DEFINE_integer(
  "max_tokens_per_micro_batch",
  0,
  "--packed: tokens per training micro-step over a role's group (0: the padded micro-batch's).",
)
flags.DEFINE_integer(
  "max_tokens_per_score_batch",
  0,
  "--packed: tokens per scoring call over a role's group (0: the padded micro-batch's).",
)
_REMAT = flags.DEFINE_enum("remat", "none", ["none", "dots_saveable", "full"], "Remat policy.")
flags.DEFINE_bool(
  "pipeline_recompute",
  False,
  "Pipelined backwards run their stage's forward again (placement.pipeline_recompute).",
)
_CHUNK = flags.DEFINE_integer("logits_chunk", 0, "Log-prob chunk tokens (0: all at once).")
_OFFLOAD = flags.DEFINE_bool(
  "offload",
  False,
  "Reference and reward parameters and actor and critic moments in host memory while idle.",
)
flags.DEFINE_list(
  "extra_roles",
  [],
  "Extra scoring roles, NAME:KIND:MODEL[:MODE[:DEVICES[:TENSOR]]] each (model.extra_roles and "
  "placement.extra_roles): KIND 'reward' or 'judge', MODEL a size or HF config.json, MODE "
  "'shared' (default, on the reward's devices), 'interleaved' or 'own'.",
)
flags.DEFINE_integer("judge_new_tokens", 8, "A judge's verdict tokens (its max_new_tokens).")
_EFFICIENCY = flags.DEFINE_string("efficiency", None, "Efficiency JSON (profile or calibration).")
_TOP = flags.DEFINE_integer("top", 10, "Rows of the table.")
_JSON = flags.DEFINE_bool("json", False, "One JSON object per plan instead of the table.")
_FUSION = flags.DEFINE_bool(
  "fusion", False, "Also predict fused scoring + tail compaction under a long-tailed length mix."
)
flags.DEFINE_float("tail_fraction", 0.1, "--fusion: share of responses in the long tail.")
flags.DEFINE_float("tail_ratio", 8.0, "--fusion: tail length over the median length.")
flags.DEFINE_integer("fusion_micro_batch", 0, "--fusion: samples per scoring call (0: slots/4).")
flags.DEFINE_float("tail_threshold", 0.25, "--fusion: share of slots left when compacting.")
_TIMELINE = flags.DEFINE_string(
  "timeline", None, "Directory for the winner's predicted timeline.json and timeline.png."
)


def main(argv):
  if len(argv) > 1:
    launch.fail(f"unexpected arguments: {' '.join(argv[1:])}")
  from rlhfjax.planner import cli

  try:
    plans, text = cli.plan_from_flags(flags.FLAGS)
  except ValueError as error:
    launch.fail(error)
  if _JSON.value:
    for plan in plans:
      print(json.dumps(plan.to_json()))
  else:
    print(text)
  if _FUSION.value:
    from rlhfjax.bench import fusion

    predictions, table = fusion.report_from_flags(flags.FLAGS, plans)
    if _JSON.value:
      for prediction in predictions:
        print(json.dumps({"fusion": prediction.to_json()}))
    else:
      print("\n" + table)
  if _TIMELINE.value:
    from rlhfjax.planner.report import write_timeline

    paths = write_timeline(plans[0], _TIMELINE.value)
    print(f"predicted timeline: {', '.join(paths)}", file=sys.stderr)
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main, flags_parser=launch.parse_flags)
