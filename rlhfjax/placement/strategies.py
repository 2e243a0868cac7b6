"""Placement strategies: functions that build a `PlacementSpec` for a job of N devices.

Devices are the indices 0..N-1 into `jax.devices()`. Training roles (actor, critic, reference,
reward) use the training layout with axes (data=1, fsdp=n/tensor, tensor) over their n devices,
or with `pipeline_stages` P > 1 (stage=P, data=1, fsdp=n/(P x tensor), tensor); the rollout
uses the generation layout with axes (data=n/rollout_tensor, tensor=rollout_tensor), whatever P.
A critic on exactly the actor's devices runs its stages in the reverse device order
(`reverse_stages`), for the fused actor-critic schedule.

- `colocated`: every role on all N devices, run one after another (the flattening baseline).
- `interleaved`: actor and critic on all devices; reference and reward on disjoint halves so
  they score at the same time. `split_actor_critic` puts actor and critic on disjoint halves
  too so their updates run concurrently. The rollout shares the actor's devices.
- `disaggregated`: the rollout on its own last `rollout_fraction` of the devices; the training
  roles share the rest (optionally split into halves like `interleaved`).
- `explicit`: a hand-written spec from the config.

Extra roles (`model.extra_roles`, placed by `placement.extra_roles`) are added to whatever a
strategy builds, by `with_extra_roles`: on another role's devices and mesh ('shared'), on half
of another scoring role's devices so the two run at the same time ('interleaved'), or on
devices of their own that the strategy leaves out ('own').

`build_placement` picks a strategy by name from the config and checks the result;
`rlhfjax.planner.place.plan_placement` resolves an experiment's placement (`auto` included)
and also checks its models (tensor sizes, rollout batch, memory).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from rlhfjax.config import ExplicitPlacementSection, ExtraPlacementSection, PlacementSection
from rlhfjax.placement.spec import (
  LAYOUT_AXES,
  OPTIONAL_AXES,
  Layout,
  PlacementSpec,
  Role,
  RoleSpec,
)
from rlhfjax.placement.validate import (
  PlacementError,
  check_spec,
  resolve_num_devices,
)

Builder = Callable[[PlacementSection, int], PlacementSpec]
"""Builds a placement from the config section for a job of the given number of devices."""

_TRAINING_ROLES = (Role.ACTOR, Role.CRITIC, Role.REFERENCE, Role.REWARD)


def colocated(
  num_devices: int, *, tensor: int = 1, rollout_tensor: int = 1, pipeline_stages: int = 1
) -> PlacementSpec:
  """Every role on all `num_devices` devices; the roles run one after another.

  Args:
    num_devices: devices of the job.
    tensor: tensor-parallel size of the training roles; fsdp takes the rest.
    rollout_tensor: tensor-parallel size of the rollout; data takes the rest.
    pipeline_stages: pipeline stages of the training roles (the critic's reversed).
  """
  devices = _device_range(0, num_devices)
  roles = {role: _training_spec(role, devices, tensor, pipeline_stages) for role in _TRAINING_ROLES}
  roles[Role.ROLLOUT] = _generation_spec(devices, rollout_tensor)
  return PlacementSpec(strategy="colocated", roles=_critic_reversed(roles))


def interleaved(
  num_devices: int,
  *,
  split_actor_critic: bool = False,
  tensor: int = 1,
  rollout_tensor: int = 1,
  pipeline_stages: int = 1,
) -> PlacementSpec:
  """Reference and reward on disjoint halves (scoring concurrently), as in the APP paper.

  Args:
    num_devices: devices of the job; must be even.
    split_actor_critic: actor on the first half and critic on the second, so their updates
      run concurrently; otherwise both use all devices.
    tensor: tensor-parallel size of the training roles.
    rollout_tensor: tensor-parallel size of the rollout, which uses the actor's devices.
    pipeline_stages: pipeline stages of each training role over its own devices.
  """
  devices = _device_range(0, num_devices)
  first, second = _halves(devices, "interleaved")
  actor, critic = (first, second) if split_actor_critic else (devices, devices)
  stages = pipeline_stages
  roles = {
    Role.ACTOR: _training_spec(Role.ACTOR, actor, tensor, stages),
    Role.CRITIC: _training_spec(Role.CRITIC, critic, tensor, stages),
    Role.REFERENCE: _training_spec(Role.REFERENCE, first, tensor, stages),
    Role.REWARD: _training_spec(Role.REWARD, second, tensor, stages),
    Role.ROLLOUT: _generation_spec(actor, rollout_tensor),
  }
  disjoint = [(Role.REFERENCE, Role.REWARD)]
  if split_actor_critic:
    disjoint.append((Role.ACTOR, Role.CRITIC))
  return PlacementSpec(
    strategy="interleaved", roles=_critic_reversed(roles), disjoint=tuple(disjoint)
  )


def disaggregated(
  num_devices: int,
  *,
  rollout_fraction: float = 0.5,
  rollout_tensor: int = 1,
  tensor: int = 1,
  split_actor_critic: bool = False,
  split_reference_reward: bool = False,
  pipeline_stages: int = 1,
) -> PlacementSpec:
  """The rollout on devices of its own, the training roles on the rest.

  Generation of the next batch can then overlap training on this one; the actor's weights
  are resharded onto the rollout mesh after every update.

  Args:
    num_devices: devices of the job; at least 2.
    rollout_fraction: share of the devices given to the rollout (rounded to the nearest
      count, at least 1 and leaving at least 1); the rollout takes the last ones.
    rollout_tensor: tensor-parallel size of the rollout.
    tensor: tensor-parallel size of the training roles.
    split_actor_critic: actor and critic on disjoint halves of the training devices.
    split_reference_reward: reference and reward on disjoint halves of the training devices.
    pipeline_stages: pipeline stages of each training role over its own devices.
  """
  if not 0.0 < rollout_fraction < 1.0:
    raise PlacementError(f"placement.rollout_fraction must be in (0, 1), got {rollout_fraction}")
  num_rollout = int(num_devices * rollout_fraction + 0.5)
  if not 1 <= num_rollout <= num_devices - 1:
    raise PlacementError(
      f"disaggregated: rollout_fraction={rollout_fraction} of {num_devices} devices gives "
      f"{num_rollout} rollout devices; need at least 1 for the rollout and 1 for training "
      f"(on {num_devices} device(s) set placement.strategy=colocated)"
    )
  training = _device_range(0, num_devices - num_rollout)
  rollout = _device_range(num_devices - num_rollout, num_devices)
  actor = critic = reference = reward = training
  disjoint = [(role, Role.ROLLOUT) for role in _TRAINING_ROLES]
  if split_actor_critic:
    actor, critic = _halves(training, "disaggregated with split_actor_critic")
    disjoint.append((Role.ACTOR, Role.CRITIC))
  if split_reference_reward:
    reference, reward = _halves(training, "disaggregated with split_reference_reward")
    disjoint.append((Role.REFERENCE, Role.REWARD))
  stages = pipeline_stages
  roles = {
    Role.ACTOR: _training_spec(Role.ACTOR, actor, tensor, stages),
    Role.CRITIC: _training_spec(Role.CRITIC, critic, tensor, stages),
    Role.REFERENCE: _training_spec(Role.REFERENCE, reference, tensor, stages),
    Role.REWARD: _training_spec(Role.REWARD, reward, tensor, stages),
    Role.ROLLOUT: _generation_spec(rollout, rollout_tensor),
  }
  return PlacementSpec(
    strategy="disaggregated", roles=_critic_reversed(roles), disjoint=tuple(disjoint)
  )


def from_explicit(explicit: ExplicitPlacementSection) -> PlacementSpec:
  """The hand-written spec of `placement.explicit`, unchecked (see `check_spec`).

  Every role must be given. Axes are put in the layout's order (devices are listed row-major
  over them), axes left out get size 1 ('stage' is left out of the spec unless given above 1),
  and unknown axis names are kept for `check_spec` to report. Roles that share no `colocate`
  group must use disjoint devices. The devices are taken as written: a critic meant to run its
  stages in the reverse order of the actor's lists its stage blocks reversed itself.
  """
  roles = {}
  for role in Role:
    section = getattr(explicit, role.value)
    if section is None:
      raise PlacementError(
        f"placement.explicit.{role} is not set; an explicit placement needs every role "
        f"({', '.join(Role)})"
      )
    default = Layout.GENERATION if role == Role.ROLLOUT else Layout.TRAINING
    layout_name = section.layout or default.value
    if layout_name not in tuple(Layout):
      raise PlacementError(
        f"placement.explicit.{role}.layout must be one of {', '.join(Layout)}, got {layout_name!r}"
      )
    layout = Layout(layout_name)
    known = LAYOUT_AXES[layout]
    axes = tuple(
      (name, section.axes.get(name, 1))
      for name in known
      if name not in OPTIONAL_AXES or section.axes.get(name, 1) != 1
    )
    axes += tuple((name, size) for name, size in section.axes.items() if name not in known)
    roles[role] = RoleSpec(devices=section.devices, axes=axes, layout=layout)
  for group in explicit.colocate:
    for name in group:
      if name not in tuple(Role):
        raise PlacementError(
          f"placement.explicit.colocate: unknown role {name!r}; roles: {', '.join(Role)}"
        )
  disjoint = tuple(
    (a, b)
    for a, b in itertools.combinations(Role, 2)
    if not any(a in group and b in group for group in explicit.colocate)
  )
  return PlacementSpec(strategy="explicit", roles=roles, disjoint=disjoint)


def _build_colocated(cfg: PlacementSection, num_devices: int) -> PlacementSpec:
  return colocated(
    num_devices,
    tensor=cfg.tensor,
    rollout_tensor=cfg.rollout_tensor,
    pipeline_stages=cfg.pipeline_stages,
  )


def _build_interleaved(cfg: PlacementSection, num_devices: int) -> PlacementSpec:
  return interleaved(
    num_devices,
    split_actor_critic=cfg.split_actor_critic,
    tensor=cfg.tensor,
    rollout_tensor=cfg.rollout_tensor,
    pipeline_stages=cfg.pipeline_stages,
  )


def _build_disaggregated(cfg: PlacementSection, num_devices: int) -> PlacementSpec:
  return disaggregated(
    num_devices,
    rollout_fraction=cfg.rollout_fraction,
    rollout_tensor=cfg.rollout_tensor,
    tensor=cfg.tensor,
    split_actor_critic=cfg.split_actor_critic,
    split_reference_reward=cfg.split_reference_reward,
    pipeline_stages=cfg.pipeline_stages,
  )


def _build_explicit(cfg: PlacementSection, num_devices: int) -> PlacementSpec:
  del num_devices  # the spec names its devices; `check_spec` checks them against the count
  return from_explicit(cfg.explicit)


Variants = Callable[[int, int, int, int | None], Iterable[tuple[str, PlacementSection]]]
"""What the planner's search tries of a strategy: for a job of N devices, a training and a
rollout tensor size (and, when not None, a fixed number of rollout devices), the (label,
config section) of each variant; `rlhfjax.planner.search` ranks what they build."""


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A registered strategy: how it builds a spec, and which variants the planner searches."""

  build: Builder
  variants: Variants


