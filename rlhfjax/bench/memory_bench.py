"""Peak device memory of the PPO actor train step, from XLA's own analysis (nothing allocated).

The step (`rlhfjax.training.steps.accumulate_and_apply` of `actor_loss`, AdamW with global-norm
clipping) is compiled ahead of time on abstract inputs for the actor's mesh of a co-located
placement; `compiled.memory_analysis()` gives the per-device bytes of its arguments, outputs
(minus those aliased to donated arguments) and temporaries.

Co-located roles (critic, reference, reward) share those devices and, unless offloaded, keep
their arrays resident during the actor's update. Their per-device bytes are added from the
shapes and shardings of their arrays (the shard shapes of the real `NamedSharding`s). With
offload, the parts `rlhfjax.mesh.offload` parks (reference and reward parameters, the critic's
optimizer state) live in host memory during the actor's update and count zero. The CPU
backend's memory analysis does not split memory spaces, so offload is accounted this way
rather than by compiling the step with host-memory arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp

from rlhfjax import models
from rlhfjax.cluster.role import RoleRuntime
from rlhfjax.config import OptimizerConfig
from rlhfjax.config.model import (
  LoraConfig,
  ModelConfig,
  get_model_config,
  model_sizes,
  param_count,
)
from rlhfjax.costmodel import workload
from rlhfjax.costmodel.memory import adapter_bytes
from rlhfjax.mesh import rules
from rlhfjax.placement import strategies
from rlhfjax.placement.spec import Role
from rlhfjax.training import steps
from rlhfjax.training.optimizer import make_optimizer

GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPoint:
  """One measured configuration; `as_row()` is the JSON line the script prints."""

  size: str
  seq_len: int
  remat: str
  chunked_logprobs: bool
  offload: bool
  num_devices: int
  context: int
  """Devices each sequence's tokens are split over (`placement.context`; 1: none)."""
  lora_rank: int
  """Rank of LoRA adapters on every trained role over a frozen bf16 base (0: full weights)."""
  step_peak_gb: float
  """The actor step's own peak per device: arguments + outputs - aliased + temporaries."""
  colocated_resident_gb: float
  """Other roles' arrays resident on each device during the update."""
  sync_gb: float
  """What one weight sync to a rollout on devices of its own moves: the bf16 weights, or with
  `lora_rank` the float32 adapters alone (`rlhfjax.cluster.adapter_sync`)."""
  compile_s: float

  @property
  def peak_gb_per_device(self) -> float:
    return self.step_peak_gb + self.colocated_resident_gb

  def as_row(self) -> dict[str, Any]:
    row = dataclasses.asdict(self)
    row["peak_gb_per_device"] = round(self.peak_gb_per_device, 3)
    return row


def _per_device_bytes(abstract: Any, shardings: Any) -> int:
  """Bytes one device holds of `abstract` laid out by `shardings` (the largest device)."""
  per_device: dict[int, int] = {}
  for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True):
    shard = sharding.shard_shape(leaf.shape)
    nbytes = math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    for device in sharding.device_set:
      per_device[device.id] = per_device.get(device.id, 0) + nbytes
  return max(per_device.values())


def _train_state_parts(rt: RoleRuntime, tx) -> tuple[int, int]:
  """Per-device bytes of a trained role's (parameters, optimizer state)."""
  abstract = rt.abstract_train_state(tx)
  shardings = rt.train_state_shardings(tx)
  return (
    _per_device_bytes(abstract.params, shardings.params),
    _per_device_bytes(abstract.opt_state, shardings.opt_state),
  )


def actor_batch(actor: RoleRuntime, rows: int, seq_len: int, prompt_len: int) -> dict[str, Any]:
  """Abstract inputs of one actor step (one micro-batch of `rows` sequences), rows split over
  the actor's batch axes."""
  t = seq_len - prompt_len
  shapes = {
    "tokens": ((1, rows, seq_len), jnp.int32),
    "attention_mask": ((1, rows, seq_len), jnp.int32),
    "response_mask": ((1, rows, t), jnp.float32),
    "old_logprobs": ((1, rows, t), jnp.float32),
    "advantages": ((1, rows, t), jnp.float32),
  }
  return {
    k: jax.ShapeDtypeStruct(s, d, sharding=actor.batch_sharding(s, leading=1))
    for k, (s, d) in shapes.items()
  }


def actor_step_memory(
  model: ModelConfig,
  num_devices: int,
  seq_len: int,
  *,
  prompt_len: int,
  micro_batch: int,
  context: int = 1,
) -> tuple[Any, float]:
  """`memory_analysis()` of the compiled actor step and the seconds its compile took."""
  spec = _placement(num_devices, context)
  actor = RoleRuntime.create(Role.ACTOR, spec[Role.ACTOR], model, "lm")
  tx = make_optimizer(OptimizerConfig(), 1000)
  state = actor.abstract_train_state(tx)
  state_sh = actor.train_state_shardings(tx)
  batch = actor_batch(actor, micro_batch, seq_len, prompt_len)
  loss = functools.partial(
    steps.actor_loss, config=model, prompt_len=prompt_len, clip_eps=0.2, entropy_coef=0.0
  )
  step = jax.jit(
    rules.constrained(
      functools.partial(steps.accumulate_and_apply, loss, tx), actor.spec.layout, actor.mesh
    ),
    in_shardings=(state_sh, jax.tree.map(lambda x: x.sharding, batch)),
    out_shardings=(state_sh, actor.replicated),
    donate_argnums=0,
  )
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  return compiled.memory_analysis(), time.perf_counter() - start


