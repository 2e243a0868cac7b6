"""Pipeline-parallel train steps: a schedule table (`rlhfjax.schedules`) run over the `stage` axis.

Letters: m micro-batches, b rows of a micro-batch, s sequence length, d hidden, p stages,
T ticks, A / G activation / gradient slots.

A model's stacked layers `[l, ...]` are split over the `stage` mesh axis in p contiguous
blocks (the 'layers' rule), so the device at stage position `i` holds the layers of one stage
of each model. The embedding's and the LM head's vocabulary are split over the stages too (the
'vocab' rule): between steps each stage keeps 1/p of them and of their optimizer state; the
step gathers them whole (the first stage looks the tokens up, the last runs the head; the final
norm is small and whole everywhere) and reduce-scatters their gradients over the stages, each
stage keeping the sum of the blocks it holds. (One SPMD program
gives every stage's shard one shape: an embedding kept by the first stage alone would leave a
block of its size on every other stage; split, each keeps 1/p.) One compiled program runs a
whole `Schedule`, a `lax.scan` over its ticks inside a `shard_map` that is manual over `stage`
only, so each stage's compute stays auto-sharded over its `data` / `fsdp` / `tensor` devices.
Each tick every stage looks up its op in the table and runs it (`lax.switch`), then two
`ppermute`s move one message up and one down the stages: a forward's output to the next stage,
a backward's input gradient to the previous one. Arrivals wait in buffer slots
(`schedules.slots`) until their op runs.

Forward and backward of a stage call the model's own loss function with the layer stack
replaced by the stage's block (`models.transformer.layers_replaced`): the first stage's block
reads the embedded tokens, the others read the activation that arrived, and only the last
stage's loss is used. A forward takes the stage's vector-Jacobian product and keeps what its
pullback needs (the residuals the model's remat policy saves; weights and the micro-batch are
not copied, the backward finds them again) in a residual slot until the backward, which
applies the pullback to the gradient that arrived, or to the loss on the last stage: the
stage's forward is not run again, as Megatron's schedules do. `Model.recompute` keeps only the
stage's input instead and runs the forward again in the backward (GPipe's
re-materialisation): one micro-batch's residuals at a time, for one more forward.

Gradients (of the trained leaves: with LoRA the adapters and a value head, `models.lora.split`)
are summed per stage over the micro-batches in micro-batch order, as
`steps.accumulate_and_apply`'s scan sums them, then averaged; the parameters outside the layer
stack are summed over the stages (each stage adds only what it used; the vocabulary's blocks
reduce-scattered, the rest all-reduced). A non-finite loss on the
last stage poisons every stage's gradients, so the optimizer skips the update as unpipelined.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from rlhfjax import schedules
from rlhfjax.config.model import ModelConfig
from rlhfjax.mesh import rules
from rlhfjax.models import head_kind, lora, transformer
from rlhfjax.placement.spec import Layout
from rlhfjax.training import steps
from rlhfjax.training.state import TrainState

AXIS = "stage"

# Ops a stage runs, by its place in the model's pipeline (the branch of `lax.switch` is
# 1 + model * len(_OPS) + op; 0 idles).
_OPS = (
  "forward_first",
  "forward_mid",
  "forward_last",
  "backward_first",
  "backward_mid",
  "backward_last",
)
_FIELDS = 9
"""Columns of the executor's table: branch, micro-batch, activation slot, gradient slot, then
(kind, slot) of the message from the stage below and of the one from above (kind 0: none,
1 + 2 * model: an activation, 2 + 2 * model: a gradient), then the residual slot."""


@dataclasses.dataclass(frozen=True)
class Model:
  """One model the schedule trains: its hyper-parameters and the loss of one micro-batch."""

  config: ModelConfig
  loss_fn: steps.LossFn
  recompute: bool = False
  """Stash only each stage's input and run the stage's forward again in its backward (GPipe's
  re-materialisation, `placement.pipeline_recompute`): one micro-batch's residuals live at a
  time instead of one per micro-batch in flight, for one more forward per backward."""


def stages_of(mesh: Mesh) -> int:
  """The size of `mesh`'s `stage` axis (1 without one)."""
  return dict(mesh.shape).get(AXIS, 1)