def _tensor_sizes_only(name: str) -> Variants:
  """The variants of a strategy without knobs of its own: one per pair of tensor sizes."""

  def variants(num_devices, tensor, rollout_tensor, rollout_devices):
    del num_devices, rollout_devices
    return [(name, PlacementSection(strategy=name, tensor=tensor, rollout_tensor=rollout_tensor))]

  return variants


def _interleaved_variants(num_devices, tensor, rollout_tensor, rollout_devices):
  del num_devices, rollout_devices
  for split in (False, True):
    label = "interleaved" + (" split_actor_critic" if split else "")
    yield (
      label,
      PlacementSection(
        strategy="interleaved",
        tensor=tensor,
        rollout_tensor=rollout_tensor,
        split_actor_critic=split,
      ),
    )


def rollout_counts(num_devices: int, rollout_tensor: int) -> tuple[int, ...]:
  """Rollout device counts the search tries for `disaggregated`: every count for small jobs,
  sixteenths of the job for large ones; multiples of `rollout_tensor`, leaving one for
  training."""
  if num_devices <= 16:
    counts = range(1, num_devices)
  else:
    counts = {round(num_devices * i / 16) for i in range(1, 16)}
  return tuple(sorted(k for k in counts if k % rollout_tensor == 0 and 0 < k < num_devices))