def _placement(num_devices: int, context: int):
  """The co-located placement, each row over `context` of the fsdp devices."""
  spec = strategies.colocated(num_devices)
  return strategies.with_context(spec, context) if context > 1 else spec


def colocated_resident_bytes(
  model: ModelConfig, num_devices: int, offload: bool, context: int = 1
) -> int:
  """Per-device bytes of the critic, reference and reward (same size as the actor) that stay
  on the actor's devices during its update; with `offload`, what the trainer parks is out.
  With LoRA (`model.lora`) the reference is the actor's base (`model.lora.reference='base'`):
  it holds nothing of its own."""
  spec = _placement(num_devices, context)
  tx = make_optimizer(OptimizerConfig(), 1000)
  critic = RoleRuntime.create(Role.CRITIC, spec[Role.CRITIC], model, "value")
  critic_params, critic_opt = _train_state_parts(critic, tx)
  frozen = 0
  base = model.replace(lora=None)  # the frozen roles carry no adapters
  frozen_roles = ((Role.REFERENCE, "lm"), (Role.REWARD, "value"))
  for role, head in frozen_roles[1:] if model.lora is not None else frozen_roles:
    rt = RoleRuntime.create(role, spec[role], base, head)
    frozen += _per_device_bytes(models.abstract_params(base, head), rt.param_shardings)
  if offload:
    return critic_params
  return critic_params + critic_opt + frozen


def bench_model(size: str) -> ModelConfig:
  """A registered size, or the model of a Hugging Face config.json (its path, or its
  checkpoint's directory) with fp32 master weights and bf16 compute, as the named real sizes."""
  if size in model_sizes():
    return get_model_config(size)
  return workload.resolve_model(size).replace(param_dtype="float32", dtype="bfloat16")


def measure(
  size: str,
  seq_len: int,
  remat: str,
  chunked: bool,
  *,
  num_devices: int = 8,
  chunk_size: int = 1024,
  micro_batch: int | None = None,
  context: int = 1,
  lora_rank: int = 0,
) -> list[MemoryPoint]:
  """The actor step of `size` at `seq_len` tokens (a quarter of them prompt), one sequence
  per device (per `context` devices with context parallelism: each holds `seq_len / context`
  of its tokens), with and without offload of the co-located roles."""
  model = bench_model(size).replace(remat=remat, logprob_chunk_size=chunk_size if chunked else None)
  if lora_rank:
    # LoRA over the checkpoint's bf16 weights (no fp32 masters), as `model.lora` trains it.
    model = model.replace(param_dtype="bfloat16", lora=LoraConfig(rank=lora_rank))
  if num_devices % context or seq_len % context:
    raise ValueError(
      f"--context={context} must divide the {num_devices} devices and the {seq_len} tokens"
    )
  stats, compile_s = actor_step_memory(
    model,
    num_devices,
    seq_len,
    prompt_len=seq_len // 4,
    micro_batch=micro_batch or num_devices // context,
    context=context,
  )
  step_peak = (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
  )
  return [
    MemoryPoint(
      size=size,
      seq_len=seq_len,
      remat=remat,
      chunked_logprobs=chunked,
      offload=offload,
      num_devices=num_devices,
      context=context,
      lora_rank=lora_rank,
      step_peak_gb=round(step_peak / GB, 3),
      colocated_resident_gb=round(
        colocated_resident_bytes(model, num_devices, offload, context) / GB, 3
      ),
      sync_gb=round(sync_bytes(model) / GB, 4),
      compile_s=round(compile_s, 1),
    )
    for offload in (False, True)
  ]


def sync_bytes(model: ModelConfig) -> int:
  """Bytes a sync of `model`'s actor to a disaggregated bf16 rollout moves."""
  if model.lora is not None:
    return adapter_bytes(model)
  return param_count(model) * 2


def targets(points: list[MemoryPoint], size: str, budget_gb: float) -> dict[str, Any]:
  """The issue's two targets for `size`, from the measured points (offload off: the harder
  case): the settings with remat whose 4k peak fits `budget_gb`, and for every setting
  measured at 4k and 8k the ratio peak(8k) / peak(4k) (<= 2: at most linear growth)."""
  peak = {
    (p.seq_len, p.remat, p.chunked_logprobs): p.peak_gb_per_device
    for p in points
    if p.size == size and not p.offload
  }
  fits = sorted(
    f"{remat}{'+chunked' if chunked else ''}"
    for (seq, remat, chunked), gb in peak.items()
    if seq == 4096 and remat != "none" and gb <= budget_gb
  )
  growth = {
    f"{remat}{'+chunked' if chunked else ''}": round(gb / peak[(4096, remat, chunked)], 3)
    for (seq, remat, chunked), gb in peak.items()
    if seq == 8192 and (4096, remat, chunked) in peak
  }
  return {
    "size": size,
    "target": f"4k fits {budget_gb:g} GB with remat; peak(8k) <= 2 x peak(4k)",
    "fits_4k_with_remat": fits,
    "growth_8k_over_4k": growth,
    "linear": bool(growth) and all(r <= 2.0 for r in growth.values()),
  }