def executor_table(
  schedule: schedules.Schedule, slots: schedules.Slots | None = None
) -> np.ndarray:
  """`[T, p, _FIELDS]` int32: what every stage does and receives at every tick (`slots`: the
  schedule's, `schedules.slots`, when the caller has them)."""
  p = schedule.stages
  if p < 2:
    raise ValueError(f"a pipelined step needs at least 2 stages, got {p}")
  slots = schedules.slots(schedule) if slots is None else slots
  table = np.zeros((schedule.ticks, p, _FIELDS), np.int32)
  for op in schedule.ops:
    stage = schedule.stage_of(op.model, op.device)
    place = "first" if stage == 0 else "last" if stage == p - 1 else "mid"
    kind = "forward" if op.kind == schedules.FORWARD else "backward"
    key = (op.model, op.micro, op.device)
    row = table[op.tick, op.device]
    row[0] = 1 + op.model * len(_OPS) + _OPS.index(f"{kind}_{place}")
    row[1] = op.micro
    row[2] = slots.activation.get(key, 0)
    row[3] = slots.gradient.get(key, 0)
    row[8] = slots.residual.get(key, 0)
    # Where this op's output goes: a forward's to the next stage, a backward's to the previous.
    if op.kind == schedules.FORWARD and stage < p - 1:
      to, code = schedule.device_of(op.model, stage + 1), 1 + 2 * op.model
      slot = slots.activation[(op.model, op.micro, to)]
    elif op.kind == schedules.BACKWARD and stage > 0:
      to, code = schedule.device_of(op.model, stage - 1), 2 + 2 * op.model
      slot = slots.gradient[(op.model, op.micro, to)]
    else:
      continue
    receiver = table[op.tick, to]
    column = 4 if to == op.device + 1 else 6  # from below (sent up) or from above (sent down)
    receiver[column], receiver[column + 1] = code, slot
  return table


def _read(buffer: jax.Array, slot: jax.Array) -> jax.Array:
  """`buffer[slot]`, the slot clamped into range as `lax.dynamic_update_index_in_dim` clamps
  it: a buffer an op does not use has its slot read and written back unchanged."""
  return jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)


def _split(params: Any) -> tuple[Any, Any]:
  """(the stacked layers, everything else) of a model's parameters."""
  rest = {name: value for name, value in params.items() if name != "layers"}
  return params["layers"], rest


def _param_specs(params: Any) -> Any:
  """Layers split over the stages along their stacking axis, the rest whole on every stage."""
  layers, rest = _split(params)
  specs = jax.tree.map(lambda _: PartitionSpec(), rest)
  specs["layers"] = jax.tree.map(lambda _: PartitionSpec(AXIS), layers)
  return specs


@dataclasses.dataclass(frozen=True)
class _StageSplit:
  """Where the training layout splits a leaf over `stage`."""

  dim: int
  names: tuple[str, ...]
  """The mesh axes of that dim, major first (the order of its blocks)."""
  spec: PartitionSpec
  """The leaf's whole spec."""


def _stage_split_leaves(config: ModelConfig, params: Any, mesh: Mesh) -> list[_StageSplit | None]:
  """Per leaf of `params`' rest (`_split`, in `jax.tree.leaves` order): where the training
  layout splits the leaf over `stage` (the vocabulary of the embedding and the head,
  `rlhfjax.mesh.rules`), else None."""
  _, rest_axes = _split(transformer.logical_axes(config, head_kind(params)))
  _, rest = _split(params)

  def where(sharding) -> _StageSplit | None:
    for dim, entry in enumerate(sharding.spec):
      names = (entry,) if isinstance(entry, str) else tuple(entry or ())
      if AXIS in names:
        return _StageSplit(dim, names, sharding.spec)
    return None

  shardings = rules.named_shardings(rest_axes, rest, mesh, Layout.TRAINING)
  return [where(sharding) for sharding in jax.tree.leaves(shardings)]


def _reverse_stage_blocks(rest: Any, split: list, mesh: Mesh) -> Any:
  """`rest` with the blocks of each stage-split leaf (`_stage_split_leaves`) in the reverse
  stage order: a model laid out with its stages reversed and viewed on the schedule's mesh
  (`rlhfjax.mesh.sharing.view_on`) reads its vocabulary in reversed blocks; this reads it in
  order (and, applied again, turns gradients back into the view's order)."""
  sizes = dict(mesh.shape)

  def one(x, where):
    if where is None or x is None:  # (a frozen leaf's place in a gradient tree)
      return x
    dim, names = where.dim, where.names
    split_sizes = [sizes[n] for n in names]
    inner = x.shape[dim] // int(np.prod(split_sizes))
    blocks = x.reshape(*x.shape[:dim], *split_sizes, inner, *x.shape[dim + 1 :])
    return jnp.flip(blocks, axis=dim + names.index(AXIS)).reshape(x.shape)

  leaves, treedef = jax.tree.flatten(rest, is_leaf=lambda x: x is None)
  return jax.tree.unflatten(treedef, [one(x, w) for x, w in zip(leaves, split, strict=True)])


