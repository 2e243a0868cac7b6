"""The placement a run gets: `plan_placement` for a flow of several roles; for a flow that
trains one model on one mesh (SFT, the reward model) `rlhfjax.placement.single_role`, whose
split the planner picks under `placement.strategy=auto` (`rlhfjax.planner.single`; the
placement and flow layers may not import the planner, so the runner asks it)."""

from __future__ import annotations

from rlhfjax.cluster.cluster import HEADS
from rlhfjax.config import ExperimentConfig
from rlhfjax.flows import registry
from rlhfjax.models.config import HeadKind, ModelConfig
from rlhfjax.placement import memory, plan_placement, single_role
from rlhfjax.placement.spec import PlacementSpec, RoleSpec
from rlhfjax.placement.validate import PlacementError, resolve_num_devices


def place(cfg: ExperimentConfig, available_devices: int) -> PlacementSpec:
  """The checked placement of `cfg`'s flow on the first of `available_devices` devices.

  Raises:
    PlacementError: what is wrong with the placement, in one line.
  """
  roles = registry.roles_of(cfg)
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
  sup = cfg.supervised
  rows = sup.batch_size // sup.micro_batches
  if placement.strategy == "auto":
    spec = _planned_spec(cfg, model, HEADS[role], n)
  else:
    spec = single_role.manual_spec(placement, model, n, rows)
  return single_role.placed(placement, role, spec, model, rows=rows, seq_len=sup.max_len)


def _planned_spec(cfg: ExperimentConfig, model: ModelConfig, head: HeadKind, n: int) -> RoleSpec:
  """The planner's fastest split that fits; prints it and the runner-up."""
  from rlhfjax.planner import auto, single  # the planner is imported only when asked for

  sup = cfg.supervised
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
