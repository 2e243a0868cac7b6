"""Every role of a placement on its own mesh: weights, optimizer states, programs, the mover.

A `Cluster` is built from a `PlacementSpec`. A flow declares what it needs of each role (a
trained role: weights and an optimizer; a frozen one: weights; the rollout: an engine fed from
a trained role), compiles its programs through `compile` (counted, so a test can prove each
compiles once), and moves every array between roles with `move` (device to device through
`rlhfjax.mesh.transfer`). The runner then `materialize`s the weights, fresh or restored from a
checkpoint, before the first iteration.

Host transfers are the exception and are named: `host(name)` is the only place a flow lets
arrays cross between host and device (the rollout's token ids for a rule reward, the scores it
returns, metric scalars). `tests/test_transfer_guard.py` runs whole iterations with every other
host transfer forbidden.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import optax
from absl import logging

from rlhfjax import models, schedules
from rlhfjax.cluster import dispatch, residency
from rlhfjax.cluster.adapter_sync import AdapterSync
from rlhfjax.cluster.residency import Key
from rlhfjax.cluster.role import RoleRuntime
from rlhfjax.config import ROLE_HEADS, ConfigError, ExperimentConfig, RolloutSection
from rlhfjax.mesh import offload, rules, sharing, transfer
from rlhfjax.models import lora
from rlhfjax.observe.timeline import Timeline
from rlhfjax.placement.memory import adapters_synced
from rlhfjax.placement.spec import PlacementSpec, Role
from rlhfjax.placement.strategies import reverse_stages
from rlhfjax.placement.validate import check_layers
from rlhfjax.programs import TraceCounter
from rlhfjax.rollout.engine import Engine, EngineConfig
from rlhfjax.training import pipeline, steps, weights
from rlhfjax.training.state import TrainState

HEADS = ROLE_HEADS
"""The head each built-in role's model carries (an extra role's: `ModelSection.head`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightSource:
  """Where a role's first weights come from (see `rlhfjax.training.weights.load_params`)."""

  source: str
  """Empty: random; else a checkpoint or Hugging Face directory."""
  what: str
  """The config field that named the source, for error messages."""
  rng: jax.Array
  """Seeds a random initialisation."""


def initial_rngs(seed: int) -> dict[Role, jax.Array]:
  """The keys of random initialisations: the actor's (the reference's too: the same weights),
  the critic's and the reward model's, all from `seed`."""
  actor, critic, reward = jax.random.split(jax.random.key(seed), 3)
  return {Role.ACTOR: actor, Role.REFERENCE: actor, Role.CRITIC: critic, Role.REWARD: reward}


def extra_rng(seed: int, role: str) -> jax.Array:
  """The key of an extra role's random initialisation: from `seed` and the role's name (stable
  across processes and runs, unlike `hash`), apart from the built-in roles' keys."""
  return jax.random.fold_in(jax.random.key(seed), zlib.crc32(role.encode()) & 0x7FFFFFFF)


def engine_config(rollout: RolloutSection, pad_id: int, replicas: int) -> EngineConfig:
  """The rollout engine's static shapes from the config's rollout section, on a mesh with
  `replicas` 'data' replicas (the page pool is `rollout.kv_pages(replicas)` pages)."""
  return EngineConfig(
    num_slots=rollout.num_slots,
    prompt_buckets=rollout.prompt_buckets,
    max_new_tokens=rollout.max_new_tokens,
    pad_token_id=pad_id,
    tail_threshold=rollout.tail_threshold,
    page_size=rollout.page_size,
    num_pages=rollout.kv_pages(replicas),
    share_prefixes=rollout.share_prefixes,
    decode_chunk=rollout.decode_chunk,
    paged_attention=rollout.attention,
    # The tokenizer's EOS, a checkpoint's own (Llama 3 has up to 3) and the run's.
    max_stop_tokens=4 + len(rollout.stop_token_ids),
  )


