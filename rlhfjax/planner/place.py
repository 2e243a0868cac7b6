"""An experiment's placement: the configured strategy, or `strategy=auto`'s search, kept to the
roles its flow uses and checked against its models. `place` is the runner's one entry: a flow of
several roles goes through `plan_placement`; one that trains a single model on one mesh (SFT,
the reward model) through `rlhfjax.placement.single_role`, whose split `strategy=auto` takes
from `rlhfjax.planner.single`.

It sits in the planner because it reads the flow registry (the roles a flow uses) and may
search; the placement package below builds and checks specs only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from rlhfjax import distributed
from rlhfjax.cluster.cluster import HEADS
from rlhfjax.config import ExperimentConfig
from rlhfjax.config.model import HeadKind, ModelConfig
from rlhfjax.flows.registry import configure, reference_from_base, roles_of, section_of
from rlhfjax.placement import memory, single_role
from rlhfjax.placement.hosts import nodes_of, tensor_across_hosts
from rlhfjax.placement.spec import PlacementSpec, Role, RoleSpec
from rlhfjax.placement.strategies import build_placement
from rlhfjax.placement.validate import (
  PlacementError,
  check_fusable,
  check_models,
  check_spec,
  resolve_num_devices,
)
from rlhfjax.planner import auto, single


def plan_placement(config: ExperimentConfig, available_devices: int) -> PlacementSpec:
  """`build_placement`, then checks the models of `config` against it (`check_models`).

  `placement.strategy='auto'` asks the planner (`rlhfjax.planner.auto`) for the fastest
  placement on the available devices and prints the chosen plan and the runner-up. Either way
  the placement keeps only the roles the flow uses (`rlhfjax.flows.registry.roles_of`).
  """
  config = configure(config)
  roles = roles_of(config)
  num_devices = resolve_num_devices(config.placement.num_devices, available_devices)
  if config.placement.strategy == "auto":
    spec, plans = auto.choose(config, num_devices)
    print(auto.describe(plans, auto.workload_of(config)), flush=True)
  else:
    spec = build_placement(config.placement, available_devices)
  # The roles the flow does not use get no mesh and count for no memory.
  spec = spec.only(roles)
  if reference_from_base(config):
    if config.placement.strategy == "explicit" and spec[Role.REFERENCE] != spec[Role.ACTOR]:
      raise PlacementError(
        "placement.explicit.reference is not the actor's placement, but the reference runs "
        "the actor's base weights on the actor's devices ('model.lora.reference'='base'): "
        "give it the actor's devices and axes, or set 'model.lora.reference'='placed'"
      )
    spec = spec.beside(Role.REFERENCE, Role.ACTOR)
  check_spec(spec, num_devices, roles)
  if config.ppo.fuse_actor_critic:
    check_fusable(spec)
  config, _ = sized(config, spec)
  train_rows, score_rows = auto.memory_rows(config)
  check_models(
    spec,
    config.model,
    config.rollout,
    config.placement.memory_per_device_gb,
    train_rows=train_rows,
    score_rows=score_rows,
    offload=config.offload,
    pipelining=auto.pipelining(config),
  )
  return spec


def sized(
  config: ExperimentConfig, spec: PlacementSpec
) -> tuple[ExperimentConfig, memory.KvPool | None]:
  """`config` with `rollout.kv_cache_tokens` sized from memory when `rollout.kv_memory_fraction`
  asks for it, and the pool (`kv_pool`); else `config` as it is and None (no rollout, no
  fraction, or the tokens given)."""
  rollout = config.rollout
  if not rollout.kv_memory_fraction or rollout.kv_cache_tokens or Role.ROLLOUT not in spec.roles:
    return config, None
  pool = kv_pool(config, spec)
  rollout = dataclasses.replace(rollout, kv_cache_tokens=pool.tokens)
  return dataclasses.replace(config, rollout=rollout), pool


def kv_pool(config: ExperimentConfig, spec: PlacementSpec) -> memory.KvPool:
  """The KV pool `rollout.kv_memory_fraction` gives the rollout of `spec`.

  Raises:
    PlacementError: the devices report no memory and `placement.memory_per_device_gb` is
      unset, or the fraction leaves no room for one sequence.
  """
  budget = config.placement.memory_per_device_gb
  if budget is not None:
    device_bytes = int(budget * memory.GIB)
  else:
    device_bytes = device_memory(tuple(spec[Role.ROLLOUT].devices))
  train_rows, score_rows = auto.memory_rows(config)
  return memory.kv_pool(
    spec,
    config.model,
    config.rollout,
    device_bytes,
    train_rows=train_rows,
    score_rows=score_rows,
    offload=config.offload,
    pipelining=auto.pipelining(config),
  )


@functools.cache
def device_memory(devices: tuple[int, ...]) -> int:
  """The least memory (bytes) JAX may allocate on any of `devices` (indices into
  `jax.devices()`), as their `memory_stats()` say, agreed by every process of the job.

  Raises:
    PlacementError: a device of this process reports none (XLA's CPU devices).
  """
  here = [d for d in (jax.devices()[i] for i in devices) if d.process_index == jax.process_index()]
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in here]
  missing = [d for d, limit in zip(here, limits, strict=True) if not limit]
  mine = "" if missing else str(min(limits, default=0))
  theirs = distributed.shared(mine, "device memory")
  if not all(theirs.values()):
    platform = (missing or here or jax.devices())[0].platform
    raise PlacementError(
      "'rollout.kv_memory_fraction' sizes the KV pool from the rollout devices' memory, but "
      f"the {platform} devices report none: set 'placement.memory_per_device_gb' too"
    )
  return min(int(v) for v in theirs.values() if v != "0")


def tensor_warnings(config: ExperimentConfig, spec: PlacementSpec) -> list[str]:
  """One line per role of `spec` whose tensor groups span nodes of the hardware that
  `placement.hardware` names (its `devices_per_node`); none when the hardware cannot be read
  ('local' without a calibration file). A live job checks its real hosts instead
  (`rlhfjax.runner.machines`)."""
  try:
    hw, _ = auto.load_planner_inputs(config.placement)
  except PlacementError:
    return []
  nodes = nodes_of(max(spec.devices) + 1, hw.devices_per_node)
  return tensor_across_hosts(spec, nodes, unit="node")


def place(cfg: ExperimentConfig, available_devices: int) -> PlacementSpec:
  """The checked placement of `cfg`'s flow on the first of `available_devices` devices.

  Raises:
    PlacementError: what is wrong with the placement, in one line.
  """
  cfg = configure(cfg)
  roles = roles_of(cfg)
  if len(roles) != 1:
    return plan_placement(cfg, available_devices)
  (role,) = roles
  placement = cfg.placement
  if placement.strategy not in single_role.STRATEGIES:
    raise PlacementError(
      f"'placement.strategy' must be one of {', '.join(single_role.STRATEGIES)} for "
      f"{cfg.algorithm.name!r}, which trains one model; got {placement.strategy!r}"
    )
  n = resolve_num_devices(placement.num_devices, available_devices)
  model = cfg.model.for_role(role.value)
  sup = section_of(cfg)
  rows = sup.batch_size // sup.micro_batches
  if placement.strategy == "auto":
    spec = _planned_spec(cfg, model, HEADS[role], n)
  else:
    spec = single_role.manual_spec(placement, model, n, rows)
  return single_role.placed(placement, role, spec, model, rows=rows, seq_len=sup.max_len)


def _planned_spec(cfg: ExperimentConfig, model: ModelConfig, head: HeadKind, n: int) -> RoleSpec:
  """The planner's fastest split that fits; prints it and the runner-up."""
  sup = section_of(cfg)
  hw, eff = auto.load_planner_inputs(cfg.placement)
  plans = single.plan(
    model,
    head,
    hw,
    eff,
    n,
    batch_size=sup.batch_size,
    micro_batches=sup.micro_batches,
    seq_len=sup.max_len,
    options=memory.model_options(model),
  )
  if not plans:
    raise PlacementError(
      f"placement.strategy=auto: no data x fsdp x tensor split of {n} devices divides the "
      f"model's heads and a micro-batch of {sup.batch_size // sup.micro_batches} rows"
    )
  if not plans[0].fits:
    raise PlacementError(f"placement.strategy=auto: no split fits; closest: {plans[0].why_not}")
  print(single.describe([p for p in plans if p.fits]), flush=True)
  return plans[0].spec()
