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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import optax

from rlhfjax import models
from rlhfjax.cluster import dispatch
from rlhfjax.cluster.role import RoleRuntime
from rlhfjax.config import ExperimentConfig
from rlhfjax.mesh import offload
from rlhfjax.observe.compiles import TraceCounter
from rlhfjax.observe.timeline import Timeline
from rlhfjax.placement.spec import PlacementSpec, Role
from rlhfjax.rollout.engine import Engine, EngineConfig
from rlhfjax.training import steps, weights
from rlhfjax.training.state import TrainState

HEADS: dict[Role, str] = {
  Role.ACTOR: "lm",
  Role.REFERENCE: "lm",
  Role.CRITIC: "value",
  Role.REWARD: "value",
  Role.ROLLOUT: "lm",
}
"""The head each role's model carries: language-model roles score tokens, value roles score
states or sequences."""


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


class Cluster:
  """The roles of one placement, each on its mesh; see the module docstring."""

  def __init__(self, cfg: ExperimentConfig, placement: PlacementSpec):
    self.cfg, self.placement = cfg, placement
    self.timeline = Timeline()
    self.traces = TraceCounter()
    self.host_transfers: collections.Counter[str] = collections.Counter()
    """How often each named host transfer happened (see `host`)."""
    mesh_cache: dict[Any, Any] = {}
    self.roles: dict[Role, RoleRuntime] = {}
    for role, head in HEADS.items():
      spec = placement[role]
      key = (spec.devices, spec.axes)
      runtime = RoleRuntime.create(
        role, spec, cfg.model.for_role(role.value), head, mesh_cache.get(key)
      )
      mesh_cache[key] = runtime.mesh
      self.roles[role] = runtime
    self.tx: dict[Role, optax.GradientTransformation] = {}
    self.state_shardings: dict[Role, TrainState] = {}
    self.states: dict[Role, TrainState] = {}
    """Trained roles' parameters and optimizer states, on their meshes."""
    self.params: dict[Role, Any] = {}
    """Frozen roles' parameters, on their meshes."""
    self._sources: dict[Role, WeightSource] = {}
    self._rollout_from: Role | None = None
    self._pad_id = 0
    self.engine: Engine | None = None

  # -------------------------------------------------------------------------------------------
  # Declaring roles.

  def train(self, role: Role, source: WeightSource, tx: optax.GradientTransformation) -> None:
    """`role` is trained with optimizer `tx`; its weights start from `source`."""
    self._sources[role] = source
    self.tx[role] = tx
    self.state_shardings[role] = self.roles[role].train_state_shardings(tx)

  def freeze(self, role: Role, source: WeightSource) -> None:
    """`role` holds fixed weights from `source` (the reference, a reward model)."""
    self._sources[role] = source

  def rollout_from(self, role: Role, pad_id: int) -> None:
    """The rollout engine generates with `role`'s weights (synced by `sync`)."""
    self._rollout_from, self._pad_id = role, pad_id

  @property
  def trained(self) -> tuple[Role, ...]:
    return tuple(self.tx)

  def uses(self, role: Role) -> bool:
    return role in self._sources or (role is Role.ROLLOUT and self._rollout_from is not None)

  def abstract_states(self) -> dict[str, Any]:
    """Shapes and shardings of every trained role's state: what a checkpoint restores."""
    return {role.value: self.roles[role].abstract_train_state(tx) for role, tx in self.tx.items()}

  def abstract_rollout(self) -> Any:
    rt = self.roles[Role.ROLLOUT]
    return weights.abstract_with_shardings(
      models.abstract_params(rt.model, rt.head), rt.param_shardings
    )

  def _load(self, role: Role) -> Any:
    rt, src = self.roles[role], self._sources[role]
    items = ("policy", "actor") if rt.head == "lm" else ("reward", "critic", "policy", "actor")
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
    for role in self._sources:
      if role in self.tx:
        if restored is not None:
          self.states[role] = restored[role.value]
        else:
          self.states[role], _ = self.roles[role].train_state(self._load(role), self.tx[role])
      else:
        self.params[role] = self._load(role)
    if self._rollout_from is not None:
      rollout = self.cfg.rollout
      engine_cfg = EngineConfig(
        num_slots=rollout.slots or rollout.batch_size,
        prompt_buckets=(rollout.max_prompt_len,),
        max_new_tokens=rollout.max_new_tokens,
        pad_token_id=self._pad_id,
        tail_threshold=rollout.tail_threshold,
      )
      rt = self.roles[Role.ROLLOUT]
      self.engine = Engine(rt.model, engine_cfg, rt.mesh)
      self.engine.update_params(self.weights(self._rollout_from))
    self.park()

  def weights(self, role: Role) -> Any:
    """`role`'s current parameters (a trained role's from its state)."""
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
  ) -> Callable:
    """`jax.jit` of `fn` with explicit shardings; every trace is counted under `name`."""
    return jax.jit(
      self.traces.wrap(name, fn),
      in_shardings=in_shardings,
      out_shardings=out_shardings,
      donate_argnums=donate_argnums,
    )

  def train_step(self, name: str, role: Role, loss_fn: steps.LossFn) -> Callable:
    """`step(state, batch) -> (state, metrics)`: one optimizer update of trained `role` from a
    mini-batch of micro-batches (`steps.accumulate_and_apply`), its state donated."""
    shardings = self.state_shardings[role]
    return self.compile(
      name,
      functools.partial(steps.accumulate_and_apply, loss_fn, self.tx[role]),
      in_shardings=(shardings, None),
      out_shardings=(shardings, self.roles[role].replicated),
      donate_argnums=0,
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
    with (
      jax.transfer_guard("allow"),
      jax.transfer_guard_host_to_device("allow"),
      jax.transfer_guard_device_to_host("allow"),
    ):
      yield

  def fetch(self, tree: Any, name: str = "metrics") -> Any:
    """NumPy copies of (small) device arrays: a named host transfer."""
    from rlhfjax import distributed

    with self.host(name):
      return distributed.to_host(tree)

  # -------------------------------------------------------------------------------------------
  # Stages.

  def stage(self, role: Role | str, name: str, fn: Callable[[], Any]) -> dispatch.Stage:
    """A stage of `role`'s work on its devices (a plain name runs on the host)."""
    if isinstance(role, Role):
      return dispatch.Stage(role=role.value, name=name, devices=self.roles[role].devices, fn=fn)
    return dispatch.Stage(role=role, name=name, devices=(), fn=fn)

  def run(self, stages: Sequence[dispatch.Stage], iteration: int) -> list[Any]:
    """Runs stages, those on disjoint devices at the same time (see `dispatch`); offloaded
    state that they use comes to device memory first, the rest goes to host memory."""
    self.prepare(stages)
    return dispatch.run_stages(stages, self.timeline, iteration)

  def prepare(self, stages: Sequence[dispatch.Stage]) -> None:
    """Offloaded state that `stages` use comes to device memory, the rest goes to host memory
    (before stages dispatched outside `run`, as fused scoring does)."""
    self._place({(s.role, s.name) for s in stages})

  # -------------------------------------------------------------------------------------------
  # Offload (`rlhfjax.mesh.offload`, ChatLearn's memory sharing).

  def _place(self, active: set[tuple[str, str]] | None) -> None:
    """What `cfg.offload` names goes to device memory when a stage in `active` (role, stage
    name) uses it, or always with None, and to host memory otherwise: parameters of frozen roles
    for their 'score' stages, optimizer states of trained roles for their 'update' stages.
    Moves of arrays already in place are no-ops."""
    off = self.cfg.offload
    for name in off.params:
      role = Role(name)
      if role in self.params:
        use = active is None or (name, "score") in active
        self.params[role] = (offload.to_device if use else offload.to_host)(self.params[role])
    for name in off.optimizer:
      role = Role(name)
      if role in self.states:
        use = active is None or (name, "update") in active
        move = offload.to_device if use else offload.to_host
        self.states[role] = self.states[role].replace(opt_state=move(self.states[role].opt_state))

  def park(self) -> None:
    """Every offloaded part in host memory (between iterations, during generation)."""
    self._place(set())

  @contextlib.contextmanager
  def resident(self) -> Iterator[None]:
    """Every offloaded part in device memory inside the block (checkpoints, evaluation)."""
    self._place(None)
    try:
      yield
    finally:
      self.park()

  def sync(self, iteration: int) -> int:
    """The rollout engine takes the current weights of its source role, device to device;
    returns the bytes moved."""
    devices = tuple(
      sorted(set(self.roles[Role.ROLLOUT].devices) | set(self.roles[self._rollout_from].devices))
    )
    with self.timeline.stage(iteration, "rollout", "sync", devices):
      moved = self.engine.update_params(self.weights(self._rollout_from))
      jax.block_until_ready(self.engine.params)
    return moved