def _sum_over_stages(rest: Any, split: list, mesh: Mesh) -> Any:
  """`rest`'s gradients (each stage's own, a frozen leaf None) summed over the stages: a leaf
  the training layout splits over them (`_stage_split_leaves`: the vocabulary) is
  reduce-scattered, each device summing only its own shard and keeping the block it holds
  (on 2 stages with tensor parallelism 2, a third of the all-reduces' bytes); the others are
  all-reduced. The vocabulary's dim `[n]`, split over mesh axes `(ahead...,
  stage, behind...)`, comes out as `[before, n / before / p]` on each stage (`before`: the
  product of the axes ahead), which `_summed_specs` joins over the stages."""
  sizes = dict(mesh.shape)
  # The scatter runs on each device's own shard: manual over the other axes too (in a
  # `shard_map` manual over `stage` alone, XLA gathers the operand over them first).
  others = {n for n in mesh.axis_names if n != AXIS}

  def one(x, where):
    if x is None:
      return x
    if where is None:
      return jax.lax.psum(x, AXIS)
    dim, i = where.dim, where.names.index(AXIS)
    ahead, behind = where.names[:i] or None, where.names[i + 1 :] or None
    entries = (*where.spec, *[None] * (x.ndim - len(where.spec)))
    spec = PartitionSpec(*entries[:dim], ahead, None, behind, *entries[dim + 1 :])
    before = int(np.prod([sizes[n] for n in ahead or ()]))
    blocks = x.reshape(*x.shape[:dim], before, sizes[AXIS], -1, *x.shape[dim + 1 :])
    scatter = functools.partial(
      jax.lax.psum_scatter, axis_name=AXIS, scatter_dimension=dim + 1, tiled=True
    )
    mine = (
      scatter(blocks)
      if not others
      else jax.shard_map(
        scatter,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=spec,
        out_specs=spec,
        axis_names=others,
        check_vma=False,
      )(blocks)
    )
    return mine.reshape(*x.shape[:dim], before, -1, *x.shape[dim + 1 :])

  leaves, treedef = jax.tree.flatten(rest, is_leaf=lambda x: x is None)
  return jax.tree.unflatten(treedef, [one(x, w) for x, w in zip(leaves, split, strict=True)])


def _summed_specs(rest: Any, split: list) -> Any:
  """The `shard_map` out-specs of `_sum_over_stages(rest, split, ...)`: a reduce-scattered
  leaf's stage blocks joined along the dim after `before`, the others whole on every stage."""

  def one(x, where):
    if x is None:
      return None
    return PartitionSpec() if where is None else PartitionSpec(*[None] * (where.dim + 1), AXIS)

  leaves, treedef = jax.tree.flatten(rest, is_leaf=lambda x: x is None)
  return jax.tree.unflatten(treedef, [one(x, w) for x, w in zip(leaves, split, strict=True)])


def _rules_without_stage(flax_rules) -> tuple:
  """The caller's logical axis rules with the (manual) `stage` axis left out."""
  return tuple(
    (name, tuple(a for a in (axes or ()) if a != AXIS) or None) for name, axes in flax_rules
  )


def _run_stage(config: ModelConfig, fn: Any, place: str, rest, block, x_in, *args):
  """`(output activation, fn(rest, *args))` of the stage holding `block`: `fn` run with the
  model's layer stack replaced by the block, which reads the embedded tokens on the first
  stage and `x_in` on the others (see the module docstring)."""
  out = {}

  def layers(x_btd, positions_bt, mask):
    x_btd = x_btd if place == "first" else x_in.astype(x_btd.dtype)
    out["x"] = transformer.apply_layers(config, block, x_btd, positions_bt, mask)
    return out["x"]

  with transformer.layers_replaced(layers):
    y = fn(rest, *args)
  return out["x"], y


def _stage_forward(model: Model, place: str, rest, block, x_in, micro):
  """`(output activation, loss, metrics)` of the model's stage holding `block`."""
  x, (loss, metrics) = _run_stage(model.config, model.loss_fn, place, rest, block, x_in, micro)
  return x, loss, metrics


