"""Per-device memory estimate of each role: parameters, optimizer state, gradients, KV cache.

The estimate counts the state that stays resident; activations and temporary buffers are left
out, so it is a lower bound meant to reject placements that cannot work, not to promise that a
placement fits.

- Parameters are stored in the model's `param_dtype`. The training layout shards them over
  `fsdp` x `tensor` (`data` holds replicas); the generation layout shards them over `tensor`
  only (each `data` group holds a full copy).
- Trained roles (actor, critic) add AdamW moments (2 x float32 per parameter) and gradients
  (`param_dtype`), sharded like the parameters.
- The rollout adds the KV cache of `batch_size` sequences of `max_prompt_len + max_new_tokens`
  tokens: the batch split over the batch axes (`data`, and `fsdp` in a training layout), the
  KV heads over `tensor`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from rlhfjax.config import ModelSection, RolloutSection
from rlhfjax.models.config import HeadKind, ModelConfig, kv_cache_bytes_per_token, param_count
from rlhfjax.placement.spec import Layout, PlacementSpec, Role, RoleSpec

GIB = 2**30
ADAM_BYTES_PER_PARAM = 2 * 4
"""AdamW's first and second moments, float32 each."""

TRAINED_ROLES = (Role.ACTOR, Role.CRITIC)
HEADS: Mapping[Role, HeadKind] = {
  Role.ACTOR: "lm",
  Role.CRITIC: "value",
  Role.REFERENCE: "lm",
  Role.REWARD: "value",
  Role.ROLLOUT: "lm",
}
"""Output head of each role's model: policies predict tokens, critics and rewards a scalar."""

PARAM_SHARDING_AXES: Mapping[Layout, tuple[str, ...]] = {
  Layout.TRAINING: ("fsdp", "tensor"),
  Layout.GENERATION: ("tensor",),
}
"""Mesh axes each layout shards parameters (and optimizer state, gradients) over."""
BATCH_AXES: Mapping[Layout, tuple[str, ...]] = {
  Layout.TRAINING: ("data", "fsdp"),
  Layout.GENERATION: ("data",),
}
"""Mesh axes each layout splits the batch over."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
  """Bytes one device of a role holds, by kind."""

  params: int
  optimizer: int = 0
  """AdamW moments (trained roles only)."""
  grads: int = 0
  """Gradients (trained roles only)."""
  kv_cache: int = 0
  """KV cache (rollout only)."""

  @property
  def total(self) -> int:
    return self.params + self.optimizer + self.grads + self.kv_cache


def estimate_memory(
  role: Role | str, spec: RoleSpec, model: ModelConfig, rollout: RolloutSection
) -> MemoryEstimate:
  """Estimates the bytes one device of `role` holds when placed as `spec`.

  Args:
    role: the role, which decides the head and whether optimizer state and KV cache exist.
    spec: the role's devices, mesh axes and layout.
    model: the role's model.
    rollout: the rollout batch shape (used by the rollout role only).

  Returns:
    The per-device breakdown, rounded up to whole bytes per kind.
  """
  role = Role(role)
  param_shards = math.prod(spec.axis_size(a) for a in PARAM_SHARDING_AXES[spec.layout])
  num_params = param_count(model, HEADS[role])
  params = _ceil_div(num_params * model.param_bytes_per_element, param_shards)
  optimizer = grads = kv_cache = 0
  if role in TRAINED_ROLES:
    optimizer = _ceil_div(num_params * ADAM_BYTES_PER_PARAM, param_shards)
    grads = params
  if role == Role.ROLLOUT:
    batch_shards = math.prod(spec.axis_size(a) for a in BATCH_AXES[spec.layout])
    sequences = _ceil_div(rollout.batch_size, batch_shards)
    per_token = _ceil_div(kv_cache_bytes_per_token(model), spec.axis_size("tensor"))
    kv_cache = sequences * rollout.max_seq_len * per_token
  return MemoryEstimate(params=params, optimizer=optimizer, grads=grads, kv_cache=kv_cache)


def estimate_placement_memory(
  placement: PlacementSpec, model: ModelSection, rollout: RolloutSection
) -> dict[Role, MemoryEstimate]:
  """`estimate_memory` of every role of `placement`, with the model each role runs."""
  return {
    role: estimate_memory(role, spec, model.for_role(role), rollout)
    for role, spec in placement.roles.items()
  }


def device_totals(
  placement: PlacementSpec, estimates: Mapping[Role, MemoryEstimate]
) -> dict[int, int]:
  """Bytes each device holds, summed over the roles placed on it (all stay resident)."""
  totals: dict[int, int] = {}
  for role, spec in placement.roles.items():
    for device in spec.devices:
      totals[device] = totals.get(device, 0) + estimates[role].total
  return totals


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)
