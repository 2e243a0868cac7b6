"""`placement.strategy='auto'`: plan for the devices at hand and return the winning spec.

The experiment config becomes a `Workload` (the trainer's batch, lengths, epochs, mini- and
micro-batches as the flow's section sets them, models, and whether the flow packs: `packs`,
with its token budgets). The config knows no mean length, so a packed run is priced with every
response at `rollout.max_new_tokens`: full rows, as padding costs, up to the rounding of the
packing's row buckets. The search ranks every placement on the configured hardware (`local`
from a calibration file, or a preset), and the first plan that fits and passes the placement
checks of the config is used. The chosen plan and the runner-up are printed.
"""

from __future__ import annotations

import dataclasses

from rlhfjax.config import ExperimentConfig
from rlhfjax.costmodel import efficiency, hardware
from rlhfjax.costmodel.costs import ONE_ANSWER, Conversation
from rlhfjax.costmodel.workload import JudgeEngine, Workload
from rlhfjax.flows.registry import (
  batch_of,
  packs,
  pricing_of,
  reference_from_base,
  roles_of,
  train_budget,
)
from rlhfjax.placement.memory import Pipelining
from rlhfjax.placement.spec import PlacementSpec, Role
from rlhfjax.placement.strategies import build_placement
from rlhfjax.placement.validate import PlacementError, check_models
from rlhfjax.planner import search
from rlhfjax.planner.evaluate import Plan, evaluate, present_roles
from rlhfjax.planner.report import format_groups


def workload_of(config: ExperimentConfig) -> Workload:
  """The planner's view of one iteration of the experiment: the roles its flow uses
  (`rlhfjax.flows.registry.roles_of`), so a critic-free flow plans no critic, a rule reward no
  reward model, and DPO no rollout; the stages priced as the flow registered them
  (`rlhfjax.flows.registry.pricing_of`), on the batch shape it reads (`batch_of`)."""
  rollout, model = config.rollout, config.model
  roles, pricing, batch = roles_of(config), pricing_of(config), batch_of(config)
  samples = _samples_per_prompt(config)
  # A flow whose prompts make a fixed number of sequences (DPO's pairs) takes the batch as
  # prompts; the others split it into groups of the samples of a prompt.
  prompts = rollout.batch_size if pricing.samples_per_prompt else rollout.batch_size // samples
  return Workload(
    actor=model.for_role(Role.ACTOR),
    critic=model.for_role(Role.CRITIC) if Role.CRITIC in roles else None,
    reward=model.for_role(Role.REWARD) if Role.REWARD in roles else None,
    reference=model.for_role(Role.REFERENCE),
    # A judge generates its verdicts on an engine of its own (`judges`).
    extra_rewards={
      role: model.for_role(role)
      for role in roles
      if role in config.reward.role_coefs or role == config.reward.judge
    },
    judges={role: _judge_engine(config, role) for role in roles if role == config.reward.judge},
    reference_from_base=reference_from_base(config),
    pricing=pricing,
    prompt_len=rollout.max_prompt_len,
    prompts=prompts,
    response_len_mean=rollout.max_new_tokens,
    samples_per_prompt=samples,
    response_len_max=rollout.max_new_tokens,
    # A conversation at its most turns, as the response at its longest; what its
    # observations hold and how long its environment takes, a config does not say.
    conversation=Conversation(turns=rollout.max_turns, workers=rollout.environment_workers)
    if rollout.environment
    else ONE_ANSWER,
    ppo_epochs=batch.epochs,
    optimizer_steps=batch.mini_batches,
    offload=config.offload,
    # A pool of `kv_cache_tokens` is the user's to size; the fraction sizes it from memory.
    kv_memory_fraction=0.0 if rollout.kv_cache_tokens else rollout.kv_memory_fraction,
    train_rows=train_rows(config),
    fuse_actor_critic=config.ppo.fuse_actor_critic,
    pipeline_schedule=config.placement.pipeline_schedule,
    pipeline_recompute=config.placement.pipeline_recompute,
    **packing_of(config),
  )


def _judge_engine(config: ExperimentConfig, role: str) -> JudgeEngine:
  """The judge's engine as `ExtraRoleSection.judge_engine` sizes it (its slots not yet rounded
  to the replicas of a placement)."""
  slots, capacity, verdict = config.model.extra_roles[role].judge_engine(config.rollout, 1)
  return JudgeEngine(slots=slots, capacity=capacity, verdict=verdict)


def packing_of(config: ExperimentConfig) -> dict:
  """The `Workload` fields of the run's packing (`rlhfjax.flows.registry.packs`): padded, or
  packed in training micro-batches of its token budget (`train_budget`) and scoring calls of
  `rollout.score_rows_packed` rows, as the engine runs them."""
  if not packs(config):
    return {"padded": True, "packed": False}
  return {
    "padded": False,
    "packed": True,
    "train_tokens": train_budget(config),
    "score_tokens": config.rollout.score_rows_packed * config.rollout.max_seq_len,
  }


def memory_rows(config: ExperimentConfig) -> tuple[int, int | None]:
  """Rows of `rollout.max_seq_len` tokens per micro-step that the memory check sizes (trained
  roles, scoring roles): a packing run's token budgets in rows (by default the padded
  micro-batch's `train_rows`; `rollout.score_rows_packed` per scoring call); a padded run's
  `train_rows` and the whole batch (None: `estimate_memory`'s default)."""
  rows = train_rows(config)
  if not packs(config):
    return rows, None
  budget = train_budget(config)
  return (
    budget // config.rollout.max_seq_len if budget else rows
  ), config.rollout.score_rows_packed