def _stage_vjp(model: Model, place: str, trained, frozen, x_in, micro):
  """`(output, metrics, pullback)` of a stage's forward: its output activation, or the loss on
  the last stage (then with the loss's metrics), and the pullback to the trained halves
  `(rest, block)` of its parameters (`models.lora.split`) and to `x_in`."""
  (rest_f, block_f) = frozen

  def out(rest_t, block_t, x):
    joined = (lora.join(rest_t, rest_f), lora.join(block_t, block_f))
    y, loss, metrics = _stage_forward(model, place, *joined, x, micro)
    return (loss, metrics) if place == "last" else (y, None)

  y, pull, metrics = jax.vjp(out, *trained, x_in, has_aux=True)
  return y, metrics, pull


@dataclasses.dataclass(frozen=True)
class _Residuals:
  """Where a stage's pullback finds its leaves (the residuals the model's remat policy keeps):
  each one either an input of the stage's forward, found again at its backward (a weight, the
  micro-batch, the stashed stage input), or a slot of a residual buffer."""

  treedef: Any
  sources: tuple[tuple[bool, int], ...]
  """Per pullback leaf: (from an input, the flat input's index) or (False, the buffer's)."""


def _plan_residuals(model: Model, place: str, args) -> tuple[_Residuals, list]:
  """The stage's `_Residuals` and the `(shape, dtype)` of each leaf it stashes, found from the
  jaxpr of its forward: a pullback leaf that is one of the forward's inputs is not stashed."""
  treedefs = []

  def leaves(*args):
    flat, treedef = jax.tree.flatten(_stage_vjp(model, place, *args)[2])
    treedefs.append(treedef)
    return flat

  jaxpr = jax.make_jaxpr(leaves)(*args).jaxpr
  stashed, sources = [], []
  for var in jaxpr.outvars:
    index = next((i for i, v in enumerate(jaxpr.invars) if v is var), None)
    if index is not None:
      sources.append((True, index))
    else:
      sources.append((False, len(stashed)))
      stashed.append((tuple(var.aval.shape), np.dtype(var.aval.dtype)))
  return _Residuals(treedefs[0], tuple(sources)), stashed


def _shared_buffers(stashes: Sequence[list], slots: Sequence[int]) -> tuple[list, list[list[int]]]:
  """One set of residual buffers for the places a model's stages take (first, middle, last),
  each place stashing `stashes[i]` in up to `slots[i]` slots: `(per buffer (slots, shape,
  dtype), per place the buffer of each stashed leaf)`. Places share a buffer for leaves of one
  shape and dtype (an SPMD program gives every device every buffer), sized for the place that
  needs the most slots: a head's residuals on the last stage of a 1F1B table need one."""
  keys: list = []
  count: list[int] = []
  owners = []
  for stashed, n in zip(stashes, slots, strict=True):
    taken: set[int] = set()
    owner = []
    for key in stashed:
      j = next((j for j, b in enumerate(keys) if b == key and j not in taken), len(keys))
      if j == len(keys):
        keys.append(key)
        count.append(0)
      count[j] = max(count[j], n)
      taken.add(j)
      owner.append(j)
    owners.append(owner)
  return [(n, *key) for n, key in zip(count, keys, strict=True)], owners


def _place_slots(schedule: schedules.Schedule, slots: schedules.Slots, model: int) -> dict:
  """Per place of `model`'s stages ('first', 'mid', 'last'), the residual slots its device
  (the most of any, for the middle stages) uses."""
  p = schedule.stages
  used: dict[str, int] = {}
  for (k, _, device), slot in slots.residual.items():
    if k != model:
      continue
    stage = schedule.stage_of(model, device)
    place = "first" if stage == 0 else "last" if stage == p - 1 else "mid"
    used[place] = max(used.get(place, 0), slot + 1)
  return used


