"""One trained model on one training mesh (SFT, reward-model training): the data/fsdp/tensor split.

Every split of N devices into data x fsdp x tensor is a candidate when `tensor` divides the
model's heads and KV heads (and stays within a node) and a micro-batch of rows splits over the
data x fsdp batch shards. Each is predicted with the RLHF planner's pieces: the step time is
`costs.train_time` (FLOPs, FSDP gathers and reduce-scatters over `fsdp`, the gradient
all-reduce over `data`, tensor all-reduces, the optimizer update), the memory per device is
`memory.train_memory` (parameters, moments and gradients sharded over fsdp x tensor, the
activations of one micro-batch). Candidates that fit are ranked by step time, the rest follow
with the reason.
"""

from __future__ import annotations

import dataclasses
import math

from rlhfjax.config.model import ModelConfig
from rlhfjax.costmodel import costs, memory
from rlhfjax.costmodel.efficiency import Efficiency
from rlhfjax.costmodel.hardware import GIB, Hardware
from rlhfjax.placement.hosts import nodes_of, tensor_spans_hosts
from rlhfjax.placement.spec import RoleSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitPlan:
  """A data x fsdp x tensor split of one trained model, with its predictions."""

  data: int
  fsdp: int
  tensor: int
  step_s: float
  """Predicted seconds of one optimizer update (all its micro-steps)."""
  memory: memory.MemoryEstimate
  fits: bool
  why_not: str = ""

  @property
  def devices(self) -> int:
    return self.data * self.fsdp * self.tensor

  @property
  def label(self) -> str:
    return f"data={self.data} fsdp={self.fsdp} tensor={self.tensor}"

  def spec(self) -> RoleSpec:
    return RoleSpec.training(
      range(self.devices), data=self.data, fsdp=self.fsdp, tensor=self.tensor
    )


def splits(num_devices: int, config: ModelConfig, rows: int, max_tensor: int) -> list[tuple]:
  """(data, fsdp, tensor) of every split of `num_devices` the model and the batch allow."""
  out = []
  for tensor in range(1, min(num_devices, max_tensor) + 1):
    if num_devices % tensor or config.num_heads % tensor or config.num_kv_heads % tensor:
      continue
    rest = num_devices // tensor
    for data in range(1, rest + 1):
      if rest % data == 0 and rows % rest == 0:
        out.append((data, rest // data, tensor))
  return out


def plan(
  config: ModelConfig,
  head: str,
  hw: Hardware,
  eff: Efficiency,
  num_devices: int,
  *,
  batch_size: int,
  micro_batches: int,
  seq_len: int,
  options: memory.Options | None = None,
) -> list[SplitPlan]:
  """Every split of `num_devices` for updates of `batch_size` sequences of `seq_len` tokens
  in `micro_batches` micro-steps, fitting ones first by predicted step time."""
  options = options or memory.Options()
  rows = batch_size // micro_batches
  plans = []
  for data, fsdp, tensor in splits(num_devices, config, rows, hw.devices_per_node):
    split = RoleSpec.training(range(num_devices), data=data, fsdp=fsdp, tensor=tensor)
    nodes = nodes_of(num_devices, hw.devices_per_node)
    group = costs.Group(
      devices=num_devices,
      tensor=tensor,
      data=data,
      spans_nodes=num_devices > hw.devices_per_node,
      tensor_spans_nodes=bool(tensor_spans_hosts(split, nodes)),
    )
    step = costs.train_time(
      hw,
      eff,
      config,
      head,
      group,
      sequences=batch_size,
      seq_len=seq_len,
      epochs=1,
      optimizer_steps=1,
      micro_steps=micro_batches,
      remat=options.remat,
      optimizer_dtype=options.optimizer_dtype,
    )
    sharding = memory.Sharding(param_shards=fsdp * tensor, batch_shards=data * fsdp, tensor=tensor)
    estimate = memory.train_memory(
      config,
      head,
      sharding,
      micro_batch=math.ceil(rows / (data * fsdp)),
      seq_len=seq_len,
      options=options,
    )
    fits = estimate.total <= hw.memory_gib * GIB
    why_not = (
      ""
      if fits
      else (
        f"needs {estimate.total / GIB:.1f} GiB per device > {hw.memory_gib:.0f} (params "
        f"{estimate.params / GIB:.1f}, optimizer {estimate.optimizer / GIB:.1f}, grads "
        f"{estimate.grads / GIB:.1f}, activations {estimate.activations / GIB:.1f})"
      )
    )
    plans.append(
      SplitPlan(
        data=data,
        fsdp=fsdp,
        tensor=tensor,
        step_s=step,
        memory=estimate,
        fits=fits,
        why_not=why_not,
      )
    )
  plans.sort(key=lambda p: (not p.fits, p.step_s if p.fits else p.memory.total))
  return plans


def describe(plans: list[SplitPlan]) -> str:
  """Two lines: the chosen split and the runner-up, with their predictions."""
  lines = []
  for name, p in zip(("chosen", "runner-up"), plans[:2], strict=False):
    lines.append(
      f"placement auto {name}: {p.label} predicted {p.step_s:.3g} s/step, "
      f"{p.memory.total / GIB:.2f} GiB per device"
    )
  return "\n".join(lines)
