"""What pipeline parallelism does to a trained role's update: its time and memory per device.

Layout: `stages` (P) is the outermost mesh axis, so a role's N devices form P consecutive
groups of N / P; each holds L / P of the model's L layers and shards them over its own `fsdp`,
`tensor` and `data` axes exactly as an unpipelined group of N / P devices would
(`rlhfjax.costmodel.costs`). The schedule is a table (`rlhfjax.schedules`): ticks in lock-step,
each device running at most one forward (F) or backward (B) of one micro-batch per tick.

Time of one pipelined update, per device:

- busy: the unpipelined update of the stage group (`costs.train_time`: matmuls, FSDP gathers
  and reduce-scatters, tensor all-reduces, the optimizer) divided by P, since every term scales
  with the layers a device holds; only the fixed cost per optimizer step (`stage_s`, `update_s`)
  is charged whole. rlhfjax's executor keeps the residuals of each stage's forward that the
  role's remat policy keeps and runs no forward again in the backward, as Megatron's schedules
  do: three passes, four with full remat; with `pipeline_recompute` (GPipe's
  re-materialisation) the backward runs the stage's forward again from its stashed input: one
  pass more (five with full remat, whose layers the recomputed forward's backward runs once
  more again). The embedding and the head are spread over the stages with the layers
  (on a 70B with a 32k vocabulary they are under 1% of the matmuls); their vocabulary, split
  over the stages between steps, is gathered at each optimizer step's start and its gradients
  reduce-scattered at the end (`vocabulary_sync_time`), charged whole like the fixed costs.
- bubbles: one op's seconds are its share of the busy time, a backward costing
  `BACKWARD_COST` = 2 forwards (the two backward matmuls of every forward one), one more for
  each forward run again (full remat's layers, `pipeline_recompute`'s stage): the pass counts
  the busy time is priced with. A lock-step tick lasts as long as its slowest op, so the
  pipeline takes the sum over the table's ticks of the slowest op, once per optimizer step
  (every step flushes the pipeline). For one model this is
  busy / (1 - `schedules.bubble_fraction(table, 1, BACKWARD_COST)`); two models of different
  sizes in one table (fused or back to back) are priced op by op the same way. Mixed ticks
  (one device's forward beside another's backward) are why 1F1B's priced bubble exceeds the
  textbook (p - 1) / (m + p - 1), which holds for equal op costs or an executor that is not
  lock-step.
- sends: after each tick every device passes one activation (forward) or its gradient
  (backward) to its neighbouring stage: a micro-batch's `[rows, seq, hidden]` in the compute
  dtype, split over `tensor` as the memory model splits the residual stream, over the node's
  links, or the network's when neighbouring stages are on different nodes (a pipeline of more
  than one node). Lock-step: the send follows the tick, not overlapped with it.

Memory per device: the stage group's `memory.train_memory` of a model with L / P layers (its
parameters, gradients and moments 1/P of the whole), the embedding's and the head's vocabulary
split over the stages with their moments (`vocabulary_over_stages`: 1/P of them kept between
steps, the rest gathered during one, their gradients whole until the step's end), plus,
for each micro-batch the schedule keeps waiting for its backward (`schedules.slots`: 1F1B about
P, GPipe m), its `[rows, seq, hidden]` stage input and the residuals its forward kept under the
remat policy (`memory.kept_activations`: the layer inputs with full remat); with
`pipeline_recompute` the stage inputs only, one micro-batch's residuals living at a time.

Fusion (RLHFuse's intra-stage fusion, `schedules.fused`): actor and critic on the same devices
and stage count, the critic's stages in the reverse device order, one table for both: the
update takes the fused table's span instead of two 1F1B tables back to back
(`schedules.sequential`); `compare` prices both for a workload.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from rlhfjax import schedules
from rlhfjax.config.model import ModelConfig
from rlhfjax.costmodel import costs, memory
from rlhfjax.costmodel.efficiency import Efficiency
from rlhfjax.costmodel.hardware import GIB, Hardware
from rlhfjax.costmodel.workload import Workload


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineChoice:
  """How a trained role is pipelined: the config's `placement.pipeline_stages`,
  `placement.pipeline_schedule` and `ppo.fuse_actor_critic`, as plain values."""

  stages: int = 1
  schedule: str = "1f1b"
  """'1f1b' or 'gpipe' for one model's pipeline (a fused update always uses
  `schedules.fused`, whose per-model limits are 1F1B's)."""
  fused: bool = False

  def __post_init__(self):
    if self.stages < 1:
      raise ValueError(f"pipeline stages must be >= 1, got {self.stages}")
    if self.schedule not in schedules.SCHEDULES:
      raise ValueError(
        f"unknown pipeline schedule {self.schedule!r}; known: {', '.join(schedules.SCHEDULES)}"
      )