def _alone(step: Callable, mesh: Any) -> Callable:
  """`step`, started once the devices run nothing else, and waited for to the end.

  A pipelined step runs collectives inside a `lax.while` and a `lax.switch` at every tick.
  XLA's CPU runtime (JAX 0.10.2) runs each device's part of a program on a shared thread pool
  and waits for a collective's peers in a rendezvous that holds its thread; two such programs
  in flight at once deadlocked (`rendezvous.cc: ... may be stuck`, then an abort): measured,
  200 back-to-back asynchronous calls of the same pipelined step hung within seconds, while
  calls waited for one by one ran to the end. The wait costs the update nothing (its stage
  waits for its result anyway) beyond what is left of the work before it; accelerators run a
  device's programs in order on their streams and do not wait."""
  if jax.default_backend() != "cpu":
    return step
  if any(size > 1 for name, size in mesh.shape.items() if name != pipeline.AXIS):
    # Waiting for idle devices did not make every run safe: stages of several devices, whose
    # collectives run inside the schedule's loop and switch, still hung at times.
    logging.warning(
      "pipeline stages of several devices can hang XLA's CPU runtime (a collective waiting "
      "for a peer that never comes); on CPU prefer one device a stage"
    )

  def alone(*args):
    jax.block_until_ready(jax.live_arrays())
    return jax.block_until_ready(step(*args))

  return alone


