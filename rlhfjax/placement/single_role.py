"""The placement of a flow that trains one model (SFT, the reward model): its one role on the
first `num_devices` devices as one training mesh, stage x data x fsdp x tensor (the layout PPO
gives its trained roles), checked against the model's heads and layers, the micro-batch and the
memory budget.

`placement.strategy='auto'` lets the planner pick the split (`rlhfjax.planner.single`); the
runner asks it, as this layer may not import the planner.
"""

from __future__ import annotations

from rlhfjax.config import PlacementSection, RolloutSection
from rlhfjax.config.model import ModelConfig
from rlhfjax.placement import memory
from rlhfjax.placement.spec import PlacementSpec, Role, RoleSpec
from rlhfjax.placement.validate import PlacementError, check_layers

STRATEGIES = ("colocated", "auto")
"""The strategies of one role: 'colocated' (`data` and `tensor` as given, fsdp over the rest)
or the planner's split."""


def manual_spec(
  placement: PlacementSection, model: ModelConfig, num_devices: int, rows: int
) -> RoleSpec:
  """`placement.pipeline_stages` x `placement.data` x fsdp x `placement.context` x
  `placement.tensor` over `num_devices` devices.

  Raises:
    PlacementError: stages x `data` x `tensor` does not divide the devices, `tensor` does not
      divide the (KV) heads, the stages do not divide the layers, or a micro-batch of `rows`
      rows does not split over the batch shards.
  """
  stages, data, tensor = placement.pipeline_stages, placement.data, placement.tensor
  named = [
    (f"placement.{field}", size)
    for field, size in (("pipeline_stages", stages), ("data", data), ("tensor", tensor))
    if size > 1 or field == "tensor"
  ]
  if num_devices % (stages * data * tensor):
    fields = " x ".join(field for field, _ in named)
    sizes = " x ".join(str(size) for _, size in named)
    raise PlacementError(
      f"{fields} = {sizes} does not divide placement.num_devices={num_devices}"
      if len(named) > 1
      else f"placement.tensor={tensor} does not divide placement.num_devices={num_devices}"
    )
  for name in ("num_heads", "num_kv_heads"):
    if getattr(model, name) % tensor:
      raise PlacementError(
        f"placement.tensor={tensor} does not divide {name}={getattr(model, name)} of the model"
      )
  check_layers(model, stages)
  fsdp = num_devices // tensor // data // stages
  context = placement.context
  if fsdp % context:
    raise PlacementError(
      f"placement.context={context} does not divide the {fsdp} fsdp devices "
      f"(placement.num_devices={num_devices} over data x tensor x stages); set it to one of "
      f"{', '.join(str(c) for c in range(1, fsdp + 1) if fsdp % c == 0)}"
    )
  fsdp //= context
  shards = data * fsdp
  if rows % shards:
    raise PlacementError(
      f"a micro-batch of {rows} rows (batch_size / micro_batches) does not split over the "
      f"{'data x fsdp' if data > 1 else 'fsdp'}={shards} batch shards; make it a multiple of "
      f"{shards}"
    )
  return RoleSpec.training(
    range(num_devices), stage=stages, data=data, fsdp=fsdp, context=context, tensor=tensor
  )


def placed(
  placement: PlacementSection,
  role: Role,
  spec: RoleSpec,
  model: ModelConfig,
  *,
  rows: int,
  seq_len: int,
) -> PlacementSpec:
  """The placement of `role` alone on `spec`, after the memory check of `placement`.

  Raises:
    PlacementError: the model, its AdamW moments, gradients and the activations of one
      micro-batch of `rows` x `seq_len` tokens do not fit `placement.memory_per_device_gb`.
  """
  if placement.memory_per_device_gb is not None:
    # Estimated as for PPO's trained role with the same head.
    trained = Role.ACTOR if role in (Role.ACTOR, Role.REFERENCE) else Role.CRITIC
    shape = RolloutSection(batch_size=rows, max_prompt_len=seq_len, max_new_tokens=1)
    need = memory.estimate_memory(trained, spec, model, shape, train_rows=rows).total
    budget = placement.memory_per_device_gb * memory.GIB
    if need > budget:
      raise PlacementError(
        f"{role} does not fit: needs {need / memory.GIB:.3g} GiB per device on "
        f"{len(spec.devices)} devices but the budget is {placement.memory_per_device_gb:.3g} "
        "GiB (placement.memory_per_device_gb)"
      )
  return PlacementSpec(strategy=placement.strategy, roles={role: spec})
