"""The planner behind `scripts/plan_placement.py`: flags in, ranked plans and their table out."""

from __future__ import annotations

import dataclasses

from rlhfjax.config import ExtraPlacementSection, OffloadSection
from rlhfjax.costmodel import efficiency, hardware
from rlhfjax.costmodel.costs import Conversation
from rlhfjax.costmodel.workload import OFFLOAD_ALL, JudgeEngine, Workload, resolve_model
from rlhfjax.flows.registry import pricing_by_name
from rlhfjax.placement.hosts import nodes_of, tensor_across_hosts
from rlhfjax.planner import report, search
from rlhfjax.planner.evaluate import Plan


def workload_from_flags(f, extra_roles: tuple | None = None) -> Workload:
  """The workload the flags describe, priced as the registered flow `--algorithm` (a critic
  only for a flow that trains one, as PPO does); `extra_roles`: `extra_roles_from_flags(f)`,
  when the caller has it already."""
  pricing = pricing_by_name(f.algorithm)
  actor = resolve_model(f.actor)
  if actor is None:
    raise ValueError("--actor cannot be 'none'")
  has_critic = "critic" in pricing.trained
  critic_name = f.critic if f.critic is not None else (f.actor if has_critic else "none")
  critic = resolve_model(critic_name)
  if not has_critic and critic is not None:
    raise ValueError(f"--algorithm={f.algorithm} has no critic; drop --critic or use ppo")
  reward_name = f.reward if f.reward is not None else (critic_name if critic else "none")
  extras, judges, _ = extra_roles or extra_roles_from_flags(f)
  # --critic=none plans a critic-free run (no critic mesh or memory), as --algorithm=grpo does.
  return Workload(
    extra_rewards=extras,
    judges={
      name: JudgeEngine(
        slots=min(f.prompts * f.samples_per_prompt, 64),
        capacity=f.prompt_len + f.response_len_max + 64,
        verdict=f.judge_new_tokens,
      )
      for name in judges
    },
    actor=actor,
    critic=critic,
    reward=resolve_model(reward_name),
    reference=resolve_model(f.reference) if f.reference else None,
    pricing=pricing,
    prompts=f.prompts,
    samples_per_prompt=f.samples_per_prompt,
    prompt_len=f.prompt_len,
    prompt_len_mean=f.prompt_len_mean,
    response_len_mean=f.response_len_mean,
    response_len_max=f.response_len_max,
    conversation=conversation_from_flags(f),
    ppo_epochs=f.ppo_epochs,
    optimizer_steps=f.optimizer_steps,
    micro_batch=f.micro_batch,
    static_batching=not f.continuous_batching,
    remat=f.remat,
    pipeline_recompute=f.pipeline_recompute,
    logits_chunk=f.logits_chunk,
    offload=OFFLOAD_ALL if f.offload else OffloadSection(),
    padded=not f.packed,
    packed=f.packed,
    train_tokens=f.max_tokens_per_micro_batch,
    score_tokens=f.max_tokens_per_score_batch,
  )


def conversation_from_flags(f) -> Conversation:
  """`--turns`, `--observation_tokens`, `--environment_s`, `--environment_workers`; one line
  naming the flag for a bad value."""
  try:
    return Conversation(
      turns=f.turns,
      observation_tokens=f.observation_tokens,
      environment_s=f.environment_s,
      workers=f.environment_workers,
    )
  except ValueError as error:
    raise ValueError(
      f"--turns={f.turns} --observation_tokens={f.observation_tokens} --environment_s="
      f"{f.environment_s} --environment_workers={f.environment_workers}: {error}"
    ) from None


def extra_roles_from_flags(f) -> tuple[dict, set, dict[str, ExtraPlacementSection]]:
  """`--extra_roles` as (models by name, the judges' names, placements by name), in order;
  a judge's engine as the config's defaults size it (`ExtraRoleSection.judge_engine`: up to 64
  slots, the rows' capacity plus 64 template tokens)."""
  models, judges, placements = {}, set(), {}
  for entry in f.extra_roles:
    parts = entry.split(":")
    if not 3 <= len(parts) <= 6:
      raise ValueError(
        f"--extra_roles entry {entry!r} must be NAME:KIND:MODEL[:MODE[:DEVICES[:TENSOR]]]"
      )
    name, kind, model, *where = parts
    if name in models or name in ("actor", "critic", "reference", "reward", "rollout"):
      raise ValueError(f"--extra_roles: {name!r} is a built-in role or named twice")
    if kind not in ("reward", "judge"):
      raise ValueError(f"--extra_roles: {name!r} has kind {kind!r}; use reward or judge")
    if kind == "judge":
      if judges:
        raise ValueError("--extra_roles: one judge at most (reward.judge names one)")
      judges.add(name)
    models[name] = resolve_model(model)
    if models[name] is None:
      raise ValueError(f"--extra_roles: {name!r} needs a model, not 'none'")
    mode, devices, tensor = [*where, *("shared", "1", "1")[len(where) :]]
    if not (devices.isdigit() and tensor.isdigit()):
      raise ValueError(f"--extra_roles: {name!r}: DEVICES and TENSOR must be whole numbers")
    try:
      placements[name] = ExtraPlacementSection(mode=mode, devices=int(devices), tensor=int(tensor))
    except ValueError as error:  # the config's one line
      raise ValueError(f"--extra_roles: {name!r}: {error}") from None
  if f.judge_new_tokens < 1:
    raise ValueError(f"--judge_new_tokens must be >= 1, got {f.judge_new_tokens}")
  return models, judges, placements