def _disaggregated_variants(num_devices, tensor, rollout_tensor, rollout_devices):
  counts = (rollout_devices,) if rollout_devices else rollout_counts(num_devices, rollout_tensor)
  for k in counts:
    for split in (False, True):
      yield (
        f"disaggregated rollout={k}" + (" split" if split else ""),
        PlacementSection(
          strategy="disaggregated",
          rollout_fraction=k / num_devices,
          rollout_tensor=rollout_tensor,
          tensor=tensor,
          split_actor_critic=split,
          split_reference_reward=split,
        ),
      )


def _no_variants(num_devices, tensor, rollout_tensor, rollout_devices):
  """`explicit` is the config's own spec: there is nothing to search."""
  del num_devices, tensor, rollout_tensor, rollout_devices
  return ()


_STRATEGIES: dict[str, Strategy] = {
  "colocated": Strategy(_build_colocated, _tensor_sizes_only("colocated")),
  "interleaved": Strategy(_build_interleaved, _interleaved_variants),
  "disaggregated": Strategy(_build_disaggregated, _disaggregated_variants),
  "explicit": Strategy(_build_explicit, _no_variants),
}


def register_strategy(name: str, builder: Builder, variants: Variants | None = None) -> None:
  """Makes `builder` available as `placement.strategy=name`, and to `strategy=auto`'s search:
  with `variants`, the config sections it tries; by default one per pair of tensor sizes."""
  if name in _STRATEGIES:
    raise ValueError(f"placement strategy {name!r} is already registered")
  _STRATEGIES[name] = Strategy(builder, variants or _tensor_sizes_only(name))