def pipelined_grads(
  models: Sequence[Model], schedule: schedules.Schedule, mesh: Mesh, params: Sequence, batches
) -> tuple[tuple, tuple]:
  """Per model, the mean float32 gradients and metrics over its `[m, ...]` micro-batches, from
  running `schedule` over `mesh`'s `stage` axis (see the module docstring)."""
  p, m = schedule.stages, schedule.micro_batches
  slots = schedules.slots(schedule)
  table = jnp.asarray(executor_table(schedule, slots))
  for k, batch in enumerate(batches):
    if jax.tree.leaves(batch)[0].shape[0] != m:
      got = jax.tree.leaves(batch)[0].shape[0]
      raise ValueError(f"model {k}'s batch has {got} micro-batches, the schedule {m}")
  # Per model, the activation between stages (what the first stage's block outputs) and the
  # metrics of one micro-batch's loss.
  shapes, metric_shapes = [], []
  for model, prm, batch in zip(models, params, batches, strict=True):
    layers, rest = _split(prm)
    block = jax.tree.map(lambda x: x[: x.shape[0] // p], layers)
    micro = jax.tree.map(lambda x: x[0], batch)
    first = functools.partial(_stage_forward, model, "first")
    x = jax.eval_shape(lambda r, bl, mi, first=first: first(r, bl, None, mi)[0], rest, block, micro)
    last = functools.partial(_stage_forward, model, "last")
    metric_shapes.append(jax.eval_shape(lambda *a, last=last: last(*a)[2], rest, block, x, micro))
    shapes.append(x)
  if len({x.shape[:-1] for x in shapes}) > 1 or len({x.dtype for x in shapes}) > 1:
    raise ValueError(
      "models fused in one pipeline need the same micro-batch rows, length and compute dtype, "
      f"got {[(x.shape, str(x.dtype)) for x in shapes]}"
    )
  b, s = shapes[0].shape[:2]
  width, dtype = max(x.shape[-1] for x in shapes), shapes[0].dtype
  places = ("first", "last") if p == 2 else ("first", "mid", "last")
  flax_rules = _rules_without_stage(nn.get_logical_axis_rules())
  # Per model, by leaf of its rest: where the training layout splits it over the stages (the
  # vocabulary; in the view's reversed order for a model whose stages run in the reverse
  # device order).
  stage_split = [
    _stage_split_leaves(model.config, prm, mesh) for model, prm in zip(models, params, strict=True)
  ]
  reverse = [d is schedules.Direction.REVERSE_ORDER for d in schedule.directions]

  def in_order(k: int, tree: Any) -> Any:
    """Model k's tree (parameters or gradients) with its rest's vocabulary blocks in order."""
    if not reverse[k]:
      return tree
    layers, rest = _split(tree)
    return {**_reverse_stage_blocks(rest, stage_split[k], mesh), "layers": layers}

  def body(params, batches):
    params = tuple(in_order(k, prm) for k, prm in enumerate(params))
    with nn.logical_axis_rules(flax_rules):
      grads, metrics, poison = staged(params, batches)
    out = []
    for k, g in enumerate(grads):
      # Back in the view's block order before the sum (a permutation of each stage's own
      # gradient), so each stage keeps the blocks its devices hold.
      layers_g, rest_g = _split(in_order(k, g))
      rest_g = _sum_over_stages(rest_g, stage_split[k], mesh)
      out.append(jax.tree.map(lambda x: (x + poison) / m, {**rest_g, "layers": layers_g}))
    return tuple(out), metrics

  def staged(params, batches):
    me = jax.lax.axis_index(AXIS)
    # The trained and frozen halves of each model's rest and block, split by the whole tree's
    # mask (`models.lora.trainable`: a block or rest alone may hold no adapters).
    halves = [tuple(tuple(reversed(_split(half))) for half in lora.split(prm)) for prm in params]

    def varying(x):
      return jax.lax.pcast(x, AXIS, to="varying")

    def pad(x):
      return jnp.pad(x.astype(dtype), ((0, 0), (0, 0), (0, width - x.shape[-1])))

    # Per model and place, where its pullback's leaves are kept, and the model's buffers.
    plans, buffer_keys = [], []
    for k, model in enumerate(models):
      if model.recompute:
        plans.append({place: (None, []) for place in places})
        buffer_keys.append([])
        continue
      x_in = jnp.zeros(shapes[k].shape, dtype)
      micro = jax.tree.map(lambda x: x[0], batches[k])
      planned = [_plan_residuals(model, place, (*halves[k], x_in, micro)) for place in places]
      used = _place_slots(schedule, slots, k)
      keys, owners = _shared_buffers(
        [stashed for _, stashed in planned], [used[place] for place in places]
      )
      plans.append(
        {
          place: (plan, owner)
          for place, (plan, _), owner in zip(places, planned, owners, strict=True)
        }
      )
      buffer_keys.append(keys)

    def branch(k: int, op: str):
      model, batch = models[k], batches[k]
      place, backward = op.split("_")[1], op.startswith("backward")
      plan, owner = plans[k][place]
      d = shapes[k].shape[-1]

      def run(micro_i, a_slot, g_slot, r_slot, acts, grads_in, residuals, acc):
        micro = jax.tree.map(
          lambda x: jax.lax.dynamic_index_in_dim(x, micro_i, keepdims=False), batch
        )
        x_in = acts[k][a_slot]
        up = down = jnp.zeros((b, s, width), dtype)
        # What every residual buffer's slot `r_slot` holds after this op: a forward writes its
        # model's, everything else keeps what is there.
        kept = [[_read(buf, r_slot) for buf in bufs] for bufs in residuals]
        grads, metrics, finite = acc
        sent = None
        if not backward:
          if plan is None:  # recomputed in the backward: nothing kept
            joined = map(lora.join, *halves[k])
            x, loss, mets = _stage_forward(model, place, *joined, x_in, micro)
            y = loss if place == "last" else x
          else:
            y, mets, pull = _stage_vjp(model, place, *halves[k], x_in, micro)
            leaves = jax.tree.leaves(pull)
            if len(leaves) != len(plan.sources):
              raise AssertionError(f"{op}: {len(leaves)} residuals, planned {len(plan.sources)}")
            for leaf, (from_input, j) in zip(leaves, plan.sources, strict=True):
              if not from_input:
                kept[k][owner[j]] = leaf
          if place == "last":
            metrics = list(metrics)
            metrics[k] = jax.tree.map(lambda a, v: a + v.astype(jnp.float32), metrics[k], mets)
            finite = finite & jnp.isfinite(y)
          else:
            sent = y
        else:
          # Gradients of the trained leaves only (`models.lora.split`: with adapters, the
          # adapters and a value head; the frozen base is a constant here), from the residuals
          # the forward kept: the stage's forward is not run again, unless recomputing.
          if plan is None:
            pull = _stage_vjp(model, place, *halves[k], x_in, micro)[2]
          else:
            inputs = jax.tree.leaves((*halves[k], x_in, micro))
            leaves = [
              inputs[j] if from_input else _read(residuals[k][owner[j]], r_slot)
              for from_input, j in plan.sources
            ]
            pull = jax.tree.unflatten(plan.treedef, leaves)
          if place == "last":
            d_rest, d_block, d_x = pull(jnp.ones((), jnp.float32))
          else:
            d_rest, d_block, d_x = pull(grads_in[k][g_slot][..., :d].astype(dtype))
          layers_acc, rest_acc = grads[k]
          grads = list(grads)
          grads[k] = (
            jax.tree.map(jnp.add, layers_acc, d_block),
            jax.tree.map(jnp.add, rest_acc, d_rest),
          )
          if place != "first":
            sent = d_x
        if sent is not None:
          reverse = schedule.directions[k] is schedules.Direction.REVERSE_ORDER
          goes_up = backward == reverse  # forward order: forwards go up, backwards down
          if goes_up:
            up = pad(sent)
          else:
            down = pad(sent)
        return up, down, kept, (tuple(grads), tuple(metrics), finite)

      return run

    def idle(micro_i, a_slot, g_slot, r_slot, acts, grads_in, residuals, acc):
      zeros = jnp.zeros((b, s, width), dtype)
      return zeros, zeros, [[_read(buf, r_slot) for buf in bufs] for bufs in residuals], acc

    # Two stages have no middle: its branches are never taken.
    branches = [idle] + [
      branch(k, op) if op.split("_")[1] in places else idle
      for k in range(len(models))
      for op in _OPS
    ]

    def tick(carry, row):
      acts, grads_in, residuals, acc = carry
      entry = row[me]
      up, down, kept, acc = jax.lax.switch(
        entry[0], branches, entry[1], entry[2], entry[3], entry[8], acts, grads_in, residuals, acc
      )
      residuals = tuple(
        tuple(
          jax.lax.dynamic_update_index_in_dim(buf, new, entry[8], 0)
          for buf, new in zip(bufs, news, strict=True)
        )
        for bufs, news in zip(residuals, kept, strict=True)
      )
      from_below = jax.lax.ppermute(up, AXIS, [(i, i + 1) for i in range(p - 1)])
      from_above = jax.lax.ppermute(down, AXIS, [(i + 1, i) for i in range(p - 1)])
      acts, grads_in = list(acts), list(grads_in)
      for message, kind, slot in (
        (from_below, entry[4], entry[5]),
        (from_above, entry[6], entry[7]),
      ):
        for k in range(len(models)):
          d = shapes[k].shape[-1]
          for buffers, code in ((acts, 1 + 2 * k), (grads_in, 2 + 2 * k)):
            old = buffers[k][slot]
            buffers[k] = buffers[k].at[slot].set(jnp.where(kind == code, message[..., :d], old))
      return (tuple(acts), tuple(grads_in), residuals, acc), None

    acts = tuple(
      varying(jnp.zeros((slots.activation_slots[k], b, s, x.shape[-1]), dtype))
      for k, x in enumerate(shapes)
    )
    grads_in = tuple(
      varying(jnp.zeros((slots.gradient_slots[k], b, s, x.shape[-1]), dtype))
      for k, x in enumerate(shapes)
    )
    residuals0 = tuple(
      tuple(varying(jnp.zeros((n, *shape), dtype_)) for n, shape, dtype_ in buffer_keys[k])
      for k in range(len(models))
    )
    grads0 = tuple(varying(_split(steps.zero_gradients(prm))) for prm in params)
    metrics0 = tuple(
      varying(jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), mets))
      for mets in metric_shapes
    )
    acc0 = (grads0, metrics0, varying(jnp.array(True)))
    carry0 = (acts, grads_in, residuals0, acc0)
    (_, _, _, (grads, metrics, finite)), _ = jax.lax.scan(tick, carry0, table)
    finite = jax.lax.pmin(finite.astype(jnp.int32), AXIS) > 0
    poison = jnp.where(finite, 0.0, jnp.nan)
    # Each stage's own sums; `body` adds them up over the stages.
    out_grads = tuple({**rest_g, "layers": layers_g} for layers_g, rest_g in grads)
    out_metrics = tuple(jax.tree.map(lambda v: jax.lax.psum(v, AXIS) / m, mets) for mets in metrics)
    return out_grads, out_metrics, poison

  trained = [lora.split(prm)[0] for prm in params]
  in_specs = (
    tuple(_param_specs(prm) for prm in params),
    jax.tree.map(lambda _: PartitionSpec(), tuple(batches)),
  )
  out_specs = (
    tuple(
      {**_summed_specs(_split(g)[1], split), "layers": _param_specs(g)["layers"]}
      for g, split in zip(trained, stage_split, strict=True)
    ),
    PartitionSpec(),
  )
  run = jax.shard_map(
    body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS}, check_vma=False
  )
  grads, metrics = run(tuple(params), tuple(batches))
  # A reduce-scattered leaf comes out as `[..., before, the rest, ...]` (`_sum_over_stages`):
  # back to the parameter's shape, the blocks already where the training layout keeps them.
  grads = tuple(
    jax.tree.map(lambda g, x: g.reshape(x.shape), got, like)
    for got, like in zip(grads, trained, strict=True)
  )
  return grads, metrics


