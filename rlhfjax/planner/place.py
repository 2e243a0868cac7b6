"""An experiment's placement: the configured strategy, or `strategy=auto`'s search, kept to the
roles its flow uses and checked against its models.

It sits in the planner because it reads the flow registry (the roles a flow uses) and may
search; the placement package below builds and checks specs only.
"""

from __future__ import annotations

from rlhfjax.config import ExperimentConfig
from rlhfjax.flows.registry import roles_of
from rlhfjax.placement.spec import PlacementSpec
from rlhfjax.placement.strategies import build_placement
from rlhfjax.placement.validate import check_models, check_spec, resolve_num_devices
from rlhfjax.planner import auto


def plan_placement(config: ExperimentConfig, available_devices: int) -> PlacementSpec:
  """`build_placement`, then checks the models of `config` against it (`check_models`).

  `placement.strategy='auto'` asks the planner (`rlhfjax.planner.auto`) for the fastest
  placement on the available devices and prints the chosen plan and the runner-up. Either way
  the placement keeps only the roles the flow uses (`rlhfjax.flows.registry.roles_of`).
  """
  roles = roles_of(config)
  num_devices = resolve_num_devices(config.placement.num_devices, available_devices)
  if config.placement.strategy == "auto":
    spec, plans = auto.choose(config, num_devices)
    print(auto.describe(plans, auto.workload_of(config)), flush=True)
  else:
    spec = build_placement(config.placement, available_devices)
  # The roles the flow does not use get no mesh and count for no memory.
  spec = spec.only(roles)
  check_spec(spec, num_devices, roles)
  check_models(
    spec,
    config.model,
    config.rollout,
    config.placement.memory_per_device_gb,
    train_rows=auto.train_rows(config),
    offload=config.offload,
  )
  return spec