def strategy_names() -> tuple[str, ...]:
  """Names accepted by `placement.strategy` (`auto` is resolved by
  `rlhfjax.planner.place.plan_placement`)."""
  return (*_STRATEGIES, "auto")


def searched_strategies() -> tuple[str, ...]:
  """The registered strategies, in registration order, that the planner's search enumerates."""
  return tuple(name for name, s in _STRATEGIES.items() if s.variants is not _no_variants)


def variants(
  name: str,
  num_devices: int,
  *,
  tensor: int,
  rollout_tensor: int,
  rollout_devices: int | None = None,
) -> Iterator[tuple[str, PlacementSpec]]:
  """(label, spec) of every variant of strategy `name` the search tries on `num_devices` (see
  `Variants`); variants that cannot be built there are skipped."""
  strategy = _STRATEGIES[name]
  for label, section in strategy.variants(num_devices, tensor, rollout_tensor, rollout_devices):
    try:
      yield label, strategy.build(section, num_devices)
    except PlacementError:
      continue


def build_placement(placement_cfg: PlacementSection, available_devices: int) -> PlacementSpec:
  """Builds the placement named by `placement_cfg.strategy` and checks its structure.

  Args:
    placement_cfg: the `placement` section of the config.
    available_devices: devices the process sees (`jax.device_count()`).

  Raises:
    PlacementError: unknown strategy, bad device count, or a spec that fails `check_spec`.
  """
  name = placement_cfg.strategy
  if name not in _STRATEGIES:
    known = strategy_names()  # from the registry, `auto` with them
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise PlacementError(
      f"unknown placement strategy {name!r}; {hint}known strategies: {', '.join(known)}"
    )
  num_devices = resolve_num_devices(placement_cfg.num_devices, available_devices)
  extras = placement_cfg.extra_roles
  spec = _STRATEGIES[name].build(placement_cfg, num_devices - own_devices(extras, num_devices))
  spec = with_extra_roles(spec, extras, num_devices, placement_cfg.pipeline_stages)
  if placement_cfg.context > 1:
    spec = with_context(spec, placement_cfg.context)
  check_spec(spec, num_devices)
  return spec


