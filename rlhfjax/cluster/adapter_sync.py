"""The weight sync of an actor that trains LoRA adapters, to a rollout on devices of its own.

Only the adapters move: the rollout keeps a copy of the frozen base from the start (cast to its
dtypes on the actor's mesh, moved once), and each sync moves the adapters (float32, a few MB
where the weights are GB) and merges them into that copy on the rollout's own mesh
(`models.lora.merged`), so the engine runs the adapted weights merged, as after a full sync.

Merged rather than applied unmerged: the engine then runs the same program as without adapters
(no per-token adapter matmuls in decode), at the cost of the base copy beside the merged
weights on the rollout devices (`rlhfjax.placement.memory` counts it). The merge computes
`W + (alpha / r) A B` from the same values in the same dtypes as the actor-side merge of a full
sync when the rollout holds the base's own dtype (a bf16 checkpoint's LoRA run): the engine's
weights are then those of a full sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhfjax import models
from rlhfjax.cluster.role import RoleRuntime
from rlhfjax.mesh import offload, transfer
from rlhfjax.models import lora


class AdapterSync:
  """The rollout's base copy and the compiled programs of an adapters-only sync."""

  def __init__(self, src: RoleRuntime, dst: RoleRuntime, compile_fn: Callable[..., Callable]):
    """`src` trains adapters (`src.model.lora`); `dst` is the rollout, on other devices;
    `compile_fn` is `Cluster.compile`."""
    self.lora = src.model.lora
    wanted = models.abstract_params(dst.model, dst.head)
    base_shardings = lora.base_layout(src.param_shardings)
    self._cast_base = compile_fn(
      "rollout_base_cast",
      # A quantized base (QLoRA) dequantized: the rollout runs float weights.
      lambda params: transfer.cast(lora.dequantized(lora.base(params)), dtypes=wanted),
      in_shardings=(src.param_shardings,),
      out_shardings=base_shardings,
      role=src.role,
    )
    adapted = RoleRuntime.create(
      dst.role, dst.spec, dst.model.replace(lora=self.lora), dst.head, dst.mesh
    )
    self.adapter_shardings = lora.adapters(adapted.param_shardings)
    """The adapters on the rollout's mesh, laid out as its generation layout lays out their
    kernels (the rank replicated)."""
    self._merge = compile_fn(
      "rollout_merge",
      lambda base, adapters: lora.merged(lora.attach(base, adapters), self.lora),
      in_shardings=(dst.param_shardings, self.adapter_shardings),
      out_shardings=dst.param_shardings,
      role=dst.role,
    )
    self._dst = dst
    self.base: Any = None
    """The rollout's copy of the frozen base, in its dtypes and layout (after `start`)."""

  def start(self, params: Any) -> None:
    """Copies the frozen base of the source's `params` to the rollout (once)."""
    self.base, _ = transfer.transfer(self._cast_base(_on_device(params)), self._dst.param_shardings)

  def merged(self, params: Any) -> tuple[Any, int]:
    """The rollout's adapted weights from the source's current `params`: its adapters moved to
    the rollout's mesh and merged into the base copy there; and the bytes moved."""
    adapters, moved = transfer.transfer(_on_device(lora.adapters(params)), self.adapter_shardings)
    return self._merge(self.base, adapters), moved


def _on_device(tree: Any) -> Any:
  """`tree` in device memory (a parked actor's weights live in host memory)."""
  kinds = offload.memory_kinds(tree)
  return tree if kinds <= {offload.DEVICE} else offload.device_copy(tree)
