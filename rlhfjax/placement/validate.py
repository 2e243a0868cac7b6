"""Checks that a `PlacementSpec` can run, with one-line `PlacementError` messages.

Two levels: `check_spec` needs only the spec and the device count (devices in range, no
duplicates, mesh axes of the layout whose sizes multiply to the group size, the disjoint pairs
the strategy asked for); `check_models` adds the models and the rollout shape (tensor sizes that
divide the heads, layers that split over the pipeline stages, batch sizes that split over the
data groups, memory per device). `check_fusable` checks a placement for the fused actor-critic
schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from rlhfjax.config import ModelSection, OffloadSection, RolloutSection
from rlhfjax.config.model import ModelConfig
from rlhfjax.placement import memory
from rlhfjax.placement.report import format_devices, format_mesh
from rlhfjax.placement.spec import LAYOUT_AXES, OPTIONAL_AXES, PlacementSpec, Role, RoleSpec


class PlacementError(ValueError):
  """A placement cannot run: bad devices, mesh sizes, overlaps, or a model that does not fit."""


def resolve_num_devices(num_devices: int | None, available_devices: int) -> int:
  """The device count of the job: `num_devices`, or all available devices when None."""
  if num_devices is None:
    return available_devices
  if num_devices < 1:
    raise PlacementError(f"placement.num_devices must be >= 1, got {num_devices}")
  if num_devices > available_devices:
    raise PlacementError(
      f"placement.num_devices={num_devices} exceeds the {available_devices} available devices"
    )
  return num_devices


def check_spec(spec: PlacementSpec, num_devices: int, roles: Iterable[str] = tuple(Role)) -> None:
  """Checks the structure of `spec` for a job of `num_devices` devices whose flow uses `roles`.

  Raises:
    PlacementError: a role is missing or has no devices, a device index is out of range or
      repeated, the mesh axes are not those of the layout or do not multiply to the number of
      devices, or two roles of `spec.disjoint` share devices.
  """
  missing = [str(role) for role in roles if role not in spec.roles]
  if missing:
    raise PlacementError(f"{spec.strategy}: no placement for role(s) {', '.join(missing)}")
  for role, role_spec in spec.roles.items():
    _check_devices(role, role_spec, num_devices)
    _check_axes(role, role_spec)
  for a, b in spec.disjoint:
    shared = sorted(set(spec[a].devices) & set(spec[b].devices))
    if shared:
      hint = ""
      if {a, b} <= set(Role) and spec.strategy == "explicit":
        hint = " (list them in one placement.explicit.colocate group to allow it)"
      elif extra := next((r for r in (a, b) if r not in tuple(Role)), None):
        hint = f" (placement.extra_roles.{extra} places it; 'own' devices are the job's last)"
      raise PlacementError(
        f"{spec.strategy}: {a} and {b} must not share devices but both use "
        f"{format_devices(shared)}{hint}"
      )


def check_models(
  spec: PlacementSpec,
  model: ModelSection,
  rollout: RolloutSection,
  memory_per_device_gb: float | None,
  *,
  train_rows: int | None = None,
  score_rows: int | None = None,
  options: memory.Options | None = None,
  offload: OffloadSection | None = None,
  pipelining: memory.Pipelining | None = None,
) -> None:
  """Checks that every role's model can be laid out on its mesh and fits its devices.

  Args:
    spec: a placement that passed `check_spec`.
    model: which model each role runs.
    rollout: the rollout batch shape.
    memory_per_device_gb: the budget of one device in GiB; None skips the memory checks.
    train_rows: sequences per micro-step of the trained roles (see `estimate_memory`).
    score_rows: sequences per call of the scoring roles (see `estimate_memory`).
    options: backend settings of the memory model (remat and chunks are each model's own).
    offload: the roles whose parameters or moments wait in host memory while idle; a role's
      offloaded parts count during its own stage and not while it is idle.
    pipelining: how the trained roles on pipeline stages run their micro-batches (see
      `estimate_memory`).

  Raises:
    PlacementError: a `tensor` size does not divide a model's heads or KV heads, a role's
      pipeline stages do not divide its model's layers, the rollout batch does not split evenly
      over its batch axes, a role needs more memory per device than the budget, or the roles
      sharing a device need more together.
  """
  for role, role_spec in spec.roles.items():
    config = model.for_role(role)
    tensor = role_spec.axis_size("tensor")
    for name in ("num_heads", "num_kv_heads"):
      heads = getattr(config, name)
      if heads % tensor:
        raise PlacementError(
          f"{role}: tensor={tensor} does not divide {name}={heads} of model "
          f"{model.model_name(role)!r}"
        )
    check_layers(config, role_spec.stages, role)
  rollout_spec = spec.roles.get(Role.ROLLOUT)  # None for a flow that generates nothing (DPO)
  batch_axes = memory.BATCH_AXES[rollout_spec.layout] if rollout_spec else ()
  batch_shards = math.prod(rollout_spec.axis_size(a) for a in batch_axes) if rollout_spec else 1
  if rollout.batch_size % batch_shards:
    raise PlacementError(
      f"rollout.batch_size={rollout.batch_size} does not split evenly over the "
      f"{batch_shards} batch shards ({'x'.join(batch_axes)}) of the rollout mesh"
    )
  if memory_per_device_gb is not None:
    estimates = memory.estimate_placement_memory(
      spec,
      model,
      rollout,
      train_rows=train_rows,
      score_rows=score_rows,
      options=options,
      offload=offload,
      pipelining=pipelining,
    )
    _check_memory(spec, estimates, memory_per_device_gb)


def check_layers(model: ModelConfig, stages: int, role: Role | None = None) -> None:
  """The scanned layers of `model` split into `stages` contiguous blocks of equal size.

  Raises:
    PlacementError: `stages` does not divide `model.num_layers`.
  """
  if model.num_layers % stages:
    who = f"{role}: " if role else ""
    fits = [k for k in range(1, model.num_layers + 1) if model.num_layers % k == 0]
    raise PlacementError(
      f"{who}model.num_layers={model.num_layers} does not split into "
      f"placement.pipeline_stages={stages} stages (stage counts that do: "
      f"{', '.join(map(str, fits))})"
    )


def check_fusable(spec: PlacementSpec) -> None:
  """The actor and critic of `spec` can run as one fused schedule (`ppo.fuse_actor_critic`):
  both pipelined with the same mesh axes, on the same devices (as sets: the critic's stages
  run in the reverse order).

  Raises:
    PlacementError: no critic (a critic-free estimator), no pipeline, or different meshes or
      devices.
  """
  if Role.CRITIC not in spec.roles:
    raise PlacementError("ppo.fuse_actor_critic fuses the actor and critic; the flow has no critic")
  actor, critic = spec[Role.ACTOR], spec[Role.CRITIC]
  if actor.stages == 1:
    raise PlacementError(
      "ppo.fuse_actor_critic needs pipelined actor and critic (placement.pipeline_stages > 1, "
      "or a 'stage' axis in placement.explicit)"
    )
  if actor.axes != critic.axes or set(actor.devices) != set(critic.devices):
    raise PlacementError(
      f"ppo.fuse_actor_critic needs the actor and critic on the same devices and mesh; actor "
      f"{format_devices(actor.devices)} ({format_mesh(actor)}), critic "
      f"{format_devices(critic.devices)} ({format_mesh(critic)})"
    )


def _check_devices(role: Role, spec: RoleSpec, num_devices: int) -> None:
  if not spec.devices:
    raise PlacementError(f"{role}: no devices")
  seen: set[int] = set()
  for d in spec.devices:
    if not 0 <= d < num_devices:
      raise PlacementError(
        f"{role}: device index {d} is out of range for {num_devices} devices "
        f"(valid: 0..{num_devices - 1}; list those in placement.explicit.{role}.devices)"
      )
    if d in seen:
      raise PlacementError(f"{role}: device {d} is listed more than once")
    seen.add(d)


def _check_axes(role: Role, spec: RoleSpec) -> None:
  allowed: Sequence[str] = LAYOUT_AXES[spec.layout]
  for name, size in spec.axes:
    if name not in allowed:
      raise PlacementError(
        f"{role}: unknown mesh axis {name!r} for the {spec.layout} layout; "
        f"allowed: {', '.join(allowed)}"
      )
    if size < 1:
      raise PlacementError(f"{role}: mesh axis {name}={size} must be >= 1")
  # An optional axis ('stage') may be left out; the others are all there, in the layout's order.
  expected = tuple(a for a in allowed if a not in OPTIONAL_AXES or a in spec.axis_names)
  if spec.axis_names != expected:
    raise PlacementError(
      f"{role}: the {spec.layout} layout needs mesh axes ({', '.join(expected)}) in this "
      f"order, got ({', '.join(spec.axis_names)})"
    )
  if spec.stages > 1 and spec.context > 1:
    raise PlacementError(
      f"{role}: a 'stage' and a 'context' axis together: context parallelism does not run "
      "inside pipeline stages"
    )
  if spec.mesh_size != len(spec.devices):
    sizes = " x ".join(f"{name}={size}" for name, size in spec.axes)
    raise PlacementError(
      f"{role}: mesh axes {sizes} = {spec.mesh_size} devices, but the role has "
      f"{len(spec.devices)} devices"
    )


def _check_memory(
  spec: PlacementSpec,
  estimates: Mapping[Role, memory.MemoryEstimate],
  memory_per_device_gb: float,
) -> None:
  budget = memory_per_device_gb * memory.GIB
  budget_text = f"the budget is {memory_per_device_gb:.3g} GiB (placement.memory_per_device_gb)"
  for role, estimate in estimates.items():
    if estimate.total > budget:
      raise PlacementError(
        f"{role} does not fit: needs {_gib(estimate.total)} GiB per device "
        f"(params {_gib(estimate.params)}, optimizer {_gib(estimate.optimizer)}, "
        f"grads {_gib(estimate.grads)}, activations {_gib(estimate.activations)}, "
        f"logits {_gib(estimate.logits)}, kv cache {_gib(estimate.kv_cache)}) on its "
        f"{len(spec[role].devices)} devices but {budget_text}"
      )
  for device, total in sorted(memory.device_totals(spec, estimates).items()):
    if total > budget:
      roles = [role.value for role, s in spec.roles.items() if device in s.devices]
      raise PlacementError(
        f"device {device} holds {' + '.join(roles)} together: {_gib(total)} GiB but {budget_text}"
      )


def _gib(num_bytes: int) -> str:
  return f"{num_bytes / memory.GIB:.3g}"