def own_devices(extras: Mapping[str, ExtraPlacementSection], num_devices: int) -> int:
  """Devices the extra roles of `extras` take for their own ('own'), the last ones of the job.

  Raises:
    PlacementError: naming the first extra role for which no device is left (the built-in
      roles keep at least one)."""
  taken = 0
  for name, section in extras.items():
    if section.mode != "own":
      continue
    taken += section.devices
    if taken >= num_devices:
      raise PlacementError(
        f"placement.extra_roles.{name}: no devices left for its {section.devices} device(s) "
        f"of its own: the job has {num_devices} devices, {taken - section.devices} taken by "
        "extra roles before it, and the other roles need at least one; lower its 'devices' or "
        "raise placement.num_devices"
      )
  return taken


def with_extra_roles(
  spec: PlacementSpec,
  extras: Mapping[str, ExtraPlacementSection],
  num_devices: int,
  stages: int = 1,
) -> PlacementSpec:
  """`spec` (the built-in roles, on the first `num_devices - own_devices(...)` devices) with
  every extra role of `extras` placed as its section says, in order (`ExtraPlacementSection`):

  - 'shared': `with_role`'s devices and mesh axes (a generation-layout role's devices in the
    training layout, fsdp over them);
  - 'interleaved': `with_role`'s devices split into halves, each half with its axes resized
    (fsdp takes what `with_role`'s tensor and stages leave); `with_role` keeps the first, the
    extra role takes the second, and the two are a disjoint pair;
  - 'own': the next devices of its own from the end of the job (`stages` pipeline stages over
    them, its `tensor`), disjoint from every other role.

  Raises:
    PlacementError: one line naming the extra role with no devices left (an 'own' role past
      the job's devices, an 'interleaved' one whose `with_role` has one device or an odd
      number), or whose sizes do not divide its devices.
  """
  roles, disjoint = dict(spec.roles), list(spec.disjoint)
  end = num_devices
  for name, section in extras.items():
    where = f"placement.extra_roles.{name}"
    if section.mode == "own":
      start = end - section.devices
      if start < 1:
        own_devices(extras, num_devices)  # raises, naming the role
      devices, end = tuple(range(start, end)), start
      try:
        roles[name] = _training_spec(name, devices, section.tensor, stages)
      except PlacementError as e:
        raise PlacementError(f"{where}: {e}") from None
      disjoint += [(other, name) for other in roles if other != name]
      continue
    host = roles[section.with_role]
    if host.layout != Layout.TRAINING:
      host = RoleSpec.training(host.devices, fsdp=len(host.devices))
    if section.mode == "shared":
      roles[name] = host
      continue
    if len(host.devices) < 2 or len(host.devices) % 2:
      raise PlacementError(
        f"{where}: no devices left to interleave with {section.with_role}, which has "
        f"{len(host.devices)} device(s); 'interleaved' splits them into two equal halves"
      )
    first, second = _halves(host.devices, where)
    sizes = {a: host.axis_size(a) for a in ("stage", "context", "tensor")}
    kept, mine = (_resized(dataclasses.replace(host, devices=d), **sizes) for d in (first, second))
    if kept is None or mine is None:
      raise PlacementError(
        f"{where}: half of {section.with_role}'s {len(host.devices)} devices does not hold its "
        f"mesh {dict(host.axes)}"
      )
    roles[section.with_role], roles[name] = kept, mine
    disjoint.append((section.with_role, name))
  return dataclasses.replace(spec, roles=roles, disjoint=tuple(disjoint))


