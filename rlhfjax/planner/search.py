"""Search: enumerate placements for N devices, drop those that do not fit, rank by time.

Candidates: the variants of every registered strategy (`rlhfjax.placement.strategies`:
co-located; interleaved with and without actor and critic split; disaggregated over a range of
rollout device counts, with and without the training roles split; and any strategy added with
`register_strategy`), each with the tensor sizes that divide every model's heads (within a
node), and each with the micro-batch sizes of `MICRO_BATCHES`; a candidate that fits with none
of them is tried with each row split over 2, 4, ... of its fsdp devices (context parallelism,
`CONTEXT_SIZES`), the smallest split that fits kept; one that still does not fit, or whose
training roles span nodes, with its training roles' layers split into 2, 4 or 8 pipeline stages
(`STAGE_SIZES`, over their fsdp devices; not for a packing run of a flow whose packed updates do
not run through stages, `Pricing.packed_pipelines`), the fastest kept. A run that fuses the
actor's and critic's updates (`fuse_actor_critic`) gets only placements that pipeline both on
the same devices, at every stage count. The best `REFINED` placements are then tried with
per-role parallelism (`per_role_variants`: a scoring role's own tensor size, the trained roles'
data-parallel size), as ChatLearn sizes each model. Plans that do not fit memory stay in the
result, last, with the reason.

Only the roles the workload has are placed (`present_roles`: no critic for critic-free
algorithms, no reward model for a rule reward, no rollout for DPO); a candidate that then
leaves devices idle is dropped, and candidates that become the same placement are one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from rlhfjax.config import ExtraPlacementSection
from rlhfjax.costmodel.efficiency import Efficiency
from rlhfjax.costmodel.hardware import Hardware
from rlhfjax.costmodel.workload import Workload
from rlhfjax.placement import strategies
from rlhfjax.placement.spec import Layout, PlacementSpec, Role
from rlhfjax.planner.evaluate import Plan, evaluate, present_roles
from rlhfjax.planner.evaluate import fused as evaluate_fused

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def tensor_sizes(workload: Workload, limit: int) -> tuple[int, ...]:
  """Tensor-parallel sizes up to `limit` that divide every present model's heads."""
  models = [m for m in (workload.actor, workload.critic, workload.reward, workload.reference) if m]
  sizes = []
  t = 1
  while t <= limit:
    if all(m.num_heads % t == 0 and m.num_kv_heads % t == 0 for m in models):
      sizes.append(t)
    t *= 2
  return tuple(sizes)


def candidates(
  num_devices: int,
  workload: Workload,
  *,
  strategy: str = "auto",
  rollout_devices: int | None = None,
  max_tensor: int = 8,
  extras: Mapping[str, ExtraPlacementSection] | None = None,
) -> Iterator[tuple[str, PlacementSpec]]:
  """(label, spec) of every placement considered; specs that cannot be built are skipped.
  `extras`: where the extra roles go in each (`strategies.with_extra_roles`; the strategies
  place the others on the devices their own devices leave).

  Raises:
    PlacementError: an extra role with no devices left."""
  extras = extras or {}
  own = strategies.own_devices(extras, num_devices)
  searched = strategies.searched_strategies()
  names = searched if strategy == "auto" else (strategy,)
  if strategy not in (*searched, "auto"):
    raise ValueError(f"unknown strategy {strategy!r}; use auto, {', '.join(searched)}")
  tensors = tensor_sizes(workload, min(max_tensor, num_devices))
  roles = present_roles(workload)
  seen = set()
  for name in names:
    for t in tensors:
      for rt in tensors:
        variants = strategies.variants(
          name, num_devices - own, tensor=t, rollout_tensor=rt, rollout_devices=rollout_devices
        )
        for label, spec in variants:
          try:
            spec = strategies.with_extra_roles(spec, extras, num_devices)
          except strategies.PlacementError:
            continue
          label, spec = f"{label} t={t} rt={rt}", spec.only(roles)
          key = tuple((r, s.devices, s.axes) for r, s in spec.roles.items())
          if len(spec.devices) < num_devices or key in seen:
            continue  # devices left idle by absent roles, or a placement already listed
          seen.add(key)
          yield label, spec


CONTEXT_SIZES = (2, 4, 8, 16)
"""Context-parallel sizes the search tries on a placement that does not fit without."""

STAGE_SIZES = (2, 4, 8)
"""Pipeline stage counts the search tries on a placement whose models do not fit without, or
whose training roles span nodes (where FSDP's gathers cross the slower network)."""


def context_sizes(spec: PlacementSpec, workload: Workload) -> tuple[int, ...]:
  """The `CONTEXT_SIZES` that split every training-layout role's fsdp devices and its rows'
  tokens (`workload.seq_len`), for a placement without pipeline stages."""
  trained = [s for s in spec.roles.values() if s.layout == Layout.TRAINING]
  if not trained or any(s.stages > 1 for s in trained):
    return ()
  return tuple(
    size
    for size in CONTEXT_SIZES
    if workload.seq_len % size == 0 and all(s.axis_size("fsdp") % size == 0 for s in trained)
  )


