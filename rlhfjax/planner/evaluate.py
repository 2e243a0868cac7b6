"""One placement, predicted: stage times, the replayed iteration, memory per device, fit.

`evaluate` turns a `PlacementSpec` and a micro-batch size into a `Plan`: each role's stage
costs on its group (`costs`), its memory per device (`memory`), the replayed timeline
(`replay`), and whether every device fits its memory (persistent state of every role on the
device plus the largest transient working set of any of them).

A packed workload (`Workload.packed`) scores and trains on packed rows: each stage is priced on
the rows its packing computes (`Workload.packing`: real tokens over the fill) in as many
micro-steps as the packing has micro-batches, and a micro-batch's memory is its token budget
(`train_tokens`, `score_tokens`; by default the padded micro-batch's rows). A packed row costs
what a padded row of its width does, attention included: a segment-masked attention kernel
computes the whole row's causal scores (one that skipped the masked blocks would cost less).

A role whose mesh has a `stage` axis (its first, when the placement pipelines) is priced as a
pipeline (`rlhfjax.costmodel.pipeline`): its cost group is one stage's devices, its update the
workload's schedule table priced op by op, its scoring a forward-only pipeline, its memory a
stage's layers plus what its micro-batches in flight keep (their stage inputs, and the
residuals of their forwards unless `pipeline_recompute`). With `fuse_actor_critic`, actor and
critic on the same devices and stages update in one fused table: the actor's update carries it
(the critic's lasts 0 s after it), and the actor's working set counts both models'.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

from rlhfjax import schedules
from rlhfjax.config import ROLE_HEADS
from rlhfjax.costmodel import costs, fill, memory, pipeline
from rlhfjax.costmodel.efficiency import Efficiency
from rlhfjax.costmodel.hardware import GIB, Hardware
from rlhfjax.costmodel.replay import Replay, StageCost, replay
from rlhfjax.costmodel.workload import Workload
from rlhfjax.placement.hosts import nodes_of, tensor_spans_hosts
from rlhfjax.placement.memory import (
  Pipelining,
  adapters_synced,
  device_totals,
  judge_engine_memory,
  judge_spec,
  offload_options,
  sharding_of,
  stage_memory,
  stage_sharding,
  without_weights,
)
from rlhfjax.placement.spec import Layout, PlacementSpec, Role, RoleSpec
from rlhfjax.planner import sync as weight_sync

HEADS = ROLE_HEADS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """A placement with its predictions."""

  label: str
  """Strategy and variant, e.g. 'disaggregated rollout=2 split_actor_critic'."""
  spec: PlacementSpec
  micro_batch: int
  replay: Replay
  memory: Mapping[str, memory.MemoryEstimate]
  peak_memory_gib: float
  fits: bool
  why_not: str = ""
  tokens_per_s_per_device: float = 0.0
  slots: int = 0
  """Sequences one rollout data group decodes at once (after the memory check)."""
  fill: float = 0.0
  """Packed workloads: real / computed tokens over the packed scoring and update stages (each
  role's packing once); 0 when nothing is packed."""

  @property
  def iteration_s(self) -> float:
    return self.replay.iteration_s

  @property
  def stages(self) -> Mapping[str, float]:
    return self.replay.stages

  def to_json(self) -> dict:
    return {
      "strategy": self.spec.strategy,
      "label": self.label,
      "iteration_s": round(self.iteration_s, 4),
      "stages": {k: round(v, 4) for k, v in self.stages.items()},
      "peak_memory_gb": round(self.peak_memory_gib * GIB / 1e9, 3),
      "peak_memory_gib": round(self.peak_memory_gib, 3),
      "tokens_per_s_per_device": round(self.tokens_per_s_per_device, 2),
      "fits": self.fits,
      "why_not": self.why_not,
      "micro_batch": self.micro_batch,
      "fill": round(self.fill, 4),
      "mesh": {str(role): dict(spec.axes) for role, spec in self.spec.roles.items()},
      "devices": {
        str(role): [min(s.devices), max(s.devices)] for role, s in self.spec.roles.items()
      },
    }


def present_roles(workload: Workload) -> tuple[str, ...]:
  """The roles the workload places, in `Role` order: actor and reference, the rollout if the
  flow generates (not DPO), and a critic or a reward model when the flow's pricing runs one
  and the workload gives its model; then the extra reward models when the pricing scores
  with a reward."""
  roles = {Role.ACTOR, Role.REFERENCE}
  used = workload.pricing.roles
  if Role.ROLLOUT in used:
    roles.add(Role.ROLLOUT)
  for role in (Role.CRITIC, Role.REWARD):
    if role in used and workload.model(role) is not None:
      roles.add(role)
  extras = tuple(workload.extra_rewards) if Role.REWARD in workload.pricing.scored else ()
  return (*(role for role in Role if role in roles), *extras)


def model_for(workload: Workload, role: str):
  return workload.actor if role == Role.ROLLOUT else workload.model(role)


def head_of(workload: Workload, role: str) -> str:
  """The head of `role`'s model: a built-in role's, or a reward model's for an extra one."""
  return "value" if role in workload.extra_rewards else HEADS[role]


def options(workload: Workload, hw: Hardware, eff: Efficiency) -> memory.Options:
  return memory.Options(
    remat=workload.remat,
    logits_chunk=workload.logits_chunk,
    optimizer_on_host=workload.optimizer_on_host,
    optimizer_dtype=workload.optimizer_dtype,
    native_half=hw.native_half,
    replicated_activations=eff.replicated_activations,
    fused_attention=eff.fused_attention,
  )


def role_memory(
  role: str,
  spec: PlacementSpec,
  workload: Workload,
  hw: Hardware,
  eff: Efficiency,
  micro_batch: int,
  slots: int,
) -> memory.MemoryEstimate:
  """Per-device memory of `role` on its group of `spec`."""
  config, rs = model_for(workload, role), spec[role]
  if role in workload.judges:  # its engine over its devices, in the generation layout
    judge = workload.judges[role]
    return judge_engine_memory(
      rs,
      config,
      slots=judge.slots,
      capacity=judge.capacity,
      verdict=judge.verdict,
      options=offload_options(options(workload, hw, eff), role, workload.offload),
    )
  sharding, stages = stage_sharding(rs), stages_of(rs)  # a stage's devices: its L / P layers
  opts = offload_options(options(workload, hw, eff), role, workload.offload)
  if role == Role.ROLLOUT:
    return memory.rollout_memory(
      config,
      sharding,
      slots=slots,
      seq_len=workload.seq_len,
      options=opts,
      receives_sync=not set(rs.devices) <= set(spec[Role.ACTOR].devices),
      sync_adapters=adapters_synced(workload.actor, spec[Role.ACTOR], rs),
    )
  trained = role in (Role.ACTOR, Role.CRITIC)
  if workload.packed:
    micro_batch = packed_micro_batch(workload, sharding.batch_shards, micro_batch, trained)
  per_step = math.ceil(workload.trained(role) / workload.optimizer_steps) if trained else 0
  m = max(1, math.ceil(per_step / (micro_batch * sharding.batch_shards)))
  estimate = stage_memory(
    config,
    head_of(workload, role),
    sharding,
    stages=stages,
    trained=trained,
    micro_batch=micro_batch,
    seq_len=workload.seq_len,
    options=opts,
    slots=pipelining(spec, workload, micro_batches=m).slots(role, stages),
    recompute=workload.pipeline_recompute,
  )
  if role is Role.REFERENCE and workload.reference_from_base:
    return without_weights(estimate)
  return estimate


def stages_of(rs: RoleSpec) -> int:
  """Pipeline stages of a role: its `stage` axis (1 without one)."""
  return dict(rs.axes).get("stage", 1)


def fused(spec: PlacementSpec, workload: Workload) -> bool:
  """Actor and critic update in one fused pipeline table: the workload asks for it and both are
  pipelined on the same devices with the same stages (elsewhere they update one after the
  other, as without it)."""
  trains_both = workload.trained("actor") and workload.trained("critic")
  if not (workload.fuse_actor_critic and trains_both) or Role.CRITIC not in spec.roles:
    return False
  actor, critic = spec[Role.ACTOR], spec[Role.CRITIC]
  return (  # (the critic's stages may run over the devices in reverse: the same set)
    set(actor.devices) == set(critic.devices)
    and stages_of(actor) == stages_of(critic)
    and stages_of(actor) > 1
  )


def pipelining(spec: PlacementSpec, workload: Workload, micro_batches: int = 1) -> Pipelining:
  """How the trained roles of `workload` on `spec` run `micro_batches` micro-batches through
  their stages: its schedule, fused where `fused` says."""
  return Pipelining(
    schedule=workload.pipeline_schedule,
    fused=fused(spec, workload),
    micro_batches=micro_batches,
    recompute=workload.pipeline_recompute,
  )


def packed_micro_batch(workload: Workload, shards: int, micro_batch: int, trained: bool) -> int:
  """Rows per batch shard of a packed micro-batch: its token budget (`train_tokens` or
  `score_tokens`) in rows of `seq_len`, or the padded micro-batch's `micro_batch` rows."""
  tokens = workload.train_tokens if trained else workload.score_tokens
  return math.ceil(fill.budget_rows(tokens, workload.seq_len, micro_batch * shards) / shards)


def evaluate(
  spec: PlacementSpec,
  workload: Workload,
  hw: Hardware,
  eff: Efficiency,
  *,
  micro_batch: int,
  async_rollout: bool = False,
  label: str = "",
  devices_per_node: int | None = None,
) -> Plan:
  """Predicts one iteration of `workload` on `spec` with `micro_batch` sequences per device
  (per batch shard; with `workload.train_rows` the micro-batch follows from it)."""
  if workload.train_rows:
    micro_batch = math.ceil(workload.train_rows / sharding_of(spec[Role.ACTOR]).batch_shards)
  roles = present_roles(workload)
  spec = spec.only(roles)
  if workload.reference_from_base:  # it scores with the actor's base, on the actor's devices
    spec = spec.beside(Role.REFERENCE, Role.ACTOR)
  per_node = devices_per_node or hw.devices_per_node
  budget = hw.memory_gib * GIB
  groups = {role: _group(spec[role], per_node) for role in roles}

  generates = Role.ROLLOUT in roles
  slots = math.ceil(workload.sequences / groups[Role.ROLLOUT].replicas) if generates else 0
  if workload.generation_batch:
    slots = min(slots, workload.generation_batch)
  estimates = {
    role: role_memory(role, spec, workload, hw, eff, micro_batch, slots) for role in roles
  }
  # Generate in waves when the KV cache of every slot does not fit beside the persistent state
  # (in the share of memory `kv_memory_fraction` gives generation, when set).
  rollout_devices = set(spec[Role.ROLLOUT].devices) if generates else set()
  resident = max(
    sum(e.persistent for r, e in estimates.items() if set(spec[r].devices) & rollout_devices),
    0,
  )
  fraction = workload.kv_memory_fraction
  generation_budget = fraction * budget if fraction else budget
  # (Only when the persistent state itself fits: otherwise the plan is over memory anyway and
  # its generation is predicted at the configured batch.)
  while slots > 1 and resident <= generation_budget < resident + estimates[Role.ROLLOUT].transient:
    slots = math.ceil(slots / 2)
    estimates[Role.ROLLOUT] = role_memory(Role.ROLLOUT, spec, workload, hw, eff, 0, slots)

  if fused(spec, workload):  # both models' working sets live during the one fused update
    estimates[Role.ACTOR] = _with_working_set(estimates[Role.ACTOR], estimates[Role.CRITIC])

  packings: list[fill.PackedStage] = []
  costs_ = _stage_costs(spec, workload, hw, eff, groups, micro_batch, slots, per_node, packings)
  result = replay(*costs_, async_rollout=async_rollout, serial=hw.host_shared)
  peaks = device_totals(spec, estimates)
  peak_device = max(peaks, key=peaks.get)
  fits = peaks[peak_device] <= budget
  why_not = ""
  short = ""
  if generates and fraction:
    left = f"kv_memory_fraction={fraction:g} leaves generation {generation_budget / GIB:.1f} GiB"
    generating = resident + estimates[Role.ROLLOUT].transient
    if resident > generation_budget:
      short = f"{left}, less than the devices hold beside it ({resident / GIB:.1f} GiB)"
    elif generating > generation_budget:
      short = f"{left}, less than one slot needs beside the rest ({generating / GIB:.1f} GiB)"
  if short:
    fits, why_not = False, short
  elif not fits:
    on_it = [r for r in roles if peak_device in spec[r].devices]
    worst = max(on_it, key=lambda r: estimates[r].total)
    e = estimates[worst]
    why_not = (
      f"device {peak_device} ({'+'.join(map(str, on_it))}) needs "
      f"{peaks[peak_device] / GIB:.1f} GiB > {hw.memory_gib:.0f}; largest: {worst} "
      f"(params {e.params / GIB:.1f}, optimizer {e.optimizer / GIB:.1f}, grads "
      f"{e.grads / GIB:.1f}, activations {e.activations / GIB:.1f}, logits {e.logits / GIB:.1f}, "
      f"kv {e.kv_cache / GIB:.1f})"
    )
  tokens = workload.sequences * workload.mean_tokens
  return Plan(
    label=label or spec.strategy,
    spec=spec,
    micro_batch=micro_batch,
    replay=result,
    memory=estimates,
    peak_memory_gib=peaks[peak_device] / GIB,
    fits=fits,
    why_not=why_not,
    tokens_per_s_per_device=tokens / result.iteration_s / len(spec.devices),
    slots=slots,
    fill=(
      sum(p.real_tokens for p in packings) / sum(p.rows * p.width for p in packings)
      if packings
      else 0.0
    ),
  )


def _with_working_set(actor: memory.MemoryEstimate, critic: memory.MemoryEstimate):
  """The actor's estimate with the critic's stage-time parts added (its gradients, gathered
  layers, activations and logits live at once in a fused update)."""
  return dataclasses.replace(
    actor,
    grads=actor.grads + critic.grads,
    gathered=actor.gathered + critic.gathered,
    activations=actor.activations + critic.activations,
    logits=actor.logits + critic.logits,
  )


@functools.lru_cache(maxsize=4096)
def _group(rs: RoleSpec, per_node: int) -> costs.Group:
  """The cost group of a role: its devices, or one pipeline stage's (the first axis). Cached:
  a search prices the same role specs in many candidates."""
  size = len(rs.devices) // stages_of(rs)
  stages = [rs.devices[i : i + size] for i in range(0, len(rs.devices), size)]
  spans = any(min(s) // per_node != max(s) // per_node for s in stages)
  # A training layout's `data` replicas hold whole parameter shards (ZeRO-2-like: no gathers).
  data = rs.axis_size("data") if rs.layout == Layout.TRAINING else 1
  nodes = nodes_of(max(rs.devices) + 1, per_node)
  return costs.Group(
    devices=size,
    tensor=rs.axis_size("tensor"),
    spans_nodes=spans,
    tensor_spans_nodes=bool(tensor_spans_hosts(rs, nodes)),
    data=data,
    context=rs.context,
  )


def _crosses_nodes(rs: RoleSpec, per_node: int) -> bool:
  """Some device of a pipelined role sends to a next-stage device on another node."""
  size = len(rs.devices) // stages_of(rs)
  d = rs.devices
  return any(d[i] // per_node != d[i + size] // per_node for i in range(len(d) - size))


def _stage_costs(spec, workload, hw, eff, groups, micro_batch, slots, per_node, packings):
  w = workload
  roles = tuple(groups)

  def shape(role, sequences, trained, batch=0):
    """(rows, tokens per row, micro-steps) in which `role` computes `sequences`: padded or
    real lengths as the workload says, or the rows of their packing (kept in `packings`)."""
    replicas = groups[role].replicas
    if not w.packed:
      return (
        sequences,
        w.compute_len,
        max(1, math.ceil(sequences / ((batch or micro_batch) * replicas))),
      )
    rows = packed_micro_batch(w, replicas, batch or micro_batch, trained) * replicas
    packing = w.packing(sequences, rows, replicas)
    packings.append(packing)
    return packing.rows, w.seq_len, packing.micro_batches

  if Role.ROLLOUT not in roles:  # nothing generated (DPO): no generation, no weight sync
    actor = spec[Role.ACTOR].devices
    generate = StageCost(role="rollout", stage="generate", devices=actor, seconds=0.0)
    sync = StageCost(role="rollout", stage="sync", devices=actor, seconds=0.0)
    advantages, updates = _train_costs(spec, w, hw, eff, groups, shape, per_node)
    scores = _score_costs(spec, w, hw, eff, groups, shape, per_node)
    return generate, scores, advantages, updates, sync
  rollout = spec[Role.ROLLOUT]
  prefill, decode = costs.generate_time(
    hw,
    eff,
    w.actor,
    groups[Role.ROLLOUT],
    sequences=w.sequences,
    prompt_len=w.prompt_tokens,
    response_mean=w.response_len_mean,
    response_max=w.response_len_max,
    slots=slots,
    static_batching=w.static_batching,
    gather_devices=len(rollout.devices) if w.decode_gathers_weights else 1,
    conversation=w.conversation,
  )
  generate = StageCost(
    role="rollout", stage="generate", devices=rollout.devices, seconds=prefill + decode
  )
  scores = _score_costs(spec, w, hw, eff, groups, shape, per_node)
  advantages, updates = _train_costs(spec, w, hw, eff, groups, shape, per_node)
  sync = _sync_cost(spec, w, hw, eff)
  return generate, scores, advantages, updates, sync


def _score_costs(spec, w, hw, eff, groups, shape, per_node):
  roles = tuple(groups)
  scores = []
  for role in (Role.ACTOR, Role.REFERENCE, Role.CRITIC, Role.REWARD, *w.extra_rewards):
    sequences = w.scored(role)
    if role not in roles or not sequences:
      continue  # e.g. DPO's actor scores its pairs inside its train step
    if role in w.judges:
      scores.append(_judge_cost(spec, w, hw, eff, role, sequences))
      continue
    rows, seq_len, steps = shape(role, sequences, False, w.score_micro_batch)
    args = (hw, eff, model_for(w, role), head_of(w, role), groups[role])
    kwargs = dict(
      sequences=rows,
      seq_len=seq_len,
      micro_steps=steps,
      offload=_offload(w, spec, role, trained=False),
    )
    stages = stages_of(spec[role])
    if stages > 1:
      calls = 1
      if not w.packed:
        # Each scoring call of `rows / steps` rows is a forward-only pipeline of its own, its
        # rows split as the cluster splits them (`Cluster.scorer`).
        calls, per_call = steps, math.ceil(rows / steps)
        inner = schedules.scoring_micro_batches(per_call, stages, groups[role].replicas)
        kwargs.update(sequences=per_call, micro_steps=inner)
      crosses = _crosses_nodes(spec[role], per_node)
      seconds = calls * pipeline.forward_time(*args, stages=stages, crosses_nodes=crosses, **kwargs)
    else:
      seconds = costs.forward_time(*args, **kwargs)
    scores.append(
      StageCost(role=str(role), stage="score", devices=spec[role].devices, seconds=seconds)
    )
  return scores


def _judge_cost(spec, w, hw, eff, role, sequences) -> StageCost:
  """A judge's verdicts on `sequences`: its engine (`judge_spec`: the role's devices, its
  tensor size, data parallel over the rest) prefills each judged text, prompt and response
  (at most its capacity; the template's own tokens are not counted), and decodes the verdict's
  tokens in its slots as a continuous batch."""
  judge, rs = w.judges[role], spec[role]
  engine = judge_spec(rs)
  data, tensor = engine.axis_size("data"), engine.axis_size("tensor")
  group = costs.Group(devices=len(rs.devices), tensor=tensor)
  prefill, decode = costs.generate_time(
    hw,
    eff,
    w.model(role),
    group,
    sequences=sequences,
    prompt_len=min(judge.capacity, w.prompt_tokens + w.response_len_mean),
    response_mean=judge.verdict,
    response_max=judge.verdict,
    slots=-(-judge.slots // data),
    static_batching=False,
  )
  return StageCost(role=str(role), stage="score", devices=rs.devices, seconds=prefill + decode)


def _train_costs(spec, w, hw, eff, groups, shape, per_node):
  roles = tuple(groups)
  actor = spec[Role.ACTOR].devices
  advantages = StageCost(
    role="actor", stage="advantages", devices=actor, seconds=eff.stage_s * hw.per_device(len(actor))
  )
  seconds, works = {}, {}
  for role in (Role.ACTOR, Role.CRITIC):
    sequences = w.trained(role)
    if role not in roles or not sequences:
      continue
    per_step = math.ceil(sequences / w.optimizer_steps)
    rows, seq_len, steps = shape(role, per_step, True)
    if w.packed:  # each mini-batch is packed on its own
      sequences = rows * w.optimizer_steps
    args = (hw, eff, model_for(w, role), HEADS[role], groups[role])
    kwargs = dict(
      sequences=sequences,
      seq_len=seq_len,
      epochs=w.ppo_epochs,
      optimizer_steps=w.optimizer_steps,
      micro_steps=w.optimizer_steps * steps,
      remat=w.remat,
      optimizer_dtype=w.optimizer_dtype,
      offload=_offload(w, spec, role, trained=True, per_node=per_node),
      devices_per_node=per_node,
    )
    stages = stages_of(spec[role])
    if stages == 1:
      seconds[role] = costs.train_time(*args, **kwargs)
      continue
    crosses = _crosses_nodes(spec[role], per_node)
    works[role] = pipeline.update_work(
      *args, stages=stages, crosses_nodes=crosses, recompute=w.pipeline_recompute, **kwargs
    )
    name, _ = pipelining(spec, w).table(role)
    if name != "fused":
      table = pipeline.table(name, stages, works[role].micro_batches)
      seconds[role] = pipeline.priced(table, [works[role]]).seconds
  if len(works) == 2 and fused(spec, w):  # one table for both; the critic's adds nothing
    actor, critic = works[Role.ACTOR], works[Role.CRITIC]
    table = pipeline.table("fused", stages_of(spec[Role.ACTOR]), actor.micro_batches)
    seconds[Role.ACTOR], seconds[Role.CRITIC] = pipeline.priced(table, [actor, critic]).seconds, 0.0
  updates = [
    StageCost(role=str(role), stage="update", devices=spec[role].devices, seconds=s)
    for role, s in seconds.items()
  ]
  return advantages, updates


def _offload(w, spec, role, *, trained, per_node=1):
  """What `role` keeps on the host. Trained roles on disjoint devices of a common node update
  at the same time and share its host's CPUs (DeepSpeed's ZeRO-Offload); co-located ones take
  turns."""
  if not trained:
    return costs.Offload(params=w.params_on_host)
  if not w.optimizer_on_host:
    return costs.Offload()
  mine = set(spec[role].devices)
  nodes = {d // per_node for d in mine}
  sharers = 1 + sum(
    1
    for other in (Role.ACTOR, Role.CRITIC)
    if other != role
    and other in spec.roles
    and not mine & set(spec[other].devices)
    and nodes & {d // per_node for d in spec[other].devices}
  )
  return costs.Offload(optimizer=True, params=w.params_on_host, host_sharers=sharers)


def _sync_cost(spec, w, hw, eff):
  rollout = spec[Role.ROLLOUT]
  actor_devices = set(spec[Role.ACTOR].devices)
  colocated = set(rollout.devices) <= actor_devices
  sync_devices = tuple(sorted(actor_devices | set(rollout.devices)))
  pair_bw = None
  if hw.pair_bw:
    pairs = [
      hw.pair_bw[a][b]
      for a in spec[Role.ACTOR].devices
      for b in rollout.devices
      if a != b and a < len(hw.pair_bw) and b < len(hw.pair_bw)
    ]
    pair_bw = sum(pairs) / len(pairs) if pairs else None
  return StageCost(
    role="rollout",
    stage="sync",
    devices=sync_devices,
    seconds=costs.sync_time(
      hw,
      eff,
      w.actor,
      rollout_tensor=rollout.axis_size("tensor"),
      colocated=colocated,
      spans_nodes=_group(
        RoleSpec(devices=sync_devices, axes=(), layout=Layout.GENERATION), hw.devices_per_node
      ).spans_nodes,
      pair_bw=pair_bw,
      devices=len(sync_devices),
      buffers=weight_sync.buffers(w.actor, spec[Role.ACTOR], rollout) if hw.host_shared else 0,
      adapters_only=adapters_synced(w.actor, spec[Role.ACTOR], rollout) is not None,
    ),
  )