def check_flags(f) -> None:
  """Refuses meaningless flag values in one line naming the flag, before any planning."""
  # The workload's own counts and lengths are checked by `Workload` itself.
  for name in ("devices", "top"):
    if getattr(f, name) < 1:
      raise ValueError(f"--{name} must be >= 1, got {getattr(f, name)}")
  if not f.packed and (f.max_tokens_per_micro_batch or f.max_tokens_per_score_batch):
    raise ValueError("--max_tokens_per_micro_batch and --max_tokens_per_score_batch need --packed")
  for name in ("devices_per_node", "rollout_devices"):
    if getattr(f, name) is not None and getattr(f, name) < 1:
      raise ValueError(f"--{name} must be >= 1, got {getattr(f, name)}")
  if f.fusion:
    if f.turns != 1:
      raise ValueError("--fusion predicts one answer per prompt: drop --turns")
    if not 0 < f.tail_fraction < 0.5:
      raise ValueError(f"--tail_fraction must be in (0, 0.5), got {f.tail_fraction}")
    if not f.tail_ratio > 1:
      raise ValueError(f"--tail_ratio must be > 1, got {f.tail_ratio}")
    if not 0 < f.tail_threshold < 1:
      raise ValueError(f"--tail_threshold must be in (0, 1), got {f.tail_threshold}")
    if f.fusion_micro_batch < 0:
      raise ValueError(f"--fusion_micro_batch must be >= 0, got {f.fusion_micro_batch}")


def plan_from_flags(f) -> tuple[list[Plan], str]:
  """Ranked plans and their table for the flags of `plan_placement.py`."""
  check_flags(f)
  extra_roles = extra_roles_from_flags(f)
  work = workload_from_flags(f, extra_roles)
  hw = hardware.load_hardware(f.hardware, f.efficiency)
  if f.devices_per_node is not None:
    hw = dataclasses.replace(hw, devices_per_node=f.devices_per_node)
  eff = efficiency.load_efficiency(f.efficiency)
  if f.rollout_devices is not None and f.strategy != "disaggregated":
    raise ValueError("--rollout_devices needs --strategy=disaggregated")
  plans = search.search(
    work,
    hw,
    eff,
    f.devices,
    strategy=f.strategy,
    rollout_devices=f.rollout_devices,
    async_rollout=f.async_rollout,
    extras=extra_roles[2],
  )
  if not plans:
    raise ValueError(f"no {f.strategy} placement can be built on {f.devices} devices")
  title = (
    f"{f.strategy} placements of {f.algorithm} on {f.devices} x {hw.name} "
    f"({hw.memory_gib:.0f} GiB), {work.sequences} sequences of {_prompt(work)}+"
    f"{work.response_len_mean:g}/{work.response_len_max} tokens{_turns(work)}"
    f"{_lengths(work, plans[0])}, "
    f"efficiency {eff.generation_engine}; stage seconds per iteration"
  )
  text = title + "\n" + report.format_plans(plans, work, top=f.top)
  nodes = nodes_of(f.devices, hw.devices_per_node)
  for line in tensor_across_hosts(plans[0].spec, nodes, unit="node"):
    text += f"\nwarning: {plans[0].label}: {line}"
  return plans, text


def _prompt(work: Workload) -> str:
  """Prompt tokens, mean/longest when they differ."""
  return f"{work.prompt_mean:g}/{work.prompt_len}" if work.prompt_len_mean else str(work.prompt_len)


def _turns(work: Workload) -> str:
  """A conversation's shape, when there are turns."""
  c = work.conversation
  if c.turns == 1:
    return ""
  return (
    f" in {c.turns:g} turns ({c.observation_tokens:g} of them the environment's, "
    f"{c.environment_s:g} s a step, {c.workers} at once)"
  )


def _lengths(work: Workload, best: Plan) -> str:
  """How scoring and training compute: padded, real lengths, or packed with the best plan's
  fill."""
  if work.packed:
    return f", packed (fill {best.fill:.3f})"
  return ", padded" if work.padded else ", real lengths"