def with_context(spec: PlacementSpec, context: int) -> PlacementSpec:
  """`spec` with every training-layout role's fsdp axis split into fsdp x context (the same
  devices in the same order: 'context' follows 'fsdp' in the layout's axes).

  Raises:
    PlacementError: `context` does not divide a role's fsdp size."""
  roles = {}
  for role, role_spec in spec.roles.items():
    if role_spec.layout != Layout.TRAINING:
      roles[role] = role_spec
      continue
    fsdp = role_spec.axis_size("fsdp")
    if fsdp % context:
      tensor = role_spec.axis_size("tensor")
      groups = f" ({fsdp} fsdp groups of placement.tensor={tensor})" if tensor > 1 else ""
      raise PlacementError(
        f"{role}: placement.context={context} does not divide its {len(role_spec.devices)} "
        f"devices{groups}; set placement.context to one of {_divisors(fsdp)}"
      )
    roles[role] = _resized(role_spec, context=context)
  return dataclasses.replace(spec, roles=roles)


def _resized(role_spec: RoleSpec, **sizes: int) -> RoleSpec | None:
  """`role_spec` (training layout) with the given axis sizes (of 'stage', 'data', 'context',
  'tensor') changed and fsdp taking the devices left, in the layout's axis order; None when
  the sizes do not divide its devices."""
  old = dict(role_spec.axes)
  kept = {a: sizes.get(a, old.get(a, 1)) for a in ("stage", "data", "context", "tensor")}
  fsdp, left = divmod(len(role_spec.devices), math.prod(kept.values()))
  if fsdp < 1 or left:
    return None
  return RoleSpec.training(role_spec.devices, fsdp=fsdp, **kept)


def with_role_mesh(
  spec: PlacementSpec, role: Role, *, tensor: int | None = None, data: int | None = None
) -> PlacementSpec:
  """`spec` with one training-layout role's `tensor` or `data` size changed on its own devices
  (fsdp takes what is left; its stages and context kept): one role's parallelism of its own,
  as ChatLearn gives each model.

  Raises:
    PlacementError: the sizes do not divide the role's devices."""
  role_spec = spec[role]
  changes = {a: size for a, size in (("tensor", tensor), ("data", data)) if size is not None}
  resized = _resized(role_spec, **changes)
  if resized is None:
    axes = dict(role_spec.axes)
    raise PlacementError(
      f"{role}: tensor={changes.get('tensor', axes.get('tensor', 1))} x "
      f"data={changes.get('data', axes.get('data', 1))} does not divide its "
      f"{len(role_spec.devices)} devices"
    )
  return dataclasses.replace(spec, roles={**spec.roles, role: resized})


def with_stages(spec: PlacementSpec, stages: int) -> PlacementSpec:
  """`spec` with every training-layout role's fsdp axis split into stage x fsdp (the same
  devices in the same order: 'stage' is outermost, so stage j holds the j-th contiguous block),
  the critic's stages reversed where it shares the actor's devices and mesh, as
  `placement.pipeline_stages` places them.

  Raises:
    PlacementError: `stages` does not divide a role's fsdp size, or a role already has stages
      or a context axis."""
  roles = {}
  for role, role_spec in spec.roles.items():
    if role_spec.layout != Layout.TRAINING:
      roles[role] = role_spec
      continue
    sizes = dict(role_spec.axes)
    if sizes.get("stage", 1) > 1 or sizes.get("context", 1) > 1:
      raise PlacementError(f"{role}: already split over {role_spec.axis_names}")
    fsdp = sizes.get("fsdp", 1)
    if fsdp % stages:
      raise PlacementError(
        f"{role}: placement.pipeline_stages={stages} does not divide its {fsdp} fsdp "
        f"devices; set placement.pipeline_stages to one of {_divisors(fsdp)}"
      )
    roles[role] = _resized(role_spec, stage=stages)
  if Role.ACTOR in roles and Role.CRITIC in roles:
    roles = _critic_reversed(roles)
  return dataclasses.replace(spec, roles=roles)


def _device_range(start: int, stop: int) -> tuple[int, ...]:
  if stop <= start:
    raise PlacementError(f"placement.num_devices must be >= 1, got {stop - start}")
  return tuple(range(start, stop))


