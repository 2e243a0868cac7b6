"""Predicts the PPO update stage of a pipelined actor and critic: two 1F1B pipelines back to back
against RLHFuse's fused schedule (both models' micro-batches in one table, the critic's stages in
the reverse device order), on hardware you name.

  python scripts/plan_pipeline.py --actor=70b --critic=70b --hardware=h100 --devices=32 \
      --stages=4 --micro_batches=8 --prompts=1024 --optimizer_steps=8

Prints one JSON object: the update seconds of each (`two_1f1b_s`, `fused_s`, their ratio `gain`),
the bubble fractions of the priced tables (`bubble_1f1b`, `bubble_two_1f1b`, `bubble_fused`;
`textbook_bubble` for comparison), the same updates without a pipeline (`unpipelined_s`) and
the peak memory per device of each. No JAX: `rlhfjax.costmodel.pipeline` prices the schedule
tables of `rlhfjax.schedules` with the cost model's stage times.
"""

import json

from absl import app, flags

from rlhfjax import launch

_ACTOR = flags.DEFINE_string("actor", "70b", "Actor size name or HF config.json path.")
_CRITIC = flags.DEFINE_string("critic", None, "Critic size or path (default: the actor).")
_HARDWARE = flags.DEFINE_string("hardware", "h100", "Hardware preset, or 'local' (--efficiency).")
_DEVICES = flags.DEFINE_integer("devices", 32, "Devices the actor and critic share.")
_PER_NODE = flags.DEFINE_integer("devices_per_node", None, "Override the preset's node size.")
_STAGES = flags.DEFINE_integer("stages", 4, "Pipeline stages (the outermost mesh axis).")
_MICRO = flags.DEFINE_integer("micro_batches", 8, "Micro-batches per optimizer step (m).")
_TENSOR = flags.DEFINE_integer("tensor", 1, "Tensor-parallel size inside a stage (FSDP: the rest).")
_PROMPTS = flags.DEFINE_integer("prompts", 1024, "Prompts per iteration.")
_SAMPLES = flags.DEFINE_integer("samples_per_prompt", 1, "Responses per prompt.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 1024, "Prompt tokens (padded to it).")
_RESPONSE_LEN = flags.DEFINE_integer("response_len_max", 1024, "Response tokens (padded to it).")
_EPOCHS = flags.DEFINE_integer("ppo_epochs", 1, "PPO epochs per iteration.")
_STEPS = flags.DEFINE_integer("optimizer_steps", 8, "Optimizer updates (mini-batches) per epoch.")
_REMAT = flags.DEFINE_enum(
  "remat", "none", ["none", "dots_saveable", "full"], "Remat policy of the unpipelined step."
)
_RECOMPUTE = flags.DEFINE_bool(
  "pipeline_recompute",
  False,
  "Each backward runs its stage's forward again (placement.pipeline_recompute).",
)
_EFFICIENCY = flags.DEFINE_string("efficiency", None, "Efficiency JSON (profile or calibration).")


def main(argv):
  if len(argv) > 1:
    launch.fail(f"unexpected arguments: {' '.join(argv[1:])}")
  from rlhfjax.costmodel import efficiency, hardware, pipeline
  from rlhfjax.costmodel.workload import Workload, resolve_model

  try:
    actor = resolve_model(_ACTOR.value)
    critic = resolve_model(_CRITIC.value or _ACTOR.value)
    if actor is None or critic is None:
      raise ValueError("--actor and --critic cannot be 'none': fusion needs both")
    workload = Workload(
      actor=actor,
      critic=critic,
      prompts=_PROMPTS.value,
      samples_per_prompt=_SAMPLES.value,
      prompt_len=_PROMPT_LEN.value,
      response_len_mean=_RESPONSE_LEN.value,
      response_len_max=_RESPONSE_LEN.value,
      ppo_epochs=_EPOCHS.value,
      optimizer_steps=_STEPS.value,
      remat=_REMAT.value,
      pipeline_recompute=_RECOMPUTE.value,
    )
    hw = hardware.load_hardware(_HARDWARE.value, _EFFICIENCY.value)
    eff = efficiency.load_efficiency(_EFFICIENCY.value)
    gain = pipeline.compare(
      workload,
      hw,
      eff,
      devices=_DEVICES.value,
      stages=_STAGES.value,
      micro_batches=_MICRO.value,
      tensor=_TENSOR.value,
      devices_per_node=_PER_NODE.value,
    )
  except ValueError as error:
    launch.fail(error)
  line = {
    "actor": _ACTOR.value,
    "critic": _CRITIC.value or _ACTOR.value,
    "hardware": hw.name,
    "devices": _DEVICES.value,
    **gain.to_json(),
    "memory_budget_gib": round(hw.memory_gib, 2),
  }
  print(json.dumps(line))


if __name__ == "__main__":
  app.run(main, flags_parser=launch.parse_flags)