def pipelined_update(
  models: Sequence[Model],
  txs: Sequence[optax.GradientTransformation],
  schedule: schedules.Schedule,
  mesh: Mesh,
  states: Sequence[TrainState],
  batches: Sequence[Any],
) -> tuple[tuple[TrainState, ...], tuple[dict[str, jax.Array], ...]]:
  """One optimizer update of every model from its pipelined mini-batch (`[m, ...]` leaves):
  `steps.accumulate_and_apply`'s result, computed by `schedule`."""
  grads, metrics = pipelined_grads(
    models, schedule, mesh, [state.params for state in states], batches
  )
  out = [
    steps.apply_gradients(tx, state, g, mets)
    for tx, state, g, mets in zip(txs, states, grads, metrics, strict=True)
  ]
  return tuple(s for s, _ in out), tuple(mt for _, mt in out)


def accumulate_and_apply(
  loss_fn: steps.LossFn,
  tx: optax.GradientTransformation,
  config: ModelConfig,
  schedule_name: str,
  mesh: Mesh,
  state: TrainState,
  batch: Any,
  *,
  recompute: bool = False,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """`steps.accumulate_and_apply` of one model pipelined over `mesh`'s stages by schedule
  `schedule_name` ('gpipe' or '1f1b'), the micro-batches being `batch`'s leading axis
  (`recompute`: `Model.recompute`)."""
  m = jax.tree.leaves(batch)[0].shape[0]
  schedule = schedules.single(schedule_name, stages_of(mesh), m)
  (state,), (metrics,) = pipelined_update(
    [Model(config, loss_fn, recompute)], [tx], schedule, mesh, [state], [batch]
  )
  return state, metrics


def fused_accumulate_and_apply(
  models: Sequence[Model],
  txs: Sequence[optax.GradientTransformation],
  mesh: Mesh,
  states: Sequence[TrainState],
  batches: Sequence[Any],
) -> tuple[tuple[TrainState, ...], tuple[dict[str, jax.Array], ...]]:
  """Two models' updates in one fused schedule (`schedules.fused`), the second's stages in
  the reverse device order: its parameters must be laid out that way on `mesh` (see
  `rlhfjax.mesh.sharing.view_on`)."""
  m = jax.tree.leaves(batches[0])[0].shape[0]
  schedule = schedules.fused(stages_of(mesh), m)
  return pipelined_update(models, txs, schedule, mesh, states, batches)


# ---------------------------------------------------------------------------------------------
# Forward-only: scoring on a staged mesh.


def pipelined_forward(
  fn: Any, config: ModelConfig, mesh: Mesh, micro_batches: int, params: Any, *inputs: jax.Array
) -> Any:
  """`fn(params, *inputs)` (every input and output with rows first) as a forward-only pipeline
  over `mesh`'s `stage` axis: the rows split into `micro_batches` micro-batches (the callers'
  `schedules.scoring_micro_batches`), stage `i`
  running its own block of the layers on micro-batch `tick - i` and sending its output up, the
  last stage running the rest of `fn` (the final norm and head, the log-probs or scores). No
  stage reads another's layers: the stacked weights are never gathered over `stage`, as an
  unpipelined call of `fn` on the staged mesh would (GPipe's forward: `micro_batches + stages -
  1` ticks, the first and last `stages - 1` of them partly idle)."""
  p, m = stages_of(mesh), micro_batches
  rows = inputs[0].shape[0]
  if rows % m:
    raise ValueError(f"{rows} rows do not split into {m} micro-batches")
  micro_inputs = tuple(x.reshape(m, rows // m, *x.shape[1:]) for x in inputs)
  layers, rest = _split(params)
  block0 = jax.tree.map(lambda x: x[: x.shape[0] // p], layers)
  one = tuple(x[0] for x in micro_inputs)

  def stage(place: str, rest, block, x_in, micro):
    return _run_stage(config, fn, place, rest, block, x_in, *micro)

  x_shape = jax.eval_shape(lambda r, b, mi: stage("first", r, b, None, mi)[0], rest, block0, one)
  y_shape = jax.eval_shape(
    lambda r, b, x, mi: stage("last", r, b, x, mi)[1], rest, block0, x_shape, one
  )
  flax_rules = _rules_without_stage(nn.get_logical_axis_rules())

  def body(params, micro_inputs):
    me = jax.lax.axis_index(AXIS)
    block, rest = _split(params)
    place = jnp.where(me == 0, 0, jnp.where(me == p - 1, 2, 1))

    def branch(k: int):
      name = ("first", "mid", "last")[k]

      def run(x_in, micro, outs, i):
        x, y = stage(name, rest, block, x_in, micro)
        if name == "last":
          outs = jax.tree.map(
            lambda o, v: jax.lax.dynamic_update_index_in_dim(o, v.astype(o.dtype), i, 0), outs, y
          )
          x = jnp.zeros(x_shape.shape, x_shape.dtype)
        return x.astype(x_shape.dtype), outs

      return run

    def idle(x_in, micro, outs, i):
      return jnp.zeros(x_shape.shape, x_shape.dtype), outs

    branches = [branch(0), branch(1), branch(2), idle]

    def tick(carry, t):
      x_in, outs = carry
      i = t - me
      valid = (i >= 0) & (i < m)
      j = jnp.clip(i, 0, m - 1)
      micro = tuple(jax.lax.dynamic_index_in_dim(x, j, keepdims=False) for x in micro_inputs)
      x, outs = jax.lax.switch(jnp.where(valid, place, 3), branches, x_in, micro, outs, j)
      x_in = jax.lax.ppermute(x, AXIS, [(k, k + 1) for k in range(p - 1)])
      return (x_in, outs), None

    varying = lambda x: jax.lax.pcast(x, AXIS, to="varying")
    outs0 = jax.tree.map(lambda s: varying(jnp.zeros((m, *s.shape), s.dtype)), y_shape)
    x0 = varying(jnp.zeros(x_shape.shape, x_shape.dtype))
    with nn.logical_axis_rules(flax_rules):
      (_, outs), _ = jax.lax.scan(tick, (x0, outs0), jnp.arange(m + p - 1))
    # Only the last stage wrote its outputs: summing over the stages hands them to every one.
    return jax.tree.map(lambda o: jax.lax.psum(o, AXIS), outs)

  in_specs = (_param_specs(params), jax.tree.map(lambda _: PartitionSpec(), micro_inputs))
  run = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=jax.tree.map(lambda _: PartitionSpec(), y_shape),
    axis_names={AXIS},
    check_vma=False,
  )
  outs = run(params, micro_inputs)
  return jax.tree.map(lambda o: o.reshape(rows, *o.shape[2:]), outs)