def _halves(devices: Sequence[int], what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  if len(devices) < 2 or len(devices) % 2:
    raise PlacementError(
      f"{what} splits {len(devices)} devices into two halves; needs an even number "
      f"(on {len(devices)} device(s) set placement.strategy=colocated)"
    )
  half = len(devices) // 2
  return tuple(devices[:half]), tuple(devices[half:])


def _divisors(n: int) -> str:
  """The sizes a mesh axis over `n` devices can take, as 'a, b or c' for a message."""
  sizes = [str(d) for d in range(1, n + 1) if n % d == 0]
  return sizes[0] if len(sizes) == 1 else f"{', '.join(sizes[:-1])} or {sizes[-1]}"


def _check_tensor(who: str, field: str, devices: tuple[int, ...], tensor: int) -> None:
  """`placement.<field>` (the tensor-parallel size of `who`) must divide its device count."""
  if tensor < 1 or len(devices) % tensor:
    raise PlacementError(
      f"{who}: placement.{field}={tensor} does not divide its {len(devices)} devices; "
      f"set placement.{field} to one of {_divisors(len(devices))}"
    )


def _training_spec(role: Role, devices: tuple[int, ...], tensor: int, stages: int = 1) -> RoleSpec:
  """stage x fsdp x tensor over `devices` (no 'stage' axis when `stages` is 1)."""
  _check_tensor(role, "tensor", devices, tensor)
  per_stage = len(devices) // tensor
  if stages < 1 or per_stage % stages:
    groups = f" ({per_stage} tensor groups of placement.tensor={tensor})" if tensor > 1 else ""
    raise PlacementError(
      f"{role}: placement.pipeline_stages={stages} does not divide its {len(devices)} "
      f"devices{groups}; set placement.pipeline_stages to one of {_divisors(per_stage)}"
    )
  return RoleSpec.training(devices, stage=stages, fsdp=per_stage // stages, tensor=tensor)


def reverse_stages(spec: RoleSpec) -> RoleSpec:
  """`spec` with its 'stage' axis reversed: stage j on the devices of stage P - 1 - j.

  The devices are row-major over the axes with 'stage' outermost, so stage j's devices are the
  j-th of P equal contiguous blocks, and flipping the axis lists the blocks in reverse order
  (the devices within a block keep their order: the same fsdp x tensor grid on every stage).
  """
  stages = spec.stages
  if stages > 1 and spec.axis_names[0] != "stage":
    raise PlacementError(f"the 'stage' axis of {spec.axis_names} is not the outermost")
  block = len(spec.devices) // stages
  blocks = [spec.devices[j * block : (j + 1) * block] for j in range(stages)]
  return dataclasses.replace(spec, devices=tuple(d for b in reversed(blocks) for d in b))


def _critic_reversed(roles: dict[Role, RoleSpec]) -> dict[Role, RoleSpec]:
  """`roles` with the critic's stages reversed when it is pipelined on exactly the actor's
  devices.

  The fused actor-critic schedule (`rlhfjax.schedules.fused`, RLHFuse) runs the critic's
  pipeline in the reverse device order: the critic's first stage sits where the actor's last
  one does, so the critic's warm-up fills the actor's drain and the other way round. Listing
  the critic's devices with the stage axis flipped makes that the mesh itself, so a step
  pipelines each model over its own mesh in plain stage order. The device *set* is unchanged:
  everything that asks whether two roles share devices still sees them co-located.
  """
  actor, critic = roles[Role.ACTOR], roles[Role.CRITIC]
  if critic.stages > 1 and critic.devices == actor.devices and critic.axes == actor.axes:
    roles = {**roles, Role.CRITIC: reverse_stages(critic)}
  return roles


def _generation_spec(devices: tuple[int, ...], tensor: int) -> RoleSpec:
  _check_tensor("rollout", "rollout_tensor", devices, tensor)
  return RoleSpec(
    devices=devices,
    axes=(("data", len(devices) // tensor), ("tensor", tensor)),
    layout=Layout.GENERATION,
  )