def pipelining(config: ExperimentConfig) -> Pipelining:
  """How `config`'s trained roles run a step's micro-batches on pipeline stages, for the memory
  their stages keep: its schedule, fusion, recompute and the flow's micro-batches per
  mini-batch (the micro-batches of one pipelined step)."""
  return Pipelining(
    schedule=config.placement.pipeline_schedule,
    fused=config.ppo.fuse_actor_critic,
    micro_batches=batch_of(config).micro_batches,
    recompute=config.placement.pipeline_recompute,
  )


def train_rows(config: ExperimentConfig) -> int:
  """Sequences per micro-step of the trained roles: the part of the rollout batch the actor
  trains on (online DPO: the pairs) split into the flow's mini- and micro-batches."""
  batch, samples = batch_of(config), _samples_per_prompt(config)
  per_prompt = pricing_of(config).trained[Role.ACTOR] or samples
  trained = config.rollout.batch_size * min(per_prompt, samples) // samples
  return max(1, trained // batch.mini_batches // batch.micro_batches)


def _samples_per_prompt(config: ExperimentConfig) -> int:
  return pricing_of(config).samples_per_prompt or batch_of(config).samples_per_prompt


def load_planner_inputs(section) -> tuple[hardware.Hardware, efficiency.Efficiency]:
  """The hardware and efficiency a `placement` section (`hardware`, `efficiency`,
  `memory_per_device_gb`) names for `strategy=auto`.

  Raises:
    PlacementError: the hardware or efficiency file cannot be read, with how to make one.
  """
  try:
    hw = hardware.load_hardware(section.hardware, section.efficiency or None)
    eff = efficiency.load_efficiency(section.efficiency or None)
  except ValueError as error:
    hint = (
      " (run scripts/calibrate.py --out=FILE and pass --config.placement.efficiency=FILE, or "
      "name a preset with --config.placement.hardware)"
    )
    raise PlacementError(f"placement.strategy=auto: {error}{hint}") from None
  if section.memory_per_device_gb is not None:
    hw = dataclasses.replace(hw, memory_gib=section.memory_per_device_gb)
  return hw, eff


def choose(config: ExperimentConfig, num_devices: int) -> tuple[PlacementSpec, list[Plan]]:
  """The fastest placement of `config` on `num_devices` that fits and passes `check_models`;
  where none fits, the fastest with pipeline stages that run their forwards again in their
  backwards (`PlacementSpec.pipeline_recompute`, label '... recompute'), if one fits.

  Raises:
    PlacementError: the hardware or efficiency file cannot be read, or no placement fits.
  """
  hw, eff = load_planner_inputs(config.placement)
  workload = workload_of(config)

  def usable(workload: Workload) -> tuple[list[Plan], list[Plan]]:
    plans = search.search(
      workload,
      hw,
      eff,
      num_devices,
      async_rollout=config.ppo.generates_ahead,
      extras=config.placement.extra_roles,
    )
    kept = []
    for plan in plans:
      if not plan.fits:
        continue
      try:
        check_models(plan.spec, config.model, config.rollout, None)
      except PlacementError:
        continue
      kept.append(plan)
    return plans, kept

  plans, fitting = usable(workload)
  if not fitting and not workload.pipeline_recompute:
    # Pipelines that keep one micro-batch's residuals at a time may fit where none does.
    _, fitting = usable(dataclasses.replace(workload, pipeline_recompute=True))
    fitting = [
      dataclasses.replace(
        plan,
        label=f"{plan.label} recompute",
        spec=dataclasses.replace(plan.spec, pipeline_recompute=True),
      )
      for plan in fitting
      if any(rs.stages > 1 for rs in plan.spec.roles.values())
    ]
  if not fitting:
    closest = plans[0].why_not if plans else "no candidate"
    raise PlacementError(f"placement.strategy=auto: no placement fits; closest: {closest}")
  return fitting[0].spec, fitting


def describe(plans: list[Plan], workload: Workload) -> str:
  """Two lines: the chosen plan and the runner-up, with their predictions."""
  roles = present_roles(workload)
  lines = []
  for name, plan in zip(("chosen", "runner-up"), plans[:2], strict=False):
    stages = " ".join(f"{k}={v:.3g}s" for k, v in plan.stages.items() if v)
    lines.append(
      f"placement auto {name}: {plan.label} [{format_groups(plan, roles)}] predicted "
      f"{plan.iteration_s:.3g} s/iteration ({stages}), peak {plan.peak_memory_gib:.2f} GiB"
    )
  return "\n".join(lines)


def predict(
  config: ExperimentConfig,
  num_devices: int,
  hw: hardware.Hardware,
  eff: efficiency.Efficiency,
  spec: PlacementSpec | None = None,
  label: str = "",
) -> Plan:
  """The planner's prediction for `spec`, by default the placement `config` names (not a
  search)."""
  spec = spec or build_placement(config.placement, num_devices)
  return evaluate(
    spec,
    workload_of(config),
    hw,
    eff,
    micro_batch=0,
    async_rollout=config.ppo.generates_ahead,
    label=label or spec.strategy,
  )


def predicted_plan(config: ExperimentConfig, spec: PlacementSpec) -> Plan:
  """The planner's prediction for `spec` (the placement `choose` picked) on the hardware the
  config names: what a planned run draws beside its measured timeline."""
  hw, eff = load_planner_inputs(config.placement)
  return predict(config, len(spec.devices), hw, eff, spec, label=f"auto: {spec.strategy}")