def stage_sizes(
  spec: PlacementSpec, workload: Workload, *, one_device: bool = False
) -> tuple[int, ...]:
  """The `STAGE_SIZES` that split every training-layout role's fsdp devices and every model's
  layers, for a run that does not pack or whose flow's packed updates run through stages
  (`Pricing.packed_pipelines`), and a placement without stages or a context axis.

  `one_device`: only sizes that leave one device a stage (a CPU host, `Hardware.host_shared`,
  where XLA's runtime can hang a collective inside a stage: `rlhfjax.cluster.cluster._alone`)."""
  trained = [s for s in spec.roles.values() if s.layout == Layout.TRAINING]
  if (workload.packed and not workload.pricing.packed_pipelines) or not trained:
    return ()
  if any(s.stages > 1 or s.axis_size("context") > 1 for s in trained):
    return ()
  models = [m for m in (workload.actor, workload.critic, workload.reward, workload.reference) if m]
  return tuple(
    size
    for size in STAGE_SIZES
    if all(m.num_layers % size == 0 for m in models)
    and all(s.axis_size("fsdp") % size == 0 for s in trained)
    and (not one_device or all(len(s.devices) == size for s in trained))
  )


def _spans_nodes(spec: PlacementSpec, per_node: int) -> bool:
  """Some training-layout role's devices are on more than one node."""
  return any(
    len({d // per_node for d in s.devices}) > 1
    for s in spec.roles.values()
    if s.layout == Layout.TRAINING
  )


def search(
  workload: Workload,
  hw: Hardware,
  eff: Efficiency,
  num_devices: int,
  *,
  strategy: str = "auto",
  rollout_devices: int | None = None,
  async_rollout: bool = False,
  micro_batches: Sequence[int] = MICRO_BATCHES,
  devices_per_node: int | None = None,
  extras: Mapping[str, ExtraPlacementSection] | None = None,
) -> list[Plan]:
  """Every candidate's best micro-batch, ranked: fitting plans by iteration time, then the
  rest by how far over memory they are; `extras` places the extra roles (`candidates`)."""
  if num_devices < 1:
    raise ValueError(f"devices must be >= 1, got {num_devices}")
  per_node = devices_per_node or hw.devices_per_node
  plans = []

  def best_of(label: str, spec: PlacementSpec) -> Plan:
    best = None
    mbs = (workload.micro_batch,) if workload.micro_batch else micro_batches
    if workload.train_rows:
      mbs = (0,)  # fixed by train_rows
    for mb in sorted(mbs, reverse=True):
      plan = evaluate(
        spec,
        workload,
        hw,
        eff,
        micro_batch=mb,
        async_rollout=async_rollout,
        label=label,
        devices_per_node=per_node,
      )
      if best is None or _key(plan) < _key(best):
        best = plan
      if plan.fits:
        break  # smaller micro-batches only add collectives and overhead
    return best

  fuse = bool(
    workload.fuse_actor_critic and workload.trained("actor") and workload.trained("critic")
  )
  for label, spec in candidates(
    num_devices,
    workload,
    strategy=strategy,
    rollout_devices=rollout_devices,
    max_tensor=min(8, per_node),
    extras=extras,
  ):
    if fuse:
      # The run fuses the actor's and critic's updates: only a placement that pipelines both
      # on the same devices can run it, so every stage count is tried and nothing else kept.
      fused = [
        best_of(f"{label} pp={size} fused", staged)
        for size in stage_sizes(spec, workload, one_device=hw.host_shared)
        if evaluate_fused(staged := strategies.with_stages(spec, size), workload)
      ]
      if fused:
        plans.append(min(fused, key=_key))
      continue
    best = best_of(label, spec)
    # Sequences too long for one device's share of the rows: split each row over the fewest
    # devices (context parallelism) that makes it fit.
    for size in context_sizes(spec, workload) if not best.fits else ():
      plan = best_of(f"{label} cp={size}", strategies.with_context(spec, size))
      if plan.fits:
        best = plan
        break
    # Models too large for the devices' memory, or training that gathers across nodes: split
    # the layers into pipeline stages, keeping the fastest plan that fits.
    if not best.fits or _spans_nodes(spec, per_node):
      for size in stage_sizes(spec, workload, one_device=hw.host_shared):
        plan = best_of(f"{label} pp={size}", strategies.with_stages(spec, size))
        if _key(plan) < _key(best):
          best = plan
    plans.append(best)
  plans.sort(key=_key)
  # Each model its own parallelism (ChatLearn's per-model sizes): the best placements tried
  # with a scoring role's tensor size, or the trained roles' data-parallel size, changed.
  tensors = tensor_sizes(workload, min(8, per_node, num_devices))
  for i, plan in enumerate(plans[:REFINED]):
    if not plan.fits:
      break
    for label, spec in per_role_variants(plan, workload, tensors, fuse):
      other = best_of(label, spec)
      if _key(other) < _key(plans[i]):
        plans[i] = other
  plans.sort(key=_key)
  return plans


REFINED = 8
"""The best placements the search tries with per-role parallelism (`per_role_variants`)."""


def per_role_variants(
  plan: Plan, workload: Workload, tensors: Sequence[int], fused: bool
) -> Iterator[tuple[str, PlacementSpec]]:
  """`plan`'s placement with one scoring role's (reference, reward) tensor size changed, or
  the trained roles' (actor and critic together, not when fused) data-parallel size: every
  such spec whose sizes divide the roles' devices."""
  spec = plan.spec
  for role in (Role.REFERENCE, Role.REWARD):
    if role not in spec.roles or spec[role].layout != Layout.TRAINING:
      continue
    if role == Role.REFERENCE and workload.reference_from_base:
      continue  # it scores on the actor's devices and mesh
    for t in tensors:
      if t == spec[role].axis_size("tensor"):
        continue
      try:
        yield f"{plan.label} {_SHORT[role]}t={t}", strategies.with_role_mesh(spec, role, tensor=t)
      except strategies.PlacementError:
        continue
  if fused:
    return
  trained = [r for r in (Role.ACTOR, Role.CRITIC) if r in spec.roles]
  for data in (2, 4, 8):
    try:
      varied = spec
      for role in trained:
        varied = strategies.with_role_mesh(varied, role, data=data)
    except strategies.PlacementError:
      continue
    yield f"{plan.label} d={data}", varied


_SHORT = {Role.REFERENCE: "ref", Role.REWARD: "rw"}


def _key(plan: Plan) -> tuple:
  return (not plan.fits, plan.peak_memory_gib if not plan.fits else plan.iteration_s)


def explain(plans: Sequence[Plan]) -> str:
  """A short reason for the winner against the best plan of each other strategy."""
  fitting = [p for p in plans if p.fits]
  if not fitting:
    return f"no placement fits memory; closest: {plans[0].label}: {plans[0].why_not}"
  best = fitting[0]
  dominant = max(best.stages, key=best.stages.get)
  parts = [
    f"{best.label} wins at {best.iteration_s:.1f} s/iteration "
    f"({dominant} dominates at {best.stages[dominant]:.1f} s)"
  ]
  for name in strategies.searched_strategies():
    other = next((p for p in fitting if p.spec.strategy == name and p is not best), None)
    if other is not None and other.spec.strategy != best.spec.strategy:
      ratio = other.iteration_s / best.iteration_s
      parts.append(f"best {name} is {ratio:.2f}x slower ({other.iteration_s:.1f} s)")
  dropped = sum(not p.fits for p in plans)
  if dropped:
    parts.append(f"{dropped} candidates do not fit memory")
  return "; ".join(parts) + "\n" + searched(plans)


def searched(plans: Sequence[Plan]) -> str:
  """One line: the space the plans came from (strategies, the parallelism sizes the search
  chooses, micro-batches) and the best plan with pipeline stages."""
  sizes: dict[str, set[int]] = {name: set() for name in _SEARCHED_AXES}
  for plan in plans:
    for spec in plan.spec.roles.values():
      for axis, size in spec.axes:
        key = f"rollout {axis}" if spec.layout == Layout.GENERATION else axis
        if key in sizes:
          sizes[key].add(size)
  axes = ", ".join(
    f"{name} {'/'.join(str(v) for v in sorted(values | {1}))}" for name, values in sizes.items()
  )
  micro = "/".join(str(m) for m in sorted({p.micro_batch for p in plans}))
  staged = [p for p in plans if any(s.stages > 1 for s in p.spec.roles.values())]
  line = (
    f"searched: {len(plans)} placements ({', '.join(sorted({p.spec.strategy for p in plans}))});"
    f" {axes}; micro-batches {micro}; the best {REFINED} with per-role tensor and data sizes"
  )
  fitting = [p for p in plans if p.fits]
  best_staged = next((p for p in staged if p.fits), None)
  if best_staged is None:
    return line + f"; {len(staged)} with pipeline stages, none fits"
  if best_staged is fitting[0]:
    return line + f"; {len(staged)} with pipeline stages, the winner among them"
  ratio = best_staged.iteration_s / fitting[0].iteration_s
  return line + (
    f"; {len(staged)} with pipeline stages, the best {best_staged.label} {ratio:.2f}x slower"
  )


_SEARCHED_AXES = ("tensor", "rollout tensor", "stage", "context")
"""The sizes the search varies (fsdp and data take the devices left)."""