class Cluster:
  """The roles of one placement, each on its mesh; see the module docstring."""

  def __init__(self, cfg: ExperimentConfig, placement: PlacementSpec):
    self.cfg, self.placement = cfg, placement
    self.timeline = Timeline()
    self.traces = TraceCounter()
    self.host_transfers: collections.Counter[str] = collections.Counter()
    """How often each named host transfer happened (see `host`)."""
    mesh_cache: dict[Any, Any] = {}
    self.roles: dict[str, RoleRuntime] = {}
    """Every placed role's runtime (a role the flow does not use,
    `rlhfjax.flows.registry.roles_of`, has no mesh), extra roles (`model.extra_roles`) by
    name."""
    for role, spec in placement.roles.items():
      key = (spec.devices, spec.axes)
      model, head = cfg.model.for_role(role), cfg.model.head(role)
      runtime = RoleRuntime.create(role, spec, model, head, mesh_cache.get(key))
      mesh_cache[key] = runtime.mesh
      self.roles[role] = runtime
    self.tx: dict[Role, optax.GradientTransformation] = {}
    self.state_shardings: dict[Role, TrainState] = {}
    self.states: dict[Role, TrainState] = {}
    """Trained roles' parameters and optimizer states, on their meshes."""
    self.params: dict[Role, Any] = {}
    """Frozen roles' parameters, on their meshes."""
    self._sources: dict[Role, WeightSource] = {}
    self._base_of: dict[Role, Role] = {}
    """Frozen roles that run another role's base weights with its adapters off, on its devices
    (the reference of an actor that trains LoRA adapters: `ModelSection.reference_from_base`)."""
    self._rollout_from: Role | None = None
    self._pad_id = 0
    self.engine: Engine | None = None
    self.released_bytes = 0
    """Bytes of weights the rollout freed after its last generation (`rollout.release`)."""
    self.residency = residency.Residency(
      self._offloaded, self._get_part, self._put_part, lambda role: self.roles[Role(role)].devices
    )
    """Where offloaded state is when (its `events` log every move)."""
    self._cast: Callable | None = None
    self._adapters: AdapterSync | None = None
    """The adapters-only sync (`syncs_adapters`), after `materialize`."""

  # -------------------------------------------------------------------------------------------
  # Declaring roles.

  def train(self, role: Role, source: WeightSource, tx: optax.GradientTransformation) -> None:
    """`role` is trained with optimizer `tx`; its weights start from `source`."""
    self._placed(role)
    self._sources[role] = source
    self.tx[role] = tx
    self.state_shardings[role] = self.roles[role].train_state_shardings(tx)

  def freeze(self, role: Role, source: WeightSource) -> None:
    """`role` holds fixed weights from `source` (the reference, a reward model). A reference
    placed beside an actor that trains adapters (`ModelSection.reference_from_base`,
    `PlacementSpec.beside`) runs the actor's base weights with the adapters off: nothing is
    loaded for it."""
    self._placed(role)
    if (
      role is Role.REFERENCE
      and self.cfg.model.reference_from_base
      and Role.ACTOR in self.roles
      and self.placement[role] == self.placement[Role.ACTOR]
    ):
      self._base_of[role] = Role.ACTOR
    self._sources[role] = source

  def _placed(self, role: Role) -> None:
    if role not in self.roles:
      raise ValueError(
        f"the flow uses {role} but the placement gives it no devices (placed: "
        f"{', '.join(self.roles)}); declare it in the flow's registered roles"
      )

  def rollout_from(self, role: Role, pad_id: int) -> None:
    """The rollout engine generates with `role`'s weights (synced by `sync`)."""
    self._rollout_from, self._pad_id = role, pad_id

  @property
  def trained(self) -> tuple[Role, ...]:
    return tuple(self.tx)

  def uses(self, role: Role) -> bool:
    return role in self._sources or (role is Role.ROLLOUT and self._rollout_from is not None)

  def abstract_states(self) -> dict[str, Any]:
    """Shapes and shardings of every trained role's state as a checkpoint holds it (see
    `checkpoint_states`): what a checkpoint restores."""
    return {
      role.value: _trained_part(self.roles[role].abstract_train_state(tx))
      for role, tx in self.tx.items()
    }

  def checkpoint_states(self) -> dict[str, TrainState]:
    """Every trained role's state as a checkpoint holds it: the trained parameters (with LoRA
    adapters, the adapters and a value head alone; the frozen base is reloaded from the role's
    source by `materialize`), the optimizer state and the step."""
    return {role.value: _trained_part(self.states[role]) for role in self.tx}

  def weight_source(self, role: Role) -> WeightSource | None:
    """Where `role`'s first weights come from (None: a role the flow does not use)."""
    return self._sources.get(role)

  def abstract_rollout(self) -> Any:
    return self._abstract(Role.ROLLOUT)

  def _load(self, role: Role) -> Any:
    rt, src = self.roles[role], self._sources[role]
    items = weights.items_for(rt.head)
    return weights.load_params(
      src.source,
      model=rt.model,
      head=rt.head,
      mesh=rt.mesh,
      layout=rt.spec.layout,
      shardings=rt.param_shardings,
      rng=src.rng,
      items=items,
      what=src.what,
    )

  def materialize(self, restored: dict[str, Any] | None = None) -> None:
    """Every declared role's weights in its shards: trained states from `restored` (a
    checkpoint's items, by role name) when given, else from their sources; then the engine."""
    self._check_bases()
    for role in self._sources:
      if role in self._base_of:
        continue  # reads its base role's weights (`weights`)
      if role in self.tx:
        if restored is not None:
          self.states[role] = self._with_frozen(role, restored[role.value])
        else:
          self.states[role], _ = self.roles[role].train_state(self._load(role), self.tx[role])
      else:
        self.params[role] = self._load(role)
    if self._rollout_from is not None:
      rollout = self.cfg.rollout
      rt, source = self.roles[Role.ROLLOUT], self._rollout_from
      engine_cfg = engine_config(rollout, self._pad_id, dict(rt.mesh.shape).get("data", 1))
      self._cast = None
      if self.rollout_reads_source and source.value in self.cfg.offload.params:
        raise ConfigError(
          f"'offload.params' names the {source.value}, whose arrays the rollout reads while it "
          f"generates (co-located, in its layout and dtype): leave the {source.value} out"
        )
      if self.rollout_reads_source:
        # Co-located in the same layout and dtype: the engine reads the source's arrays
        # themselves each time it runs (after each update, whose donation freed the old ones).
        shardings = self.roles[source].param_shardings
        self.engine = Engine(rt.model, engine_cfg, rt.mesh, param_shardings=shardings)
        self.engine.read_params_from(lambda: self.weights(source))
      else:
        self.engine = Engine(rt.model, engine_cfg, rt.mesh)
        self._adapters = None
        if self.syncs_adapters:
          self._adapters = AdapterSync(self.roles[source], rt, self.compile)
          self._adapters.start(self.weights(source))
        else:
          self._cast = self._rollout_cast()
        self._take_weights()
    self.park()

  def _with_frozen(self, role: Role, state: TrainState) -> TrainState:
    """A restored state (`checkpoint_states`) with its frozen base loaded from the role's
    source again: the same weights the run started from, so the resume is exact."""
    if self.roles[role].model.lora is None:
      return state
    frozen = lora.split(self._load(role))[1]
    return state.replace(params=lora.join(state.params, frozen))

  @functools.cached_property
  def rollout_reads_source(self) -> bool:
    """Whether the rollout reads its source role's weights as they are, with no copy and no
    sync: the two lay out every parameter alike (`rlhfjax.mesh.sharing.same_layout`: shapes,
    dtypes, shards per device), as a co-located rollout in the actor's layout does. A bf16
    rollout beside fp32 masters, or another layout, is synced by copy."""
    if self._rollout_from is None:
      return False
    return sharing.same_layout(self._abstract(self._rollout_from), self._abstract(Role.ROLLOUT))

  @functools.cached_property
  def syncs_adapters(self) -> bool:
    """Whether each sync moves only the source's LoRA adapters, merged into the rollout's own
    copy of the frozen base (`rlhfjax.cluster.adapter_sync`): the source trains adapters and
    the rollout runs on devices of its own. (On the same devices the merge and cast of a full
    sync move nothing between devices, and no base copy is needed.)"""
    if self._rollout_from is None or self.rollout_reads_source:
      return False
    src, dst = self.roles[self._rollout_from], self.roles[Role.ROLLOUT]
    return adapters_synced(src.model, src.spec, dst.spec) is not None

  def _abstract(self, role: Role) -> Any:
    rt = self.roles[role]
    return weights.abstract_with_shardings(
      models.abstract_params(rt.model, rt.head), rt.param_shardings
    )

  def _check_bases(self) -> None:
    """A role run on another's base weights starts from the same source as that role, which
    trains adapters, and lays the base out as its own model would (shapes, dtypes, shards)."""
    for role, base in self._base_of.items():
      mine, theirs = self._sources[role], self._sources.get(base)
      if base not in self.tx or self.roles[base].model.lora is None:
        raise ValueError(f"{role} runs {base}'s base weights, but {base} trains no adapters")
      if theirs is None or mine.source != theirs.source:
        raise ValueError(
          f"{role} runs {base}'s base weights, so both must start from the same weights: "
          f"{mine.what}={mine.source!r}, {base}'s from {theirs and theirs.source!r}; set "
          "'model.lora.reference'='placed' for a reference of its own"
        )
      if not sharing.same_layout(self._abstract(role), lora.base(self._abstract(base))):
        raise ValueError(
          f"{role}'s model ({self.cfg.model.model_name(role.value)}) is not {base}'s base; set "
          "'model.lora.reference'='placed'"
        )

  def weights(self, role: Role) -> Any:
    """`role`'s current parameters (a trained role's from its state; the base weights of the
    role it runs on, its adapters dropped: no copy)."""
    if role in self._base_of:
      return lora.base(self.weights(self._base_of[role]))
    return self.states[role].params if role in self.states else self.params[role]

  # -------------------------------------------------------------------------------------------
  # Programs and moves.

  def compile(
    self,
    name: str,
    fn: Callable,
    *,
    in_shardings: Any = None,
    out_shardings: Any = None,
    donate_argnums: int | Sequence[int] = (),
    role: Role | None = None,
  ) -> Callable:
    """`jax.jit` of `fn` with explicit shardings; every trace is counted under `name`. A
    `role`'s program is traced under its mesh and layout rules, so the model's activation
    sharding constraints apply (`rlhfjax.mesh.rules.constrained`)."""
    if role is not None:
      rt = self.roles[role]
      fn = rules.constrained(fn, rt.spec.layout, rt.mesh)
    return self.traces.jit(
      name,
      fn,
      in_shardings=in_shardings,
      out_shardings=out_shardings,
      donate_argnums=donate_argnums,
    )

  def scorer(
    self,
    name: str,
    fn: Callable,
    *,
    role: Role,
    in_shardings: Any = None,
    out_shardings: Any = None,
  ) -> Callable:
    """`compile` of a scoring function `fn(params, *inputs)` of `role`'s weights (every input
    and output with rows first: log-probs, values, scores). On a mesh with pipeline stages it
    runs as a forward-only pipeline over them (`pipeline.pipelined_forward`): each stage applies
    its own layers to micro-batches in turn, and no stage gathers another's (on CPU run alone,
    as a pipelined step is: `_alone`)."""
    rt = self.roles[role]
    stages = pipeline.stages_of(rt.mesh)
    if stages > 1:
      check_layers(rt.model, stages, role)
      whole = fn

      def fn(params, *inputs):
        rows = inputs[0].shape[0]
        axes = rt.batch_sharding((rows,)).spec[0] or ()
        axes = (axes,) if isinstance(axes, str) else axes
        shards = math.prod(dict(rt.mesh.shape)[a] for a in axes if a != pipeline.AXIS)
        m = schedules.scoring_micro_batches(rows, stages, shards)
        return pipeline.pipelined_forward(whole, rt.model, rt.mesh, m, params, *inputs)

    compiled = self.compile(
      name, fn, in_shardings=in_shardings, out_shardings=out_shardings, role=role
    )
    return _alone(compiled, rt.mesh) if stages > 1 else compiled

  @property
  def _recompute_stages(self) -> bool:
    """Pipelined steps run each stage's forward again in its backward: the config asks for it,
    or `strategy=auto` chose it (`PlacementSpec.pipeline_recompute`)."""
    return self.cfg.placement.pipeline_recompute or self.placement.pipeline_recompute

  def train_step(self, name: str, role: Role, loss_fn: steps.LossFn) -> Callable:
    """`step(state, batch) -> (state, metrics)`: one optimizer update of trained `role` from a
    mini-batch of micro-batches (`steps.accumulate_and_apply`), its state donated. On a mesh
    with pipeline stages the micro-batches run through them by `placement.pipeline_schedule`
    (`rlhfjax.training.pipeline`)."""
    rt, shardings = self.roles[role], self.state_shardings[role]
    if pipeline.stages_of(rt.mesh) > 1:
      check_layers(rt.model, pipeline.stages_of(rt.mesh), role)
      step = functools.partial(
        pipeline.accumulate_and_apply,
        loss_fn,
        self.tx[role],
        rt.model,
        self.cfg.placement.pipeline_schedule,
        rt.mesh,
        recompute=self._recompute_stages,
      )
    else:
      step = functools.partial(steps.accumulate_and_apply, loss_fn, self.tx[role])
    compiled = self.compile(
      name,
      step,
      in_shardings=(shardings, None),
      out_shardings=(shardings, rt.replicated),
      donate_argnums=0,
      role=role,
    )
    return _alone(compiled, rt.mesh) if pipeline.stages_of(rt.mesh) > 1 else compiled

  def fused_train_step(
    self, name: str, roles: tuple[Role, Role], loss_fns: tuple[steps.LossFn, steps.LossFn]
  ) -> Callable:
    """`step(states, batches) -> (states, metrics)`: one optimizer update of each of two
    trained roles in one fused pipeline schedule (`schedules.fused`, RLHFuse's intra-stage
    fusion) on the first role's mesh, their states donated. The second role's stages run in
    the reverse device order: its mesh is the first's with the `stage` axis reversed (as the
    placement strategies lay out a co-located critic), and its state and batches enter and
    leave as views on the first's mesh (`fused_update_stage`), so no weight moves."""
    first, second = (self.roles[role] for role in roles)
    stages = pipeline.stages_of(first.mesh)
    if stages < 2:
      raise ValueError(
        "ppo.fuse_actor_critic fuses two pipelines: set placement.pipeline_stages >= 2"
      )
    if second.spec != reverse_stages(first.spec):
      raise ValueError(
        f"ppo.fuse_actor_critic needs {roles[1]} on {roles[0]}'s devices with the stage axis "
        f"reversed (got {roles[0]} {first.spec.devices}, {roles[1]} {second.spec.devices})"
      )
    for role, rt in zip(roles, (first, second), strict=True):
      check_layers(rt.model, stages, role)
    models = tuple(
      pipeline.Model(rt.model, loss, recompute=self._recompute_stages)
      for rt, loss in zip((first, second), loss_fns, strict=True)
    )
    shardings = (
      self.state_shardings[roles[0]],
      jax.tree.map(lambda sh: sharing.on_mesh(sh, first.mesh), self.state_shardings[roles[1]]),
    )
    return _alone(
      self.compile(
        name,
        functools.partial(
          pipeline.fused_accumulate_and_apply, models, tuple(self.tx[r] for r in roles), first.mesh
        ),
        in_shardings=(shardings, None),
        out_shardings=(shardings, (first.replicated, first.replicated)),
        donate_argnums=0,
        role=roles[0],
      ),
      first.mesh,
    )

  def move(self, role: Role, tree: Any, leading: int = 0) -> Any:
    """`tree` (device arrays of any role) on `role`'s mesh, rows split over its batch axes:
    device to device, without a copy where it already lies as asked."""
    return self.roles[role].put_batch(tree, leading)

  def upload(
    self, role: Role, tree: Any, name: str, leading: int = 0, *, replicated: bool = False
  ) -> Any:
    """Host arrays onto `role`'s mesh (rows split, or `replicated`): a named host transfer
    (see `host`)."""
    with self.host(name):
      if replicated:
        return jax.device_put(tree, self.roles[role].replicated)
      return self.roles[role].put_batch(tree, leading)

  @contextlib.contextmanager
  def host(self, name: str) -> Iterator[None]:
    """Lets host transfers through inside the block and counts them under `name`.

    Flows wrap every deliberate crossing in one of these; anything else is caught by
    `rlhfjax.mesh.transfer.no_host_transfers` in the transfer-guard test.
    """
    self.host_transfers[name] += 1
    with transfer.host_transfers_allowed():
      yield

  def fetch(self, tree: Any, name: str = "metrics") -> Any:
    """NumPy copies of (small) device arrays: a named host transfer."""
    with self.host(name):
      return transfer.to_host(tree)

  # -------------------------------------------------------------------------------------------
  # Stages.

  def update_stage(
    self, role: Role, step: Callable, batch: Any, name: str = "update"
  ) -> dispatch.Stage:
    """A stage of one optimizer update of trained `role`: `step(state, batch) -> (state,
    metrics)` (a `train_step`); its result is the metrics.

    The new state is committed here, by the cluster that owns `states`, inside the stage:
    the residency's `after` of the same stage parks it (offloaded optimizer state), and the
    next stage of the role, which runs after it on the same devices and so in the same
    thread, reads it. Stages of different roles touch different entries."""

    def update() -> Any:
      self.states[role], metrics = step(self.states[role], batch)
      return metrics

    return self.stage(role, name, update)

  def fused_update_stage(
    self, roles: tuple[Role, Role], step: Callable, batches: tuple[Any, Any], name: str = "update"
  ) -> dispatch.Stage:
    """A stage of one fused update of two trained roles (a `fused_train_step`), on the first
    role's devices; its result is both roles' metrics. The second role's state goes in and
    comes back as a view on the first role's mesh (`rlhfjax.mesh.sharing.view_on`)."""
    first, second = roles

    def update() -> Any:
      # The view is the only array on the second role's buffers when they are donated. With
      # the cluster's own arrays still holding them, the first fused update after a resume
      # hung XLA's CPU runtime (3 runs of 3); with the view alone it ran to the end.
      states = (
        self.states.pop(first),
        sharing.view_on(self.states.pop(second), self.roles[first].mesh),
      )
      (state_a, state_b), metrics = step(states, batches)
      self.states[first] = state_a
      self.states[second] = sharing.view_on(state_b, self.roles[second].mesh)
      return metrics

    return self.stage(first, name, update)

  def stage(self, role: str, name: str, fn: Callable[[], Any]) -> dispatch.Stage:
    """A stage of `role`'s work on its devices (a name that is no placed role runs on the
    host: 'reward_fn')."""
    devices = self.roles[role].devices if role in self.roles else ()
    return dispatch.Stage(role=str(role), name=name, devices=devices, fn=fn)

  def run(
    self, stages: Sequence[dispatch.Stage], iteration: int, *, then: Sequence[Key] = ()
  ) -> list[Any]:
    """Runs stages, those on disjoint devices at the same time (see `dispatch`). Offloaded state
    a stage uses is in device memory while it runs, prefetched while the stage before it runs
    (`rlhfjax.cluster.residency`); `then` names the (role, stage) of the next call's stages, so
    their state is prefetched during this call's last stage."""
    return self.residency.run(stages, self.timeline, iteration, then)

  def prepare(self, stages: Sequence[dispatch.Stage]) -> None:
    """Offloaded state that `stages` use comes to device memory, the rest goes to host memory
    (before stages dispatched outside `run`, as fused scoring does)."""
    self.residency.place({(s.role, s.name) for s in stages})

  # -------------------------------------------------------------------------------------------
  # Offload (`rlhfjax.mesh.offload`, ChatLearn's memory sharing).

  def _offloaded(self) -> list[residency.Part]:
    """The parts `cfg.offload` names that this cluster holds."""
    off, parts = self.cfg.offload, []
    for kind, names in (("params", off.params), ("optimizer", off.optimizer)):
      for name in names:
        role = Role(name)
        if role in self.states or (kind == "params" and role in self.params):
          parts.append(residency.part_of(name, kind, trained=role in self.states))
    return parts

  def _get_part(self, part: residency.Part) -> Any:
    role = Role(part.role)
    if part.kind == "optimizer":
      return self.states[role].opt_state
    return self.states[role].params if role in self.states else self.params[role]

  def _put_part(self, part: residency.Part, tree: Any) -> None:
    role = Role(part.role)
    if part.kind == "optimizer":
      self.states[role] = self.states[role].replace(opt_state=tree)
    elif role in self.states:
      self.states[role] = self.states[role].replace(params=tree)
    else:
      self.params[role] = tree

  def park(self) -> None:
    """Every offloaded part in host memory (between iterations, during generation)."""
    self.residency.place(set())

  @contextlib.contextmanager
  def resident(self) -> Iterator[None]:
    """Every offloaded part in device memory inside the block (checkpoints, evaluation)."""
    self.residency.place(None)
    try:
      yield
    finally:
      self.park()

  def _rollout_cast(self) -> Callable | None:
    """The compiled cast of the source role's weights to the rollout's dtypes on the source's
    mesh (`rlhfjax.mesh.transfer.cast`), its adapters first merged into the base weights
    (`models.lora.merged`) when it has them, or None when nothing changes."""
    src, dst = self.roles[self._rollout_from], self.roles[Role.ROLLOUT]
    wanted = models.abstract_params(dst.model, dst.head)
    have = models.abstract_params(src.model, src.head)
    adapted = src.model.lora is not None
    if adapted:
      have = lora.base_layout(have)
    pairs = zip(jax.tree.leaves(have), jax.tree.leaves(wanted), strict=True)
    if not adapted and all(a.dtype == b.dtype for a, b in pairs):
      return None

    def prepare(params):
      if adapted:
        params = lora.merged(params, src.model.lora)
      return transfer.cast(params, dtypes=wanted)

    return self.compile(
      "rollout_cast",
      prepare,
      in_shardings=(src.param_shardings,),
      out_shardings=lora.base_layout(src.param_shardings),
      role=self._rollout_from,
    )

  def _rollout_weights(self) -> Any:
    """The source role's weights in the rollout's dtypes: cast on the source's mesh when they
    differ (bf16 rollout weights from fp32 masters: half the bytes then move), else as they
    are."""
    params = self.weights(self._rollout_from)
    if self._rollout_from.value in self.cfg.offload.params:
      # Parked in host memory after their stages (and deleted on the device): the engine gets a
      # device copy it may keep, never arrays that the next park deletes.
      params = offload.device_copy(params)
    return params if self._cast is None else self._cast(params)

  def sync(self, iteration: int) -> int:
    """The rollout engine takes the current weights of its source role (cast to the rollout's
    dtypes first where they differ; with `syncs_adapters` only the adapters move), device to
    device; returns the bytes moved. Nothing runs when the rollout reads the source's arrays
    themselves (`rollout_reads_source`)."""
    if self.rollout_reads_source:
      return 0
    devices = tuple(
      sorted(set(self.roles[Role.ROLLOUT].devices) | set(self.roles[self._rollout_from].devices))
    )
    with self.timeline.stage(iteration, "rollout", "sync", devices):
      moved = self._take_weights()
    return moved

  @contextlib.contextmanager
  def generating(self) -> Iterator[None]:
    """Around one generation: the engine has weights (the source's current ones copied again
    when `rollout.release` freed them), and with `rollout.release` frees its copy after
    (`released_bytes`)."""
    if not self.engine.has_params:
      self._take_weights()
    try:
      yield
    finally:
      if self.cfg.rollout.release:
        self.released_bytes = self.engine.release_params()

  def resync(self) -> float:
    """Runs `sync` again outside the timeline and returns its wall seconds (0 where nothing
    runs). The sync is idempotent (the rollout takes its source's current weights again), so
    repeating it samples the stage's time more finely than one sync per iteration can: what
    `rlhfjax.bench.localcheck.check` measures the sync with."""
    if self.rollout_reads_source:
      return 0.0
    start = time.perf_counter()
    self._take_weights()
    return time.perf_counter() - start

  def _take_weights(self) -> int:
    """The sync itself: the engine takes the source's weights (cast first where the dtypes
    differ) and waits for them; returns the bytes moved."""
    if self._adapters is not None:
      params, moved = self._adapters.merged(self.weights(self._rollout_from))
      self.engine.update_params(params)
    else:
      moved = self.engine.update_params(self._rollout_weights())
    jax.block_until_ready(self.engine.params)
    return moved


def _trained_part(state: TrainState) -> TrainState:
  """`state` with its frozen parameters (a LoRA base) as None: what a checkpoint saves."""
  return state.replace(params=lora.split(state.params)[0])
