"""Per-device memory of each role of a placement, from the planner's memory model.

The model itself (`rlhfjax.costmodel.memory`) counts parameters, gradients, optimizer moments in
their dtypes, activations with and without remat, logits (whole or chunked), the KV cache and
the weight sync's temporary buffer from the shapes alone. This module feeds it a placement:

- the training layout shards parameters (and moments, gradients) over `stage` x `fsdp` x
  `tensor` and splits the batch over `data` x `fsdp` x `stage`; the generation layout shards
  parameters over `tensor` and gives each `data` group its share of the rollout slots. A
  pipeline stage's devices hold 1/P of the layers, sharded over the stage's own axes, and 1/P
  of the embedding's and head's vocabulary, as the training layout splits them (the rest
  gathered during a step); a trained role's stage also keeps, for every micro-batch its
  schedule holds waiting for a backward (`Pipelining`: 1F1B about P, GPipe all of the step's),
  its stage input and what its forward kept for the backward, as the planner prices it
  (`rlhfjax.costmodel.pipeline.train_memory`; `stage_memory` is the one implementation both
  use);
- actor and critic are trained on micro-batches of `train_rows` sequences (the config's mini-
  batch split into micro-batches); reference and reward score the whole rollout batch at once,
  as the padded trainer does, or `score_rows` rows per call. A packing run passes its token
  budgets in rows of `max_seq_len` tokens (`rlhfjax.planner.auto.memory_rows`): a packed
  micro-batch holds as many tokens as its budget, whatever the sequences in it;
- a device's need is the persistent state (parameters, moments) of every role on it plus the
  largest transient set of any of them: stages sharing a device run one at a time and free
  their temporaries. Offload is per role (`config.offload`): a part a role offloads waits in
  host memory while the role is idle and comes back for its stage, so it counts in that role's
  transient set and not in what the role keeps on its devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from rlhfjax.config import (
  ROLE_HEADS,
  ExtraRoleSection,
  ModelSection,
  OffloadSection,
  RolloutSection,
)
from rlhfjax.config.model import LoraConfig, ModelConfig
from rlhfjax.costmodel import pipeline
from rlhfjax.costmodel.memory import (
  MemoryEstimate,
  Options,
  Sharding,
  forward_memory,
  kv_token_bytes,
  rollout_memory,
  train_memory,
)
from rlhfjax.costmodel.replay import cells
from rlhfjax.placement.spec import Layout, PlacementSpec, Role, RoleSpec

GIB = 2**30

TRAINED_ROLES = (Role.ACTOR, Role.CRITIC)
HEADS = ROLE_HEADS
"""Output head of each built-in role's model: policies predict tokens, critics and rewards a
scalar (an extra role's is its kind's: `rlhfjax.config.ModelSection.head`)."""

PARAM_SHARDING_AXES: Mapping[Layout, tuple[str, ...]] = {
  Layout.TRAINING: ("stage", "fsdp", "context", "tensor"),
  Layout.GENERATION: ("tensor",),
}
"""Mesh axes each layout shards parameters (and optimizer state, gradients) over."""
BATCH_AXES: Mapping[Layout, tuple[str, ...]] = {
  Layout.TRAINING: ("data", "fsdp", "stage"),
  Layout.GENERATION: ("data",),
}
"""Mesh axes each layout splits the batch over (for a pipeline, its activations: see above)."""

__all__ = [
  "GIB",
  "KvPool",
  "MemoryEstimate",
  "OptionEffect",
  "Pipelining",
  "Options",
  "estimate_memory",
  "estimate_placement_memory",
  "kv_pool",
  "offload_options",
  "option_effects",
  "option_peaks",
  "stage_memory",
]


def sharding_of(spec: RoleSpec) -> Sharding:
  """How `spec` splits parameters and batch, as the memory model takes it."""
  return Sharding(
    param_shards=math.prod(spec.axis_size(a) for a in PARAM_SHARDING_AXES[spec.layout]),
    batch_shards=math.prod(spec.axis_size(a) for a in BATCH_AXES[spec.layout]),
    tensor=spec.axis_size("tensor"),
    context=spec.context,
  )


def stage_sharding(spec: RoleSpec) -> Sharding:
  """`sharding_of(spec)` for one pipeline stage's devices: its parameters and its micro-batches
  split over the stage's own axes (the whole of `spec` without a `stage` axis)."""
  whole = sharding_of(spec)
  if spec.stages == 1 or spec.layout != Layout.TRAINING:
    return whole
  return dataclasses.replace(
    whole,
    param_shards=whole.param_shards // spec.stages,
    batch_shards=whole.batch_shards // spec.stages,
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipelining:
  """How trained roles on pipeline stages run a step's micro-batches, which sets what a stage
  keeps for their backwards: the config's `placement.pipeline_schedule` ('1f1b' or 'gpipe'),
  `ppo.fuse_actor_critic` (actor and critic in one fused table), the micro-batches of a
  pipelined step (the flow's micro-batches per mini-batch) and
  `placement.pipeline_recompute` (stage inputs kept, forwards run again): a config's is
  `rlhfjax.planner.auto.pipelining(config)`."""

  schedule: str = "1f1b"
  fused: bool = False
  micro_batches: int = 1
  recompute: bool = False

  def table(self, role: Role | str) -> tuple[str, int]:
    """The schedule table a trained `role`'s update runs in and the role's model index in it
    (`rlhfjax.costmodel.pipeline.table`)."""
    if self.fused and role in TRAINED_ROLES:
      return "fused", TRAINED_ROLES.index(role)
    return self.schedule, 0

  def slots(self, role: Role | str, stages: int) -> int:
    """Micro-batches a stage of `role` keeps waiting for their backwards (the most of any
    stage: `rlhfjax.costmodel.pipeline.stash_slots`; none without stages)."""
    name, model = self.table(role)
    return pipeline.stash_slots(name, stages, self.micro_batches)[model]


def stage_memory(
  config: ModelConfig,
  head: str,
  sharding: Sharding,
  *,
  stages: int,
  trained: bool,
  micro_batch: int,
  seq_len: int,
  options: Options,
  slots: int = 1,
  recompute: bool = False,
) -> MemoryEstimate:
  """One device of a trained or scoring role whose mesh has `stages` pipeline stages (1: none),
  `sharding` being one stage's (`stage_sharding`) and `micro_batch` its sequences per batch
  shard: the stage's L / P layers with 1/P of the vocabulary kept, and for a trained role
  `slots` micro-batches in flight (`rlhfjax.costmodel.pipeline.train_memory`). The placement
  check, `show_placement` and the planner all count a role this way."""
  kwargs = dict(micro_batch=micro_batch, seq_len=seq_len, options=options)
  if trained and stages > 1:
    return pipeline.train_memory(
      config, head, sharding, stages=stages, slots=slots, recompute=recompute, **kwargs
    )
  fn = train_memory if trained else forward_memory
  if stages == 1:
    return fn(config, head, sharding, **kwargs)
  estimate = fn(pipeline.stage_config(config, stages), head, sharding, **kwargs)
  return pipeline.vocabulary_over_stages(
    estimate, config, head, sharding, stages=stages, options=options, trained=trained
  )


def estimate_memory(
  role: Role | str,
  spec: RoleSpec,
  model: ModelConfig,
  rollout: RolloutSection,
  *,
  train_rows: int | None = None,
  score_rows: int | None = None,
  receives_sync: bool = False,
  sync_adapters: LoraConfig | None = None,
  options: Options | None = None,
  offload: OffloadSection | None = None,
  head: str | None = None,
  pipelining: Pipelining | None = None,
) -> MemoryEstimate:
  """Estimates the bytes one device of `role` needs when placed as `spec`.

  Args:
    role: the role: trained (actor, critic), scoring (reference, reward, an extra role) or
      the rollout.
    spec: the role's devices, mesh axes and layout.
    model: the role's model.
    rollout: the rollout batch shape (sequence length; slots of the rollout).
    train_rows: sequences (packed: rows of `max_seq_len` tokens, the token budget) per
      micro-step of a trained role (default: the whole batch).
    score_rows: sequences (packed: rows) per call of a scoring role (default: the whole batch).
    receives_sync: the rollout gets the actor's weights from other devices.
    sync_adapters: with `receives_sync`, the actor's LoRA adapters, which are all a sync
      moves (`rlhfjax.cluster.adapter_sync`): the rollout keeps a copy of the base too.
    options: backend numerics; remat, the logits chunk and fused attention are always the
      role's model's own, and the offload flags are `role`'s own in `offload`.
    offload: the roles whose parameters or moments wait in host memory while idle (none when
      None); `role`'s offloaded parts count in its stage only (`MemoryEstimate.parked`).
    head: the head of `role`'s model; None: a built-in role's (`HEADS`). An extra role's is
      its kind's (`rlhfjax.config.ModelSection.head`).
    pipelining: how a trained role on pipeline stages runs its micro-batches (`train_rows`
      sequences each); None: `Pipelining()`, 1F1B over one micro-batch.
  """
  options = offload_options(model_options(model, options), role, offload)
  sharding = stage_sharding(spec)  # the whole mesh's but on pipeline stages
  seq_len = rollout.max_seq_len
  if role == Role.ROLLOUT:
    slots = math.ceil(rollout.num_slots / sharding.batch_shards)
    return rollout_memory(
      model,
      sharding,
      slots=slots,
      seq_len=seq_len,
      options=options,
      receives_sync=receives_sync,
      cache_tokens=rollout_cache_tokens(rollout, sharding.batch_shards),
      released=rollout.release,
      sync_adapters=sync_adapters,
    )
  trained = role in TRAINED_ROLES
  rows = (train_rows if trained else score_rows) or rollout.batch_size
  run = pipelining or Pipelining()
  return stage_memory(
    model,
    head or HEADS[role],
    sharding,
    stages=spec.stages,
    trained=trained,
    micro_batch=math.ceil(rows / sharding.batch_shards),
    seq_len=seq_len,
    options=options,
    slots=run.slots(role, spec.stages),
    recompute=run.recompute,
  )


def adapters_synced(actor: ModelConfig, actor_spec: RoleSpec, rollout_spec: RoleSpec):
  """The actor's LoRA adapters when a sync to a rollout placed as `rollout_spec` moves them
  alone (the rollout on devices of its own: `rlhfjax.cluster.Cluster.syncs_adapters`), else
  None."""
  if actor.lora is None or set(actor_spec.devices) & set(rollout_spec.devices):
    return None
  return actor.lora


def rollout_cache_tokens(rollout: RolloutSection, replicas: int) -> int:
  """Tokens one 'data' replica's KV cache holds: its share of the page pool in whole pages plus
  the reserved page."""
  return rollout.kv_pages(replicas) // replicas * rollout.page_size


def model_options(model: ModelConfig, options: Options | None = None) -> Options:
  """`options` with the memory settings `model` itself carries (remat, log-prob chunks,
  flash attention)."""
  return dataclasses.replace(
    options or Options(),
    remat=model.remat,
    logits_chunk=model.logprob_chunk_size or 0,
    fused_attention=model.attention not in ("xla", "einsum"),
  )


def offload_options(options: Options, role: Role | str, offload: OffloadSection | None) -> Options:
  """`options` with the offload flags of `role` in `offload` (none when None): the memory model
  takes offload one role at a time."""
  name = str(role)
  off = offload or OffloadSection()
  return dataclasses.replace(
    options, offload_params=name in off.params, offload_optimizer=name in off.optimizer
  )


def estimate_placement_memory(
  placement: PlacementSpec,
  model: ModelSection,
  rollout: RolloutSection,
  *,
  train_rows: int | None = None,
  score_rows: int | None = None,
  options: Options | None = None,
  offload: OffloadSection | None = None,
  pipelining: Pipelining | None = None,
) -> dict[Role, MemoryEstimate]:
  """`estimate_memory` of every role of `placement`, with the model each role runs and its own
  offload in `offload`; its pipelined roles run as `pipelining` says, recomputing their
  stages' forwards where `placement` asks for it too."""
  actor_devices = set(placement[Role.ACTOR].devices)
  actor = model.for_role(Role.ACTOR)
  run = with_recompute(pipelining, placement)
  estimates = {
    role: estimate_memory(
      role,
      spec,
      model.for_role(role),
      rollout,
      train_rows=train_rows,
      score_rows=score_rows,
      receives_sync=role == Role.ROLLOUT and not set(spec.devices) <= actor_devices,
      sync_adapters=adapters_synced(actor, placement[Role.ACTOR], spec),
      options=options,
      offload=offload,
      head=model.head(role),
      pipelining=run,
    )
    for role, spec in placement.roles.items()
  }
  for role, section in model.extra_roles.items():
    if section.kind == "judge" and role in estimates:
      estimates[role] = judge_memory(
        section, placement[role], model.for_role(role), rollout, options
      )
  if model.reference_from_base and Role.REFERENCE in estimates:
    # The actor's base weights with the adapters off, beside it: its scoring only.
    estimates[Role.REFERENCE] = without_weights(estimates[Role.REFERENCE])
  return estimates


def with_recompute(pipelining: Pipelining | None, placement: PlacementSpec) -> Pipelining:
  """`pipelining` (default `Pipelining()`) recomputing the stages' forwards when `placement`
  asks for it (`PlacementSpec.pipeline_recompute`, `strategy=auto`'s choice)."""
  run = pipelining or Pipelining()
  if placement.pipeline_recompute and not run.recompute:
    return dataclasses.replace(run, recompute=True)
  return run


JUDGE_PAGE_SIZE = 16
"""Tokens per page of a judge's KV pool (`rlhfjax.cluster.judge`)."""


def judge_spec(spec: RoleSpec) -> RoleSpec:
  """The mesh a judge's engine runs on: its role's devices in the generation layout, its
  mesh's tensor size and data parallel over the rest."""
  tensor = spec.axis_size("tensor")
  return RoleSpec.generation(spec.devices, data=len(spec.devices) // tensor, tensor=tensor)


def judge_memory(
  section: ExtraRoleSection,
  spec: RoleSpec,
  model: ModelConfig,
  rollout: RolloutSection,
  options: Options | None = None,
) -> MemoryEstimate:
  """A judge's bytes per device: its engine over its devices in the generation layout (its
  mesh's tensor size, data parallel over the rest), with the dense pool of its slots at its
  prompt capacity plus its longest verdict (`ExtraRoleSection.judge_engine`), the reserved page
  included."""
  data = judge_spec(spec).axis_size("data")
  slots, capacity, verdict = section.judge_engine(rollout, data)
  return judge_engine_memory(
    spec,
    model,
    slots=slots,
    capacity=capacity,
    verdict=verdict,
    options=model_options(model, options),
  )


def judge_engine_memory(
  spec: RoleSpec, model: ModelConfig, *, slots: int, capacity: int, verdict: int, options: Options
) -> MemoryEstimate:
  """A judge's engine on `spec`'s devices (`judge_spec`): `slots` over its replicas (rounded up
  to a multiple of them), a page pool of each slot's `capacity + verdict` tokens plus the
  reserved page."""
  engine_spec = judge_spec(spec)
  data = engine_spec.axis_size("data")
  per_replica = -(-slots // data)
  pages = -(-(capacity + verdict) // JUDGE_PAGE_SIZE)
  return rollout_memory(
    model,
    sharding_of(engine_spec),
    slots=per_replica,
    seq_len=capacity + verdict,
    options=options,
    receives_sync=False,
    cache_tokens=(per_replica * pages + 1) * JUDGE_PAGE_SIZE,
  )


def without_weights(estimate: MemoryEstimate) -> MemoryEstimate:
  """`estimate` of a role that runs another role's weights (the reference on the actor's
  base): its stage's working set alone."""
  return dataclasses.replace(estimate, params=0, parked=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KvPool:
  """The rollout's KV page pool sized from device memory (`rollout.kv_memory_fraction`)."""

  tokens: int
  """Tokens of the pool over all 'data' replicas, in whole pages (`rollout.kv_cache_tokens`)."""
  replicas: int
  """'data' replicas of the rollout, one pool each."""
  fraction: float
  device_bytes: int
  """Memory of one rollout device (the least of them)."""
  resident: int
  """Bytes a rollout device holds while it generates, the pool aside (the most of any): the
  rollout's weights, logits and sync buffer, and the idle state of the roles sharing it."""
  token_bytes: int
  """Bytes of one token's keys and values on one rollout device."""
  capped: bool
  """The memory would hold more, but the pool stops at every slot at full length: more pages
  could never be used."""

  def describe(self) -> str:
    """One line: the pool and where its size comes from."""
    per_device = self.tokens // self.replicas * self.token_bytes
    cap = ", every slot at full length: the most its slots can use" if self.capped else ""
    return (
      f"rollout KV pool: {self.tokens:,} tokens ({_size(per_device)} per device{cap}), "
      f"rollout.kv_memory_fraction={self.fraction:g} of {_size(self.device_bytes)} less "
      f"{_size(self.resident)} of weights and resident state"
    )


def _size(num_bytes: int) -> str:
  """Bytes as GiB from 1 GiB up, else MiB."""
  if num_bytes >= GIB:
    return f"{num_bytes / GIB:.3g} GiB"
  return f"{num_bytes / 2**20:.3g} MiB"


def kv_pool(
  placement: PlacementSpec,
  model: ModelSection,
  rollout: RolloutSection,
  device_bytes: int,
  *,
  train_rows: int | None = None,
  score_rows: int | None = None,
  options: Options | None = None,
  offload: OffloadSection | None = None,
  pipelining: Pipelining | None = None,
) -> KvPool:
  """The largest page pool per rollout replica that fits `rollout.kv_memory_fraction` of
  `device_bytes` beside what the rollout's devices hold while it generates (its weights,
  logits and sync buffer; the parameters and moments of co-located roles, unless offloaded),
  in the memory model's bytes; at most every slot at full length. The pool's reserved page
  counts in the memory.

  Raises:
    PlacementError: the fraction leaves room for less than one sequence of `max_seq_len`
      tokens; the message gives the memory one sequence needs and the fraction that fits it.
  """
  from rlhfjax.placement.validate import PlacementError  # validate imports this module

  spec = placement[Role.ROLLOUT]
  sharding = sharding_of(spec)
  replicas = sharding.batch_shards
  token_bytes = kv_token_bytes(model.for_role(Role.ROLLOUT), sharding, options or Options())
  # Without a pool: the rollout's stage bytes, and what every role keeps while idle.
  estimates = estimate_placement_memory(
    placement,
    model,
    dataclasses.replace(rollout, kv_cache_tokens=rollout.max_seq_len),
    train_rows=train_rows,
    score_rows=score_rows,
    options=options,
    offload=offload,
    pipelining=pipelining,
  )
  estimates[Role.ROLLOUT] = dataclasses.replace(estimates[Role.ROLLOUT], kv_cache=0)
  rollout_stage = estimates[Role.ROLLOUT].total - estimates[Role.ROLLOUT].persistent
  resident = max(
    rollout_stage
    + sum(e.persistent for role, e in estimates.items() if device in placement[role].devices)
    for device in spec.devices
  )
  page_bytes = rollout.page_size * token_bytes
  free = int(rollout.kv_memory_fraction * device_bytes) - resident
  pages = max(0, free // page_bytes - 1)  # less the reserved page
  one = -(-rollout.max_seq_len // rollout.page_size)
  if pages < one:
    need = resident + (one + 1) * page_bytes
    fits = (
      f"a fraction of at least {_round_up(need / device_bytes):.3g} fits one"
      if need <= device_bytes
      else f"no fraction does: {_size(need)} per device would (more devices for the rollout, "
      "or a smaller model)"
    )
    raise PlacementError(
      f"'rollout.kv_memory_fraction'={rollout.kv_memory_fraction:g} of {_size(device_bytes)} "
      f"per rollout device leaves {_size(max(free, 0))} for the KV pool after "
      f"{_size(resident)} of weights and resident state, less than one sequence of "
      f"max_prompt_len + max_new_tokens = {rollout.max_seq_len} tokens needs "
      f"({_size((one + 1) * page_bytes)} with the reserved page): {fits}"
    )
  most = -(-rollout.num_slots // replicas) * one
  return KvPool(
    tokens=replicas * min(pages, most) * rollout.page_size,
    replicas=replicas,
    fraction=rollout.kv_memory_fraction,
    device_bytes=device_bytes,
    resident=resident,
    token_bytes=token_bytes,
    capped=pages > most,
  )


def _round_up(x: float, digits: int = 3) -> float:
  """`x` > 0 rounded up to `digits` significant digits."""
  scale = 10.0 ** (digits - math.ceil(math.log10(x)))
  return math.ceil(x * scale) / scale


def device_totals(
  placement: PlacementSpec, estimates: Mapping[Role, MemoryEstimate]
) -> dict[int, int]:
  """Bytes each device needs at its peak: what every role on it keeps while idle (offloaded
  parts are out) plus the largest extra of any one of them during its stage (offloaded parts
  back in)."""
  return stage_peaks(placement, {role: (e.persistent, e.total) for role, e in estimates.items()})


def stage_peaks(placement: PlacementSpec, needs: Mapping[Role, tuple[int, int]]) -> dict[int, int]:
  """Bytes each device needs at its peak, from each role's (bytes kept while idle, bytes during
  its stage): the roles' idle bytes summed, plus the largest stage-time extra among them
  (stages sharing a device run one at a time)."""
  roles = tuple(needs)
  totals: dict[int, int] = {}
  for key, devices in cells(tuple(placement[role].devices for role in roles)).items():
    here = [needs[roles[i]] for i in key]
    need = sum(idle for idle, _ in here) + max(stage - idle for idle, stage in here)
    totals.update(dict.fromkeys(devices, need))
  return totals


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptionEffect:
  """What the memory options of one role (its model's remat and log-prob chunk, and the
  config's offload) do to its bytes per device, from the planner's memory model."""

  plain: int
  """During its stage, without remat or log-prob chunks."""
  remat: int
  """Change from the role's remat policy alone (negative: saved)."""
  chunk: int
  """Change from the role's log-prob chunk alone (negative: saved)."""
  configured: int
  """During its stage, with both."""
  idle: int
  """Kept on its devices while other roles' stages run (parameters and moments)."""
  idle_offloaded: int
  """The same with the configured offload (parked parts in host memory)."""

  @property
  def transient(self) -> int:
    return self.configured - self.idle


def option_effects(
  placement: PlacementSpec,
  model: ModelSection,
  rollout: RolloutSection,
  *,
  train_rows: int | None,
  score_rows: int | None = None,
  offload: OffloadSection | None = None,
  pipelining: Pipelining | None = None,
) -> dict[Role, OptionEffect]:
  """Each role's `OptionEffect`: `estimate_memory` of its model with and without its remat and
  log-prob chunk, and its idle bytes with and without its own parts of `offload`."""
  actor_devices = set(placement[Role.ACTOR].devices)
  run = with_recompute(pipelining, placement)
  out = {}
  for role, spec in placement.roles.items():
    config = model.for_role(role)

    def total(cfg: ModelConfig, role=role, spec=spec) -> MemoryEstimate:
      return estimate_memory(
        role,
        spec,
        cfg,
        rollout,
        train_rows=train_rows,
        score_rows=score_rows,
        receives_sync=role == Role.ROLLOUT and not set(spec.devices) <= actor_devices,
        offload=offload,
        head=model.head(role),
        pipelining=run,
      )

    plain = total(config.replace(remat="none", logprob_chunk_size=None)).total
    configured = total(config)
    out[role] = OptionEffect(
      plain=plain,
      remat=total(config.replace(logprob_chunk_size=None)).total - plain,
      chunk=total(config.replace(remat="none")).total - plain,
      configured=configured.total,
      idle=configured.params + configured.optimizer,
      idle_offloaded=configured.persistent,
    )
  return out


def option_peaks(placement: PlacementSpec, effects: Mapping[Role, OptionEffect]) -> dict[str, int]:
  """The largest need of any device (`stage_peaks`, as the placement check counts it), plain
  (no remat, no chunks, no offload) and configured."""
  plain = stage_peaks(placement, {role: (e.idle, e.plain) for role, e in effects.items()})
  configured = stage_peaks(
    placement, {role: (e.idle_offloaded, e.configured) for role, e in effects.items()}
  )
  return {"plain": max(plain.values()), "configured": max(configured.values())}