BACKWARD_COST = 2.0
"""A pipelined backward op's cost in forwards: the two backward matmuls of every forward one
(one more when the stage's forward runs again)."""


def stage_config(config: ModelConfig, stages: int) -> ModelConfig:
  """The model one stage holds: L / P of its layers."""
  if config.num_layers % stages:
    raise ValueError(
      f"pipeline stages={stages} must divide the model's num_layers={config.num_layers}"
    )
  return config.replace(num_layers=config.num_layers // stages)


@functools.lru_cache(maxsize=256)
def table(name: str, stages: int, micro_batches: int) -> schedules.Schedule:
  """The schedule table `name` ('gpipe', '1f1b', 'two_1f1b', 'fused') for P and m."""
  if name == "two_1f1b":
    return schedules.sequential(stages, micro_batches)
  if name == "fused":
    return schedules.fused(stages, micro_batches)
  return schedules.single(name, stages, micro_batches)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageWork:
  """One model's pipelined update on one device, before a schedule places its ops."""

  busy_s: float
  """Compute, collectives and optimizer of the device's L / P layers, all optimizer steps."""
  send_s: float
  """One activation (or its gradient) to the neighbouring stage."""
  micro_batches: int
  """Per optimizer step: the m of the schedule."""
  flushes: int
  """Optimizer steps over all epochs: the pipeline drains once per step."""
  backward_cost: float = BACKWARD_COST

  def op_s(self, kind: str) -> float:
    """Seconds of one forward or backward op of one micro-batch."""
    forward = self.busy_s / (self.flushes * self.micro_batches * (1 + self.backward_cost))
    return forward * (self.backward_cost if kind == schedules.BACKWARD else 1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineTime:
  """A schedule table priced with its models' ops."""

  schedule: str
  stages: int
  micro_batches: int
  seconds: float
  """The update's wall time, sends included."""
  bubble_fraction: float
  """Idle fraction of the devices' compute time (sends left out), op costs as priced."""
  send_s: float
  """Of `seconds`, the part spent sending between stages."""
  ticks: int
  """Ticks per optimizer step."""

  def to_json(self) -> dict:
    return {
      "schedule": self.schedule,
      "update_s": round(self.seconds, 4),
      "bubble_fraction": round(self.bubble_fraction, 4),
      "send_s": round(self.send_s, 4),
      "ticks": self.ticks,
    }


def priced(schedule: schedules.Schedule, works: Sequence[StageWork]) -> PipelineTime:
  """`schedule`'s wall time when model i's ops cost `works[i]`'s: per optimizer step, the sum
  over ticks of the tick's slowest op and then its largest send."""
  if len(works) != len(schedule.models):
    raise ValueError(f"schedule {schedule.name!r} has {len(schedule.models)} models")
  flushes = {w.flushes for w in works}
  if len(flushes) > 1 or any(w.micro_batches != schedule.micro_batches for w in works):
    raise ValueError(
      "models in one pipeline table need the same optimizer steps and micro-batches, got "
      + ", ".join(f"{w.flushes} x {w.micro_batches}" for w in works)
    )
  (steps,) = flushes
  if schedule.stages == 1:  # no pipeline: the busy time itself, no bubble, nothing to send
    return PipelineTime(
      schedule=schedule.name,
      stages=1,
      micro_batches=schedule.micro_batches,
      seconds=sum(w.busy_s for w in works),
      bubble_fraction=0.0,
      send_s=0.0,
      ticks=schedule.ticks,
    )
  op_s = {
    (i, kind): w.op_s(kind)
    for i, w in enumerate(works)
    for kind in (schedules.FORWARD, schedules.BACKWARD)
  }
  compute = sends = 0.0
  for row in schedule.table():
    ops = [op for op in row if op]
    compute += max((op_s[(op.model, op.kind)] for op in ops), default=0.0)
    sends += max((works[op.model].send_s for op in ops), default=0.0)
  busy = sum(w.busy_s for w in works) / steps
  return PipelineTime(
    schedule=schedule.name,
    stages=schedule.stages,
    micro_batches=schedule.micro_batches,
    seconds=steps * (compute + sends),
    bubble_fraction=1.0 - busy / compute,
    send_s=steps * sends,
    ticks=schedule.ticks,
  )


def send_time(
  hw: Hardware,
  eff: Efficiency,
  config: ModelConfig,
  stage_group: costs.Group,
  *,
  sequences: int,
  micro_batches: int,
  seq_len: int,
  crosses_nodes: bool,
) -> float:
  """One device's share of a micro-batch's activation (`sequences` split into `micro_batches`
  over the stage's batch shards, then over `tensor`) to the next stage's device."""
  rows = math.ceil(sequences / (micro_batches * stage_group.replicas))
  c = memory.activation_bytes(config, hw.native_half)
  bytes_ = rows * seq_len * config.hidden_size * c / stage_group.tensor
  link = hw.inter_node_bw if crosses_nodes else hw.intra_node_bw
  return bytes_ / (link * eff.collective_bw)


def split_vocabulary(config: ModelConfig, head: str, tensor: int, stages: int) -> int:
  """Elements of the embedding and the LM head (untied) that the training layout splits over
  the stages (`rlhfjax.mesh.rules`: where the vocabulary divides over tensor x stages); 0 when
  it keeps them whole on every stage."""
  if stages == 1 or config.vocab_size % (tensor * stages):
    return 0
  elements = config.vocab_size * config.hidden_size
  return 2 * elements if head == "lm" and not config.tie_embeddings else elements


def vocabulary_sync_time(
  hw: Hardware,
  eff: Efficiency,
  config: ModelConfig,
  head: str,
  stage_group: costs.Group,
  *,
  stages: int,
  crosses_nodes: bool,
) -> float:
  """Per optimizer step of a pipelined update whose vocabulary is split over the stages
  (`vocabulary_over_stages`): each device gathers the embedding's and the head's blocks the
  other stages keep, and at the end reduce-scatters their float32 gradients back (a ring over
  the stages each way, `rlhfjax.training.pipeline`); with LoRA only the gather (the base is
  frozen)."""
  elements = split_vocabulary(config, head, stage_group.tensor, stages)
  shard = elements / (stage_group.tensor * stage_group.fsdp)  # one device's, whole over stages
  moved = shard * memory.dtype_bytes(config.param_dtype)
  if config.lora is None:
    moved += shard * 4
  link = hw.inter_node_bw if crosses_nodes else hw.intra_node_bw
  return moved * (stages - 1) / stages / (link * eff.collective_bw)


def update_work(
  hw: Hardware,
  eff: Efficiency,
  config: ModelConfig,
  head: str,
  stage_group: costs.Group,
  *,
  stages: int,
  crosses_nodes: bool,
  recompute: bool = False,
  **train,
) -> StageWork:
  """One model's update over `stages` stages of `stage_group` each, its ops not yet scheduled.
  `train`: the keyword arguments of `costs.train_time` (`micro_steps` per epoch over every
  optimizer step, as there); `crosses_nodes`: some neighbouring stages are on different nodes;
  `recompute`: the backward runs the stage's forward again (`Workload.pipeline_recompute`)."""
  backward_cost = BACKWARD_COST
  if stages > 1:
    stage_config(config, stages)  # the layers must split evenly
    # Each layer's forward once more in the backward under full remat, and the whole stage's
    # once more when recomputing it.
    backward_cost += (train["remat"] == "full") + recompute
    if recompute:
      train = {**train, "extra_forwards": 1}
  whole = costs.train_time(hw, eff, config, head, stage_group, **train)
  steps = train["optimizer_steps"]
  m = math.ceil(train["micro_steps"] / steps)
  flushes = train["epochs"] * steps
  if stages == 1:
    return StageWork(busy_s=whole, send_s=0.0, micro_batches=m, flushes=flushes)
  fixed = (eff.stage_s + eff.update_s) * flushes * hw.per_device(stage_group.devices)
  vocabulary = flushes * vocabulary_sync_time(
    hw, eff, config, head, stage_group, stages=stages, crosses_nodes=crosses_nodes
  )
  send = send_time(
    hw,
    eff,
    config,
    stage_group,
    sequences=train["sequences"],
    micro_batches=steps * m,
    seq_len=train["seq_len"],
    crosses_nodes=crosses_nodes,
  )
  return StageWork(
    busy_s=(whole - fixed) / stages + fixed + vocabulary,
    send_s=send,
    micro_batches=m,
    flushes=flushes,
    backward_cost=backward_cost,
  )


def forward_time(
  hw: Hardware,
  eff: Efficiency,
  config: ModelConfig,
  head: str,
  stage_group: costs.Group,
  *,
  stages: int,
  crosses_nodes: bool,
  **forward,
) -> float:
  """A scoring forward over `stages` stages of `stage_group` each (`forward`: the keyword
  arguments of `costs.forward_time`): the stage group's forward divided by P (its fixed
  dispatch whole), over m + P - 1 ticks for m micro-batches of work (the forward-only
  pipeline's bubble, `schedules.textbook_bubble`), a send after each tick."""
  whole = costs.forward_time(hw, eff, config, head, stage_group, **forward)
  if stages == 1:
    return whole
  stage_config(config, stages)
  m = forward["micro_steps"]
  fixed = eff.stage_s * hw.per_device(stage_group.devices)
  send = send_time(
    hw,
    eff,
    config,
    stage_group,
    sequences=forward["sequences"],
    micro_batches=m,
    seq_len=forward["seq_len"],
    crosses_nodes=crosses_nodes,
  )
  busy = (whole - fixed) / stages
  return busy / (1 - schedules.textbook_bubble(stages, m)) + (m + stages - 1) * send + fixed


def vocabulary_over_stages(
  estimate: memory.MemoryEstimate,
  config: ModelConfig,
  head: str,
  sharding: memory.Sharding,
  *,
  stages: int,
  options: memory.Options,
  trained: bool,
) -> memory.MemoryEstimate:
  """A stage's estimate (`estimate`, counted with the whole embedding and LM head) with their
  vocabulary split over the stages, as the training layout splits it (`rlhfjax.mesh.rules`,
  where the vocabulary divides over tensor x stages): between steps each stage keeps 1/P of
  them and of their moments; during a step the rest comes back gathered."""
  elements = split_vocabulary(config, head, sharding.tensor, stages)
  if not elements:
    return estimate
  away = 1 - 1 / stages
  params = int(away * elements * memory.dtype_bytes(config.param_dtype) / sharding.param_shards)
  moments = 0
  if trained and config.lora is None and not options.optimizer_on_host:
    ob = memory.dtype_bytes(options.optimizer_dtype or config.param_dtype)
    moments = int(away * 2 * elements * ob / sharding.param_shards)
  return dataclasses.replace(
    estimate,
    params=estimate.params - params,
    optimizer=estimate.optimizer - moments,
    gathered=estimate.gathered + params,
    parked=min(estimate.parked, estimate.params - params + estimate.optimizer - moments),
  )


@functools.lru_cache(maxsize=1024)
def stash_slots(name: str, stages: int, micro_batches: int) -> tuple[int, ...]:
  """Per model of table `name`: the micro-batches a device keeps waiting for their backwards
  (their stage inputs or the residuals of their forwards, whichever buffer needs more)."""
  if stages == 1:
    return (0,) * (2 if name in ("two_1f1b", "fused") else 1)
  slots = schedules.slots(table(name, stages, micro_batches))
  return tuple(map(max, slots.activation_slots, slots.residual_slots))


def train_memory(
  config: ModelConfig,
  head: str,
  sharding: memory.Sharding,
  *,
  stages: int,
  slots: int,
  micro_batch: int,
  seq_len: int,
  options: memory.Options,
  recompute: bool = False,
) -> memory.MemoryEstimate:
  """Per-device memory of a pipelined train step: a stage's L / P layers sharded over the
  stage's devices (`sharding`: one stage's fsdp, tensor and data), plus, for `slots`
  micro-batches of `micro_batch` sequences per batch shard in flight, their stage inputs and
  what their forwards keep for their backwards (the stage's estimate counts one such set
  already); with `recompute` their stage inputs only, the one micro-batch being recomputed
  keeping its set. One stage gives the unpipelined estimate."""
  if stages == 1:
    return memory.train_memory(
      config, head, sharding, micro_batch=micro_batch, seq_len=seq_len, options=options
    )
  estimate = memory.train_memory(
    stage_config(config, stages),
    head,
    sharding,
    micro_batch=micro_batch,
    seq_len=seq_len,
    options=options,
  )
  estimate = vocabulary_over_stages(
    estimate, config, head, sharding, stages=stages, options=options, trained=True
  )
  c = memory.activation_bytes(config, options.native_half)
  inputs = slots * micro_batch * seq_len * config.hidden_size * c // sharding.tensor
  kept = memory.kept_activations(
    stage_config(config, stages),
    sharding,
    micro_batch=micro_batch,
    seq_len=seq_len,
    options=options,
  )
  stash = inputs + (0 if recompute else max(slots - 1, 0) * kept)
  return dataclasses.replace(estimate, activations=estimate.activations + stash)


# ---------------------------------------------------------------------------------------------
# Two 1F1B pipelines back to back against one fused schedule, for a workload.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
  """A pipeline of `stages` over `devices` devices: each stage `devices / stages` of them,
  tensor-parallel by `tensor` and FSDP over the rest."""

  stage_group: costs.Group
  crosses_nodes: bool


def layout(devices: int, stages: int, tensor: int, devices_per_node: int) -> Layout:
  """Stage j on devices [j S, (j + 1) S), S = devices / stages; tensor the innermost axis."""
  if stages < 1 or devices % stages:
    raise ValueError(f"pipeline stages={stages} must divide devices={devices}")
  size = devices // stages
  if tensor < 1 or size % tensor:
    raise ValueError(f"tensor={tensor} must divide the {size} devices of a stage")

  def node(d):
    return d // devices_per_node

  def spans(first, count):
    return node(first) != node(first + count - 1)

  group = costs.Group(
    devices=size,
    tensor=tensor,
    spans_nodes=any(spans(j * size, size) for j in range(stages)),
    tensor_spans_nodes=any(spans(g, tensor) for g in range(0, devices, tensor)),
  )
  crosses = any(node(d) != node(d + size) for d in range(devices - size))
  return Layout(stage_group=group, crosses_nodes=crosses)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusionGain:
  """The actor's and critic's update on one pipelined layout: back to back or fused."""

  stages: int
  micro_batches: int
  rows: int
  """Sequences per device in one micro-batch."""
  layout: Layout
  unpipelined_s: float
  """Both updates back to back without a pipeline, FSDP (and `tensor`) over all devices, the
  same rows per device per micro-batch."""
  unpipelined_layout: Layout
  """The layout `unpipelined_s` prices: one stage of every device, `tensor` and FSDP."""
  one_1f1b: PipelineTime
  """The actor's update alone in one 1F1B pipeline."""
  two_1f1b: PipelineTime
  fused: PipelineTime
  memory_gib: dict[str, float]
  """Peak per device of the update: 'unpipelined' and 'two_1f1b' (one model's working set at a
  time), 'fused' (both models' at once)."""

  @property
  def gain(self) -> float:
    return self.two_1f1b.seconds / self.fused.seconds

  def to_json(self) -> dict:
    g = self.layout.stage_group
    return {
      "stages": self.stages,
      "micro_batches": self.micro_batches,
      "rows_per_micro_batch": self.rows,
      "stage_devices": g.devices,
      "tensor": g.tensor,
      "fsdp": g.fsdp,
      "stages_cross_nodes": self.layout.crosses_nodes,
      "textbook_bubble": round(schedules.textbook_bubble(self.stages, self.micro_batches), 4),
      "bubble_1f1b": round(self.one_1f1b.bubble_fraction, 4),
      "bubble_two_1f1b": round(self.two_1f1b.bubble_fraction, 4),
      "bubble_fused": round(self.fused.bubble_fraction, 4),
      "unpipelined_s": round(self.unpipelined_s, 3),
      "unpipelined_layout": {
        "tensor": self.unpipelined_layout.stage_group.tensor,
        "fsdp": self.unpipelined_layout.stage_group.fsdp,
      },
      "two_1f1b_s": round(self.two_1f1b.seconds, 3),
      "fused_s": round(self.fused.seconds, 3),
      "send_s": round(self.fused.send_s, 3),
      "gain": round(self.gain, 4),
      "memory_gib": {k: round(v, 2) for k, v in self.memory_gib.items()},
    }


def compare(
  workload: Workload,
  hw: Hardware,
  eff: Efficiency,
  *,
  devices: int,
  stages: int,
  micro_batches: int,
  tensor: int = 1,
  devices_per_node: int | None = None,
) -> FusionGain:
  """The update stage of `workload`'s actor and critic on `devices` devices in `stages` stages,
  `micro_batches` per optimizer step: two 1F1B pipelines back to back against the fused
  schedule (padded sequences of `workload.seq_len`)."""
  if workload.critic is None:
    raise ValueError("fusion needs a critic: the workload has none")
  if micro_batches < 1:
    raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
  per_node = devices_per_node or hw.devices_per_node
  lay = layout(devices, stages, tensor, per_node)
  g = lay.stage_group
  w = workload
  per_step = math.ceil(w.trained("actor") / w.optimizer_steps)
  if per_step < micro_batches * g.replicas:
    raise ValueError(
      f"micro_batches={micro_batches} leaves batch shards without rows: {per_step} sequences "
      f"per optimizer step over a stage's {g.replicas} batch shards make at most "
      f"{per_step // g.replicas} micro-batches"
    )
  rows = math.ceil(per_step / (micro_batches * g.replicas))
  opts = memory.Options(
    remat=w.remat,
    logits_chunk=w.logits_chunk,
    optimizer_dtype=w.optimizer_dtype,
    native_half=hw.native_half,
    replicated_activations=eff.replicated_activations,
    fused_attention=eff.fused_attention,
  )

  def work(config, head, group, p, m):
    return update_work(
      hw,
      eff,
      config,
      head,
      group,
      stages=p,
      crosses_nodes=lay.crosses_nodes,
      recompute=w.pipeline_recompute,
      sequences=per_step * w.optimizer_steps,
      seq_len=w.seq_len,
      epochs=w.ppo_epochs,
      optimizer_steps=w.optimizer_steps,
      micro_steps=w.optimizer_steps * m,
      remat=w.remat,
      optimizer_dtype=w.optimizer_dtype,
      devices_per_node=per_node,
    )

  models = ((w.actor, "lm"), (w.critic, "value"))
  works = [work(c, h, g, stages, micro_batches) for c, h in models]
  flat_layout = layout(devices, 1, tensor, per_node)
  whole = flat_layout.stage_group
  flat = math.ceil(micro_batches / stages)  # the same rows per device over every device
  unpipelined = sum(work(c, h, whole, 1, flat).busy_s for c, h in models)

  def peak(name, p, group, m):
    """Peak GiB per device of both updates in table `name`: `p` stages of `group`, `m`
    micro-batches per optimizer step."""
    slots = stash_slots(name, p, m)
    at = memory.Sharding(
      param_shards=group.fsdp * group.tensor, batch_shards=group.fsdp, tensor=group.tensor
    )
    batch = math.ceil(per_step / (m * group.replicas))
    kw = dict(stages=p, micro_batch=batch, seq_len=w.seq_len, options=opts)
    kw["recompute"] = w.pipeline_recompute
    est = [train_memory(c, h, at, slots=s, **kw) for (c, h), s in zip(models, slots, strict=True)]
    kept = sum(e.persistent for e in est)
    extra = [e.total - e.persistent for e in est]
    return (kept + (sum(extra) if name == "fused" else max(extra))) / GIB

  return FusionGain(
    stages=stages,
    micro_batches=micro_batches,
    rows=rows,
    layout=lay,
    unpipelined_s=unpipelined,
    unpipelined_layout=flat_layout,
    one_1f1b=priced(table("1f1b", stages, micro_batches), works[:1]),
    two_1f1b=priced(table("two_1f1b", stages, micro_batches), works),
    fused=priced(table("fused", stages, micro_batches), works),
    memory_gib={
      "unpipelined": peak("two_1f1b", 1, whole, flat),
      "two_1f1b": peak("two_1f1b", stages, g, micro_batches),
      "fused": peak("fused", stages, g, micro_batches),
    },
  )
